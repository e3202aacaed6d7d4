"""onnxq.patterns.island: QDQ islands around ops with no QLinear kernel (QDQ output only)."""

import numpy as np
import pytest
from helpers import make_model
from onnx import helper as h
from rulecheck import check_rule

from onnxq.patterns.island import ConvBiasHardActivationPattern, ConvTransposeBiasPattern

G = np.random.default_rng(0)


def test_conv_transpose_with_bias():
    inits = {
        "W": G.normal(0, 0.3, (3, 4, 2, 2)).astype(np.float32),
        "B": G.normal(0, 0.3, 4).astype(np.float32),
    }
    nodes = [h.make_node("ConvTranspose", ["x", "W", "B"], ["y"], strides=[2, 2], name="up")]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
    check_rule(
        model,
        ConvTransposeBiasPattern,
        {"up"},
        {"ConvTranspose": 1, "QuantizeLinear": 2, "DequantizeLinear": 3},
        format="qdq",
    )


@pytest.mark.parametrize("act", ["HardSwish", "HardSigmoid"])
def test_conv_into_a_hard_activation(act):
    inits = {
        "W": G.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
        "B": G.normal(0, 0.3, 4).astype(np.float32),
    }
    nodes = [
        h.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        h.make_node(act, ["c"], ["y"], name="act"),
    ]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits, opset=14)
    check_rule(
        model,
        ConvBiasHardActivationPattern,
        {"conv", "act"},
        {"Conv": 1, act: 1},
        format="qdq",
        min_sqnr=25,
    )
