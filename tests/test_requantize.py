"""The requantize pass, on hand-built Q/DQ graphs, checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import ops, run
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

from onnxq.post.requantize import Requantizer


def qdq_model(nodes, inits, out_shape=(1, 4, 4, 4), opset=13):
    graph = h.make_graph(
        nodes,
        "rq",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))],
        [nh.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", opset), h.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    return model


def scalars(**kw):
    out = {}
    for k, v in kw.items():
        out[k] = np.float32(v) if k.startswith("s") else np.uint8(v)
    return out


X = np.random.default_rng(0).uniform(-1, 2, (1, 4, 4, 4)).astype(np.float32)


def test_equal_pair_is_removed():
    nodes = [
        h.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q"], name="q0"),
        h.make_node("DequantizeLinear", ["q", "s1", "z1"], ["d"], name="dq0"),
        h.make_node("QuantizeLinear", ["d", "s1", "z1"], ["q2"], name="q1"),
        h.make_node("DequantizeLinear", ["q2", "s1", "z1"], ["y"], name="dq1"),
    ]
    model = qdq_model(nodes, scalars(s1=0.02, z1=60))
    rq = Requantizer()
    out = rq.requantize(model)
    assert ops(out) == ["QuantizeLinear", "DequantizeLinear"] and rq.stats.folded_pairs == 1
    np.testing.assert_array_equal(run(out, {"x": X})[0], run(model, {"x": X})[0])


def test_different_params_feed_qlinear_op_directly():
    # Q(x,s1) -> DQ -> Q(s2) -> QLinearAdd(·, ·) : the add reads the s1 tensor directly
    nodes = [
        h.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q"], name="q0"),
        h.make_node("DequantizeLinear", ["q", "s1", "z1"], ["d"], name="dq0"),
        h.make_node("QuantizeLinear", ["d", "s2", "z2"], ["q2"], name="q1"),
        h.make_node(
            "QLinearAdd",
            ["q2", "s2", "z2", "q2", "s2", "z2", "s3", "z3"],
            ["a"],
            domain="com.microsoft",
            name="add",
        ),
        h.make_node("DequantizeLinear", ["a", "s3", "z3"], ["y"], name="dq1"),
    ]
    model = qdq_model(nodes, scalars(s1=0.012, z1=85, s2=0.02, z2=60, s3=0.03, z3=70))
    rq = Requantizer()
    out = rq.requantize(model)
    assert ops(out) == ["QuantizeLinear", "QLinearAdd", "DequantizeLinear"]
    assert rq.stats.rescaled_pairs == 1
    ref = (X * 2).clip(-70 * 0.03, 185 * 0.03)
    got = run(out, {"x": X})[0]
    old = run(model, {"x": X})[0]
    # reading the finer int8 directly is at least as accurate as the double rounding
    assert np.abs(got - ref).max() <= np.abs(old - ref).max() + 1e-6
    assert np.abs(got - ref).max() <= 0.03 + 2 * 0.012


def test_dq_moves_past_maxpool_and_pair_folds():
    nodes = [
        h.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q"], name="q0"),
        h.make_node("DequantizeLinear", ["q", "s1", "z1"], ["d"], name="dq0"),
        h.make_node("MaxPool", ["d"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
        h.make_node("QuantizeLinear", ["p", "s1", "z1"], ["q2"], name="q1"),
        h.make_node("DequantizeLinear", ["q2", "s1", "z1"], ["y"], name="dq1"),
    ]
    model = qdq_model(nodes, scalars(s1=0.02, z1=60), out_shape=(1, 4, 2, 2))
    rq = Requantizer()
    out = rq.requantize(model)
    assert ops(out) == ["QuantizeLinear", "MaxPool", "DequantizeLinear"]
    assert rq.stats.crossed_ops == ["pool"]
    np.testing.assert_array_equal(run(out, {"x": X})[0], run(model, {"x": X})[0])


def test_maxpool_is_not_crossed_below_opset_12():
    nodes = [
        h.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q"], name="q0"),
        h.make_node("DequantizeLinear", ["q", "s1", "z1"], ["d"], name="dq0"),
        h.make_node("MaxPool", ["d"], ["y"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
    ]
    model = qdq_model(nodes, scalars(s1=0.02, z1=60), out_shape=(1, 4, 2, 2), opset=11)
    out = Requantizer().requantize(model)
    assert ops(out) == ["QuantizeLinear", "DequantizeLinear", "MaxPool"]


def test_relu_after_dq_at_qmin_is_dropped_and_kept_otherwise():
    for zp, kept in ((0, False), (60, True)):
        nodes = [
            h.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q"], name="q0"),
            h.make_node("DequantizeLinear", ["q", "s1", "z1"], ["d"], name="dq0"),
            h.make_node("Relu", ["d"], ["y"], name="relu"),
        ]
        model = qdq_model(nodes, scalars(s1=0.02, z1=zp))
        out = Requantizer().requantize(model)
        assert ("Relu" in ops(out)) is kept
        assert out.graph.output[0].name == "y"
        onnx.checker.check_model(out)
        np.testing.assert_array_equal(run(out, {"x": X})[0], run(model, {"x": X})[0])


def _crossing_model(op_node, inits, out_shape):
    nodes = [
        h.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q"], name="q0"),
        h.make_node("DequantizeLinear", ["q", "s1", "z1"], ["d"], name="dq0"),
        op_node,
        h.make_node("QuantizeLinear", ["p", "s1", "z1"], ["q2"], name="q1"),
        h.make_node("DequantizeLinear", ["q2", "s1", "z1"], ["y"], name="dq1"),
    ]
    return qdq_model(nodes, {**scalars(s1=0.02, z1=60), **inits}, out_shape=out_shape)


def test_more_ops_carry_int8():
    cases = [
        (
            h.make_node("Slice", ["d", "st", "en", "ax"], ["p"], name="op"),
            {
                "st": np.array([1], np.int64),
                "en": np.array([3], np.int64),
                "ax": np.array([1], np.int64),
            },
            (1, 2, 4, 4),
        ),
        (
            h.make_node("Gather", ["d", "idx"], ["p"], axis=1, name="op"),
            {"idx": np.array([3, 0], np.int64)},
            (1, 2, 4, 4),
        ),
        (
            h.make_node("Resize", ["d", "", "sc"], ["p"], mode="nearest", name="op"),
            {"sc": np.array([1, 1, 2, 2], np.float32)},
            (1, 4, 8, 8),
        ),
        (h.make_node("DepthToSpace", ["d"], ["p"], blocksize=2, name="op"), {}, (1, 1, 8, 8)),
    ]
    for node, inits, shape in cases:
        model = _crossing_model(node, inits, shape)
        rq = Requantizer()
        out = rq.requantize(model)
        assert ops(out) == ["QuantizeLinear", node.op_type, "DequantizeLinear"], node.op_type
        np.testing.assert_array_equal(run(out, {"x": X})[0], run(model, {"x": X})[0])


def test_linear_resize_is_not_crossed():
    node = h.make_node("Resize", ["d", "", "sc"], ["p"], mode="linear", name="op")
    model = _crossing_model(node, {"sc": np.array([1, 1, 2, 2], np.float32)}, (1, 4, 8, 8))
    assert ops(Requantizer().requantize(model))[:3] == [
        "QuantizeLinear",
        "DequantizeLinear",
        "Resize",
    ]


@pytest.mark.parametrize("zp", [0, 60])
def test_zero_pad_becomes_zero_point_pad(zp):
    node = h.make_node("Pad", ["d", "pads"], ["p"], name="op")
    pads = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)
    nodes = [
        h.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q"], name="q0"),
        h.make_node("DequantizeLinear", ["q", "s1", "z1"], ["d"], name="dq0"),
        node,
        h.make_node("QuantizeLinear", ["p", "s1", "z1"], ["q2"], name="q1"),
        h.make_node("DequantizeLinear", ["q2", "s1", "z1"], ["y"], name="dq1"),
    ]
    model = qdq_model(nodes, {**scalars(s1=0.02, z1=zp), "pads": pads}, out_shape=(1, 4, 6, 6))
    out = Requantizer().requantize(model)
    assert ops(out) == ["QuantizeLinear", "Pad", "DequantizeLinear"]
    np.testing.assert_array_equal(run(out, {"x": X})[0], run(model, {"x": X})[0])


@pytest.mark.parametrize("mode", ["reflect", "edge"])
def test_copying_pads_are_crossed(mode):
    node = h.make_node("Pad", ["d", "pads"], ["p"], mode=mode, name="op")
    pads = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)
    model = _crossing_model(node, {"pads": pads}, (1, 4, 6, 6))
    out = Requantizer().requantize(model)
    assert ops(out) == ["QuantizeLinear", "Pad", "DequantizeLinear"]
    np.testing.assert_array_equal(run(out, {"x": X})[0], run(model, {"x": X})[0])


def test_nonzero_constant_pad_is_not_crossed():
    node = h.make_node("Pad", ["d", "pads", "v"], ["p"], name="op")
    pads = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)
    model = _crossing_model(node, {"pads": pads, "v": np.float32(0.5)}, (1, 4, 6, 6))
    assert ops(Requantizer().requantize(model))[:3] == ["QuantizeLinear", "DequantizeLinear", "Pad"]


def _pair_into_conv():
    """Q(x, s1) → DQ → Q(s2) → QLinearConv (int32 bias b) → DQ."""
    return [
        h.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q"], name="q0"),
        h.make_node("DequantizeLinear", ["q", "s1", "z1"], ["d"], name="dq0"),
        h.make_node("QuantizeLinear", ["d", "s2", "z2"], ["q2"], name="q1"),
        h.make_node(
            "QLinearConv",
            ["q2", "s2", "z2", "w", "sw", "zw", "sy", "zy", "b"],
            ["yq"],
            name="conv",
        ),
        h.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"], name="dq1"),
    ]


def test_rescaled_pair_rescales_the_int32_bias():
    # Q(x, s1) -> DQ -> Q(s2) -> QLinearConv with an int32 bias at s2·s_w. Reading the s1 tensor
    # directly changes the accumulator scale to s1·s_w: the bias must follow, or every output
    # shifts by bias·(1 − s2/s1) (a bug that once cost nudenet a third of its box IoU).
    w = np.random.default_rng(1).integers(-60, 60, (4, 4, 1, 1)).astype(np.int8)
    nodes = _pair_into_conv()
    inits = {
        **scalars(s1=0.015, z1=70, s2=0.012, z2=85, sy=0.1, zy=128),
        "w": w,
        "sw": np.float32(0.01),
        "zw": np.int8(0),
        "b": np.array([20000, -15000, 5000, 40000], np.int32),
    }
    model = qdq_model(nodes, inits)
    rq = Requantizer()
    out = rq.requantize(model)
    assert rq.stats.rescaled_pairs == 1 and "QuantizeLinear" not in ops(out)[1:]
    bias = {i.name: nh.to_array(i) for i in out.graph.initializer}
    conv = next(n for n in out.graph.node if n.op_type == "QLinearConv")
    np.testing.assert_array_equal(bias[conv.input[8]], np.round(inits["b"] * 0.012 / 0.015))
    # the folded model differs from the original only by the input's rounding, not by the bias
    diff = np.abs(run(out, {"x": X})[0] - run(model, {"x": X})[0])
    assert diff.max() <= 0.1 * 2 + 1e-6  # at most two output steps
    assert diff.mean() < 0.1


def test_rescaled_bias_that_would_overflow_keeps_the_pair():
    nodes = _pair_into_conv()
    inits = {
        **scalars(s1=0.0001, z1=70, s2=0.012, z2=85, sy=0.1, zy=128),
        "w": np.ones((4, 4, 1, 1), np.int8),
        "sw": np.float32(0.01),
        "zw": np.int8(0),
        "b": np.full(4, 2_000_000_000 // 2, np.int32),
    }
    rq = Requantizer()
    out = rq.requantize(qdq_model(nodes, inits))
    assert rq.stats.rescaled_pairs == 0 and ops(out).count("QuantizeLinear") == 2


def _split_model(readers):
    """q0 → dq0 → Split into a and b; ``readers`` reads them and writes y."""
    nodes = [
        h.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q"], name="q0"),
        h.make_node("DequantizeLinear", ["q", "s1", "z1"], ["d"], name="dq0"),
        h.make_node("Split", ["d", "halves"], ["a", "b"], axis=1, name="split"),
        *readers,
    ]
    inits = {**scalars(s1=0.02, z1=60), "halves": np.array([2, 2], np.int64)}
    return qdq_model(nodes, inits, out_shape=(1, 2, 4, 4))


def test_dq_stays_before_a_split_whose_parts_only_float_ops_read():
    # moved past the Split it would become two dequantizers and fold with nothing
    model = _split_model(
        [
            h.make_node("Sigmoid", ["a"], ["sa"], name="sig"),
            h.make_node("Tanh", ["b"], ["tb"], name="tanh"),
            h.make_node("Mul", ["sa", "tb"], ["y"], name="mul"),
        ]
    )
    rq = Requantizer()
    out = rq.requantize(model)
    assert ops(out) == ["QuantizeLinear", "DequantizeLinear", "Split", "Sigmoid", "Tanh", "Mul"]
    assert rq.stats.crossed_ops == []


def test_dq_crosses_a_split_when_a_part_meets_a_quantizer():
    model = _split_model(
        [
            h.make_node("QuantizeLinear", ["a", "s1", "z1"], ["qa"], name="q1"),
            h.make_node("DequantizeLinear", ["qa", "s1", "z1"], ["da"], name="dq1"),
            h.make_node("Tanh", ["b"], ["tb"], name="tanh"),
            h.make_node("Mul", ["da", "tb"], ["y"], name="mul"),
        ]
    )
    rq = Requantizer()
    out = rq.requantize(model)
    assert rq.stats.crossed_ops == ["split"]
    assert rq.stats.folded_pairs == 1
    assert ops(out).count("DequantizeLinear") == 2
    np.testing.assert_array_equal(run(out, {"x": X})[0], run(model, {"x": X})[0])
