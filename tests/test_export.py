"""QDQ export: standard ONNX only, and it agrees with the QOperator model in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import MODELS, make_model, ops, rng, run
from onnx import helper as h
from test_patterns import BINARY_CASES, CONV_CASES, DENSE_CASES, POOL_CASES, weights

import onnxq
from onnxq.cli import main

R = rng(5)


def both(model, data, **kw):
    qop, rep = onnxq.quantize(model, data, progress=False, **kw)
    qdq, _ = onnxq.quantize(model, data, progress=False, format="qdq", **kw)
    onnx.checker.check_model(qdq)
    assert {o.domain for o in qdq.opset_import} <= {"", "ai.onnx"}
    assert not {n.op_type for n in qdq.graph.node} & {"QLinearConv", "QGemm", "QLinearAdd"}
    return qop, qdq, rep


def agree(qop, qdq, feeds, scale):
    a, b = run(qop, feeds)[0], run(qdq, feeds)[0]
    assert np.abs(a - b).max() <= float(np.max(scale)) * 1.001 + 1e-7


def model_of(nodes, inits, shape):
    return make_model(nodes, [("x", ["N", *shape[1:]])], [("y", None)], inits)


CASES = {
    **{f"conv:{k}": (*v[:2], [1, 3, 8, 8]) for k, v in CONV_CASES.items()},
    **{f"dense:{k}": (*v[:2], [1, 16]) for k, v in DENSE_CASES.items()},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("per_channel", [True, False])
def test_qdq_matches_qoperator(case, per_channel):
    nodes, inits, shape = CASES[case]
    model = model_of(nodes, inits, shape)
    data = {"x": R.normal(0, 1, (8, *shape[1:])).astype(np.float32)}
    qop, qdq, rep = both(model, data, per_channel=per_channel)
    assert "QuantizeLinear" in ops(qdq) and "DequantizeLinear" in ops(qdq)
    agree(qop, qdq, {"x": data["x"][:2]}, rep.values["y_scale"])


@pytest.mark.parametrize("case", [*BINARY_CASES, *POOL_CASES])
def test_qdq_activation_ops(case):
    if case in BINARY_CASES:
        op, _, relu = BINARY_CASES[case]
        mid = [h.make_node(op, ["a", "b"], ["s" if relu else "t"], name="bin")]
        if relu:
            mid.append(h.make_node("Relu", ["s"], ["t"], name="relu"))
    else:
        pool = POOL_CASES[case][0]
        mid = [
            h.make_node("Relu", ["a"], ["ra"], name="ra"),
            h.make_node(
                pool.op_type,
                ["ra"],
                ["t"],
                name="pool",
                **{a.name: h.get_attribute_value(a) for a in pool.attribute},
            ),
        ]
    nodes = [
        h.make_node("Conv", ["x", "W1"], ["a"], pads=[1, 1, 1, 1], name="c1"),
        h.make_node("Conv", ["x", "W2"], ["b"], pads=[1, 1, 1, 1], name="c2"),
        *mid,
        h.make_node("Conv", ["t", "W3"], ["y"], name="c3"),
    ]
    inits = {"W1": weights(4, 3, 3, 3), "W2": weights(4, 3, 3, 3), "W3": weights(2, 4, 1, 1)}
    model = model_of(nodes, inits, [1, 3, 8, 8])
    data = {"x": R.normal(0, 1, (8, 3, 8, 8)).astype(np.float32)}
    qop, qdq, rep = both(model, data)
    agree(qop, qdq, {"x": data["x"][:2]}, rep.values["y_scale"])


def test_qdq_raises_opset_for_per_channel_and_keeps_low_opset_per_tensor():
    nodes = [h.make_node("Conv", ["x", "W", "B"], ["y"], name="conv")]
    model = make_model(
        nodes,
        [("x", ["N", 3, 8, 8])],
        [("y", None)],
        {"W": weights(4, 3, 3, 3), "B": weights(4)},
        opset=11,
    )
    data = {"x": R.normal(0, 1, (4, 3, 8, 8)).astype(np.float32)}
    pc, _ = onnxq.quantize(model, data, format="qdq", progress=False)
    pt, _ = onnxq.quantize(model, data, format="qdq", per_channel=False, progress=False)
    opset = {o.domain: o.version for o in pc.opset_import}[""]
    assert opset >= 13
    assert {o.domain: o.version for o in pt.opset_import}[""] == 11
    axes = [a.i for n in pc.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute]
    assert axes and set(axes) == {0}
    np.testing.assert_allclose(
        run(pc, {"x": data["x"][:1]})[0], run(pt, {"x": data["x"][:1]})[0], atol=0.1
    )


def test_cli_format_qdq_on_zoo_model(tmp_path):
    x = R.uniform(0, 1, (16, 1, 28, 28)).astype(np.float32)
    np.savez(tmp_path / "c.npz", input=x)
    for fmt in ("qoperator", "qdq"):
        assert (
            main(
                [
                    "quantize",
                    str(MODELS / "digits_cnn.onnx"),
                    "-o",
                    str(tmp_path / f"{fmt}.onnx"),
                    "--data",
                    str(tmp_path / "c.npz"),
                    "--format",
                    fmt,
                    "--quiet",
                ]
            )
            == 0
        )
    a = run(tmp_path / "qoperator.onnx", {"input": x[:4]})[0]
    b = run(tmp_path / "qdq.onnx", {"input": x[:4]})[0]
    scale = onnx.numpy_helper.to_array(
        next(
            i
            for i in onnx.load(str(tmp_path / "qdq.onnx")).graph.initializer
            if i.name == "logits_scale"
        )
    )
    assert np.abs(a - b).max() <= float(scale) + 1e-6
