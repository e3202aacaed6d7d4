"""Fast bias correction: the expected shift against onnxruntime, and its effect end to end."""

import numpy as np
import onnx
import pytest
from helpers import make_model, rng, run
from onnx import helper as h

import onnxq
from onnxq.core.errors import ConfigError
from onnxq.core.qparams import QParams
from onnxq.solve.bias_correction import Layer, expected_shift, weight_error


def _conv(weight, group, pads=(0, 0, 0, 0)):
    node = h.make_node("Conv", ["x", "W"], ["y"], name="conv", group=group, pads=list(pads))
    c_in = weight.shape[1] * group
    return make_model([node], [("x", ["N", c_in, 6, 6])], [("y", None)], {"W": weight})


@pytest.mark.parametrize("group", [1, 2, 4], ids=["dense-conv", "grouped", "depthwise"])
def test_expected_shift_is_what_onnxruntime_computes_on_a_constant_input(group):
    """ΔW convolved with an input that is its mean everywhere (no padding) is exactly the shift."""
    r = rng(4)
    weight = r.normal(0, 0.3, (4, 4 // group, 3, 3)).astype(np.float32)
    scale = (np.abs(weight).reshape(4, -1).max(1) / 63).astype(np.float32)
    layer = Layer("conv", weight, QParams(scale, np.zeros(4, np.int8), 0), group=group)
    mean = r.normal(1, 0.5, 4).astype(np.float32)
    x = np.broadcast_to(mean.reshape(1, 4, 1, 1), (1, 4, 6, 6)).astype(np.float32)
    got = run(_conv(weight_error(layer), group), {"x": np.ascontiguousarray(x)})[0]
    np.testing.assert_allclose(got[0, :, 0, 0], expected_shift(layer, mean), rtol=1e-4, atol=1e-6)


def test_dense_shift_for_both_weight_layouts():
    r = rng(5)
    w = r.normal(0, 0.5, (8, 3)).astype(np.float32)  # (K, N)
    qp = QParams((np.abs(w).max(0) / 63).astype(np.float32), np.zeros(3, np.int8), 1)
    mean = r.normal(0.5, 1, 8)
    plain = expected_shift(Layer("dense", w, qp), mean)
    np.testing.assert_allclose(plain, mean @ weight_error(Layer("dense", w, qp)), rtol=1e-6)
    qt = QParams(qp.scale, qp.zero_point, 0)
    transposed = expected_shift(
        Layer("dense", np.ascontiguousarray(w.T), qt, transposed=True), mean
    )
    np.testing.assert_allclose(transposed, plain, rtol=1e-6)


def _depthwise_chain():
    """A depthwise Conv with a bias whose weights all round the same way, inputs of mean ~2."""
    r = rng(6)
    c = 8
    # weights sit 0.45 steps above a grid point of the 7-bit grid: rounding moves every tap down
    steps = r.integers(-40, 40, (c, 1, 3, 3)).astype(np.float32)
    steps[:, 0, 0, 0] = 63  # the largest tap fixes the scale at 1/63 of it
    weight = ((steps + np.where(steps == 63, 0, 0.45)) / 63 * 0.5).astype(np.float32)
    bias = r.normal(0, 0.1, c).astype(np.float32)
    nodes = [
        h.make_node("Conv", ["x", "W", "B"], ["y"], name="dw", group=c, pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["y"], ["z"], name="relu"),
    ]
    model = make_model(nodes, [("x", ["N", c, 10, 10])], [("z", None)], {"W": weight, "B": bias})
    data = {"x": (r.normal(2, 0.5, (64, c, 10, 10))).astype(np.float32)}
    return model, data


CHAIN_KW = dict(progress=False, weight_bits=7, method="minmax", rounding="nearest")


def _chain_errors(mode):
    """Per-channel mean output error of the depthwise chain without and with ``mode``."""
    model, data = _depthwise_chain()
    held_out = {"x": (rng(7).normal(2, 0.5, (32, 8, 10, 10))).astype(np.float32)}
    ref = run(model, held_out)[0]
    plain, _ = onnxq.quantize(model, data, bias_correction="none", **CHAIN_KW)
    fixed, report = onnxq.quantize(model, data, bias_correction=mode, **CHAIN_KW)

    def mean_error(q):  # per channel, over samples and positions
        return np.abs((run(q, held_out)[0] - ref).mean(axis=(0, 2, 3)))

    return mean_error(plain), mean_error(fixed), report


def test_fast_correction_removes_the_mean_shift_of_rounded_weights():
    before, after, report = _chain_errors("fast")
    assert before.mean() > 0.01  # the rounding does shift the outputs
    assert after.mean() < 0.25 * before.mean(), (before, after)
    assert set(report.bias_corrections) == {"dw.bias"} and report.bias_corrections["dw.bias"] > 0
    assert any(p.name == "bias-correction" for p in report.passes)
    assert "bias_corrections" in report.to_dict()


def test_on_by_default_for_a_cnn_off_with_none_and_a_bad_value_names_the_parameter():
    model, data = _depthwise_chain()
    _, report = onnxq.quantize(model, data, progress=False)
    assert report.model_kind == "cnn" and set(report.bias_corrections) == {"dw.bias"}
    assert "biases corrected" in report.algorithms["bias-correction"]
    _, report = onnxq.quantize(model, data, progress=False, bias_correction="none")
    assert report.bias_corrections == {} and all(p.name != "bias-correction" for p in report.passes)
    assert report.algorithms["bias-correction"] == "off (bias_correction='none')"
    with pytest.raises(ConfigError, match="bias_correction='slow'"):
        onnxq.quantize(model, data, progress=False, bias_correction="slow")
    assert isinstance(model, onnx.ModelProto)


def test_cli_takes_the_flag(tmp_path):
    from onnxq.cli import main

    model, data = _depthwise_chain()
    src, npz, out = tmp_path / "m.onnx", tmp_path / "c.npz", tmp_path / "q.onnx"
    onnx.save(model, str(src))
    np.savez(npz, x=data["x"])
    args = ["quantize", str(src), "--data", str(npz), "-o", str(out), "--quiet"]
    assert main([*args, "--bias-correction", "fast"]) == 0 and out.is_file()
    with pytest.raises(SystemExit) as info:  # argparse: the usage and one error line
        main([*args, "--bias-correction", "slow"])
    assert info.value.code == 2


def test_layerwise_shift_is_what_onnxruntime_computes_with_the_input_on_its_grid():
    """E[Wq·x̂] − E[W·x]: the int8 layer (QDQ input and weights) against the float layer, no
    padding, on inputs whose channels sit between grid points and beyond the clipped range."""
    from onnxq.solve.bias_correction import layerwise_shift

    r = rng(8)
    c = 4
    weight = r.normal(0, 0.5, (6, c, 3, 3)).astype(np.float32)
    wscale = (np.abs(weight).reshape(6, -1).max(1) / 63).astype(np.float32)
    layer = Layer("conv", weight, QParams(wscale, np.zeros(6, np.int8), 0))
    # constant over space (window means are the channel means), varying over samples
    x = r.normal(0, 1, (64, c, 1, 1)) * [[[[0.05]], [[1]], [[2]], [[0.4]]]] + 0.33
    x = np.ascontiguousarray(np.broadcast_to(x, (64, c, 6, 6)), np.float32)
    xq = QParams(np.float32(0.05), np.uint8(20))  # [-1, 11.75]: clips channel 2's tail
    from onnxq.core.qparams import dequantize, quantize

    x_hat = dequantize(quantize(x, xq), xq)
    wq = dequantize(quantize(weight, layer.qparams), layer.qparams)
    got = run(_conv(wq, 1), {"x": x_hat})[0].mean(axis=(0, 2, 3))
    ref = run(_conv(weight, 1), {"x": x})[0].mean(axis=(0, 2, 3))
    shift = layerwise_shift(layer, x.mean(axis=(0, 2, 3)), x_hat.mean(axis=(0, 2, 3)))
    np.testing.assert_allclose(shift, got - ref, rtol=1e-3, atol=1e-5)
    # and it differs from the weights-only shift: the input grid's own bias is in it
    assert np.abs(shift - expected_shift(layer, x.mean(axis=(0, 2, 3)))).max() > 1e-3


def test_layerwise_correction_end_to_end_and_its_fallback_on_one_shot_data():
    before, after, report = _chain_errors("layerwise")
    model, data = _depthwise_chain()
    kw = CHAIN_KW
    assert after.mean() < 0.25 * before.mean()
    assert "biases corrected, layerwise" in report.algorithms["bias-correction"]
    one_shot = ({"x": data["x"][i : i + 8]} for i in range(0, 64, 8))  # a generator
    _, report = onnxq.quantize(model, one_shot, bias_correction="layerwise", **kw)
    assert "fast (the data cannot be read again)" in report.algorithms["bias-correction"]


def test_a_float_layer_reading_an_int8_input_gets_that_grid_s_shift_removed():
    """c1 (identity 1×1 Conv, Relu folded: int8 output) → dw (excluded: float). c1's weights
    are exact on the grid, so the only bias shift left is the one c1's output grid puts into
    the float dw Conv: channels sitting between two grid points."""
    r = rng(12)
    c = 8
    nodes = [
        h.make_node("Conv", ["x", "W1", "B1"], ["a"], name="c1"),
        h.make_node("Relu", ["a"], ["a1"], name="relu"),
        h.make_node("Conv", ["a1", "W2", "B2"], ["y"], name="dw", group=c),
    ]
    inits = {
        "W1": np.eye(c, dtype=np.float32).reshape(c, c, 1, 1),
        "B1": np.zeros(c, np.float32),
        "W2": r.normal(1.0, 0.3, (c, 1, 3, 3)).astype(np.float32),
        "B2": r.normal(0, 0.1, c).astype(np.float32),
    }
    model = make_model(nodes, [("x", ["N", c, 6, 6])], [("y", None)], inits)
    # every channel nearly constant, a third of a grid step (6/255) off the grid
    levels = r.integers(20, 200, c) * (6 / 255) + (6 / 255) / 3

    def data(seed, n):
        noise = rng(seed).normal(0, 0.002, (n, c, 6, 6))
        x = levels.reshape(1, c, 1, 1) + noise
        x[:, 0, 0, 0] = 6.0  # the range is [0, 6] whatever the sample
        return {"x": x.astype(np.float32)}

    calib, held = data(13, 64), data(14, 32)
    kw = dict(progress=False, method="minmax", rounding="nearest", exclude=["dw"])
    ref = run(model, held)[0]
    plain, _ = onnxq.quantize(model, calib, bias_correction="none", **kw)
    fixed, report = onnxq.quantize(model, calib, bias_correction="fast", **kw)
    assert "dw" not in report.quantized_nodes
    assert "1 float layer(s) corrected" in report.algorithms["bias-correction"]

    def mean_error(q):
        return np.abs((run(q, held)[0] - ref)[:, 1:].mean(axis=(0, 2, 3)))  # past channel 0

    before, after = mean_error(plain), mean_error(fixed)
    assert before.mean() > 0.01
    assert after.mean() < 0.2 * before.mean(), (before, after)
    fq, _ = onnxq.quantize(model, calib, bias_correction="fast", format="openvino", **kw)
    b2 = {i.name: onnx.numpy_helper.to_array(i) for i in fq.graph.initializer}["B2"]
    assert not np.allclose(b2, inits["B2"])  # the FakeQuantize form holds the corrected bias


def test_channel_sums_match_a_float64_reference_in_every_dtype():
    from onnxq.solve.bias_correction import channel_means

    x = np.random.default_rng(3).normal(2.0, 3.0, (4, 24, 30, 30))
    ref = x.transpose(1, 0, 2, 3).reshape(24, -1).sum(axis=1)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-6)):
        sums, count = channel_means(x.astype(dtype), 1)
        assert count == 4 * 30 * 30 and sums.dtype == np.float64
        np.testing.assert_allclose(sums, ref, rtol=tol, atol=tol * np.abs(x).sum() / 24)
    big = np.full((2, 3, 100, 100), 60000.0, np.float16)  # rows sum past float16's range
    sums, _ = channel_means(big, 1)
    np.testing.assert_allclose(sums, 60000.0 * 2 * 100 * 100)
