"""Every quantizer pattern: match / no-match, expected op counts, numerics through onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import dq_q_pairs_between_quantized, make_model, ops, rng, run
from onnx import helper as h

import onnxq
from onnxq.annotate.quantizer import Quantizer

R = rng(0)


@pytest.fixture(autouse=True)
def _fixed_weights():
    """Every test draws its weights from the same seed, whatever ran before."""
    global R
    R = rng(0)


def weights(*shape, scale=0.3):
    return R.normal(0, scale, shape).astype(np.float32)


def close_enough(model, qmodel, feeds, tol=0.04):
    """Quantized output within ``tol`` of the float output's range, cosine > 0.999."""
    f = run(model, feeds)[0].ravel()
    q = run(qmodel, feeds)[0].ravel()
    span = float(f.max() - f.min()) or 1.0
    err = float(np.abs(f - q).max()) / span
    cos = float(f @ q / (np.linalg.norm(f) * np.linalg.norm(q) + 1e-12))
    assert err < tol, f"max error {err:.4f} of the output range"
    assert cos > 0.999, f"cosine {cos:.5f}"


def within_steps(model, qmodel, feeds, scale, steps=3.0):
    """Every output within ``steps`` quantization steps of the float output."""
    f = run(model, feeds)[0]
    q = run(qmodel, feeds)[0]
    err = float(np.abs(f - q).max())
    assert err <= steps * float(scale), f"max error {err:.4g} = {err / float(scale):.2f} steps"


def quantize_random(model, input_shapes, n=16, **kw):
    gen = rng(1)  # the same data whatever ran before
    data = {k: gen.normal(0, 1, (n, *s[1:])).astype(np.float32) for k, s in input_shapes.items()}
    q, report = onnxq.quantize(model, data, progress=False, **kw)
    feeds = {k: v[:2] for k, v in data.items()}  # inside the calibrated range
    return q, report, feeds


CONV_CASES = {
    "conv": (
        [h.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1], name="conv")],
        {"W": weights(8, 3, 3, 3)},
        ["QLinearConv"],
    ),
    "conv+bias": (
        [h.make_node("Conv", ["x", "W", "B"], ["y"], pads=[1, 1, 1, 1], name="conv")],
        {"W": weights(8, 3, 3, 3), "B": weights(8)},
        ["QLinearConv"],
    ),
    "conv+bias+relu": (
        [
            h.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
            h.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        {"W": weights(8, 3, 3, 3), "B": weights(8)},
        ["QLinearConv"],
    ),
    "conv+relu (no bias)": (
        [
            h.make_node("Conv", ["x", "W"], ["c"], name="conv"),
            h.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        {"W": weights(8, 3, 3, 3)},
        ["QLinearConv"],
    ),
    "depthwise": (
        [h.make_node("Conv", ["x", "W", "B"], ["y"], group=3, pads=[1, 1, 1, 1], name="conv")],
        {"W": weights(3, 1, 3, 3), "B": weights(3)},
        ["QLinearConv"],
    ),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.parametrize("per_channel", [True, False])
def test_conv_patterns(case, per_channel):
    nodes, inits, expected = CONV_CASES[case]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]}, per_channel=per_channel)
    assert ops(q) == ["QuantizeLinear", *expected, "DequantizeLinear"]
    assert all(d.quantized for d in report.decisions)
    close_enough(model, q, feeds)


DENSE_CASES = {
    "matmul": (
        [h.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        {"W": weights(16, 8)},
        "MatMulIntegerToFloat",
    ),
    "matmul+add": (
        [
            h.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
            h.make_node("Add", ["m", "B"], ["y"], name="add"),
        ],
        {"W": weights(16, 8), "B": weights(8)},
        "QGemm",
    ),
    "bias+matmul (bias first)": (
        [
            h.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
            h.make_node("Add", ["B", "m"], ["y"], name="add"),
        ],
        {"W": weights(16, 8), "B": weights(8)},
        "QGemm",
    ),
    "gemm transB=0": (
        [h.make_node("Gemm", ["x", "W", "B"], ["y"], name="gemm")],
        {"W": weights(16, 8), "B": weights(8)},
        "QGemm",
    ),
    "gemm transB=1 alpha beta": (
        [h.make_node("Gemm", ["x", "W", "B"], ["y"], transB=1, alpha=0.5, beta=2.0, name="gemm")],
        {"W": weights(8, 16), "B": weights(8)},
        "QGemm",
    ),
    "gemm no bias": (
        [h.make_node("Gemm", ["x", "W"], ["y"], transB=1, name="gemm")],
        {"W": weights(8, 16)},
        "QGemm",
    ),
    "gemm+relu": (
        [
            h.make_node("Gemm", ["x", "W", "B"], ["g"], name="gemm"),
            h.make_node("Relu", ["g"], ["y"], name="relu"),
        ],
        {"W": weights(16, 8), "B": weights(8)},
        "QGemm",
    ),
}


@pytest.mark.parametrize("case", list(DENSE_CASES))
@pytest.mark.parametrize("per_channel", [True, False])
def test_dense_patterns(case, per_channel):
    nodes, inits, qop = DENSE_CASES[case]
    model = make_model(nodes, [("x", ["N", 16])], [("y", None)], inits)
    q, report, feeds = quantize_random(model, {"x": [1, 16]}, per_channel=per_channel)
    # the graph output is read by no int8 op: the int8 product is written in float
    # (onnxq.post.float_outputs), except after a folded Relu, whose clipping is the grid's
    relu = case == "gemm+relu"
    assert ops(q) == ["QuantizeLinear", qop, *(["DequantizeLinear"] if relu else [])]
    close_enough(model, q, feeds)


def test_per_channel_scales_follow_output_axis():
    w = weights(8, 16)
    w[3] *= 50  # one output row of a transB=1 weight is much larger
    model = make_model(
        [h.make_node("Gemm", ["x", "W"], ["y"], transB=1, name="gemm")],
        [("x", ["N", 16])],
        [("y", None)],
        {"W": w},
    )
    _, report, _ = quantize_random(model, {"x": [1, 16]})
    scale = np.asarray(report.values["W_scale"])
    assert scale.shape == (8,) and scale.argmax() == 3
    assert scale[3] / np.delete(scale, 3).max() > 10


def test_matmul_3d_input_keeps_bias_float_with_reason():
    model = make_model(
        [
            h.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
            h.make_node("Add", ["m", "B"], ["y"], name="add"),
        ],
        [("x", ["N", 4, 16])],
        [("y", None)],
        {"W": weights(16, 8), "B": weights(8)},
    )
    q, report, feeds = quantize_random(model, {"x": [1, 4, 16]})
    # the bias Add stays out of the pattern but goes into the float-output op
    assert ops(q) == ["QuantizeLinear", "MatMulIntegerToFloat"]
    add = next(d for d in report.decisions if d.node == "add")
    assert not add.quantized and "2-D input" in add.reason
    close_enough(model, q, feeds)


def test_conv_with_dynamic_weight_is_not_matched():
    model = make_model(
        [h.make_node("Conv", ["x", "w"], ["y"], name="conv")],
        [("x", ["N", 3, 8, 8]), ("w", [4, 3, 3, 3])],
        [("y", None)],
    )
    decision = Quantizer(model).decisions["conv"]
    assert not decision.quantized and "'w' is not a constant" in decision.reason


BINARY_CASES = {
    "add": ("Add", "QLinearAdd", False),
    "mul": ("Mul", "QLinearMul", False),
    "add+relu": ("Add", "QLinearAdd", True),
    "mul+relu": ("Mul", "QLinearMul", True),
}


@pytest.mark.parametrize("case", list(BINARY_CASES))
def test_binary_patterns_between_convs(case):
    op, qop, relu = BINARY_CASES[case]
    nodes = [
        h.make_node("Conv", ["x", "W1", "B1"], ["a"], pads=[1, 1, 1, 1], name="c1"),
        h.make_node("Conv", ["x", "W2", "B2"], ["b"], pads=[1, 1, 1, 1], name="c2"),
        h.make_node(op, ["a", "b"], ["s" if relu else "t"], name="bin"),
    ]
    if relu:
        nodes.append(h.make_node("Relu", ["s"], ["t"], name="relu"))
    nodes.append(h.make_node("Conv", ["t", "W3"], ["y"], name="c3"))
    inits = {
        "W1": weights(4, 3, 3, 3),
        "B1": weights(4),
        "W2": weights(4, 3, 3, 3),
        "B2": weights(4),
        "W3": weights(2, 4, 1, 1),
    }
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]})
    hist = ops(q)
    assert hist.count(qop) == 1 and hist.count("QLinearConv") == 3
    assert hist.count("QuantizeLinear") == 1 and hist.count("DequantizeLinear") == 1
    assert op not in hist and "Relu" not in hist
    assert dq_q_pairs_between_quantized(q) == []
    close_enough(model, q, feeds, tol=0.06)


def test_add_with_constant_is_not_a_binary_pattern():
    model = make_model(
        [h.make_node("Add", ["x", "k"], ["y"], name="add")],
        [("x", ["N", 4])],
        [("y", None)],
        {"k": weights(4)},
    )
    d = Quantizer(model).decisions["add"]
    assert not d.quantized and "is a constant" in d.reason


def test_isolated_add_stays_float():
    model = make_model(
        [h.make_node("Add", ["x", "z"], ["y"], name="add")],
        [("x", ["N", 4]), ("z", ["N", 4])],
        [("y", None)],
    )
    qz = Quantizer(model)
    d = qz.decisions["add"]
    assert not d.quantized and "round trip" in d.reason
    assert qz.records == []


def test_op_read_only_by_float_ops_stays_float():
    # Conv (int8) → Mul(a, a) → ReduceSum: an int8 square would be dequantized at once for the
    # float reduction, costing a rounding of the variance-like sum (magika's LayerNorm)
    nodes = [
        h.make_node("Conv", ["x", "W"], ["a"], name="conv"),
        h.make_node("Mul", ["a", "a"], ["sq"], name="square"),
        h.make_node("ReduceSum", ["sq"], ["y"], name="sum", keepdims=0),
    ]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], {"W": weights(4, 3, 3, 3)})
    q, report, feeds = quantize_random(model, {"x": [2, 3, 8, 8]})
    square = next(d for d in report.decisions if d.node == "square")
    assert not square.quantized and "dequantized at once" in square.reason
    assert "QLinearMul" not in ops(q) and "QLinearConv" in ops(q)
    np.testing.assert_allclose(run(q, feeds)[0], run(model, feeds)[0], rtol=0.01)


def test_consumer_left_float_does_not_count_as_quantized():
    # Conv → Mul(a, a) → Mul(·, a) → Tanh (a GELU's cubic): the second Mul is left float (only
    # Tanh reads it), so the first must be too — a matched-but-float group is not a reader
    nodes = [
        h.make_node("Conv", ["x", "W"], ["a"], name="conv"),
        h.make_node("Mul", ["a", "a"], ["sq"], name="square"),
        h.make_node("Mul", ["sq", "a"], ["cube"], name="cube"),
        h.make_node("Tanh", ["cube"], ["y"], name="tanh"),
    ]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], {"W": weights(4, 3, 3, 3)})
    q, report, feeds = quantize_random(model, {"x": [2, 3, 8, 8]})
    decided = {d.node: d for d in report.decisions}
    assert not decided["cube"].quantized and not decided["square"].quantized
    assert "QLinearMul" not in ops(q)
    # the cube triples the Conv output's relative error: 0.041 of the range with the 7-bit
    # weights of a CPU without VNNI (under 0.04 with 8-bit weights on one with VNNI)
    close_enough(model, q, feeds, tol=0.06)


def test_shared_input_is_quantized_once():
    nodes = [
        h.make_node("Conv", ["x", "W1"], ["a"], name="c1"),
        h.make_node("Conv", ["x", "W2"], ["b"], name="c2"),
        h.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    model = make_model(
        nodes,
        [("x", ["N", 3, 8, 8])],
        [("y", None)],
        {"W1": weights(4, 3, 3, 3), "W2": weights(4, 3, 3, 3)},
    )
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]})
    assert ops(q).count("QuantizeLinear") == 1
    assert [k for k in report.values if k.startswith("x_")] == ["x_scale", "x_zero_point"]
    close_enough(model, q, feeds)


def test_relu_folded_output_has_zero_point_at_qmin():
    model = make_model(
        [
            h.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
            h.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        [("x", ["N", 3, 8, 8])],
        [("y", None)],
        {"W": weights(8, 3, 3, 3), "B": weights(8)},
    )
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]})
    assert report.values["y_zero_point"] == 0
    assert run(q, feeds)[0].min() >= 0
    q8, report8, _ = quantize_random(model, {"x": [1, 3, 8, 8]}, activation_dtype="int8")
    assert report8.values["y_zero_point"] == -128
    close_enough(model, q8, feeds)


def test_excluded_node_stays_float():
    nodes = [
        h.make_node("Conv", ["x", "W1"], ["a"], name="c1"),
        h.make_node("Conv", ["a", "W2"], ["y"], name="c2"),
    ]
    model = make_model(
        nodes,
        [("x", ["N", 3, 8, 8])],
        [("y", None)],
        {"W1": weights(4, 3, 3, 3), "W2": weights(4, 4, 3, 3)},
    )
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]}, exclude=["c2"])
    # the float Conv reads the int8 tensor through Cast/Sub/Mul (onnxq.post.float_guard)
    assert ops(q) == ["QuantizeLinear", "QLinearConv", "Cast", "Sub", "Mul", "Conv"]
    d = next(d for d in report.decisions if d.node == "c2")
    assert not d.quantized and "exclude" in d.reason
    close_enough(model, q, feeds)


def test_placeholder_names_are_deterministic():
    model = make_model(
        [h.make_node("Conv", ["x", "W", "B"], ["y"], name="conv")],
        [("x", ["N", 3, 8, 8])],
        [("y", None)],
        {"W": weights(4, 3, 3, 3), "B": weights(4)},
    )
    names = [sorted(Quantizer(model).placeholders) for _ in range(2)]
    assert names[0] == names[1]
    assert names[0] == [
        "W_quantized",
        "W_scale",
        "W_zero_point",
        "conv.bias_quantized",
        "x_scale",
        "x_zero_point",
        "y_scale",
        "y_zero_point",
    ]


def test_bias_overflow_widens_weight_scale_instead_of_clipping():
    w = np.full((2, 4), 1e-6, np.float32)
    b = np.array([1e6, 1.0], np.float32)
    model = make_model(
        [h.make_node("Gemm", ["x", "W", "B"], ["y"], transB=1, name="gemm")],
        [("x", ["N", 4])],
        [("y", None)],
        {"W": w, "B": b},
    )
    data = {"x": np.full((4, 4), 1e-3, np.float32)}
    q, report = onnxq.quantize(model, data, progress=False)
    ws = np.asarray(report.values["W_scale"])
    xs = float(report.values["x_scale"])
    assert abs(1e6 / (xs * ws[0])) <= 2**31 - 1
    np.testing.assert_allclose(run(q, data)[0][:, 0], run(model, data)[0][:, 0], rtol=1e-3)


POOL_CASES = {
    "global-average-pool": (
        h.make_node("GlobalAveragePool", ["a"], ["p"], name="pool"),
        "QLinearGlobalAveragePool",
        [2, 1, 1],
    ),
    "average-pool": (
        h.make_node("AveragePool", ["a"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
        "QLinearAveragePool",
        [2, 4, 4],
    ),
}


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_average_pooling_between_convs(case):
    pool, qop, _ = POOL_CASES[case]
    nodes = [
        h.make_node("Conv", ["x", "W1", "B1"], ["c"], pads=[1, 1, 1, 1], name="c1"),
        h.make_node("Relu", ["c"], ["a"], name="relu"),
        pool,
        h.make_node("Conv", ["p", "W2"], ["y"], name="c2"),
    ]
    inits = {"W1": weights(4, 3, 3, 3), "B1": weights(4), "W2": weights(2, 4, 1, 1)}
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]})
    assert ops(q) == ["QuantizeLinear", "QLinearConv", qop, "QLinearConv", "DequantizeLinear"]
    assert dq_q_pairs_between_quantized(q) == []
    within_steps(model, q, feeds, report.values["y_scale"], steps=4)


def test_isolated_pooling_stays_float_with_reason():
    model = make_model(
        [h.make_node("GlobalAveragePool", ["x"], ["y"], name="pool")],
        [("x", ["N", 3, 8, 8])],
        [("y", None)],
    )
    d = Quantizer(model).decisions["pool"]
    assert not d.quantized and "round trip" in d.reason


@pytest.mark.parametrize("opset", [13, 9])
def test_conv_relu6_clip_is_folded(opset):
    if opset >= 11:
        clip = h.make_node("Clip", ["c", "lo", "hi"], ["y"], name="clip")
        inits = {"lo": np.float32(0), "hi": np.float32(6)}
    else:
        clip = h.make_node("Clip", ["c"], ["y"], min=0.0, max=6.0, name="clip")
        inits = {}
    w = weights(8, 3, 3, 3, scale=1.0)
    model = make_model(
        [h.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"), clip],
        [("x", ["N", 3, 8, 8])],
        [("y", None)],
        {"W": w, "B": np.full(8, 4.0, np.float32), **inits},
        opset=opset,
    )
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]})
    assert ops(q) == ["QuantizeLinear", "QLinearConv", "DequantizeLinear"]
    out = run(q, feeds)[0]
    assert out.min() >= 0 and out.max() <= 6.0 + 1e-6
    assert (run(model, feeds)[0] >= 6.0).mean() > 0.05  # the upper clamp is exercised
    close_enough(model, q, feeds, tol=0.05)


def test_clip_with_nonzero_min_is_not_folded():
    model = make_model(
        [
            h.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
            h.make_node("Clip", ["c", "lo", "hi"], ["y"], name="clip"),
        ],
        [("x", ["N", 3, 8, 8])],
        [("y", None)],
        {"W": weights(8, 3, 3, 3), "B": weights(8), "lo": np.float32(-1), "hi": np.float32(1)},
    )
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]})
    assert ops(q) == ["QuantizeLinear", "QLinearConv", "DequantizeLinear", "Clip"]
    close_enough(model, q, feeds)


ACT_CASES = {
    "sigmoid": (h.make_node("Sigmoid", ["a"], ["t"], name="act"), "QLinearSigmoid"),
    "leaky-relu": (
        h.make_node("LeakyRelu", ["a"], ["t"], alpha=0.2, name="act"),
        "QLinearLeakyRelu",
    ),
    "softmax": (h.make_node("Softmax", ["a"], ["t"], axis=1, name="act"), "QLinearSoftmax"),
}


def _between_convs(act):
    """x → Conv → ``act`` (output t) → Conv → y."""
    nodes = [
        h.make_node("Conv", ["x", "W1", "B1"], ["a"], pads=[1, 1, 1, 1], name="c1"),
        act,
        h.make_node("Conv", ["t", "W2"], ["y"], name="c2"),
    ]
    inits = {"W1": weights(4, 3, 3, 3), "B1": weights(4), "W2": weights(2, 4, 1, 1)}
    return make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)


@pytest.mark.parametrize("case", list(ACT_CASES))
def test_activations_between_convs(case):
    act, qop = ACT_CASES[case]
    model = _between_convs(act)
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]})
    assert ops(q) == ["QuantizeLinear", "QLinearConv", qop, "QLinearConv", "DequantizeLinear"]
    if case in ("sigmoid", "softmax"):
        assert (
            report.values["t_scale"] == pytest.approx(1 / 255)
            and report.values["t_zero_point"] == 0
        )
    close_enough(model, q, feeds, tol=0.05)


@pytest.mark.parametrize("case", ["sigmoid", "softmax"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_fixed_unit_grid_for_int16_activations(case, symmetric):
    # the fixed [0, 1] grid had entries for uint8 and int8 only: int16 activations (A16W8,
    # QDQ) raised KeyError 'int16' on any model with a Sigmoid or Softmax between int8 layers
    model = _between_convs(ACT_CASES[case][0])
    kw = {"activation_dtype": "int16", "format": "qdq", "symmetric_activations": symmetric}
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]}, **kw)
    scale, zero = (1 / 32767, 0) if symmetric else (1 / 65535, -32768)
    assert report.values["t_scale"] == pytest.approx(scale)
    assert report.values["t_zero_point"] == zero
    zp = next(i for i in q.graph.initializer if i.name == "t_zero_point")
    assert zp.data_type == onnx.TensorProto.INT16
    close_enough(model, q, feeds, tol=0.01)


def test_softmax_at_the_output_stays_float():
    nodes = [
        h.make_node("Gemm", ["x", "W"], ["l"], name="fc"),
        h.make_node("Softmax", ["l"], ["y"], name="softmax"),
    ]
    model = make_model(nodes, [("x", ["N", 16])], [("y", None)], {"W": weights(16, 8)})
    q, report, feeds = quantize_random(model, {"x": [1, 16]})
    assert ops(q) == ["QuantizeLinear", "QGemm", "Softmax"]  # QGemm writes float
    d = next(d for d in report.decisions if d.node == "softmax")
    assert not d.quantized and "round trip" in d.reason


def test_attention_matmul_with_two_activations():
    d = 8
    nodes = [
        h.make_node("MatMul", ["x", "Wq"], ["q"], name="q_proj"),
        h.make_node("MatMul", ["x", "Wk"], ["k"], name="k_proj"),
        h.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
        h.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        h.make_node("MatMul", ["s", "Wo"], ["y"], name="out"),
    ]
    inits = {"Wq": weights(d, d), "Wk": weights(d, d), "Wo": weights(6, d)}
    model = make_model(nodes, [("x", ["N", 6, d])], [("y", None)], inits)
    q, report, feeds = quantize_random(model, {"x": [1, 6, d]})
    assert ops(q).count("QLinearMatMul") == 3 and "MatMul" not in ops(q)
    assert ops(q)[-1] == "MatMulIntegerToFloat"  # out: only the graph output reads it
    scores = next(x for x in report.decisions if x.node == "scores")
    assert scores.quantized and scores.pattern == "matmul-activations"
    close_enough(model, q, feeds, tol=0.05)


def _concat_model(extra_reader: bool):
    nodes = [
        h.make_node("Conv", ["x", "W1"], ["a"], pads=[1, 1, 1, 1], name="c1"),
        h.make_node("Conv", ["x", "W2"], ["b"], pads=[1, 1, 1, 1], name="c2"),
        h.make_node("Concat", ["a", "b"], ["t"], axis=1, name="cat"),
    ]
    if extra_reader:
        nodes.append(h.make_node("Conv", ["t", "W3"], ["y"], name="c3"))
        out = "y"
    else:
        out = "t"
    inits = {"W1": weights(4, 3, 3, 3), "W2": weights(4, 3, 3, 3) * 10, "W3": weights(2, 8, 1, 1)}
    return make_model(nodes, [("x", ["N", 3, 8, 8])], [(out, None)], inits)


def test_concat_inside_the_quantized_region():
    model = _concat_model(extra_reader=True)
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]})
    assert ops(q) == [
        "QuantizeLinear",
        "QLinearConv",
        "QLinearConv",
        "QLinearConcat",
        "QLinearConv",
        "DequantizeLinear",
    ]
    close_enough(model, q, feeds, tol=0.05)


def test_concat_at_the_output_stays_float_with_reason():
    model = _concat_model(extra_reader=False)
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]})
    assert "Concat" in ops(q) and "QLinearConcat" not in ops(q)
    d = next(d for d in report.decisions if d.node == "cat")
    assert not d.quantized and "different ranges" in d.reason
    close_enough(model, q, feeds)


def test_yolo_c2f_block_stays_int8_through_split_and_concat():
    nodes = [
        h.make_node("Conv", ["x", "W1"], ["a"], pads=[1, 1, 1, 1], name="c1"),
        h.make_node("Split", ["a"], ["s0", "s1"], axis=1, name="split"),
        h.make_node("Conv", ["s1", "W2"], ["b"], pads=[1, 1, 1, 1], name="c2"),
        h.make_node("Concat", ["s0", "s1", "b"], ["cat"], axis=1, name="cat"),
        h.make_node("Conv", ["cat", "W3"], ["y"], name="c3"),
    ]
    inits = {"W1": weights(8, 3, 3, 3), "W2": weights(4, 4, 3, 3), "W3": weights(2, 12, 1, 1)}
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
    q, report, feeds = quantize_random(model, {"x": [1, 3, 8, 8]})
    assert ops(q) == [
        "QuantizeLinear",
        "QLinearConv",
        "Split",
        "QLinearConv",
        "QLinearConcat",
        "QLinearConv",
        "DequantizeLinear",
    ]
    assert dq_q_pairs_between_quantized(q) == []
    close_enough(model, q, feeds, tol=0.05)


def test_embedding_table_is_stored_int8_and_gathered_exactly():
    table = weights(50, 16, scale=1.0)
    nodes = [
        h.make_node("Gather", ["E", "ids"], ["e"], axis=0, name="embed"),
        h.make_node("MatMul", ["e", "W"], ["y"], name="proj"),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N", 7])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 7, 8])],
        [
            onnx.numpy_helper.from_array(table, "E"),
            onnx.numpy_helper.from_array(weights(16, 8), "W"),
        ],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    ids = np.random.default_rng(2).integers(0, 50, (4, 7)).astype(np.int64)
    q, report = onnxq.quantize(model, {"ids": ids}, progress=False)
    assert ops(q) == [
        "Gather",
        "DequantizeLinear",
        "QuantizeLinear",
        "MatMulIntegerToFloat",
    ]
    ints = {i.name: onnx.numpy_helper.to_array(i) for i in q.graph.initializer}
    assert ints["E_quantized"].dtype == np.int8 and ints["E_scale"].shape == (16,)
    embed = next(d for d in report.decisions if d.node == "embed")
    assert embed.quantized and embed.pattern == "gather-table"
    # the gathered rows equal the dequantized table rows
    scale = ints["E_scale"]
    ref = ints["E_quantized"][ids].astype(np.float32) * scale
    np.testing.assert_allclose(np.abs(ref - table[ids]).max(), 0, atol=scale.max())
    close_enough(model, q, {"ids": ids}, tol=0.05)


def test_silu_fixed_sigmoid_grid_is_not_a_conflict():
    # YOLOv8's SiLU: Conv → Sigmoid → Mul(conv, sigmoid) → Conv. The Mul observes the sigmoid's
    # range, but the sigmoid's fixed 1/255 grid defines that tensor: no conflict is reported
    nodes = [
        h.make_node("Conv", ["x", "W1"], ["a"], name="c1"),
        h.make_node("Sigmoid", ["a"], ["s"], name="sig"),
        h.make_node("Mul", ["a", "s"], ["m"], name="silu"),
        h.make_node("Conv", ["m", "W2"], ["y"], name="c2"),
    ]
    model = make_model(
        nodes,
        [("x", ["N", 3, 8, 8])],
        [("y", None)],
        {"W1": weights(4, 3, 3, 3), "W2": weights(4, 4, 3, 3)},
    )
    q, report, feeds = quantize_random(model, {"x": [2, 3, 8, 8]})
    assert {"QLinearSigmoid", "QLinearMul"} <= set(ops(q))
    assert report.calibration.conflicts == []
    assert report.values["s_scale"] == pytest.approx(1 / 255)
    close_enough(model, q, feeds)


def test_a_sigmoid_output_well_inside_0_1_gets_its_calibrated_grid():
    # a Sigmoid graph output whose values stay well under 0.5 used a fraction of the fixed
    # grid's codes: 5 dB under onnxruntime's calibrated grid on a random graph (issue 13)
    g = rng(21)
    nodes = [
        h.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        h.make_node("Sigmoid", ["c"], ["y"], name="sig"),
        h.make_node("Conv", ["y", "W2"], ["z"], name="conv2"),  # y is read by a quantized op too
    ]
    inits = {
        "W": g.normal(0, 0.05, (4, 3, 3, 3)).astype(np.float32),
        "B": np.full(4, -3.0, np.float32),
        "W2": g.normal(0, 0.5, (2, 4, 1, 1)).astype(np.float32),
    }
    model = make_model(nodes, [("x", ["N", 3, 6, 6])], [("y", None), ("z", None)], inits)
    data = {"x": g.standard_normal((32, 3, 6, 6)).astype(np.float32)}
    ref = run(model, data)[0]
    assert 0.0 < ref.min() and ref.max() < 0.3
    q, report = onnxq.quantize(model, data, progress=False)
    scale = float(report.values["y_scale"])
    assert scale < 0.2 / 255  # not the fixed 1/255: measured 1/2580
    mean_error = np.abs(run(q, data)[0] - ref).mean()
    assert mean_error < 0.25 / 255  # the fixed grid alone rounds by 1/4 step on average
