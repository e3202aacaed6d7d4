"""The recipe choice's FakeQuantize models come from one build: the same bytes as a fresh one.

The candidates of the choice differ in values only (ranges, rounded weights, corrected biases);
:class:`~onnxq.lower.fakequantize.FakeQuantizeCache` builds the graph once and writes each
candidate's bounds and constants into a copy. A model from it must be the one
:func:`~onnxq.lower.fakequantize.to_fakequantize` builds for the same arguments, byte for
byte, and the graph must be built again when the values change what the build decides (a
MatMul result left float, a second rounding that is exact).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper as h

import onnxq.lower.fakequantize as fq
from onnxq.annotate.quantizer import Quantizer, QuantizerConfig
from onnxq.lower.fakequantize import FakeQuantizeCache, to_fakequantize
from tests.helpers import make_model, rng, trained_model


def _encoder_block() -> onnx.ModelProto:
    """A MatMul only a float Add reads (it writes float unless its grid starts at 0), a
    biased Conv, an Add and a Concat."""
    r = rng(5)
    inits = {
        "w1": r.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "b1": r.normal(0, 0.1, 8).astype(np.float32),
        "w2": r.normal(0, 0.3, (8, 8, 1, 1)).astype(np.float32),
        "w3": r.normal(0, 0.3, (16, 10)).astype(np.float32),
        "b3": r.normal(0, 0.1, 10).astype(np.float32),
        "rows": np.array([1, 1, 16], np.int64),
    }
    nodes = [
        h.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c1"], ["r1"], "relu1"),
        h.make_node("Conv", ["r1", "w2"], ["c2"], "conv2"),
        h.make_node("Add", ["r1", "c2"], ["a"], "add"),
        h.make_node("Concat", ["r1", "a"], ["d"], "concat", axis=1),
        h.make_node("GlobalAveragePool", ["d"], ["g"], "gap"),
        h.make_node("Reshape", ["g", "rows"], ["f"], "rows"),
        h.make_node("MatMul", ["f", "w3"], ["m"], "fc"),
        h.make_node("Add", ["m", "b3"], ["y"], "fc_bias"),
    ]
    return make_model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, 1, 10])], inits, opset=14)


def _values(q: Quantizer, seed: int, zero_at: str | None = None) -> dict[str, np.ndarray]:
    """Random scales and uint8 zero points; ``zero_at``'s output grid starts at its dtype's
    minimum."""
    r = rng(seed)
    values = {name: ph.default() for name, ph in q.placeholders.items()}
    for name, ph in q.placeholders.items():
        if ph.kind == "scale":
            values[name] = r.uniform(0.01, 0.1, ph.shape).astype(np.float32)
        elif ph.kind == "zero_point" and ph.dtype == "uint8":
            values[name] = np.full(ph.shape, r.integers(100, 156), np.uint8)
    for rec in q.records:
        if rec.node == zero_at:
            zp = values[rec.outputs[0].zero_point]
            values[rec.outputs[0].zero_point] = np.full_like(zp, np.iinfo(zp.dtype).min)
    return values


def _constants(q: Quantizer, seed: int) -> dict[str, np.ndarray]:
    """Every weight moved and every quantized layer's bias corrected, by random amounts."""
    r = rng(seed)
    out = {}
    for rec in q.records:
        for qt in rec.inputs:
            if qt.role == "weight":
                w = q.float_value(qt.tensor)
                out[qt.tensor] = (w + r.normal(0, 0.01, w.shape)).astype(np.float32)
        if rec.bias is not None:
            name = q.biases[rec.bias].bias
            b = q.float_value(name)
            out[name] = (b + r.normal(0, 0.05, b.shape)).astype(np.float32)
    return out


@pytest.mark.parametrize("name", ["block", "digits_cnn"])
def test_a_model_from_the_cache_is_the_one_a_fresh_build_writes(name: str, monkeypatch) -> None:
    model = _encoder_block() if name == "block" else onnx.load(trained_model(name))
    q = Quantizer(model, config=QuantizerConfig())
    builds = []
    real = fq._build
    monkeypatch.setattr(fq, "_build", lambda *a: builds.append(1) or real(*a))
    cache = FakeQuantizeCache()
    # the candidates of a choice: other ranges, other constants, none replaced
    cases = [
        (_values(q, 1), _constants(q, 1)),
        (_values(q, 2), _constants(q, 2)),
        (_values(q, 2), {}),
        (_values(q, 3), _constants(q, 4)),
    ]
    for values, constants in cases:
        want = to_fakequantize(q, values, (-64, 63), constants)
        got = cache.model(q, values, (-64, 63), constants)
        assert got.SerializeToString() == want.SerializeToString()
    assert len(builds) == len(cases) + 1  # the fresh builds, and the cache's one
    # the written constants are the candidate's (not the first one's, nor the float ones)
    inits = {i.name: i for i in got.graph.initializer}
    w = next(qt.tensor for rec in q.records for qt in rec.inputs if qt.role == "weight")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(inits[w]), cases[-1][1][w])


def test_the_cache_builds_again_when_the_values_change_the_graph() -> None:
    q = Quantizer(_encoder_block(), config=QuantizerConfig())
    cache = FakeQuantizeCache()
    floated = cache.model(q, _values(q, 1), None, {})
    # the MatMul's grid now starts at 0: its result is rounded (a Relu may be folded in it)
    values = _values(q, 1, zero_at="fc")
    rounded = cache.model(q, values, None, {})
    assert len(rounded.graph.node) == len(floated.graph.node) + 1
    assert rounded.SerializeToString() == to_fakequantize(q, values).SerializeToString()
