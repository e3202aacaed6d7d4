"""Sequential bias correction: the piece-by-piece runner, and the correction it drives."""

import numpy as np
import onnx
import pytest
from helpers import make_model, rng, run
from onnx import helper as h
from test_bias_correction import CHAIN_KW, _chain_errors, _depthwise_chain

import onnxq
from onnxq.api import quantize_state
from onnxq.calibrate.sequential import run_in_order
from onnxq.io.graph import in_memory_names, values_apart
from onnxq.io.session import make_session
from onnxq.simulate import emulate as emulate_module
from onnxq.simulate.emulate import emulate
from onnxq.solve.bias_correction import channel_means


def _residual_qdq():
    """x → Q/DQ → c1 → Relu → Q/DQ → c2 → Add(with the DQ'd c1 branch) → c3: three targets,
    a residual edge held across pieces, DequantizeLinears between them."""
    r = rng(21)
    c = 6
    s, z = np.float32(0.05), np.uint8(100)

    def qdq(x, name):
        return [
            h.make_node("QuantizeLinear", [x, "s", "z"], [f"{name}_q"], f"{name}/Q"),
            h.make_node("DequantizeLinear", [f"{name}_q", "s", "z"], [name], f"{name}/DQ"),
        ]

    nodes = [
        *qdq("x", "xd"),
        h.make_node("Conv", ["xd", "W1", "B1"], ["y1"], "c1", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["y1"], ["r1"], "relu"),
        *qdq("r1", "r1d"),
        h.make_node("Conv", ["r1d", "W2", "B2"], ["y2"], "c2", group=c, pads=[1, 1, 1, 1]),
        h.make_node("Add", ["y2", "r1d"], ["a"], "add"),
        h.make_node("Conv", ["a", "W3", "B3"], ["y3"], "c3"),
    ]
    inits = {
        "W1": r.normal(0, 0.3, (c, 3, 3, 3)), "B1": r.normal(0, 0.1, c),
        "W2": r.normal(0, 0.3, (c, 1, 3, 3)), "B2": r.normal(0, 0.1, c),
        "W3": r.normal(0, 0.3, (4, c, 1, 1)), "B3": r.normal(0, 0.1, 4), "s": s, "z": z,
    }  # fmt: skip
    inits = {k: v if k in "sz" else np.float32(v) for k, v in inits.items()}
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y3", None)], inits)
    batches = [{"x": r.normal(0, 1, (4, 3, 8, 8)).astype(np.float32)} for _ in range(5)]
    return model, batches


TARGETS = [("y3", 1), ("y1", 1), ("y2", 1)]  # in any order: measured in graph order


def _exposed_sums(model, batches, names):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.extend(h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    session = make_session(m, optimize=False)  # Q/DQ and float Convs as written
    sums = {n: 0.0 for n in names}
    count = 0
    for feed in batches:
        outs = session.run(names, feed)
        for n, arr in zip(names, outs, strict=True):
            total, k = channel_means(arr, 1)
            sums[n] = sums[n] + total
        count += k
    return sums, count


def test_pieces_measure_what_one_run_of_the_whole_model_computes():
    model, batches = _residual_qdq()
    seen = {}

    def correct(k, sums, count, used):
        seen[TARGETS[k][0]] = (sums / count, used)
        return None  # no shift: every piece runs the model as it is

    assert run_in_order(model, TARGETS, batches, correct) == 5
    ref, count = _exposed_sums(model, batches, ["y1", "y2", "y3"])
    assert list(seen) == ["y1", "y2", "y3"]  # graph order
    for name in ref:
        np.testing.assert_allclose(seen[name][0], ref[name] / count, rtol=1e-5, atol=1e-6)
    assert model.graph.node[2].output[0] == "y1"  # the caller's model is left as it was


def test_a_branch_runs_in_the_piece_of_the_target_that_needs_it(monkeypatch):
    """Two branches interleaved in graph order (as exporters write a multi-head model): the
    second branch's Mul and Relu, written before the first branch's Conv, run with the second
    Conv, so no piece hands the other branch a half-computed tensor; the measurements are
    those of one run of the whole model."""
    import onnxq.calibrate.sequential as sequential

    r = rng(5)
    nodes = [
        h.make_node("Mul", ["x", "two"], ["b1"], "b_mul"),
        h.make_node("Conv", ["x", "WA", "BA"], ["ya"], "conv_a"),
        h.make_node("Relu", ["b1"], ["b2"], "b_relu"),
        h.make_node("Conv", ["b2", "WB", "BB"], ["yb"], "conv_b"),
        h.make_node("Add", ["ya", "yb"], ["out"], "join"),
    ]
    inits = {
        "two": np.float32(2.0),
        "WA": r.normal(0, 0.3, (4, 3, 1, 1)).astype(np.float32),
        "BA": r.normal(0, 0.1, 4).astype(np.float32),
        "WB": r.normal(0, 0.3, (4, 3, 1, 1)).astype(np.float32),
        "BB": r.normal(0, 0.1, 4).astype(np.float32),
    }
    model = make_model(nodes, [("x", ["N", 3, 4, 4])], [("out", None)], inits)
    batches = [{"x": r.normal(0, 1, (2, 3, 4, 4)).astype(np.float32)} for _ in range(3)]
    pieces: list = []
    real = sequential._submodel

    def spy(m, piece_nodes, *args, **kwargs):
        pieces.append([n.name for n in piece_nodes])
        return real(m, piece_nodes, *args, **kwargs)

    monkeypatch.setattr(sequential, "_submodel", spy)
    seen = {}

    def correct(k, sums, count, used):
        seen[["ya", "yb"][k]] = sums / count

    run_in_order(model, [("ya", 1), ("yb", 1)], batches, correct)
    assert pieces[0] == ["conv_a"]
    assert pieces[1] == ["b_mul", "conv_a", "ya/Shift", "b_relu", "conv_b"]
    ref, count = _exposed_sums(model, batches, ["ya", "yb"])
    for name in ref:
        np.testing.assert_allclose(seen[name], ref[name] / count, rtol=1e-5, atol=1e-6)


def test_a_shift_is_applied_before_the_next_target_is_measured():
    """Shift y1 by +1 per channel: y2 and y3 are measured on the shifted model (each piece
    starts from the held, shifted tensors), as one run of the model with B1 + 1 computes."""
    model, batches = _residual_qdq()
    seen = {}

    def correct(k, sums, count, used):
        seen[TARGETS[k][0]] = sums / count
        return np.ones(6) if TARGETS[k][0] == "y1" else None

    run_in_order(model, TARGETS, batches, correct)
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    for init in moved.graph.initializer:
        if init.name == "B1":
            init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) + 1, "B1"))
    ref, count = _exposed_sums(moved, batches, ["y2", "y3"])
    for name in ref:
        np.testing.assert_allclose(seen[name], ref[name] / count, rtol=1e-5, atol=1e-6)


def test_the_inputs_let_go_of_measure_the_same_and_go_after_their_last_piece():
    import gc
    import weakref

    model, batches = _residual_qdq()

    def run(let_go):
        handed = [{"x": b["x"].copy()} for b in batches]
        alive = [weakref.ref(b["x"]) for b in handed]
        seen, gone = [], []

        def correct(k, sums, count, used):
            gc.collect()
            gone.append(sum(ref() is None for ref in alive))
            seen.append(sums.tobytes())
            return np.full(sums.shape, 0.25 * (k + 1), np.float32)  # later pieces see shifts

        run_in_order(model, TARGETS, handed, correct, let_go=let_go)
        return handed, seen, gone

    kept, seen_kept, gone_kept = run(False)
    emptied, seen, gone = run(True)
    assert len(kept) == 5 and emptied == []  # emptied: the inputs are the pieces' to let go of
    assert seen == seen_kept  # the same bits
    assert gone_kept == [0, 0, 0] and gone[-1] == 5  # only the first piece reads the inputs


def test_held_tensors_over_the_limit_drop_the_later_batches():
    model, batches = _residual_qdq()
    used = []

    def correct(k, sums, count, used_now):
        used.append((TARGETS[k][0], used_now, count))
        return None

    assert run_in_order(model, TARGETS, batches, correct, limit=1) == 1
    assert used[0] == ("y1", 5, 5 * 4 * 64)  # the first piece runs every batch
    assert [u[1] for u in used[1:]] == [1, 1]  # then only the first is held
    assert [u[2] for u in used[1:]] == [4 * 64, 4 * 64]


def test_the_resolved_emulation_is_the_fixed_one():
    model, data = _depthwise_chain()
    state = quantize_state(model, data, **CHAIN_KW)
    emu = emulate(state)
    feed = {"x": data["x"][:8]}
    for on in (None, [], emu.without([0])):
        flat = make_session(emu.resolved(on), as_written=True).run(None, feed)[0]
        np.testing.assert_allclose(flat, run(emu.fixed(on), feed)[0], rtol=1e-5, atol=1e-5)
    flat = emu.resolved()
    assert not any(n.op_type in ("If", "Where", "Gather") for n in flat.graph.node)
    assert all(i.name != "onnxq_debug_flags" for i in flat.graph.input)


def test_weights_apart_measure_the_same_and_are_let_go_after_their_last_piece():
    model, batches = _residual_qdq()
    inline, apart = {}, {}

    def record(into):
        def correct(k, sums, count, used):
            into[TARGETS[k][0]] = sums / count
            return np.ones(6) if TARGETS[k][0] == "y1" else None

        return correct

    run_in_order(model, TARGETS, batches, record(inline))
    stubs, values = values_apart(model.graph.initializer, limit=16)
    assert {"W1", "W2", "W3"} <= set(values) and "s" not in values  # scalars stay inline
    assert all(v.flags.owndata for v in values.values())  # copies: the model can be let go of
    stubbed = onnx.ModelProto()
    stubbed.CopyFrom(model)
    del stubbed.graph.initializer[:]
    stubbed.graph.initializer.extend(stubs)
    held = dict(values)
    run_in_order(stubbed, TARGETS, batches, record(apart), weights=held)
    assert held == {}  # each weight dropped once no later piece reads it
    for name in inline:
        np.testing.assert_array_equal(apart[name], inline[name])


def test_the_emulation_without_float_branches_resolves_apart_to_the_same_model(monkeypatch):
    monkeypatch.setattr(emulate_module, "APART_BYTES", 0)  # every weight apart, however small
    model, data = _depthwise_chain()
    state = quantize_state(model, data, **CHAIN_KW)
    whole = emulate(state, int32_biases=False)
    lean = emulate(state, int32_biases=False, float_branches=False)
    assert lean.held and all(v.flags.owndata for v in lean.held.values())
    with pytest.raises(ValueError, match="resolves apart only"):
        lean.resolved()
    stub_model, values = lean.resolved_apart()
    assert set(in_memory_names(stub_model)) == set(values)
    feed = {"x": data["x"][:8]}
    got = make_session(stub_model, as_written=True, weights=values).run(None, feed)[0]
    ref = make_session(whole.resolved(), as_written=True).run(None, feed)[0]
    np.testing.assert_array_equal(got, ref)


def test_a_large_weight_is_fake_quantized_in_slices_to_the_same_values(monkeypatch):
    r = rng(3)
    cases = [((40, 7, 3, 3), (40, 1, 1, 1)), ((40, 7, 3, 3), ()), ((64, 30), (1, 30))]
    for shape, bound in cases:
        x = r.normal(0, 1, shape).astype(np.float32)
        lo = -np.abs(r.normal(0, 1, bound)).astype(np.float32)
        hi = np.abs(r.normal(0, 1, bound)).astype(np.float32)
        whole = emulate_module._fq(x, lo, hi, 255)
        monkeypatch.setattr(emulate_module, "FQ_SLICE", 50)
        np.testing.assert_array_equal(emulate_module._fq(x, lo, hi, 255), whole)
        monkeypatch.undo()


def test_sequential_correction_removes_the_mean_shift_and_falls_back_on_one_shot_data():
    before, after, report = _chain_errors("sequential")
    assert before.mean() > 0.01
    assert after.mean() < 0.25 * before.mean(), (before, after)
    assert "biases corrected, sequential on 64 samples" in report.algorithms["bias-correction"]
    model, data = _depthwise_chain()
    one_shot = ({"x": data["x"][i : i + 8]} for i in range(0, 64, 8))
    _, report = onnxq.quantize(model, one_shot, bias_correction="sequential", **CHAIN_KW)
    assert "fast (the data cannot be read again)" in report.algorithms["bias-correction"]


def _two_layer_chain():
    """conv (3×3, Relu) → dw (3×3, Relu) → pw (1×1): the input of each sits on a coarse grid
    (7-bit weights, a wide calibrated range), so every layer inherits the earlier ones' shift."""
    r = rng(31)
    c = 8
    nodes = [
        h.make_node("Conv", ["x", "W1", "B1"], ["y1"], "conv", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["y1"], ["r1"], "relu1"),
        h.make_node("Conv", ["r1", "W2", "B2"], ["y2"], "dw", group=c, pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["y2"], ["r2"], "relu2"),
        h.make_node("Conv", ["r2", "W3", "B3"], ["y3"], "pw"),
    ]
    inits = {
        "W1": r.normal(0, 0.4, (c, 3, 3, 3)), "B1": r.normal(0.2, 0.2, c),
        "W2": r.normal(0.1, 0.4, (c, 1, 3, 3)), "B2": r.normal(0, 0.2, c),
        "W3": r.normal(0, 0.4, (c, c, 1, 1)), "B3": r.normal(0, 0.1, c),
    }  # fmt: skip
    inits = {k: np.float32(v) for k, v in inits.items()}
    model = make_model(nodes, [("x", ["N", 3, 12, 12])], [("y3", None)], inits)
    x = r.normal(0, 1, (64, 3, 12, 12)).astype(np.float32)
    x[:, :, 0, 0] = 12.0  # a wide range: a coarse input grid
    return model, {"x": x}


def test_sequential_matches_the_last_layer_s_means_where_fast_does_not():
    """On the calibration samples, the int8 model's output means per channel are the float
    model's once every layer is corrected on its int8 input; fast leaves the shift the input
    grids and the earlier layers put in."""
    model, data = _two_layer_chain()
    ref = run(model, data)[0].mean(axis=(0, 2, 3))
    kw = dict(progress=False, weight_bits=7, method="minmax", rounding="nearest")
    errors = {}
    for mode in ("none", "fast", "sequential"):
        q, _ = onnxq.quantize(model, data, bias_correction=mode, **kw)
        errors[mode] = np.abs(run(q, data)[0].mean(axis=(0, 2, 3)) - ref).mean()
    assert errors["none"] > 0.005, errors
    assert errors["sequential"] < 0.3 * errors["fast"], errors
    assert errors["sequential"] < 0.2 * errors["none"], errors


def test_batches_are_joined_only_where_every_input_has_one_symbolic_batch_axis():
    from types import SimpleNamespace

    from onnxq.calibrate.dataset import InputSpec
    from onnxq.passes.bias_correction import _grouped, _merged

    def state(*specs):
        return SimpleNamespace(dataset=SimpleNamespace(inputs=list(specs)))

    image = InputSpec("x", np.dtype(np.float32), (None, 3, 8, 8))
    feeds = [{"x": np.full((1, 3, 8, 8), i, np.float32)} for i in range(6)]
    runs, sizes = _merged(state(image), feeds)
    assert sizes == [4, 2] and [r["x"].shape[0] for r in runs] == [4, 2]
    np.testing.assert_array_equal(runs[1]["x"][:, 0, 0, 0], [4, 5])  # in order
    sums = [(np.full(3, float(i)), 10) for i in range(6)]
    assert [(list(s), n) for s, n in _grouped(sums, sizes)] == [([6.0] * 3, 40), ([9.0] * 3, 20)]
    # a fixed batch, an undeclared shape: as they come
    assert _merged(state(InputSpec("x", np.dtype(np.float32), (1, 3, 8, 8))), feeds)[1] == [1] * 6
    assert _merged(state(InputSpec("x", np.dtype(np.float32), None)), feeds)[1] == [1] * 6
    # a recurrent state with its batch on axis 1 (silero-vad): the feeds' first axes differ
    rnn = [
        {"x": np.zeros((1, 512), np.float32), "state": np.zeros((2, 1, 128), np.float32)}
        for _ in range(3)
    ]
    specs = (
        InputSpec("x", np.dtype(np.float32), (None, None)),
        InputSpec("state", np.dtype(np.float32), (None, None, None)),
    )
    assert _merged(state(*specs), rnn)[1] == [1, 1, 1]
    # different shapes are never joined (padded text batches of different lengths)
    mixed = [{"x": np.zeros((1, 3, 8, w), np.float32)} for w in (8, 8, 9, 9, 9)]
    assert _merged(state(InputSpec("x", np.dtype(np.float32), (None, 3, 8, None))), mixed)[1] == [
        2,
        3,
    ]


def _without_the_calibrate_stream(monkeypatch):
    """The sequential correction measuring the float layers with a float run of its own."""
    from onnxq.passes import bias_correction

    monkeypatch.setattr(bias_correction, "taps", lambda state: {})


def test_the_float_sums_come_from_the_calibrate_stream_and_match_a_run_of_their_own(
    monkeypatch,
):
    from onnxq.passes import bias_correction

    model, data = _two_layer_chain()
    kw = dict(progress=False, weight_bits=7, method="minmax", rounding="nearest")
    own_runs = []
    real = bias_correction._output_sums
    monkeypatch.setattr(bias_correction, "_output_sums", lambda *a: own_runs.append(1) or real(*a))
    streamed, _ = onnxq.quantize(model, data, bias_correction="sequential", **kw)
    assert not own_runs  # one float pass fewer: the calibrate stream gave every sum
    _without_the_calibrate_stream(monkeypatch)
    own, _ = onnxq.quantize(model, data, bias_correction="sequential", **kw)
    assert own_runs  # the fallback ran the float model itself
    assert streamed.SerializeToString() == own.SerializeToString()


def test_a_batch_the_stream_skipped_sends_the_correction_to_its_own_float_run(monkeypatch):
    from onnxq.passes.bias_correction import BatchSums

    sums = BatchSums(axis=1)
    x = rng(3).normal(0, 1, (2, 4, 3, 3)).astype(np.float32)
    sums.observe(x, index=0)
    sums.observe(x, index=2)  # batch 1 had NaN in it: the stream skipped it
    assert sums.covers(1) and not sums.covers(3)
    other = BatchSums(axis=1)
    other.observe(x * 2, index=1)  # another worker's shard
    sums.merge(other)
    assert sums.covers(3)
    first = sums.first(3)
    np.testing.assert_array_equal(first[1][0], channel_means(x * 2, 1)[0])
    sums.observe(x, index=10_000)  # past the samples the correction runs: not kept
    assert 10_000 not in sums.sums


def test_the_heap_is_trimmed_between_pieces_only_past_the_growth(monkeypatch):
    # glibc keeps what each piece freed (its session, its tensors): the pieces climbed to the
    # sum (OriNet 146 -> 430 MB) unless the heap is handed back between them
    import onnxq.calibrate.sequential as sequential
    from onnxq.io import session

    resident = iter([100, 100 + session.TRIM_GROWTH, 101 + session.TRIM_GROWTH, 60])
    trims = []
    monkeypatch.setattr(session, "resident_bytes", lambda: next(resident))
    monkeypatch.setattr(session, "trim_heap", lambda: trims.append(1))
    assert session.trim_heap_if_grown(None) == 100  # the starting point
    assert session.trim_heap_if_grown(100) == 100 and not trims  # grown by the bound: kept
    assert session.trim_heap_if_grown(100) == 60 and trims == [1]  # past it: trimmed, re-read
    monkeypatch.setattr(session, "resident_bytes", lambda: None)
    assert session.trim_heap_if_grown(100) is None and trims == [1]  # not Linux: nothing

    calls = []
    monkeypatch.setattr(sequential, "trim_heap_if_grown", lambda since: calls.append(since))
    model, batches = _residual_qdq()
    run_in_order(model, TARGETS, batches, lambda *a: None)
    assert len(calls) == 1 + len(TARGETS)  # before the first piece, then after each
