"""A quantized neighbourhood for rules that need one: Conv → [op under test] → Conv."""

import numpy as np
from helpers import make_model
from onnx import helper as h

from onnxq.patterns.conv import ConvBiasPattern, ConvPattern

#: the rules of the neighbours
CONV_RULES = (ConvBiasPattern, ConvPattern)

G = np.random.default_rng(0)
INITS = {
    "W1": G.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
    "B1": G.normal(0, 0.3, 4).astype(np.float32),
    "W2": G.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
    "B2": G.normal(0, 0.3, 4).astype(np.float32),
    "W3": G.normal(0, 0.3, (2, 4, 1, 1)).astype(np.float32),
}


def between_convs(middle, two_inputs=False, out="t"):
    """x → Conv c1 (and c2) → ``middle`` nodes (reading 'a' [and 'b']) → Conv c3 reading ``out``."""
    nodes = [h.make_node("Conv", ["x", "W1", "B1"], ["a"], pads=[1, 1, 1, 1], name="c1")]
    if two_inputs:
        nodes.append(h.make_node("Conv", ["x", "W2", "B2"], ["b"], pads=[1, 1, 1, 1], name="c2"))
    nodes += [*middle, h.make_node("Conv", [out, "W3"], ["y"], name="c3")]
    inits = {k: v for k, v in INITS.items() if two_inputs or k not in ("W2", "B2")}
    return make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
