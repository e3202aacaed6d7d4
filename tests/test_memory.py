"""Fewer copies of the weights: each must leave every number and byte as it was.

Peak memory itself is measured by the benchmarks and stated in the README; these tests hold the
equivalences the savings rely on.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import make_model, rng
from onnx import helper as h

import onnxq.io.session as session
import onnxq.solve.qparams as qparams
from onnxq.io.graph import serialize, skeleton
from onnxq.solve.qparams import QParams, quantize


@pytest.mark.parametrize(
    ("shape", "axis"),
    [((300, 50, 3, 3), 0), ((300, 50, 3, 3), 1), ((5000, 3000), 0), ((5000, 3000), None)],
)
def test_chunked_weight_quantization_equals_the_whole_array_at_once(monkeypatch, shape, axis):
    r = rng(1)
    x = (r.standard_normal(shape) * 3).astype(np.float32)
    n = shape[axis] if axis is not None else None
    scale = np.asarray(r.uniform(0.01, 0.05, n) if n else 0.02, np.float32)
    zp = np.asarray(r.integers(-5, 5, n) if n else 3, np.int8)
    qp = QParams(scale, zp, axis)
    monkeypatch.setattr(qparams, "QUANTIZE_CHUNK", 1 << 40)
    whole = quantize(x, qp)
    monkeypatch.setattr(qparams, "QUANTIZE_CHUNK", 4096)
    assert np.array_equal(quantize(x, qp), whole)
    assert whole.dtype == np.int8


def _dense_model():
    w = rng(2).standard_normal((64, 32)).astype(np.float32)
    b = rng(3).standard_normal(32).astype(np.float32)
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["m"]),
        h.make_node("Add", ["m", "b"], ["a"]),
        h.make_node("Relu", ["a"], ["y"]),
    ]
    return make_model(nodes, [("x", [2, 64])], [("y", [2, 32])], {"w": w, "b": b})


def test_a_session_fed_weights_as_arrays_computes_what_the_bytes_do(monkeypatch):
    model = _dense_model()
    before = serialize(model)
    x = {"x": rng(4).standard_normal((2, 64)).astype(np.float32)}
    by_bytes = session.make_session(model, expose=["m"]).run(None, x)
    monkeypatch.setattr(session, "SHARED_WEIGHTS_BYTES", 0)  # every model takes that path
    by_arrays = session.make_session(model, expose=["m"]).run(None, x)
    assert len(by_bytes) == 2  # y and the exposed m
    for a, b in zip(by_bytes, by_arrays):
        assert np.array_equal(a, b)
    assert serialize(model) == before  # the exposed output was removed again


def test_shape_inference_on_the_skeleton_matches_the_full_model():
    model = _dense_model()
    full = onnx.shape_inference.infer_shapes(model, data_prop=True)
    bare = skeleton(model, limit=64)
    assert bare.ByteSize() < model.ByteSize() // 4
    inferred = onnx.shape_inference.infer_shapes(bare, data_prop=True)
    assert [str(v) for v in inferred.graph.value_info] == [str(v) for v in full.graph.value_info]
