"""Preprocessing: folds that make weights constant and fold affine ops, checked numerically."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import make_model, ops, rng, run
from onnx import helper as h

import onnxq
from onnxq.prepare.preprocess import preprocess

R = rng(21)


def w(*shape, scale=0.3):
    return R.normal(0, scale, shape).astype(np.float32)


X = R.normal(0, 1, (2, 3, 8, 8)).astype(np.float32)


def same_function(model):
    pre = preprocess(model)
    np.testing.assert_allclose(run(pre, {"x": X})[0], run(model, {"x": X})[0], rtol=1e-4, atol=1e-5)
    return pre


def test_batchnorm_folds_into_conv():
    nodes = [
        h.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        h.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], name="bn"),
    ]
    inits = {"W": w(4, 3, 3, 3), "g": w(4) + 1, "b": w(4), "m": w(4), "v": np.abs(w(4)) + 0.5}
    pre = same_function(make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits))
    assert ops(pre) == ["Conv"]


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias", ["none", "vector", "row"])
def test_batchnorm_folds_into_gemm(trans_b, bias):
    # Linear → BatchNorm1d: alpha and beta move into the folded weight and bias
    x = R.normal(0, 1, (5, 6)).astype(np.float32)
    inputs = ["x", "W"] + ({"none": [], "vector": ["C"], "row": ["C"]}[bias])
    nodes = [
        h.make_node("Gemm", inputs, ["g"], transB=trans_b, alpha=0.5, beta=2.0, name="fc"),
        h.make_node("BatchNormalization", ["g", "ga", "be", "m", "v"], ["y"], name="bn"),
    ]
    inits = {
        "W": w(4, 6) if trans_b else w(6, 4),
        "ga": w(4) + 1,
        "be": w(4),
        "m": w(4),
        "v": np.abs(w(4)) + 0.5,
    }
    if bias != "none":
        inits["C"] = w(4) if bias == "vector" else w(1, 4)
    model = make_model(nodes, [("x", ["N", 6])], [("y", None)], inits)
    pre = preprocess(model)
    assert ops(pre) == ["Gemm"]
    np.testing.assert_allclose(run(pre, {"x": x})[0], run(model, {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_batchnorm_folds_into_conv_transpose():
    nodes = [
        h.make_node("ConvTranspose", ["x", "W", "B"], ["c"], strides=[2, 2], name="up"),
        h.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], name="bn"),
    ]
    inits = {
        "W": w(3, 4, 2, 2),
        "B": w(4),
        "g": w(4) + 1,
        "b": w(4),
        "m": w(4),
        "v": np.abs(w(4)) + 0.5,
    }
    pre = same_function(make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits))
    assert ops(pre) == ["ConvTranspose"]


@pytest.mark.parametrize("shape", [(1, 4, 1, 1), (4, 1, 1), (1,), ()])
def test_mul_and_add_by_per_channel_constants_fold_into_conv(shape):
    size = int(np.prod(shape)) if shape else 1
    mul = (np.abs(w(size)) + 0.5).reshape(shape)
    add = w(size).reshape(shape)
    nodes = [
        h.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
        h.make_node("Mul", ["c", "m"], ["cm"], name="mul"),
        h.make_node("Add", ["a", "cm"], ["y"], name="add"),
    ]
    inits = {"W": w(4, 3, 3, 3), "B": w(4), "m": mul, "a": add}
    pre = same_function(make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits))
    assert ops(pre) == ["Conv"]


def test_affine_with_spatial_constant_is_not_folded():
    nodes = [
        h.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        h.make_node("Mul", ["c", "m"], ["y"], name="mul"),
    ]
    inits = {"W": w(4, 3, 3, 3), "m": w(1, 4, 8, 8)}
    pre = same_function(make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits))
    assert ops(pre) == ["Conv", "Mul"]


def test_identity_nodes_are_removed_except_at_graph_outputs():
    # paddle2onnx style: Conv → Identity → Relu; the Identity hid the Conv+Relu group
    g = rng(7)
    nodes = [
        h.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        h.make_node("Identity", ["c"], ["ci"], name="id1"),
        h.make_node("Relu", ["ci"], ["r"], name="relu"),
        h.make_node("Conv", ["r", "W2"], ["y0"], name="conv2"),
        h.make_node("Identity", ["y0"], ["y"], name="id_out"),
    ]
    inits = {
        "W": g.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
        "W2": g.normal(0, 0.3, (2, 4, 1, 1)).astype(np.float32),
    }
    model = make_model(nodes, [("x", [1, 3, 8, 8])], [("y", None)], inits)
    pre = preprocess(model)
    assert [n.name for n in pre.graph.node if n.op_type == "Identity"] == ["id_out"]
    x = {"x": g.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)}
    assert np.allclose(run(pre, x)[0], run(model, x)[0])
    data = {"x": g.normal(0, 1, (8, 3, 8, 8)).astype(np.float32)}
    q, report = onnxq.quantize(model, data, method="minmax", progress=False)
    relu = next(d for d in report.decisions if d.node == "relu")
    assert relu.quantized and relu.pattern == "conv"
    x = {"x": data["x"][:1]}  # inside the calibrated range
    assert np.abs(run(q, x)[0] - run(model, x)[0]).max() < 0.05 * np.abs(run(model, x)[0]).max()


def test_constant_node_and_constant_subgraph_weights_become_initializers():
    weight = w(4, 3, 3, 3)
    nodes = [
        h.make_node(
            "Constant",
            [],
            ["wt"],
            name="k",
            value=onnx.numpy_helper.from_array(weight.transpose(1, 0, 2, 3)),
        ),
        h.make_node("Transpose", ["wt"], ["W"], perm=[1, 0, 2, 3], name="t"),
        h.make_node("Conv", ["x", "W"], ["y"], name="conv"),
    ]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)])
    pre = same_function(model)
    assert ops(pre) == ["Conv"]
    q, report = onnxq.quantize(model, {"x": X}, progress=False)
    assert "QLinearConv" in ops(q)


def test_symbolic_shape_inference_leaves_no_file_in_the_working_directory(tmp_path, monkeypatch):
    # onnxruntime's SymbolicShapeInference saves "sym_shape_infer_temp.onnx" (+ external data)
    # in the working directory when it gives up (it did on ddddocr's int8 model)
    from onnxruntime.tools import symbolic_shape_infer

    from onnxq.prepare.preprocess import _symbolic_shapes

    def gives_up(model, **kwargs):
        onnx.save_model(model, "sym_shape_infer_temp.onnx")
        raise RuntimeError("Incomplete symbolic shape inference")

    monkeypatch.setattr(
        symbolic_shape_infer.SymbolicShapeInference, "infer_shapes", staticmethod(gives_up)
    )
    monkeypatch.chdir(tmp_path)
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2])
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    nodes = [h.make_node("Relu", ["x"], ["r"]), h.make_node("Relu", ["r"], ["y"])]
    model = h.make_model(h.make_graph(nodes, "g", [x], [y]))
    assert _symbolic_shapes(model) is model  # unchanged when the pass gives up
    assert list(tmp_path.iterdir()) == []
