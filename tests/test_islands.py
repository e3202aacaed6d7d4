"""QDQ islands: ConvTranspose and Conv → HardSwish/HardSigmoid for QDQ and OpenVINO output."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import make_model, run

import onnxq
from onnxq.io.openvino import openvino_compile

H = onnx.helper


@pytest.fixture(scope="module")
def decoder():
    """conv1+bias → HardSwish → ConvTranspose(stride 2)+bias → Relu → conv2 → HardSigmoid →
    conv3 → LeakyRelu → conv4: every group has a quantized neighbour."""
    g = np.random.default_rng(21)
    nodes = [
        H.make_node("Conv", ["x", "W1", "B1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        H.make_node("HardSwish", ["c"], ["h"], name="hswish"),
        H.make_node("ConvTranspose", ["h", "WT", "BT"], ["u"], name="up", strides=[2, 2]),
        H.make_node("Relu", ["u"], ["ur"], name="relu"),
        H.make_node("Conv", ["ur", "W2"], ["c2"], name="conv2"),
        H.make_node("HardSigmoid", ["c2"], ["s"], name="hsig"),
        H.make_node("Conv", ["s", "W3"], ["c3"], name="conv3"),
        H.make_node("LeakyRelu", ["c3"], ["l"], name="leaky", alpha=0.1),
        H.make_node("Conv", ["l", "W4"], ["y"], name="conv4"),
    ]
    inits = {
        "W1": g.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "B1": g.normal(0, 0.1, 8).astype(np.float32),
        "WT": g.normal(0, 0.3, (8, 4, 2, 2)).astype(np.float32),
        "BT": g.normal(0, 0.1, 4).astype(np.float32),
        "W2": g.normal(0, 0.5, (6, 4, 1, 1)).astype(np.float32),
        "W3": g.normal(0, 0.5, (5, 6, 1, 1)).astype(np.float32),
        "W4": g.normal(0, 0.5, (2, 5, 1, 1)).astype(np.float32),
    }
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits, opset=14)
    data = {"x": g.normal(0, 1, (32, 3, 8, 8)).astype(np.float32)}
    return model, data


def _producer_op(model: onnx.ModelProto, op: str) -> str:
    producers = {o: n for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.op_type == op)
    return producers[node.input[0]].op_type


def test_qdq_islands_run_in_onnxruntime(decoder):
    model, data = decoder
    q, report = onnxq.quantize(model, data, format="qdq", progress=False)
    by = {d.node: d for d in report.decisions}
    assert all(d.quantized for d in report.decisions), [d for d in report.decisions]
    assert by["up"].pattern == "conv-transpose+bias"
    assert by["hswish"].pattern == by["conv1"].pattern == "conv+bias+hard-activation"
    assert by["hsig"].pattern == by["leaky"].pattern == "conv+hard-activation"
    # the activation reads the convolution directly: no Q/DQ between them (runtimes fuse it)
    for act in ("HardSwish", "HardSigmoid", "LeakyRelu"):
        assert _producer_op(q, act) == "Conv"
    assert _producer_op(q, "Relu") == "ConvTranspose"
    # ConvTranspose reads an int8 weight, per channel along its output-channel axis 1
    producers = {o: n for n in q.graph.node for o in n.output}
    ct = next(n for n in q.graph.node if n.op_type == "ConvTranspose")
    wdq = producers[ct.input[1]]
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in q.graph.initializer}
    assert wdq.op_type == "DequantizeLinear" and inits[wdq.input[0]].dtype == np.int8
    assert {a.name: a.i for a in wdq.attribute}.get("axis") == 1
    assert inits[wdq.input[1]].shape == (4,)
    x = {"x": data["x"][:8]}
    ref, got = run(model, x)[0], run(q, x)[0]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_qoperator_keeps_them_float_and_says_why(decoder):
    model, data = decoder
    q, report = onnxq.quantize(model, data, format="qoperator", progress=False)
    by = {d.node: d for d in report.decisions}
    assert not by["up"].quantized and "no int8 kernel for ConvTranspose" in by["up"].reason
    assert not by["hswish"].quantized
    assert "Conv followed by HardSwish" in by["hswish"].reason
    assert by["conv1"].quantized and by["conv1"].pattern == "conv+bias"
    assert by["leaky"].quantized and by["leaky"].pattern == "leaky-relu"  # QLinearLeakyRelu
    assert "ConvTranspose" in [n.op_type for n in q.graph.node]
    x = {"x": data["x"][:8]}
    ref, got = run(model, x)[0], run(q, x)[0]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_openvino_islands_agree_with_qdq(decoder):
    pytest.importorskip("openvino")
    model, data = decoder
    # 7-bit weights in both: exact in onnxruntime and OpenVINO on any CPU (onnxq.io.hostcheck)
    qdq, report = onnxq.quantize(model, data, format="qdq", weight_bits=7, progress=False)
    fq, _ = onnxq.quantize(model, data, format="openvino", weight_bits=7, progress=False)
    kinds = [n.op_type for n in fq.graph.node]
    assert "ConvTranspose" in kinds and kinds.count("FakeQuantize") >= 8
    x = data["x"][:8]
    got = openvino_compile(fq)(x)[0]
    ref = run(qdq, {"x": x})[0]
    step = report.values["y_scale"] * 1.001
    diff = np.abs(got - ref)
    # five quantized layers deep, OpenVINO's own rounding of intermediate ties moves a few
    # outputs by up to 3 steps; both stay as close to float
    assert (diff <= step).mean() >= 0.97 and diff.max() <= 3 * step
    fl = run(model, {"x": x})[0]
    assert np.abs(got - fl).max() <= np.abs(ref - fl).max() + step
