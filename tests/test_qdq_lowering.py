"""The QDQ lowering is the QOperator one's sibling: written from the records, never un-fused.

Both templates are written from the same annotation records by the same op table
(onnxq.lower.qoperator, onnxq.lower.qdq); requantize, float-outputs and share-scales work on
either form. The QDQ model must compute bit for bit what un-fusing the QOperator model
computed (the lowering it replaces, kept for ``onnxq convert``), with the same constants.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import helper as h
from onnx import numpy_helper

import onnxq.lower.qdq as qdq_module
from onnxq.annotate.quantizer import Quantizer, QuantizerConfig
from onnxq.api import quantize
from onnxq.core.constraints import SAME_SCALE
from onnxq.io.graph import export_model, import_graph
from onnxq.lower.qdq import lower_qdq, to_qdq
from onnxq.lower.qoperator import TemplateWriter
from onnxq.post.float_outputs import float_outputs
from onnxq.post.requantize import Requantizer
from onnxq.solve.constraints import share_scales_graph
from tests.helpers import DIGITS_CNN, make_model, rng, run, trained_model


def _blocks() -> onnx.ModelProto:
    """Conv+Relu → MaxPool → 1×1 Conv (its input rescaled, and its bias) → {Conv → HardSwish
    (a QDQ island), itself} → Add → Concat → GlobalAveragePool → Reshape → MatMul + bias Add
    (a MatMul only a float Add reads: it writes float)."""
    r = rng(3)
    w = {
        "w1": r.normal(0, 0.3, (8, 3, 3, 3)),
        "b1": r.normal(0, 0.1, 8),
        "w2": r.normal(0, 0.3, (8, 8, 1, 1)),
        "b2": r.normal(0, 0.1, 8),
        "w3": r.normal(0, 0.2, (8, 8, 3, 3)),
        "b3": r.normal(0, 0.1, 8),
        "w4": r.normal(0, 0.3, (16, 10)),
        "b4": r.normal(0, 0.1, 10),
    }
    nodes = [
        h.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c1"], ["r1"], "relu1"),
        h.make_node("MaxPool", ["r1"], ["p1"], "pool1", kernel_shape=[2, 2], strides=[2, 2]),
        h.make_node("Conv", ["p1", "w2", "b2"], ["a"], "conv2"),
        h.make_node("Conv", ["a", "w3", "b3"], ["c3"], "conv3", pads=[1, 1, 1, 1]),
        h.make_node("HardSwish", ["c3"], ["b"], "hswish3"),
        h.make_node("Add", ["a", "b"], ["c"], "add"),
        h.make_node("Concat", ["a", "c"], ["d"], "concat", axis=1),
        h.make_node("GlobalAveragePool", ["d"], ["g"], "gap"),
        h.make_node("Reshape", ["g", "rows"], ["f"], "rows"),  # 3-D: stays a MatMul
        h.make_node("MatMul", ["f", "w4"], ["m"], "fc"),
        h.make_node("Add", ["b4", "m"], ["y"], "fc_bias"),  # the bias first, as BERT exports
    ]
    inits = {k: v.astype(np.float32) for k, v in w.items()}
    inits["rows"] = np.array([1, 1, 16], np.int64)
    return make_model(nodes, [("x", [1, 3, 16, 16])], [("y", [1, 1, 10])], inits, opset=14)


def _values(q: Quantizer, seed: int) -> dict[str, np.ndarray]:
    """Random scales (every DQ → Q pair rescales) and zero points off zero (float outputs
    apply), but a folded Relu's output at its type's minimum."""
    r = rng(seed)
    folded = {qt.zero_point for rec in q.records if rec.relu_folded for qt in rec.outputs}
    values = {}
    for name, ph in q.placeholders.items():
        if ph.kind == "scale":
            values[name] = r.uniform(0.01, 0.1, ph.shape).astype(np.float32)
        elif ph.kind == "zero_point" and ph.dtype == "uint8" and name not in folded:
            values[name] = np.full(ph.shape, r.integers(100, 156), np.uint8)
    return values


def _finished(q: Quantizer, values: dict, form: str, share: bool) -> onnx.ModelProto:
    """Materialized in ``form``, requantized, shared scales, float outputs: as the pipeline."""
    model = q.materialize(values, form=form)
    graph = import_graph(model)
    ops = q.template_of(form).ops if form == "qdq" else {}
    Requantizer(qdq_ops=ops).requantize_graph(graph, graph.opset)
    if share:
        share_scales_graph(graph, set(SAME_SCALE), [], ops)
    float_outputs(graph, ops)
    return export_model(graph, model)


def _constants(model: onnx.ModelProto) -> collections.Counter:
    """Every initializer's (dtype, shape, bytes), whatever its name."""
    return collections.Counter(
        (a.dtype.str, a.shape, a.tobytes())
        for a in (numpy_helper.to_array(i) for i in model.graph.initializer)
    )


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("name", ["blocks", "digits_cnn", "digits_mlp"])
def test_qdq_from_records_computes_what_unfusing_qoperator_did(name: str, share: bool) -> None:
    model = _blocks() if name == "blocks" else onnx.load(trained_model(name))
    q = Quantizer(model, config=QuantizerConfig(format="qdq"))
    values = _values(q, seed=len(name))
    new = lower_qdq(_finished(q, values, "qdq", share))
    old = to_qdq(_finished(q, values, "qoperator", share))
    assert not {n.op_type for n in new.graph.node} & {"QLinearConv", "QLinearMatMul", "QGemm"}
    if name == "blocks":  # the island, the rescaled biases and the float MatMul are there
        assert "HardSwish" in {n.op_type for n in new.graph.node}
        assert any(i.name.endswith("_rescaled") for i in new.graph.initializer)
        assert "MatMulIntegerToFloat" not in {n.op_type for n in new.graph.node}
        # the product first, as un-fusing MatMulIntegerToFloat wrote it (onnxruntime's fusions
        # of the two orders round differently: a BERT-class encoder's outputs moved)
        add = next(n for n in new.graph.node if n.output[0] == "y")
        assert [n.op_type for n in new.graph.node if n.output[0] == add.input[0]] == ["MatMul"]
    assert _constants(new) == _constants(old)
    shape = [d.dim_value or 1 for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = rng(7).normal(0, 1, [4, *shape[1:]] if shape[0] == 1 and name != "blocks" else shape)
    feeds = {model.graph.input[0].name: x.astype(np.float32)}
    for a, b in zip(run(new, feeds, exact=True), run(old, feeds, exact=True), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("options", [{"format": "qdq"}, {"target": "tensorrt"}])
def test_qdq_output_never_builds_qoperator(monkeypatch: pytest.MonkeyPatch, options) -> None:
    """No QLinear op is written and nothing is un-fused on the way to a QDQ model."""

    def refused(*args, **kwargs):
        raise AssertionError("the QDQ lowering went through the QOperator form")

    monkeypatch.setattr(TemplateWriter, "_qlinear", refused)
    monkeypatch.setattr(qdq_module, "to_qdq", refused)
    demo = np.load(DIGITS_CNN.parent / "digits.npz")
    data = {"input": demo["calib"][:16] / np.float32(16)}
    model, _ = quantize(str(DIGITS_CNN), data, progress=False, **options)
    kinds = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= kinds
    assert not any(k.startswith("QLinear") for k in kinds)
    feeds = {"input": demo["test"][:200] / np.float32(16)}
    (got,), (want,) = run(model, feeds, exact=True), run(str(DIGITS_CNN), feeds)
    assert np.mean(got.argmax(1) == want.argmax(1)) > 0.95
