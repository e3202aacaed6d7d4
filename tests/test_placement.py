"""Graph facts that keep nodes float before any rule matches (onnxq.annotate.placement).

The attention-mask placement is tested with the encoders in test_transformer.py; here the
expectation over a Softmax (YOLOv8's box head).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_model, rng, run
from onnx import helper as h

import onnxq
from onnxq.annotate import quantizer as quantizer_module


def _box_head(out_channels: int = 1, softmax: bool = True):
    """A YOLOv8-style box head: Conv → Reshape [N, 4, 16, A] → Transpose → Softmax over the 16
    bins → 1×1 Conv with weights 0..15 (the expected distance) → Reshape → anchor - distance.
    """
    r = rng(7)
    bins = np.tile(np.arange(16, dtype=np.float32), (out_channels, 1))[:, :, None, None]
    nodes = [
        h.make_node("Conv", ["x", "W1", "B1"], ["f"], "head", pads=[1, 1, 1, 1]),
        h.make_node("Reshape", ["f", "s1"], ["r"], "split_bins"),
        h.make_node("Transpose", ["r"], ["t"], "bins_first", perm=[0, 2, 1, 3]),
        h.make_node("Softmax", ["t"], ["p"], "soft", axis=1)
        if softmax
        else h.make_node("Relu", ["t"], ["p"], "soft"),
        h.make_node("Conv", ["p", "bins"], ["d"], "dfl"),
        h.make_node("Reshape", ["d", "s2"], ["e"], "edges"),
        h.make_node("Sub", ["anchors", "e"], ["box"], "decode"),
    ]
    inits = {
        "W1": r.normal(0, 0.1, (64, 8, 3, 3)).astype(np.float32),
        "B1": r.normal(0, 0.5, 64).astype(np.float32),
        "s1": np.array([-1, 4, 16, 36], np.int64),
        "s2": np.array([-1, 4 * out_channels, 36], np.int64),
        "bins": bins,
        "anchors": (r.uniform(0, 6, (1, 1, 36)) * 8).astype(np.float32),
    }
    model = make_model(nodes, [("x", ["N", 8, 6, 6])], [("box", None)], inits)
    x = r.normal(0, 1, (64, 8, 6, 6)).astype(np.float32)
    return model, {"x": x}


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_the_expectation_over_a_softmax_stays_float(fmt, monkeypatch):
    model, data = _box_head()
    q, report = onnxq.quantize(model, data, progress=False, format=fmt)
    why = {d.node: d for d in report.decisions}
    assert not why["dfl"].quantized and "expectation of Softmax 'soft'" in why["dfl"].reason
    assert not why["soft"].quantized  # nothing quantized reads it then
    assert why["head"].quantized
    conv = next(n for n in q.graph.node if n.name == "dfl")
    assert conv.op_type == "Conv"
    w = next(t for t in q.graph.initializer if t.name == conv.input[1])
    assert w.data_type == 1  # the float weights 0..15
    # onnxruntime: the box edges off by less than with the expectation rounded to int8
    monkeypatch.setattr(quantizer_module, "expectations", lambda graph: {})
    rounded, _ = onnxq.quantize(model, data, progress=False, format=fmt)
    x = {"x": data["x"][:32]}
    ref = run(model, x)[0]
    err = np.sqrt(np.mean((run(q, x)[0] - ref) ** 2))
    assert err < 0.7 * np.sqrt(np.mean((run(rounded, x)[0] - ref) ** 2))


@pytest.mark.parametrize("shape", ["two channels", "no softmax"])
def test_other_convs_after_a_distribution_are_quantized(shape):
    model, data = _box_head(
        out_channels=2 if shape == "two channels" else 1, softmax=shape != "no softmax"
    )
    _, report = onnxq.quantize(model, data, progress=False)
    assert next(d for d in report.decisions if d.node == "dfl").quantized
