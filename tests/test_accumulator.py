"""The int32 accumulator never wraps: bias plus the worst-case sum of products fits int32."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_model, rng, run
from onnx import helper as h

import onnxq
from onnxq.core.qparams import INT32_MAX, accumulation_bound
from onnxq.report import widened_notes


def _conv_bn(gamma_dead: float = 1e-6):
    g = rng(5)
    c = 4
    gamma = np.ones(c, np.float32)
    gamma[1] = gamma_dead  # channel 1 is dead after folding: its output is beta = 1.0
    inits = {
        "W": g.normal(0, 0.3, (c, 3, 3, 3)).astype(np.float32),
        "B": g.normal(0, 0.1, c).astype(np.float32),
        "gamma": gamma,
        "beta": np.array([0.0, 1.0, 0.0, 0.0], np.float32),
        "mean": np.zeros(c, np.float32),
        "var": np.ones(c, np.float32),
    }
    nodes = [
        h.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        h.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], name="bn"),
    ]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
    return model, {"x": g.uniform(-2, 2, (16, 3, 8, 8)).astype(np.float32)}


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
@pytest.mark.parametrize("bits", [7, 8])
def test_dead_channel_after_batchnorm_stays_exact(fmt, bits):
    model, data = _conv_bn()
    q, report = onnxq.quantize(model, data, format=fmt, weight_bits=bits, progress=False)
    x = {"x": data["x"][:4]}
    ref = run(model, x)[0]
    got = run(q, x, exact=bits == 8)[0]  # 8-bit: the exact U8S8 path (onnxq.io.hostcheck)
    step = report.values["y_scale"]
    # the dead channel is 1.0 everywhere; before the fix it came out anywhere in [-1, 1]
    assert np.abs(got[:, 1] - 1.0).max() <= step
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()
    widened = [n for n in report.notes if "widened" in n and "int32 accumulator" in n]
    assert len(widened) == 1 and report.widened_biases
    assert set(report.to_dict()["widened_biases"]) == set(report.widened_biases)


def test_widened_biases_make_one_note_naming_the_most():
    one = widened_notes({"b1": 2})
    assert len(one) == 1 and "2 channel(s)" in one[0] and "bias 'b1'" in one[0]
    many = widened_notes({f"b{i}": 1 for i in range(36)} | {"stem.bias": 7})
    assert len(many) == 1
    assert "43 channel(s)" in many[0] and "37 biases" in many[0] and "'stem.bias' (7)" in many[0]
    assert widened_notes({}) == []


def test_random_tiny_weight_large_bias_channels_keep_their_sqnr():
    g = rng(11)
    k, n = 64, 16
    w = g.normal(0, 0.2, (k, n)).astype(np.float32)
    b = g.normal(0, 0.1, n).astype(np.float32)
    tiny = g.choice(n, 5, replace=False)
    w[:, tiny] *= 1e-7
    b[tiny] = g.uniform(-50, 50, tiny.size)
    model = make_model(
        [h.make_node("Gemm", ["x", "W", "B"], ["y"], name="fc")],
        [("x", ["N", k])],
        [("y", None)],
        {"W": w, "B": b},
    )
    data = {"x": g.normal(0, 1, (64, k)).astype(np.float32)}
    q, _ = onnxq.quantize(model, data, progress=False)
    x = {"x": data["x"][:16]}
    ref, got = run(model, x)[0], run(q, x)[0]
    sqnr = 10 * np.log10((ref**2).sum() / ((ref - got) ** 2).sum())
    assert sqnr > 30, sqnr
    np.testing.assert_allclose(got[:, tiny], ref[:, tiny], atol=0.5)


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_dead_channels_keep_their_bias_exactly(fmt):
    # zero weights (pruned) after a coarse Relu (input scale 0.79): with weight scale 1.0 the
    # bias grid was 0.79 and a bias of 0.62 came out 0.79 (hypothesis found it: 24 dB where
    # per-tensor weights gave 37)
    g = rng(12)
    w = g.normal(0, 1e-3, (6, 2, 3, 3)).astype(np.float32)
    w[:2] = 0.0
    b = np.array([0.6156, 1.381, 1.98, -1.61, 1.54, 2.13], np.float32)
    model = make_model(
        [
            h.make_node("Relu", ["x"], ["r"], name="relu"),
            h.make_node("Conv", ["r", "W", "B"], ["y"], name="conv"),
        ],
        [("x", ["N", 2, 6, 6])],
        [("y", None)],
        {"W": w, "B": b},
    )
    data = {"x": (g.standard_normal((16, 2, 6, 6)) * 60).astype(np.float32)}
    q, report = onnxq.quantize(model, data, format=fmt, progress=False)
    got = run(q, {"x": data["x"][:4]})[0]
    step = float(report.values["y_scale"])
    for c in (0, 1):
        assert np.abs(got[:, c] - b[c]).max() <= step / 2 + 1e-6


def test_accumulation_bound_is_the_worst_case():
    # uint8 input with zero point 0: 255 · 127 per product
    assert accumulation_bound(27, 127, "uint8", np.array(0, np.uint8)) == 27 * 255 * 127
    # zero point in the middle: the farther end decides
    assert accumulation_bound(10, 63, "uint8", np.array(100, np.uint8)) == 10 * 155 * 63
    assert accumulation_bound(1, 127, "int8", np.array(0, np.int8)) == 128 * 127
    assert accumulation_bound(66_000, 127, "uint8", np.array(0, np.uint8)) < INT32_MAX
    assert accumulation_bound(4096, 127, "int16", np.array(0, np.int16)) == 0
