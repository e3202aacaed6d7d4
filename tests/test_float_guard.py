"""A layer left float stays float in onnxruntime (its optimizer quantizes a float Conv/Gemm
behind a DequantizeLinear per tensor on its own)."""

import numpy as np
import onnxruntime as ort
import pytest
from helpers import make_model, ops, rng, run
from onnx import helper as h

import onnxq
from onnxq.post.float_guard import guard_float_layers


def _chain(op):
    """c1 (int8) → Relu → mid (excluded) → Relu → c3 (int8); mid's channel 0 weighs 300× the
    rest, so one per-tensor weight scale leaves the other channels a few levels."""
    r = rng(21)
    w_mid = r.normal(0, 0.3, (8, 8, 1, 1))
    w_mid[0] *= 300
    if op == "Conv":
        mid = h.make_node("Conv", ["a1", "Wm", "Bm"], ["m"], name="mid")
        w = w_mid
    else:  # Gemm on the flattened 8 channels
        mid = h.make_node("Gemm", ["a1", "Wm", "Bm"], ["m"], name="mid", transB=1)
        w = w_mid[:, :, 0, 0]
    c1 = "Conv" if op == "Conv" else "Gemm"
    first = (
        h.make_node("Conv", ["x", "W1", "B1"], ["a"], name="c1")
        if c1 == "Conv"
        else h.make_node("Gemm", ["x", "W1", "B1"], ["a"], name="c1", transB=1)
    )
    last = (
        h.make_node("Conv", ["m1", "W3", "B3"], ["y"], name="c3")
        if c1 == "Conv"
        else h.make_node("Gemm", ["m1", "W3", "B3"], ["y"], name="c3", transB=1)
    )
    nodes = [
        first,
        h.make_node("Relu", ["a"], ["a1"], name="r1"),
        mid,
        h.make_node("Relu", ["m"], ["m1"], name="r2"),
        last,
    ]
    shape = (8, 8, 1, 1) if c1 == "Conv" else (8, 8)
    inits = {
        "W1": r.normal(0, 0.5, shape), "B1": r.normal(0.2, 0.1, 8), "Wm": w,
        "Bm": r.normal(0, 0.1, 8), "W3": r.normal(0, 0.5, shape), "B3": r.normal(0, 0.1, 8),
    }  # fmt: skip
    inits = {k: np.asarray(v, np.float32) for k, v in inits.items()}
    xshape = ["N", 8, 5, 5] if c1 == "Conv" else ["N", 8]
    model = make_model(nodes, [("x", xshape)], [("y", None)], inits)
    dims = (5, 5) if c1 == "Conv" else ()
    data = {"x": r.normal(0, 1, (64, 8, *dims)).astype(np.float32)}
    return model, data


def _run(model, feeds, optimize):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), so)
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("op", ["Conv", "Gemm"])
@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_an_excluded_layer_runs_float_in_onnxruntime(op, fmt):
    model, data = _chain(op)
    q, report = onnxq.quantize(model, data, exclude=["mid"], format=fmt, progress=False)
    assert "mid" not in report.quantized_nodes and "c1" in report.quantized_nodes
    assert "Cast" in ops(q) and "1 float layer(s) guarded" in report.summary(verbose=True)
    # what onnxruntime runs equals the graph as written (its optimizer changed nothing here)
    held = {"x": data["x"][:16]}
    np.testing.assert_allclose(_run(q, held, True), _run(q, held, False), atol=1e-4)
    ref = run(model, held)[0]
    err = np.abs(_run(q, held, True) - ref).max()
    assert err < 0.05 * np.abs(ref).max(), err


@pytest.mark.parametrize("zp_dtype", [np.uint8, np.int8])
def test_the_guard_is_bit_identical(zp_dtype):
    r = rng(22)
    zp = np.array(3 if zp_dtype is np.uint8 else -5, zp_dtype)
    nodes = [
        h.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        h.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
        h.make_node("Conv", ["xd", "W"], ["y"], name="conv", pads=[1, 1, 1, 1]),
    ]
    inits = {"s": np.float32(0.037), "z": zp, "W": r.normal(0, 1, (4, 3, 3, 3)).astype(np.float32)}
    model = make_model(nodes, [("x", ["N", 3, 6, 6])], [("y", None)], inits)
    guarded_model, guarded = guard_float_layers(model)
    assert guarded == ["conv"] and "DequantizeLinear" not in ops(guarded_model)
    feeds = {"x": r.normal(0, 2, (4, 3, 6, 6)).astype(np.float32)}
    np.testing.assert_array_equal(_run(guarded_model, feeds, False), _run(model, feeds, False))


def test_int8_layers_are_left_alone():
    model, data = _chain("Conv")
    qdq, _ = onnxq.quantize(model, data, format="qdq", progress=False)  # every layer int8
    same, guarded = guard_float_layers(qdq)
    assert guarded == [] and same is qdq  # weights behind DequantizeLinear: int8 layers
