"""Already-quantized models: QDQ → QOperator by patterns, QOperator → QDQ, clear refusals."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN, MODELS, make_model, ops, rng, run, zoo_datasets
from onnx import helper as h
from test_patterns import weights

import onnxq
from onnxq.cli import main
from onnxq.core.errors import ModelError
from onnxq.io.openvino import openvino_compile
from onnxq.lower.convert import convert, quantized_form

R = rng(11)
ds = zoo_datasets()


@pytest.fixture(scope="module")
def digits():
    xtr, _, xte, yte = ds.digits()
    return xtr, xte, yte


def test_onnxq_qdq_round_trips_to_the_same_qoperator_model(digits):
    xtr, xte, _ = digits
    qop, _ = onnxq.quantize(str(DIGITS_CNN), {"input": xtr[:64]}, progress=False)
    qdq, _ = onnxq.quantize(str(DIGITS_CNN), {"input": xtr[:64]}, progress=False, format="qdq")
    back, report = convert(qdq, "qoperator")
    assert quantized_form(back) == "qoperator" and report.left == {}
    assert ops(back) == ops(qop)
    np.testing.assert_array_equal(run(back, {"input": xte})[0], run(qop, {"input": xte})[0])


def test_onnxruntime_qdq_output_converts_and_keeps_accuracy(tmp_path, digits):
    xtr, xte, yte = digits
    path = tmp_path / "ort_qdq.onnx"
    _ort_qdq(path, xtr)
    out = tmp_path / "qop.onnx"
    assert main(["convert", str(path), "-o", str(out), "--format", "qoperator", "--quiet"]) == 0
    model = onnx.load(str(out))
    kinds = set(ops(model))
    assert "QLinearConv" in kinds and "Conv" not in kinds and "Gemm" not in kinds
    ref = run(path, {"input": xte})[0]
    got = run(model, {"input": xte})[0]
    assert (ref.argmax(1) == got.argmax(1)).mean() > 0.99
    assert (got.argmax(1) == yte).mean() >= (ref.argmax(1) == yte).mean() - 0.005


def test_op_without_qlinear_form_keeps_its_qdq_and_is_reported():
    nodes = [
        h.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        h.make_node("Tanh", ["c"], ["s"], name="sig"),
        h.make_node("Conv", ["s", "W2"], ["y"], name="conv2"),
    ]
    model = make_model(
        nodes,
        [("x", ["N", 3, 6, 6])],
        [("y", None)],
        {"W": weights(4, 3, 3, 3), "W2": weights(2, 4, 1, 1)},
    )
    data = {"x": R.normal(0, 1, (8, 3, 6, 6)).astype(np.float32)}
    qdq, _ = onnxq.quantize(model, data, format="qdq", progress=False)
    qop, _ = onnxq.quantize(model, data, progress=False)
    back, report = convert(qdq, "qoperator")
    assert ops(back).count("QLinearConv") == 2 and "Tanh" in ops(back)
    assert list(report.left) == ["sig"]
    np.testing.assert_allclose(
        run(back, {"x": data["x"][:2]})[0], run(qop, {"x": data["x"][:2]})[0], atol=1e-6
    )


def test_qoperator_to_qdq_and_same_format(digits):
    xtr, xte, _ = digits
    qop, _ = onnxq.quantize(
        str(MODELS / "digits_mlp.onnx"), {"flatten_input": ds.nhwc(xtr[:32])}, progress=False
    )
    qdq, report = convert(qop, "qdq")
    assert quantized_form(qdq) == "qdq" and len(report.converted) == 2
    feeds = {"flatten_input": ds.nhwc(xte[:16])}
    np.testing.assert_allclose(run(qdq, feeds)[0], run(qop, feeds)[0], atol=1e-6)
    same, _ = convert(qop, "qoperator")
    assert same is qop


def test_float_model_and_bad_format_are_refused(tmp_path, capsys):
    with pytest.raises(ModelError, match="float model"):
        convert(onnx.load(str(DIGITS_CNN)), "qdq")
    rc = main(
        [
            "convert",
            str(DIGITS_CNN),
            "-o",
            str(tmp_path / "o.onnx"),
            "--format",
            "qdq",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "use `onnxq quantize`" in err and not (tmp_path / "o.onnx").exists()


def _ort_qdq(path, xtr):
    from onnxruntime.quantization import QuantFormat, quantize_static

    class Reader:
        def __init__(self):
            self.it = iter([{"input": xtr[i : i + 1]} for i in range(64)])

        def get_next(self):
            return next(self.it, None)

    quantize_static(
        str(DIGITS_CNN),
        str(path),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
    )
    return onnx.load(str(path))


@pytest.mark.parametrize("source", ["onnxq-qdq", "onnxq-qoperator", "onnxruntime-qdq"])
def test_convert_to_fakequantize_runs_in_openvino(source, tmp_path, digits):
    pytest.importorskip("openvino")
    xtr, xte, yte = digits
    if source == "onnxruntime-qdq":
        q = _ort_qdq(tmp_path / "ort.onnx", xtr)
    else:
        fmt = "qdq" if source == "onnxq-qdq" else "qoperator"
        q, _ = onnxq.quantize(str(DIGITS_CNN), {"input": xtr[:64]}, format=fmt, progress=False)
    src = tmp_path / "q.onnx"
    onnx.save(q, str(src))
    out = tmp_path / "fq.onnx"
    assert main(["convert", str(src), "-o", str(out), "--format", "openvino", "--quiet"]) == 0
    fq = onnx.load(str(out))
    kinds = set(ops(fq))
    assert "FakeQuantize" in kinds and not kinds & {
        "QuantizeLinear",
        "DequantizeLinear",
        "QLinearConv",
    }
    got = openvino_compile(fq)(xte)[0]
    # onnxruntime's quantizer writes 8-bit weights: compare with its exact U8S8 arithmetic
    ref = run(q, {"input": xte}, exact=True)[0]
    # the same integer arithmetic, rounded by another runtime: the same decisions
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.99
    assert (got.argmax(1) == yte).mean() >= (ref.argmax(1) == yte).mean() - 0.005
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_convert_to_fakequantize_refuses_integer_inputs():
    nodes = [
        h.make_node("DequantizeLinear", ["xq", "s", "z"], ["x"], name="dq_in"),
        h.make_node("Relu", ["x"], ["y"], name="relu"),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [onnx.helper.make_tensor_value_info("xq", onnx.TensorProto.UINT8, [1, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
        [
            onnx.numpy_helper.from_array(np.float32(0.1), "s"),
            onnx.numpy_helper.from_array(np.uint8(3), "z"),
        ],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    with pytest.raises(ModelError, match="which no QuantizeLinear produces"):
        convert(model, "openvino")


def test_convert_to_fakequantize_follows_split_outputs_and_cascaded_maxpools():
    # YOLOv8's shapes: a Split whose second output carries int8 to its reader, and SPPF's
    # MaxPool → MaxPool → MaxPool cascade read at every stage. The converted model must read
    # the right Split output and declare float types past an earlier chain's FakeQuantize.
    pytest.importorskip("openvino")
    g = rng(31)
    pool = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    nodes = [
        h.make_node("Conv", ["x", "W1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c"], ["r"], name="relu1"),
        h.make_node("Split", ["r", "sizes"], ["s0", "s1"], name="split", axis=1),
        h.make_node("MaxPool", ["s1"], ["p1"], name="pool1", **pool),
        h.make_node("MaxPool", ["p1"], ["p2"], name="pool2", **pool),
        h.make_node("Concat", ["s1", "p1", "p2", "s0"], ["cat"], name="cat", axis=1),
        h.make_node("Conv", ["cat", "W2"], ["y"], name="conv2"),
    ]
    inits = {
        "W1": g.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "sizes": np.array([2, 6], np.int64),
        "W2": g.normal(0, 0.3, (4, 20, 1, 1)).astype(np.float32),
    }
    model = make_model(nodes, [("x", [1, 3, 8, 8])], [("y", None)], inits)
    data = {"x": g.normal(0, 1, (16, 3, 8, 8)).astype(np.float32)}
    qdq, report = onnxq.quantize(model, data, format="qdq", method="minmax", progress=False)
    fq, _ = convert(qdq, "openvino")
    x = data["x"][:1]
    got = openvino_compile(fq)(x)[0]
    ref = run(qdq, {"x": x})[0]
    step = report.values["y_scale"] * 1.001
    assert np.abs(got - ref).max() <= 2 * step
    assert np.abs(got - run(model, {"x": x})[0]).max() < 0.05 * np.abs(ref).max()


@pytest.mark.parametrize(
    "op, attrs",
    [("Sigmoid", {}), ("LeakyRelu", {"alpha": 0.2}), ("Softmax", {"axis": 1})],
    ids=["sigmoid", "leaky-relu", "softmax"],
)
def test_every_op_of_the_table_round_trips_through_qdq(op, attrs):
    """convert re-fuses what the QDQ lowering un-fused, for the table's activation ops too."""
    r = rng(23)
    nodes = [  # after an Add: a Conv → LeakyRelu would be one QDQ island
        h.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        h.make_node("Conv", ["x", "W3"], ["d"], name="conv_b"),
        h.make_node("Add", ["c", "d"], ["s"], name="add"),
        h.make_node(op, ["s"], ["a"], name="act", **attrs),
        h.make_node("Conv", ["a", "W2"], ["y"], name="conv2"),
    ]
    model = make_model(
        nodes,
        [("x", ["N", 3, 6, 6])],
        [("y", None)],
        {
            "W": r.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
            "W3": r.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
            "W2": r.normal(0, 0.3, (2, 4, 1, 1)).astype(np.float32),
        },
        opset=13,
    )
    data = {"x": r.normal(0, 1, (16, 3, 6, 6)).astype(np.float32)}
    qop, _ = onnxq.quantize(model, data, progress=False)
    qdq, _ = onnxq.quantize(model, data, progress=False, format="qdq")
    assert f"QLinear{op}" in ops(qop) and f"QLinear{op}" not in ops(qdq)
    back, report = convert(qdq, "qoperator")
    assert report.left == {} and ops(back) == ops(qop)
    np.testing.assert_array_equal(run(back, data)[0], run(qop, data)[0])
