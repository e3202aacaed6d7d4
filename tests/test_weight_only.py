"""Weight-only block-wise int4 (opset 21 DequantizeLinear with block_size)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import MODELS, make_model, ops, run, trained_model, zoo_datasets
from onnx import helper as h

import onnxq
from onnxq.cli import main
from onnxq.core.errors import ConfigError
from onnxq.post.weight_only import int4_blocks

ds = zoo_datasets()


def test_int4_blocks_against_a_direct_reference():
    w = np.random.default_rng(0).normal(0, 1, (40, 3)).astype(np.float32)
    q, scale = int4_blocks(w, 16)
    assert q.shape == (40, 3) and scale.shape == (3, 3)  # ceil(40 / 16) blocks
    assert q.min() >= -8 and q.max() <= 7
    for b in range(3):
        rows = slice(16 * b, min(16 * b + 16, 40))
        np.testing.assert_allclose(scale[b], np.abs(w[rows]).max(0) / 7, rtol=1e-6)
        assert np.abs(q[rows] * scale[b] - w[rows]).max() <= scale[b].max() / 2 + 1e-6


@pytest.mark.parametrize("name, layout", [("digits_mlp", "nhwc"), ("digits_cnn", "nchw")])
def test_int4_models_keep_accuracy_and_shrink(name, layout, tmp_path):
    _, _, xte, yte = ds.digits()
    x = ds.nhwc(xte) if layout == "nhwc" else xte
    path = trained_model(name)
    out = tmp_path / "q4.onnx"
    assert (
        main(["quantize", str(path), "-o", str(out), "--weight-dtype", "int4", "--quiet"]) == 0
    )  # no --data: weight-only
    q = onnx.load(str(out))
    onnx.checker.check_model(q)
    assert {o.domain: o.version for o in q.opset_import}[""] >= 21
    dqs = [n for n in q.graph.node if n.op_type == "DequantizeLinear"]
    assert dqs and all(any(a.name == "block_size" for a in n.attribute) for n in dqs)
    assert any(i.data_type == onnx.TensorProto.INT4 for i in q.graph.initializer)
    inp = q.graph.input[0].name
    fp = (run(path, {inp: x})[0].argmax(1) == yte).mean()
    assert (run(q, {inp: x})[0].argmax(1) == yte).mean() >= fp - 0.01
    if name == "digits_mlp":
        assert out.stat().st_size < 0.2 * path.stat().st_size


def test_gemm_transb_and_skips():
    w = np.random.default_rng(1).normal(0, 1, (8, 64)).astype(np.float32)
    nodes = [
        h.make_node("Gemm", ["x", "W"], ["g"], transB=1, name="fc"),
        h.make_node("MatMul", ["g", "v"], ["y"], name="dyn"),
    ]
    model = make_model(nodes, [("x", ["N", 64]), ("v", [8, 4])], [("y", None)], {"W": w})
    q, report = onnxq.quantize(model, weight_dtype="int4", block_size=16, progress=False)
    d = {x.node: x for x in report.decisions}
    assert d["fc"].quantized and not d["dyn"].quantized and "not a constant" in d["dyn"].reason
    x = np.random.default_rng(2).normal(0, 1, (3, 64)).astype(np.float32)
    v = np.random.default_rng(3).normal(0, 1, (8, 4)).astype(np.float32)
    ref, got = run(model, {"x": x, "v": v})[0], run(q, {"x": x, "v": v})[0]
    assert np.abs(ref - got).max() < 0.15 * np.abs(ref).max()
    assert "Gemm" in ops(q)


def test_int4_refuses_other_formats_and_bad_block_sizes():
    with pytest.raises(ConfigError, match="standard QDQ"):
        onnxq.quantize(str(MODELS / "digits_mlp.onnx"), weight_dtype="int4", format="qoperator")
    with pytest.raises(ConfigError, match="power of two"):
        onnxq.quantize(str(MODELS / "digits_mlp.onnx"), weight_dtype="int4", block_size=24)
