"""Fewer copies of the weights: each must leave every number and byte as it was.

Peak memory itself is measured by the benchmarks and stated in the README; these tests hold the
equivalences the savings rely on.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from helpers import make_model, rng
from onnx import helper as h
from onnx_graphsurgeon.ir.tensor import LazyValues

import onnxq.core.qparams as qparams
import onnxq.io.session as session
from onnxq.annotate.quantizer import Quantizer
from onnxq.core.qparams import QParams, dequantize, quantize
from onnxq.io.graph import (
    add_initializer,
    constant_value,
    holds_constant,
    import_graph,
    serialize,
    skeleton,
)


@pytest.mark.parametrize(
    ("shape", "axis"),
    [((300, 50, 3, 3), 0), ((300, 50, 3, 3), 1), ((5000, 3000), 0), ((5000, 3000), None)],
)
def test_weights_quantized_and_back_in_slices_equal_the_whole_array(monkeypatch, shape, axis):
    r = rng(1)
    x = (r.standard_normal(shape) * 3).astype(np.float32)
    n = shape[axis] if axis is not None else None
    scale = np.asarray(r.uniform(0.01, 0.05, n) if n else 0.02, np.float32)
    zp = np.asarray(r.integers(-5, 5, n) if n else 3, np.int8)
    qp = QParams(scale, zp, axis)
    monkeypatch.setattr(qparams, "QUANTIZE_CHUNK", 1 << 40)
    whole = quantize(x, qp)
    back = dequantize(whole, qp)
    monkeypatch.setattr(qparams, "QUANTIZE_CHUNK", 4096)
    assert np.array_equal(quantize(x, qp), whole)
    assert whole.dtype == np.int8
    sliced = dequantize(whole, qp)
    assert sliced.dtype == back.dtype == np.float32 and np.array_equal(sliced, back)


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


def test_a_session_that_exposes_tensors_plans_no_memory_pattern():
    # the pattern's block is one allocation of the run's whole size: a calibration session
    # allocates tensor by tensor from the shared arena instead
    model = _dense_model()
    x = {"x": rng(5).standard_normal((2, 64)).astype(np.float32)}
    exposed = session.make_session(model, expose=["m"])
    options = exposed.get_session_options()
    assert not options.enable_mem_pattern
    assert options.get_session_config_entry("session.use_env_allocators") == "1"
    plain = session.make_session(model)
    assert plain.get_session_options().enable_mem_pattern
    with pytest.raises(RuntimeError, match="does not have configuration"):  # its own arena
        plain.get_session_options().get_session_config_entry("session.use_env_allocators")
    assert np.array_equal(exposed.run(["y"], x)[0], plain.run(None, x)[0])


def _wide_model(width: int) -> onnx.ModelProto:
    """x (1, width) -> a large intermediate of 64 x width floats -> its sum."""
    nodes = [
        h.make_node("Tile", ["x", "reps"], ["t"]),
        h.make_node("Relu", ["t"], ["r"]),
        h.make_node("ReduceSum", ["r"], ["y"], keepdims=0),
    ]
    return make_model(nodes, [("x", [1, width])], [("y", [])], {"reps": np.array([64, 1])})


@pytest.mark.skipif(session.resident_bytes() is None, reason="reads /proc/self/statm")
def test_the_shared_arena_reuses_memory_and_hands_it_back_when_released():
    # as-written and exposing sessions allocate from one arena: a run reuses what the one
    # before it (in any such session) freed, and the release after a pass returns it
    model = _wide_model(1 << 18)  # a 64 MiB intermediate a run (the Relu may write in place)
    x = {"x": np.ones((1, 1 << 18), np.float32)}
    session.release_shared_arena()
    session.trim_heap()
    for _ in range(2):  # the second session's run reuses the first's memory
        s = session.make_session(model, as_written=True)
        assert s.get_session_options().get_session_config_entry("session.use_env_allocators")
        assert s.run(None, x)[0] == 64 << 18
        del s
    session.trim_heap()
    held = session.resident_bytes()
    session.release_shared_arena()
    session.trim_heap()
    freed = held - session.resident_bytes()
    assert freed > 48 << 20, f"the release freed {freed >> 20} MiB of the run's 64 MiB"


def test_shape_inference_on_the_skeleton_matches_the_full_model():
    model = _dense_model()
    full = onnx.shape_inference.infer_shapes(model, data_prop=True)
    bare = skeleton(model, limit=64)
    assert bare.ByteSize() < model.ByteSize() // 4
    inferred = onnx.shape_inference.infer_shapes(bare, data_prop=True)
    assert [str(v) for v in inferred.graph.value_info] == [str(v) for v in full.graph.value_info]


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int32, np.int64, np.bool_]
)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 4)])
def test_an_initializer_written_into_the_graph_has_from_arrays_bytes(dtype, shape):
    value = (rng(2).standard_normal(shape) * 10).astype(dtype)
    ref, got = onnx.GraphProto(), onnx.GraphProto()
    ref.initializer.add().CopyFrom(onnx.numpy_helper.from_array(value, "w"))
    add_initializer(got, "w", value)
    assert got.SerializeToString() == ref.SerializeToString()


def test_a_weight_matched_and_read_by_a_rule_is_not_kept_in_the_graph():
    # the graph imports its weights lazily from the model; a copy kept once read held VGG19's
    # first dense layer twice (411 MB)
    w = rng(3).normal(0, 1, (64, 32)).astype(np.float32)
    model = make_model(
        [h.make_node("MatMul", ["x", "W"], ["y"], "mm")], [("x", [1, 64])], [("y", None)], {"W": w}
    )
    graph = import_graph(model)
    tensor = graph.tensors()["W"]
    assert holds_constant(tensor)
    np.testing.assert_array_equal(constant_value(tensor), w)
    assert isinstance(tensor._values, LazyValues)  # read afresh, not cached
    quantizer = Quantizer(model)  # the rules match and read W (per-channel ranges)
    assert any(rec.node == "mm" for rec in quantizer.records)
    held = [o for o in gc.get_objects() if isinstance(o, gs.Constant) and o.name == "W"]
    assert held and all(isinstance(t._values, LazyValues) for t in held), held
    del quantizer


def test_a_model_is_weighed_by_its_weights_without_serializing_it(monkeypatch):
    # session and free_memory weigh a model by its weights: protobuf's ByteSize serialized a
    # 70 MB encoder on every call (16 calls, 1.8 s of one quantize, and a peak 190 MB higher)
    from onnxq.io import graph as graph_module

    w = rng(0).normal(0, 1, (64, 32)).astype(np.float32)
    body_w = np.ones((8, 8), np.float64)
    then = h.make_graph(
        [h.make_node("Identity", ["bw"], ["t"])],
        "then",
        [],
        [h.make_tensor_value_info("t", onnx.TensorProto.DOUBLE, [8, 8])],
        [onnx.numpy_helper.from_array(body_w, "bw")],
    )
    other = h.make_graph(
        [h.make_node("Identity", ["ew"], ["e"])],
        "else",
        [],
        [h.make_tensor_value_info("e", onnx.TensorProto.DOUBLE, [8, 8])],
        [onnx.numpy_helper.from_array(body_w, "ew")],
    )
    model = make_model(
        [
            h.make_node("MatMul", ["x", "W"], ["y"]),
            h.make_node(
                "Constant", [], ["c"], value=h.make_tensor("cv", onnx.TensorProto.BOOL, [], [True])
            ),
            h.make_node("If", ["c"], ["z"], then_branch=then, else_branch=other),
        ],
        [("x", ["N", 64])],
        [("y", ["N", 32])],
        {"W": w},
    )

    def refused(*args, **kwargs):
        raise AssertionError("weighing a model serialized it")

    monkeypatch.setattr(graph_module, "proto_size", refused)
    assert graph_module.weight_bytes(model) == w.nbytes + 2 * body_w.nbytes
    session.free_memory(model)  # weighs it, collects nothing at this size
    x = rng(1).normal(0, 1, (3, 64)).astype(np.float32)
    got = session.make_session(model).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, x @ w, rtol=1e-5)


@pytest.mark.skipif(
    session.resident_bytes() is None or not hasattr(os, "fork"), reason="reads /proc/self/statm"
)
def test_resident_bytes_in_a_forked_child_are_the_childs():
    # the probe keeps /proc/self/statm open; a child forked after it was opened must read its
    # own memory, not its parent's through the inherited descriptor
    session.resident_bytes()
    pid = os.fork()
    if pid == 0:  # the child: grow by 64 MiB, touched, and say whether the probe saw it
        before = session.resident_bytes()
        grown = np.ones(8 << 20)
        after = session.resident_bytes()
        os._exit(0 if after - before > 48 << 20 and grown[-1] == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
