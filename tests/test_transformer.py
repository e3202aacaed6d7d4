"""Transformer encoders: the attention-mask path stays float, SmoothQuant, float MatMul outputs,
and the model kind that picks the default algorithms. Every check runs the models."""

import numpy as np
import onnx
import pytest
from helpers import make_model, rng, run
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxq
from onnxq.calibrators import METHODS
from onnxq.core.errors import ConfigError
from onnxq.passes.smoothquant import _apply, _readers
from onnxq.prepare.kind import detect
from onnxq.solve.smoothquant import (
    Smoothing,
    choose,
    fake_quant_activation,
    fake_quant_weight,
    output_error,
    scaled_product,
    smoothing_scales,
)

D, HEADS, VOCAB, FLOAT_MIN = 16, 1, 50, float(np.finfo(np.float32).min)


def _encoder(
    mask_value: float = FLOAT_MIN, outlier: float = 1.0, fill: bool = False
) -> onnx.ModelProto:
    """One attention block as exporters write it: ids → embeddings → LayerNorm → Q, K, V;
    scores / sqrt(d) + (1 - mask) · mask_value → Softmax → · V → dense + bias → residual.

    ``fill``: the mask written over the scores instead, as PyTorch exports ``masked_fill``:
    Where(mask == 0, mask_value, scores)."""
    r = rng(11)
    emb = r.normal(0, 1, (VOCAB, D)).astype(np.float32)
    emb[:, 3] *= outlier  # an outlier channel, as BERT-class encoders have
    inits = {
        "emb": emb,
        "gamma": np.ones(D, np.float32),
        "beta": np.zeros(D, np.float32),
        "Wq": r.normal(0, 0.3, (D, D)).astype(np.float32),
        "Wk": r.normal(0, 0.3, (D, D)).astype(np.float32),
        "Wv": r.normal(0, 0.3, (D, D)).astype(np.float32),
        "Wo": r.normal(0, 0.3, (D, D)).astype(np.float32),
        "bo": r.normal(0, 0.1, D).astype(np.float32),
        "sqrt_d": np.array(np.sqrt(D), np.float32),
        "one": np.array(1.0, np.float32),
        "minval": np.array(mask_value, np.float32),
        "axes1": np.array([1], np.int64),
        "perm_k": np.array(0, np.int64),
        "zero_i": np.array(0, np.int64),
    }
    if fill:
        applied = [
            h.make_node("Unsqueeze", ["mask", "axes1"], ["m1"], name="mask_unsqueeze"),
            h.make_node("Equal", ["m1", "zero_i"], ["pad"], name="mask_pad"),
            h.make_node("Where", ["pad", "minval", "sd"], ["masked"], name="mask_fill"),
        ]
    else:
        applied = [
            h.make_node("Unsqueeze", ["mask", "axes1"], ["m1"], name="mask_unsqueeze"),
            h.make_node("Cast", ["m1"], ["mf"], name="mask_cast", to=TensorProto.FLOAT),
            h.make_node("Sub", ["one", "mf"], ["inv"], name="mask_invert"),
            h.make_node("Mul", ["inv", "minval"], ["bias"], name="mask_scale"),
            h.make_node("Add", ["sd", "bias"], ["masked"], name="mask_add"),
        ]
    nodes = [
        h.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
        h.make_node("LayerNormalization", ["e", "gamma", "beta"], ["x"], name="ln", axis=-1),
        h.make_node("MatMul", ["x", "Wq"], ["q"], name="query"),
        h.make_node("MatMul", ["x", "Wk"], ["k"], name="key"),
        h.make_node("MatMul", ["x", "Wv"], ["v"], name="value"),
        h.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
        h.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        h.make_node("Div", ["s", "sqrt_d"], ["sd"], name="scale"),
        *applied,
        h.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
        h.make_node("MatMul", ["p", "v"], ["ctx"], name="context"),
        h.make_node("MatMul", ["ctx", "Wo"], ["o"], name="dense"),
        h.make_node("Add", ["o", "bo"], ["ob"], name="dense_bias"),
        h.make_node("Add", ["ob", "x"], ["y"], name="residual"),
    ]
    graph = h.make_graph(
        nodes,
        "encoder",
        [
            h.make_tensor_value_info("ids", TensorProto.INT64, ["N", "S"]),
            h.make_tensor_value_info("mask", TensorProto.INT64, ["N", "S"]),
        ],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "S", D])],
        [nh.from_array(v, k) for k, v in inits.items()],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _padded(n: int, seed: int, pad: bool = True) -> list[dict]:
    """Batches of 4 sequences of 3 to 12 tokens padded to 12 (mask 0 on padding)."""
    r = rng(seed)
    out = []
    for _ in range(n):
        ids = r.integers(1, VOCAB, (4, 12)).astype(np.int64)
        mask = np.ones((4, 12), np.int64)
        if pad:
            for row, length in enumerate(r.integers(3, 13, 4)):
                ids[row, length:], mask[row, length:] = 0, 0
        out.append({"ids": ids, "mask": mask})
    return out


def _cosines(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> np.ndarray:
    keep = mask.reshape(-1).astype(bool)
    a, b = a.reshape(-1, D)[keep], b.reshape(-1, D)[keep]
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


MASK_PATH = {"mask_cast", "mask_invert", "mask_scale", "mask_add", "softmax"}


@pytest.mark.parametrize("calibration_padded", [True, False], ids=["padded", "no-padding"])
@pytest.mark.parametrize("mask_value", [FLOAT_MIN, -10000.0], ids=["float-min", "-10000"])
def test_the_attention_mask_path_stays_float_and_never_sets_a_scale(mask_value, calibration_padded):
    """Decided from the graph: even calibration data without padding cannot hide the mask."""
    model = _encoder(mask_value)
    q, report = onnxq.quantize(model, _padded(8, 1, calibration_padded), progress=False)
    kept = {d.node: d for d in report.decisions if d.node in MASK_PATH}
    assert all(not d.quantized and d.pattern == "placement" for d in kept.values()), kept
    assert "additive attention mask" in kept["mask_add"].reason
    assert {"query", "key", "value", "context", "dense"} <= set(report.quantized_nodes)
    scales = [
        np.abs(nh.to_array(i)).max() for i in q.graph.initializer if i.name.endswith("_scale")
    ]
    assert max(scales) < 1.0  # the mask's magnitude set none of them
    for feeds in _padded(4, 2):
        ref, got = run(model, feeds)[0], run(q, feeds)[0]
        assert _cosines(ref, got, feeds["mask"]).min() > 0.99


@pytest.mark.parametrize("mask_value", [-1e9, FLOAT_MIN], ids=["-1e9", "float-min"])
def test_a_mask_written_over_the_scores_stays_float_too(mask_value):
    """PyTorch's masked_fill exports as Where(padding, -1e9, scores) before Softmax: a GRU
    transliterator's decoder (arabic-name-romanizer) quantized that Where's output on a scale of
    3.9e6, its attention went uniform and 98% of its outputs changed."""
    model = _encoder(mask_value, fill=True)
    q, report = onnxq.quantize(model, _padded(8, 1), progress=False)
    kept = {d.node: d for d in report.decisions if d.node in ("mask_fill", "softmax")}
    assert all(not d.quantized and d.pattern == "placement" for d in kept.values()), kept
    assert "written over the scores by 'mask_fill'" in kept["mask_fill"].reason
    assert {"query", "key", "value", "context", "dense"} <= set(report.quantized_nodes)
    scales = [
        np.abs(nh.to_array(i)).max() for i in q.graph.initializer if i.name.endswith("_scale")
    ]
    assert max(scales) < 1.0
    for feeds in _padded(4, 2):
        ref, got = run(model, feeds)[0], run(q, feeds)[0]
        assert _cosines(ref, got, feeds["mask"]).min() > 0.99


def _two_lengths(n: int, seed: int) -> list[dict]:
    """``_padded`` batches cut to 7 and 12 tokens in turn: each batch padded to its own length."""
    return [
        {k: v[:, : 12 if i % 2 else 7] for k, v in f.items()}
        for i, f in enumerate(_padded(n, seed))
    ]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_calibrates_on_padded_batches_of_different_lengths(method):
    """output-aware failed on MiniLM's batches of 54 and 35 tokens (it joined the layer's
    outputs of all batches into one array)."""
    feeds = _two_lengths(8, 4)
    model = _encoder(outlier=30.0)
    q, report = onnxq.quantize(model, feeds, method=method, progress=False)
    assert {"query", "key", "value", "dense"} <= set(report.quantized_nodes)
    for f in feeds[:2]:
        ref, got = run(model, f)[0], run(q, f)[0]
        assert _cosines(ref, got, f["mask"]).min() > 0.99


def test_debug_and_max_drop_rank_padded_batches_of_different_lengths(tmp_path):
    """Serving pads each batch to its own longest sentence: MiniLM's debug failed when its
    ranking joined batches of 54 and 35 tokens into one."""
    from onnxq.tools.debug import debug

    feeds = _two_lengths(8, 3)
    model = _encoder(outlier=30.0)
    result = debug(model, feeds, budget=0, output=tmp_path / "fix.toml")
    assert {g.node for g in result.ranking.groups} >= {"query", "key", "value", "dense"}
    assert result.check.agrees
    q, report = onnxq.quantize(model, feeds, max_drop=0.01, progress=False)
    assert report.fallback is not None and report.fallback["met"]
    assert report.fallback["trials"][0]["drop"] > 0.01  # it had to rank and return a group
    for f in feeds[:2]:
        ref, got = run(model, f)[0], run(q, f)[0]
        assert _cosines(ref, got, f["mask"]).min() > 0.99


def test_without_the_placement_the_mask_would_have_wrecked_the_scores():
    """The same model with the mask path forced into int8 (a mask fed as a float input that
    the placement cannot see) is the failure the placement prevents."""
    model = _encoder(-10000.0)
    feeds = _padded(4, 2)
    q, _ = onnxq.quantize(model, _padded(8, 1), progress=False)
    good = min(_cosines(run(model, f)[0], run(q, f)[0], f["mask"]).min() for f in feeds)
    # the mask as a float graph input of -10000 / 0, added to the scores inside a quantized Add
    m2 = _encoder(-10000.0)
    g = m2.graph
    for n in list(g.node):
        if n.name in ("mask_unsqueeze", "mask_cast", "mask_invert", "mask_scale"):
            g.node.remove(n)
    del g.input[1]
    g.input.append(h.make_tensor_value_info("bias", TensorProto.FLOAT, ["N", 1, "S"]))

    def as_bias(f):
        return {"ids": f["ids"], "bias": ((1.0 - f["mask"][:, None, :]) * -10000.0).astype("f4")}

    q2, report = onnxq.quantize(m2, [as_bias(f) for f in _padded(8, 1)], progress=False)
    # a float graph input is still recognised as the mask: nothing computes it from weights
    assert not next(d for d in report.decisions if d.node == "mask_add").quantized
    kept = min(
        _cosines(run(m2, as_bias(f))[0], run(q2, as_bias(f))[0], f["mask"]).min() for f in feeds
    )
    assert kept > 0.99 and good > 0.99


def test_smoothquant_scales_follow_the_formula():
    a, w = np.array([8.0, 1.0, 0.0, 2.0]), np.array([0.5, 2.0, 1.0, 0.0])
    s = smoothing_scales(a, w, 0.5)
    np.testing.assert_allclose(s, [4.0, 0.5**0.5 / 1.0, 1.0, 1.0], rtol=1e-12)


def test_smoothquant_choice_never_makes_the_measured_error_worse():
    r = rng(3)
    x = r.normal(0, 1, (512, 16))
    x[:, 5] *= 60  # one outlier channel
    w = r.normal(0, 0.2, (16, 8))
    st = (np.abs(x).max(0), x.min(0), x.max(0))
    choice = choose(x, *st, [w], bits=8)
    assert choice.alpha is not None and choice.error_after < 0.5 * choice.error_before
    flat = r.normal(0, 1, (512, 16))
    plain = choose(flat, np.abs(flat).max(0), flat.min(0), flat.max(0), [w], bits=8)
    assert plain.error_after <= plain.error_before


@pytest.mark.parametrize("k, bits", [(40, 8), (1201, 8), (3001, 7), (64, 16)])
def test_the_int8_product_is_exact_in_float32_slices(k, bits):
    """Codes of 8 and 8 bits: past 518 inputs a float32 product would round, so it is sliced;
    16-bit codes do not fit float32's 24 bits at all and take float64."""
    r = rng(k)
    top = 2 ** (bits - 1) - 1
    a = r.integers(-255, 256, (64, k)).astype(np.float64)
    b = r.integers(-top, top + 1, (k, 24)).astype(np.float64)
    a[0], b[:, 0] = 255, top  # the largest terms, all of one sign: the widest partial sums
    scale = r.uniform(0.5, 2.0, (1, 24))
    exact = (a.astype(np.int64) @ b.astype(np.int64)).astype(np.float64) * scale
    np.testing.assert_array_equal(scaled_product(a, b, scale), exact)


def test_the_smoothing_error_is_the_float64_error_of_the_fake_quantized_product():
    """The error measured on codes equals the one of fake-quantized float64 matrices."""
    r = rng(5)
    x = r.normal(0, 1, (300, 700))
    x[:, 9] *= 40
    w = r.normal(0, 0.1, (700, 50))
    s = smoothing_scales(np.abs(x).max(0), np.abs(w).max(1), 0.6)
    lo, hi = (x.min(0) / s).min(), (x.max(0) / s).max()
    ref = x @ w
    got = fake_quant_activation(x / s, lo, hi) @ fake_quant_weight(w * s[:, None], 8)
    want = np.sqrt(np.sum((got - ref) ** 2) / np.sum(ref**2))
    assert output_error(x, lo, hi, w, s, 8, ref) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("where", ["layernorm", "mul"])
def test_smoothquant_leaves_the_float_model_unchanged(where):
    """Folded into the LayerNorm (nothing else reads it) or a Mul (the residual reads it too)."""
    model = _encoder(outlier=20.0)
    if where == "layernorm":  # drop the residual: only Q, K, V read the LayerNorm's output
        g = model.graph
        res = next(n for n in g.node if n.name == "residual")
        g.node.remove(res)
        next(n for n in g.node if n.name == "dense_bias").output[0] = "y"
    readers = _readers(model, set())
    s = np.linspace(0.5, 4.0, D)
    smoothed = onnx.ModelProto()
    smoothed.CopyFrom(model)
    readers = _readers(smoothed, set())
    went = _apply(smoothed, "x", readers["x"], Smoothing(0.5, s, 1.0, 0.5))
    assert went.startswith("LayerNormalization" if where == "layernorm" else "Mul")
    onnx.checker.check_model(smoothed)
    feeds = _padded(2, 5)[0]
    ref, got = run(model, feeds)[0], run(smoothed, feeds)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_smoothquant_lowers_the_error_on_outlier_channels_and_is_reported():
    model = _encoder(outlier=40.0)
    calib, evaluation = _padded(16, 1), _padded(6, 2)
    errors = {}
    for mode in ("off", "on"):
        q, report = onnxq.quantize(model, calib, progress=False, smoothquant=mode)
        errs = [
            np.linalg.norm(run(q, f)[0] - run(model, f)[0]) / np.linalg.norm(run(model, f)[0])
            for f in evaluation
        ]
        errors[mode] = float(np.mean(errs))
        if mode == "on":
            entry = report.smoothing["x"]
            assert entry["readers"] == ["query", "key", "value"]
            mul = next(d for d in report.decisions if d.node == "x_smoothed")
            assert not mul.quantized and mul.pattern == "placement"
            assert mul.reason.startswith("SmoothQuant: divides 'x' by s")
            assert entry["error_after"] < entry["error_before"]
            assert "smoothed" in report.algorithms["smoothquant"]
            # its statistics are of the model before smoothing: one stream more, said so
            first, then = report.data_reads[0], report.data_reads[1]
            assert (first["pass"], first["batches"]) == ("smoothquant", 16)
            assert "the smoothed model" in first["why"] and then["pass"] == "calibrate"
        else:
            assert report.algorithms["smoothquant"].startswith("off")
            assert [r["pass"] for r in report.data_reads][:1] == ["calibrate"]
    assert errors["on"] < errors["off"]


def test_a_range_table_of_a_smoothed_model_is_refused(tmp_path):
    model, calib = _encoder(outlier=40.0), _padded(16, 1)
    table = tmp_path / "ranges.json"
    _, report = onnxq.quantize(model, calib, progress=False, smoothquant="on", save_ranges=table)
    assert report.smoothing["x"]["alpha"] is not None
    with pytest.raises(ConfigError, match="as smoothquant rewrote it"):
        onnxq.quantize(model, None, progress=False, load_ranges=table)


def test_float_outputs_keep_int8_math_and_fold_the_bias():
    """dense → bias Add → residual: only float ops read it, so it writes float
    (MatMulIntegerToFloat with the bias inside); the QDQ form has no Q after it."""
    model = _encoder()
    calib, feeds = _padded(8, 1), _padded(1, 2)[0]
    q, report = onnxq.quantize(model, calib, progress=False)
    ops = [n.op_type for n in q.graph.node]
    assert "MatMulIntegerToFloat" in ops and "dense_bias" not in {n.name for n in q.graph.node}
    mif = next(n for n in q.graph.node if n.name.startswith("dense"))
    assert mif.op_type == "MatMulIntegerToFloat" and mif.input[6] == "bo"
    assert "dense" in report.quantized_nodes
    # the int8 output's scale and zero point went with it (onnxruntime warned of each unused one)
    read = {i for n in q.graph.node for i in n.input}
    assert [i.name for i in q.graph.initializer if i.name not in read] == []
    ref = run(model, feeds)[0]
    assert _cosines(ref, run(q, feeds)[0], feeds["mask"]).min() > 0.995
    qdq, _ = onnxq.quantize(model, calib, progress=False, format="qdq")
    readers = {i: n.op_type for n in qdq.graph.node for i in n.input}
    dense = next(n for n in qdq.graph.node if n.op_type == "MatMul" and n.name.startswith("dense"))
    assert readers[dense.output[0]] != "QuantizeLinear"
    assert _cosines(ref, run(qdq, feeds)[0], feeds["mask"]).min() > 0.995


def test_an_int8_reader_keeps_the_int8_output():
    r = rng(9)
    w1, w2 = (r.normal(0, 0.3, (8, 8)).astype(np.float32) for _ in range(2))
    nodes = [h.make_node("MatMul", ["x", "W1"], ["a"], name="m1"),
             h.make_node("MatMul", ["a", "W2"], ["y"], name="m2")]  # fmt: skip
    model = make_model(nodes, [("x", ["N", 8])], [("y", ["N", 8])], {"W1": w1, "W2": w2})
    data = [{"x": r.normal(0, 1, (16, 8)).astype(np.float32)} for _ in range(4)]
    q, _ = onnxq.quantize(model, data, progress=False)
    by_name = {n.name: n.op_type for n in q.graph.node}
    assert [op for name, op in by_name.items() if name.startswith("m1")] == ["QLinearMatMul"]
    assert "MatMulIntegerToFloat" in by_name.values()  # m2: its reader is the graph output


def test_a_split_of_float_gates_leaves_the_matmul_writing_float():
    """A recurrent cell's gates: MatMul → bias → Split → Sigmoid/Tanh. Only float ops read the
    parts, so the MatMul writes float (no int8 rounding of the gates, one op fewer a step)."""
    r = rng(10)
    w = r.normal(0, 0.3, (8, 16)).astype(np.float32)
    nodes = [
        h.make_node("MatMul", ["x", "W"], ["g0"], name="gates"),
        h.make_node("Add", ["g0", "B"], ["g"], name="gates_bias"),
        h.make_node("Split", ["g", "halves"], ["a", "b"], axis=1, name="split"),
        h.make_node("Sigmoid", ["a"], ["sa"], name="sig"),
        h.make_node("Tanh", ["b"], ["tb"], name="tanh"),
        h.make_node("Mul", ["sa", "tb"], ["y"], name="cell"),
    ]
    inits = {"W": w, "B": r.normal(0, 0.1, 16).astype(np.float32),
             "halves": np.array([8, 8], np.int64)}  # fmt: skip
    model = make_model(nodes, [("x", ["N", 8])], [("y", ["N", 8])], inits)
    data = [{"x": r.normal(0, 1, (16, 8)).astype(np.float32)} for _ in range(8)]
    q, report = onnxq.quantize(model, data, progress=False)
    ops = [n.op_type for n in q.graph.node]
    assert "gates" in report.quantized_nodes
    assert ops == ["QuantizeLinear", "QGemm", "Split", "Sigmoid", "Tanh", "Mul"]  # bias fused
    assert len(q.graph.node[1].input) == 7  # no output scale and zero point: it writes float
    feed = {"x": r.normal(0, 1, (32, 8)).astype(np.float32)}
    np.testing.assert_allclose(run(q, feed)[0], run(model, feed)[0], atol=0.03)


def test_a_reshaped_result_that_only_float_ops_read_is_written_float():
    """MatMul → Reshape → Tanh: the dequantizer stays before the Reshape, so the MatMul
    writes float rather than round its result to int8 for a float reader."""
    r = rng(11)
    nodes = [
        h.make_node("MatMul", ["x", "W"], ["m"], name="dense"),
        h.make_node("Reshape", ["m", "shape"], ["r"], name="reshape"),
        h.make_node("Tanh", ["r"], ["y"], name="tanh"),
    ]
    inits = {"W": r.normal(0, 0.3, (8, 16)).astype(np.float32),
             "shape": np.array([-1, 4, 4], np.int64)}  # fmt: skip
    model = make_model(nodes, [("x", ["N", 8])], [("y", ["N", 4, 4])], inits)
    data = [{"x": r.normal(0, 1, (16, 8)).astype(np.float32)} for _ in range(8)]
    q, report = onnxq.quantize(model, data, progress=False)
    assert "dense" in report.quantized_nodes
    assert [n.op_type for n in q.graph.node] == [
        "QuantizeLinear", "MatMulIntegerToFloat", "Reshape", "Tanh"]  # fmt: skip
    feed = {"x": r.normal(0, 1, (32, 8)).astype(np.float32)}
    np.testing.assert_allclose(run(q, feed)[0], run(model, feed)[0], atol=0.03)


def test_the_model_kind_is_read_from_the_graph_and_can_be_overridden(tmp_path):
    from helpers import trained_model

    assert detect(_encoder())[0] == "transformer"
    assert detect(onnx.load(trained_model("digits_cnn")))[0] == "cnn"
    assert detect(onnx.load(trained_model("digits_mlp")))[0] == "other"
    lstm = h.make_node("LSTM", ["x", "W", "R"], ["y"], name="lstm", hidden_size=4)
    rnn = make_model(
        [lstm],
        [("x", [5, 1, 3])],
        [("y", None)],
        {"W": np.zeros((1, 16, 3), np.float32), "R": np.zeros((1, 16, 4), np.float32)},
    )
    assert detect(rnn)[0] == "rnn"
    model = _encoder()
    _, auto = onnxq.quantize(model, _padded(4, 1), progress=False)
    assert auto.model_kind == "transformer" and "attention" in auto.model_kind_reason
    assert auto.algorithms["bias-correction"].startswith("off")
    _, forced = onnxq.quantize(model, _padded(4, 1), progress=False, model_kind="cnn")
    assert forced.model_kind == "cnn" and "the graph says transformer" in forced.model_kind_reason
    assert forced.algorithms["smoothquant"].startswith("off")
    assert forced.algorithms["bias-correction"] == "nothing to correct"  # it ran: no fused bias
    with pytest.raises(ConfigError, match="model_kind='vision' is unknown"):
        onnxq.quantize(model, _padded(4, 1), progress=False, model_kind="vision")


def test_smoothquant_reads_a_one_shot_iterator_once():
    """Its statistics pass keeps the batches for calibration when the source cannot rewind."""
    model = _encoder(outlier=40.0)
    q, report = onnxq.quantize(model, iter(_padded(6, 1)), progress=False, smoothquant="on")
    assert report.calibration.samples == 24 and report.smoothing


def test_a_function_returning_a_generator_is_read_again_on_every_pass():
    """SmoothQuant, calibration and the check each read the data: a function that returns a
    fresh generator each call must not be taken for a consumed one-shot iterator (it was)."""
    model = _encoder(outlier=40.0)
    feeds = _padded(6, 1)
    q, report = onnxq.quantize(model, lambda: (f for f in feeds), progress=False)
    assert report.calibration.samples == 24 and report.smoothing


def test_smoothquant_output_is_byte_identical_across_runs():
    model = _encoder(outlier=40.0)
    a, _ = onnxq.quantize(model, _padded(6, 1), progress=False, smoothquant="on")
    b, _ = onnxq.quantize(model, _padded(6, 1), progress=False, smoothquant="on")
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def test_keep_float_in_a_config_is_exclude_for_smoothquant_too():
    # SmoothQuant rewrites the float model before annotation: it must leave a node kept float
    # by the config alone, as it does one given to --exclude (onnxq debug's config relies on it)
    from onnxq.annotate.config import UserConfig

    model = _encoder(outlier=40.0)
    calib = _padded(6, 1)
    plain, _ = onnxq.quantize(model, calib, progress=False, smoothquant="on")
    excluded, rep_x = onnxq.quantize(
        model, calib, progress=False, smoothquant="on", exclude=["query"]
    )
    config = UserConfig.from_dict({"node": {"query": {"keep_float": True}}})
    configured, rep_c = onnxq.quantize(
        model, calib, progress=False, smoothquant="on", config=config
    )
    assert rep_x.smoothing["x"]["readers"] == ["key", "value"]
    assert rep_c.smoothing == rep_x.smoothing
    same = excluded.SerializeToString(deterministic=True)
    assert configured.SerializeToString(deterministic=True) == same
    assert plain.SerializeToString(deterministic=True) != same


def test_smoothquant_sees_the_prepared_model_a_transposed_weight_folded():
    """A weight written as Transpose(constant), as some exporters write a Linear layer, is a
    constant once the prepare pass has folded it: SmoothQuant smooths all three readers."""
    model = _encoder(outlier=40.0)
    g = model.graph
    wq = next(i for i in g.initializer if i.name == "Wq")
    transposed = nh.from_array(np.ascontiguousarray(nh.to_array(wq).T), "Wq_t")
    g.initializer.remove(wq)
    g.initializer.append(transposed)
    g.node.insert(0, h.make_node("Transpose", ["Wq_t"], ["Wq"], name="wq_transpose", perm=[1, 0]))
    onnx.checker.check_model(model)
    q, report = onnxq.quantize(model, _padded(16, 1), progress=False, smoothquant="on")
    assert report.smoothing["x"]["readers"] == ["query", "key", "value"]
    assert report.smoothing["x"]["divided_in"]
    assert "-1 Transpose" in next(p.changed for p in report.passes if p.name == "prepare")
    feeds = _padded(2, 5)[0]
    ref, got = run(model, feeds)[0], run(q, feeds)[0]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05
