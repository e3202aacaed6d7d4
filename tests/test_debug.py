"""The pieces of ``onnxq debug``: the switchable emulation of a quantization, the sensitivity
ranking built on it (also the fallback's), and the cross-runtime check."""

import tomllib

import numpy as np
import onnx
import pytest
from helpers import make_model, rng, run
from onnx import helper as h
from onnx import numpy_helper
from test_fallback import _fragile_mlp, three_gemms

from onnxq.api import quantize_state
from onnxq.io.session import make_session
from onnxq.report import build_report
from onnxq.simulate.crosscheck import PART_STEPS, cross_check
from onnxq.simulate.emulate import FLAGS, emulate, held_float
from onnxq.simulate.sensitivity import db, rank


def _sqnr(ref, got):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return db(float(np.sum((ref - got) ** 2) / np.sum(ref**2)))


def _digits():
    import os

    import onnxq.demo

    folder = os.path.dirname(onnxq.demo.__file__)
    model = onnx.load(f"{folder}/digits_cnn.onnx")
    data = np.load(f"{folder}/digits.npz")
    name = model.graph.input[0].name
    calib = {name: data["calib"][:128].astype(np.float32)}
    test = data["test"].astype(np.float32)
    return model, calib, [{name: test[i : i + 32]} for i in range(0, 128, 32)]


def _weight_outlier_mlp():
    """x → A → Relu → B → Relu → C with per-tensor weights; one weight of B is 400× the rest:
    B's grid is too coarse for its other weights. Activations are benign."""
    r = rng(5)
    wb = r.normal(0, 0.3, (32, 32))
    wb[3, 7] = 120.0
    inits = {
        "WA": r.normal(0, 0.3, (16, 32)), "BA": r.normal(0, 0.1, 32), "WB": wb,
        "BB": r.normal(0, 0.1, 32), "WC": r.normal(0, 0.3, (32, 8)), "BC": r.normal(0, 0.1, 8),
    }  # fmt: skip
    model = three_gemms(inits)
    x = r.normal(0, 1, (256, 16)).astype(np.float32)
    return model, {"x": x}


KW = dict(progress=False, batch_size=16, rounding="nearest")


def test_switches_off_is_the_float_model_and_on_is_the_quantized_one():
    model, calib, feeds = _digits()
    state = quantize_state(model, calib, progress=False)
    emu = emulate(state)
    session = make_session(emu.model)
    q = make_session(state.model)
    for feed in feeds:
        off = session.run(None, {**feed, FLAGS: emu.flags([])})[0]
        on = session.run(None, {**feed, FLAGS: emu.flags()})[0]
        ref = run(model, feed)[0]
        np.testing.assert_allclose(off, ref, rtol=1e-4, atol=1e-3)
        assert _sqnr(q.run(None, feed)[0], on) > 40  # the int8 model, but for rounding ties
        assert _sqnr(ref, on) < 60  # and the switches did quantize
    # every group owns its weight and its output; every switch has an owner
    assert all(g.weights and g.activations for g in emu.groups if g.op == "Conv")
    assert all(s.groups for s in emu.switches)
    # fixed(): the same model, its flags set by default
    fixed = emu.fixed()
    on = session.run(None, {**feeds[0], FLAGS: emu.flags()})[0]
    np.testing.assert_array_equal(run(fixed, feeds[0])[0], on)


@pytest.mark.parametrize(
    "nodes",
    [
        {"conv2": {"activation_dtype": "int16"}},  # an int16 island in a uint8 model
        {"conv1": {"activation_dtype": "int16"}},  # the graph input read as int16
    ],
)
def test_switches_on_is_the_int8_model_where_dtypes_meet(nodes):
    # conv2 int16 in a uint8 model: conv1 writes r1 as uint8 and conv2 reads it again as int16;
    # conv2 writes int16 that MaxPool carries to conv3, which reads it again as uint8. The
    # emulation must round both times, as the written model's rescales do (it rounded r1 on
    # the int16 grid alone and the pooled tensor on conv2's int16 grid alone: 58 dB apart)
    import onnxruntime as ort

    from onnxq.annotate.config import UserConfig
    from onnxq.post.requantize import rescales

    model, calib, feeds = _digits()
    config = UserConfig.from_dict({"node": nodes})
    state = quantize_state(model, calib, progress=False, format="qdq", config=config)
    assert rescales(state.model)  # the dtypes meet
    emu = emulate(state)
    session = make_session(emu.model)
    options = ort.SessionOptions()  # Q/DQ arithmetic in float, as the emulation computes it
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    written = ort.InferenceSession(
        state.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    for feed in feeds:
        on = session.run(None, {**feed, FLAGS: emu.flags()})[0]
        assert _sqnr(written.run(None, feed)[0], on) > 80


def test_ranking_names_the_fragile_activation_first():
    model, data = _fragile_mlp()
    state = quantize_state(model, data, **KW)
    feeds = [{"x": data["x"][i : i + 16]} for i in range(0, 64, 16)]
    ranking = rank(emulate(state), feeds)
    first = ranking.groups[0]
    assert first.node == "A" and first.dominant == "activations"
    assert first.float_share > 0.9 and ranking.groups[1].score < 0.1
    assert ranking.samples == 64 and ranking.split == 3
    assert "A" in ranking.table()


def test_ranking_names_the_fragile_weight_first():
    model, data = _weight_outlier_mlp()
    state = quantize_state(model, data, per_channel=False, **KW)
    ranking = rank(emulate(state), [data])
    first = ranking.groups[0]
    assert first.node == "B" and first.dominant == "weights", ranking.table()
    assert first.weights > 5 * first.activations


def test_ranking_keeps_to_its_budget():
    model, calib, feeds = _digits()
    state = quantize_state(model, calib, progress=False)
    emulation = emulate(state)
    ranking = rank(emulation, feeds * 8, budget=0.0)
    assert ranking.samples == 1  # one sample left
    # the screening is complete; alone float and the split only for the first group
    assert len(ranking.groups) == len(emulation.groups) == 4
    assert [g.without is not None for g in ranking.groups].count(True) == 1
    assert ranking.split == 1
    assert sum("budget" in n for n in ranking.notes) == 3
    full = rank(emulation, feeds)
    assert full.samples == 128 and full.split == 4 and not full.notes


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_cross_check_agrees_on_a_sound_onnxruntime_model(fmt):
    model, calib, feeds = _digits()
    state = quantize_state(model, calib, progress=False, format=fmt)
    check = cross_check(emulate(state), state.quantizer.float_model, state.model, feeds)
    assert check.agrees and check.runtime == "onnxruntime", check.summary()
    local = [x for x in check.layers if x.steps == x.steps]  # the quantized tensors
    assert len(local) == 3 and all(x.steps < 0.1 for x in local)
    assert min(x.agreement_db for x in check.layers) > 60  # integer kernels = the emulation


def sound_agreement(check, tensor):
    return next(x.agreement_db for x in check.layers if x.tensor == tensor)


def test_cross_check_finds_a_broken_fakequantize_conversion():
    pytest.importorskip("openvino", reason="pip install openvino")
    model, calib, feeds = _digits()
    state = quantize_state(model, calib, progress=False, format="openvino")
    emulation = emulate(state)
    assert emulation.steps()["r2"] > 0
    float_model = state.quantizer.float_model
    sound = cross_check(emulation, float_model, state.model, feeds)
    assert sound.agrees and sound.runtime == "openvino", sound.summary()
    # a conversion that writes the wrong output range for relu2's output (r2): the dequantized
    # values come out 1.5× too large
    broken = onnx.ModelProto()
    broken.CopyFrom(state.model)
    fq = next(n for n in broken.graph.node if n.name == "r2/FakeQuantize")
    high = next(i for i in broken.graph.initializer if i.name == fq.input[4])
    broken.graph.initializer.append(
        numpy_helper.from_array(numpy_helper.to_array(high) * 1.5, "r2/output_high")
    )
    fq.input[4] = "r2/output_high"
    check = cross_check(emulation, float_model, broken, feeds)
    assert not check.agrees
    part = check.first_part
    assert part.node == "relu2" and part.tensor == "r2" and part.steps > 10 * PART_STEPS
    assert "relu2" in check.summary()
    # downstream, the broken values drift every layer far from the reference, but computed from
    # the same (broken) inputs the later layers are sound: only r2 parts
    later = {x.tensor: x for x in check.layers}
    assert later["r3"].agreement_db < sound_agreement(sound, "r3") - 10
    assert later["r3"].steps <= PART_STEPS


def _deep_fragile_mlp(layers=24):
    """x → L0 → Relu → L1 → ... → L23: the first layer reads an input column spanning ±1000
    that it barely uses, as in _fragile_mlp; 23 benign layers follow."""
    r = rng(21)
    nodes, inits, prev = [], {}, "x"
    for i in range(layers):
        w = r.normal(0, (2 / 32) ** 0.5, (16 if i == 0 else 32, 32))
        if i == 0:
            w[0] = 1e-5
        inits[f"W{i}"], inits[f"B{i}"] = w, r.normal(0, 0.05, 32)
        nodes.append(h.make_node("Gemm", [prev, f"W{i}", f"B{i}"], [f"g{i}"], name=f"L{i}"))
        if i < layers - 1:
            nodes.append(h.make_node("Relu", [f"g{i}"], [f"r{i}"], name=f"relu{i}"))
            prev = f"r{i}"
    inits = {k: v.astype(np.float32) for k, v in inits.items()}
    model = make_model(nodes, [("x", ["N", 16])], [(f"g{layers - 1}", ["N", 32])], inits)
    x = r.normal(0, 1, (256, 16))
    x[:, 0] = r.uniform(-1000, 1000, 256)
    return model, {"x": x.astype(np.float32)}


def test_debug_names_the_culprit_and_its_config_reproduces_the_gain(tmp_path, capsys):
    import json

    from onnxq.cli import main
    from onnxq.fallback import output_cosine

    model, data = _deep_fragile_mlp()
    src, npz, fix = tmp_path / "deep.onnx", tmp_path / "calib.npz", tmp_path / "fix.toml"
    onnx.save(model, str(src))
    np.savez(npz, **data)
    before = src.read_bytes()
    assert main(["debug", str(src), "--data", str(npz), "--batch-size", "16", "-o", str(fix),
                 "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert src.read_bytes() == before
    assert result["ranking"]["groups"][0]["node"] == "L0"
    assert result["ranking"]["groups"][0]["dominant"] == "activations"
    assert result["chosen"] == ["L0"] and result["recovered"] >= 0.8
    assert result["int8_nodes_fixed"] >= 0.9 * result["int8_nodes"]
    assert result["cross_check"]["agrees"]
    # where the loss sits: the input's 8-bit grid alone loses most of it, int16 activations
    # (the input's included) almost none
    parts, loss = result["loss_parts"], result["loss"]
    assert parts["rounded_inputs"] == ["x"] and not parts["notes"]
    assert result["fp32"] - parts["inputs"] >= 0.8 * loss
    assert result["fp32"] - parts["weights"] <= 0.1 * loss
    # the same int8 model in float arithmetic: ties move the metric by less than a tenth of
    # the loss here (the threshold of the ties line)
    assert abs(parts["exact"] - result["int8"]) < 0.1 * loss
    text = fix.read_text()
    assert tomllib.loads(text)["node"]["L0"] == {"keep_float": True} and "output noise" in text
    assert "--config" in result["command"] and str(fix) in result["command"]
    # the config, applied by quantize, gives the figure debug promised
    out = tmp_path / "fixed.onnx"
    assert main(["quantize", str(src), "--data", str(npz), "--batch-size", "16", "--config",
                 str(fix), "-o", str(out), "--quiet", "--no-latency-check"]) == 0  # fmt: skip
    feeds = [{"x": data["x"][i : i + 16]} for i in range(0, 256, 16)]
    metric = output_cosine(model, feeds)
    assert metric(onnx.load(str(out))) == pytest.approx(result["fixed"], abs=1e-9)
    assert result["fixed"] - result["int8"] >= 0.8 * (result["fp32"] - result["int8"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--recover", "2"], "--recover 2.0 must be in (0, 1]"),
        (["--eval", "nosuchmodule:score"], "--eval 'nosuchmodule:score': cannot import"),
        (["--budget", "-1"], "--budget -1.0 must be ≥ 0 seconds"),
        (["--samples", "0"], "--samples 0 must be ≥ 1"),
        (["--fallback", "int16"], "--fallback int16 returns groups to int16 activations"),
        (["--fallback", "int16", "--target", "tensorrt"], "runs symmetric int8 activations only"),
        (["--report", "nofolder/r.html"], "output folder 'nofolder' does not exist"),
    ],
)
def test_debug_refuses_bad_options_in_one_line(tmp_path, capsys, extra, message):
    from onnxq.cli import main

    model, data = _fragile_mlp()
    src, npz = tmp_path / "m.onnx", tmp_path / "calib.npz"
    onnx.save(model, str(src))
    np.savez(npz, **data)
    assert (
        main(["debug", str(src), "--data", str(npz), "-o", str(tmp_path / "f.toml"), *extra]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "f.toml").exists()


def test_debug_never_writes_over_its_input(tmp_path, capsys):
    from onnxq.cli import main

    model, data = _fragile_mlp()
    src, npz = tmp_path / "m.onnx", tmp_path / "calib.npz"
    onnx.save(model, str(src))
    np.savez(npz, **data)
    before = src.read_bytes()
    for flag in ("-o", "--report"):
        assert main(["debug", str(src), "--data", str(npz), flag, str(src)]) == 2
        assert "onnxq never overwrites what it reads" in capsys.readouterr().err
        assert src.read_bytes() == before


def test_debug_refuses_a_quantized_model(tmp_path, capsys):
    from onnxq.cli import main

    model, data = _fragile_mlp()
    q, _ = onnxq_quantize(model, data)
    src, npz = tmp_path / "q.onnx", tmp_path / "calib.npz"
    onnx.save(q, str(src))
    np.savez(npz, **data)
    assert main(["debug", str(src), "--data", str(npz)]) == 2
    assert "already quantized" in capsys.readouterr().err


def onnxq_quantize(model, data):
    import onnxq

    return onnxq.quantize(model, data, **KW)


def test_zoo_eval_gives_any_zoo_model_as_data_and_metric(monkeypatch):
    # the references the docs' walkthrough passes to --data and --eval
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    sys.modules.pop("models.zoo_eval", None)
    from models import zoo_eval

    path = zoo_eval.model_path("digits_cnn")
    batches = zoo_eval.digits_cnn_data()
    assert sum(len(b["input"]) for b in batches) == 300
    score = zoo_eval.digits_cnn(str(path))
    assert 95 < score <= 100  # the fp32 accuracy on the zoo's evaluation digits
    each = zoo_eval.digits_cnn_samples(str(path))  # per sample: what --metric's noise rule needs
    assert set(np.unique(each)) <= {0.0, 100.0} and each.mean() == pytest.approx(score)
    with pytest.raises(AttributeError, match="no zoo model named 'nosuchmodel'"):
        zoo_eval.nosuchmodel("x.onnx")


def test_debug_writes_no_config_when_no_float_set_helps(tmp_path, capsys, monkeypatch):
    import json

    from onnxq.cli import main

    model, data = _fragile_mlp()
    src, npz = tmp_path / "m.onnx", tmp_path / "calib.npz"
    onnx.save(model, str(src))
    np.savez(npz, **data)
    # a metric that only the float model satisfies: no set of float groups raises it
    (tmp_path / "allornothing.py").write_text(
        "import onnx\n"
        "def score(path):\n"
        "    ops = {n.op_type for n in onnx.load(path).graph.node}\n"
        "    return 50.0 if any('Quant' in o or o.startswith('QGemm') for o in ops) else 100.0\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("onnxq.tools.debug.MAX_GROUPS", 2)  # all three float would be fp32
    fix = tmp_path / "fix.toml"
    assert main(["debug", str(src), "--data", str(npz), "--batch-size", "16", "--eval",
                 "allornothing:score", "-o", str(fix), "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result["fp32"] == 100 and result["int8"] == 50
    assert result["fixed"] is None and result["config"] is None and not fix.exists()
    assert [s["groups"] for s in result["steps"]] == [0, 1, 2]
    assert all(s["metric"] == 50 for s in result["steps"])
    assert any("no config written" in n for n in result["notes"])


def test_int16_ranking_returns_activations_and_keeps_the_weights():
    """Returned to int16, a group whose noise is in its activations loses it and one whose
    noise is in its weights keeps it (its fix is then float)."""
    from onnxq.simulate.sensitivity import fix

    model, data = _fragile_mlp()
    feeds = [{"x": data["x"][i : i + 16]} for i in range(0, 64, 16)]
    emulation = emulate(quantize_state(model, data, target="generic", **KW))
    wide = rank(emulation, feeds, fallback="int16")
    first = wide.groups[0]
    assert first.node == "A" and first.float_share > 0.9 and fix(first, "int16") == "int16"
    assert wide.fallback == "int16" and "int16 →" in wide.table()
    assert wide.to_dict()["fallback"] == "int16"

    model, data = _weight_outlier_mlp()
    state = quantize_state(model, data, per_channel=False, target="generic", **KW)
    emulation = emulate(state)
    as_float = rank(emulation, [data]).groups[0]
    as_int16 = rank(emulation, [data], fallback="int16").groups[0]
    assert as_float.node == as_int16.node == "B" and as_int16.dominant == "weights"
    assert fix(as_int16, "int16") == "float" and fix(as_int16, "float") == "float"
    # measured at int16 first, B loses little; its fix being float, it is measured float again
    assert as_int16.without == pytest.approx(as_float.without) and as_float.float_share > 0.5
    b = next(i for i, g in enumerate(emulation.groups) if g.node == "B")
    session = make_session(emulation.model)
    ref = session.run(None, {**data, FLAGS: emulation.flags([])})[0]
    wide = session.run(None, {**data, FLAGS: emulation.flags(emulation.without([b], True))})[0]
    whole = session.run(None, {**data, FLAGS: emulation.flags()})[0]
    assert _sqnr(ref, wide) < _sqnr(ref, whole) + 1  # int16 activations leave B's noise
    # the int16 switches: B's weight on, the activations only B touches off
    b = next(i for i, g in enumerate(emulation.groups) if g.node == "B")
    on = set(emulation.without([b], int16=True))
    group = emulation.groups[b]
    assert set(group.weights) <= on and not set(group.weights) & set(emulation.without([b]))
    assert on - set(emulation.without([b])) == set(group.weights)


def test_debug_with_int16_fallback_writes_activation_dtype_entries(tmp_path, capsys):
    """A target that runs int16 activations: the culprit goes to int16, not to float, and the
    written config, applied, runs in onnxruntime as promised with every group integer."""
    import json

    from onnxq.cli import main
    from onnxq.fallback import output_cosine

    model, data = _deep_fragile_mlp()
    src, npz, fix = tmp_path / "deep.onnx", tmp_path / "calib.npz", tmp_path / "fix.toml"
    targets = tmp_path / "npu.toml"
    targets.write_text(
        '[target.a16w8]\nformat = "qdq"\nactivation_dtype = "int8"\n'
        "symmetric_activations = true\nint16_activations = true\n"
    )
    onnx.save(model, str(src))
    np.savez(npz, **data)
    common = ["--data", str(npz), "--batch-size", "16", "--target-file", str(targets),
              "--target", "a16w8"]  # fmt: skip
    assert main(["debug", str(src), *common, "-o", str(fix), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fallback"] == "int16" and result["ranking"]["fallback"] == "int16"
    assert result["chosen"] == ["L0"] and result["chosen_fix"] == ["int16"]
    assert result["recovered"] >= 0.8
    # every group stays integer: L0 at int16 activations, the other 23 int8
    assert result["int16_nodes_fixed"] == 1
    assert result["int8_nodes_fixed"] + 1 == result["int8_nodes"]
    text = fix.read_text()
    assert tomllib.loads(text)["node"]["L0"] == {"activation_dtype": "int16"}
    assert "keep_float" not in text
    assert "back to int16 activations (1) or float (0)" in text
    assert f"--target-file {targets} --target a16w8 --config" in result["command"]
    out = tmp_path / "fixed.onnx"
    assert main(["quantize", str(src), *common, "--config", str(fix), "-o", str(out), "--quiet",
                 "--no-latency-check"]) == 0  # fmt: skip
    fixed = onnx.load(str(out))
    feeds = [{"x": data["x"][i : i + 16]} for i in range(0, 256, 16)]
    assert output_cosine(model, feeds)(fixed) == pytest.approx(result["fixed"], abs=1e-9)
    assert all(
        n.op_type != "Gemm"
        or all(
            any(p.output[0] == i and p.op_type == "DequantizeLinear" for p in fixed.graph.node)
            for i in n.input[:2]
        )  # fmt: skip
        for n in fixed.graph.node
    )  # every Gemm reads dequantized input and weight: none went float
    zero_points = {
        numpy_helper.to_array(i).dtype for i in fixed.graph.initializer if "zero_point" in i.name
    }
    assert np.dtype(np.int16) in zero_points
    # --fallback float on the same target: keep_float again
    assert main(["debug", str(src), *common, "--fallback", "float", "-o", str(fix),
                 "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result["chosen_fix"] == ["float"] and "keep_float = true" in fix.read_text()


def _swish_after_gemm():
    """x → A (MatMul) → + bias → a; a · 1.0 → m (float: a Mul by a constant is not quantized);
    Sigmoid(m) and a · Sigmoid(m) are int8 (Paddle's swish as exported in RapidOCR), read by
    B. A writes float with its bias folded in (onnxq.post.float_outputs), so the int8 model
    holds ``a`` in float and quantizes it for the swish Mul only. Heavy-tailed inputs and a
    percentile range clip the grids of ``a`` and ``m``."""
    r = rng(3)
    nodes = [
        h.make_node("MatMul", ["x", "WA"], ["p"], name="A"),
        h.make_node("Add", ["p", "BA"], ["a"], name="bias"),
        h.make_node("Mul", ["a", "one"], ["m"], name="times_one"),
        h.make_node("Sigmoid", ["m"], ["s"], name="sigmoid"),
        h.make_node("Mul", ["a", "s"], ["y"], name="swish"),
        h.make_node("MatMul", ["y", "WB"], ["z"], name="B"),
    ]
    inits = {
        "WA": r.normal(0, 0.3, (16, 32)), "BA": r.normal(0, 0.1, 32), "one": np.ones(1),
        "WB": r.normal(0, 0.3, (32, 8)),
    }  # fmt: skip
    inits = {k: v.astype(np.float32) for k, v in inits.items()}
    model = make_model(nodes, [("x", ["N", 4, 16])], [("z", ["N", 4, 8])], inits)
    x = r.standard_t(2, (256, 4, 16)).astype(np.float32)
    return model, {"x": x}


def test_a_float_op_reads_what_the_written_model_gives_it():
    """The float Mul reads ``a`` as the int8 model holds it (float, not rounded and clipped),
    and the cross-check, given the same inputs, does not blame onnxruntime for the grid of
    ``m`` (on RapidOCR it did: 1.4 steps RMS, "the runtimes part first at p2o.Mul.184")."""
    model, data = _swish_after_gemm()
    state = quantize_state(model, data, method="percentile", percentile=99.0, **KW)
    decisions = {d.node: d.quantized for d in build_report(state).decisions}
    assert not decisions["times_one"] and decisions["sigmoid"] and decisions["swish"]
    emulation = emulate(state)
    held = emulation.model
    reader = next(n for n in held.graph.node if n.name == "times_one")
    assert reader.input[0] == "a"  # the FakeQuantize's input, not its output
    feeds = [{"x": data["x"][i : i + 32]} for i in range(0, 128, 32)]
    check = cross_check(emulation, state.quantizer.float_model, state.model, feeds)
    assert check.agrees, check.summary()
    steps = {x.tensor: x.steps for x in check.layers}
    assert max(steps[t] for t in ("a", "m", "s", "y")) < 0.01
    # before materialize (the sequential bias correction's emulation) nothing is held float
    assert held_float(onnx.ModelProto()) == set()
    assert held_float(state.model) == {"a"}


_BROKEN_RUNTIME = '''
import numpy as np
import onnx
from onnx import numpy_helper

from onnxq.io.openvino import openvino_compile

REF = {}


def broken(model):
    """A runtime that miscomputes conv2 whenever conv2 is quantized: relu2's output comes out
    shifted and stretched (the FakeQuantize of r2 with a wrong output range)."""
    prod = {o: n for n in model.graph.node for o in n.output}
    conv = next(n for n in model.graph.node if n.name == "conv2")
    fq = next((n for n in model.graph.node if n.name == "r2/FakeQuantize"), None)
    weights = prod.get(conv.input[1])
    if fq is None or weights is None or weights.op_type != "FakeQuantize":
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    fq = next(n for n in out.graph.node if n.name == "r2/FakeQuantize")
    high = next(i for i in out.graph.initializer if i.name == fq.input[4])
    value = numpy_helper.to_array(high)
    out.graph.initializer.extend([
        numpy_helper.from_array(value * 0.5, "r2/output_low"),
        numpy_helper.from_array(value * 1.5, "r2/output_high"),
    ])
    fq.input[3], fq.input[4] = "r2/output_low", "r2/output_high"
    return out


def agreement(path):
    """Top-1 agreement with fp32 (%) on the test digits, run as the broken runtime runs it."""
    compiled = openvino_compile(broken(onnx.load(path)))
    got = np.concatenate([compiled(x)[compiled.outputs[0]].argmax(1) for x in REF["x"]])
    return 100.0 * float(np.mean(got == REF["labels"]))
'''


def test_debug_returns_first_the_groups_where_the_runtime_parts(tmp_path, monkeypatch):
    """OpenVINO computed nudenet's box-head Convs far from the fake-quantized model (IoU 78%
    against 97% in onnxruntime). The ranking measures the emulation and cannot see it; the
    cross-check can, and debug returns those groups to float first."""
    import importlib
    import sys

    pytest.importorskip("openvino", reason="pip install openvino")
    import onnxq
    from onnxq.tools import debug as debug_module

    model, calib, feeds = _digits()
    (tmp_path / "brokenruntime.py").write_text(_BROKEN_RUNTIME)
    monkeypatch.syspath_prepend(str(tmp_path))
    runtime = importlib.import_module("brokenruntime")
    monkeypatch.setitem(sys.modules, "brokenruntime", runtime)
    fp32 = make_session(model)
    runtime.REF["x"] = [f["input"] for f in feeds]
    runtime.REF["labels"] = np.concatenate([fp32.run(None, f)[0].argmax(1) for f in feeds])
    real = debug_module.cross_check
    monkeypatch.setattr(
        debug_module,
        "cross_check",
        lambda emulation, float_model, target, *a, **k: real(
            emulation, float_model, runtime.broken(target), *a, **k
        ),
    )
    fix = tmp_path / "fix.toml"
    page = tmp_path / "debug.html"
    result = debug_module.debug(
        model,
        calib,
        eval="brokenruntime:agreement",
        target="openvino",
        output=fix,
        budget=0,
        report=page,
    )
    # the report of an OpenVINO model (onnxruntime cannot load it: the report failed on it)
    assert "Cross-runtime check" in page.read_text() and "conv2" in page.read_text()
    assert result.int8 < 95, result.summary()  # the fault costs more than 5 points
    assert result.check.first_part is not None and result.check.first_part.node == "relu2"
    group = next(g for g in result.ranking.groups if "conv2" in g.nodes)
    assert list(result.parted) == [group.node] and result.chosen[0] is group
    assert result.fixed is not None and result.recovered >= 0.8
    assert result.int8_nodes_fixed >= result.int8_nodes - 3  # conv2 with its Relu and pool
    text = fix.read_text()
    assert group.node in tomllib.loads(text)["node"] and "computes it" in text
    assert "runtime parts" in result.summary() and "float first" in result.summary()
    # this metric cannot run the emulation (it looks conv2 up by name): that part is left out
    # with the reason, and the run goes on
    assert any(n.startswith("inputs alone: not measured") for n in result.parts.notes)
    assert result.to_dict()["runtime_parted"] == {
        group.node: pytest.approx(result.parted[group.node])
    }
    # applied by quantize, the config gives the promised figure in the broken runtime
    out = tmp_path / "fixed.onnx"
    q, _ = onnxq.quantize(model, calib, target="openvino", config=str(fix), progress=False)
    onnx.save(q, str(out))
    assert runtime.agreement(str(out)) == pytest.approx(result.fixed)


def test_debug_on_the_openvino_target_measures_its_default_metric_in_openvino(tmp_path):
    """Without --eval, debug's output cosine loaded the FakeQuantize model in onnxruntime,
    which cannot run it: ``onnxq debug --target openvino`` failed on every model."""
    pytest.importorskip("openvino", reason="pip install openvino")
    from onnxq.tools import debug as debug_module

    model, calib, _ = _digits()
    fix = tmp_path / "fix.toml"
    result = debug_module.debug(model, calib, target="openvino", budget=0, output=fix)
    assert result.fp32 == pytest.approx(100.0)
    assert 99.0 < result.int8 < 100.0, result.summary()


def test_quantize_warns_when_openvino_computes_the_model_apart(tmp_path, monkeypatch):
    """quantize --target openvino wrote nudenet's model in silence, though OpenVINO computed its
    output at 14 dB from fp32 where the same model fake-quantized is at 41 dB."""
    import importlib

    pytest.importorskip("openvino", reason="pip install openvino")
    import onnxq
    from onnxq.io.openvino import OpenVINOSession
    from onnxq.passes import check

    model, calib, _ = _digits()
    q, report = onnxq.quantize(model, calib, target="openvino", progress=False)
    assert not [w for w in report.warnings if "OpenVINO" in w], report.warnings
    (tmp_path / "brokenruntime2.py").write_text(_BROKEN_RUNTIME)
    monkeypatch.syspath_prepend(str(tmp_path))
    runtime = importlib.import_module("brokenruntime2")
    monkeypatch.setattr(check, "OpenVINOSession", lambda m: OpenVINOSession(runtime.broken(m)))
    q2, report = onnxq.quantize(model, calib, target="openvino", progress=False)
    warned = [w for w in report.warnings if "in OpenVINO" in w]
    assert len(warned) == 1 and "output 'logits'" in warned[0] and "onnxq debug" in warned[0]
    assert q2.SerializeToString() == q.SerializeToString()  # a warning; the model is the same


def test_the_emulation_holds_no_initializer_it_does_not_read():
    """EfficientNet-Lite1's emulation did not load in onnxruntime ("Failed to find existing
    initializer ….bias/on"): a corrected bias's switch constants stayed in the graph after the
    int32 rounding of the bias took their place, read by no node."""
    from onnxq.io.graph import names_read
    from onnxq.simulate.emulate import FLAGS

    model, calib, _ = _digits()
    state = quantize_state(model, calib, progress=False)
    graph = emulate(state).fixed().graph
    unread = {i.name for i in graph.initializer} - names_read(graph.node) - {FLAGS}
    assert not unread
    assert any(i.name.endswith("/bias/int32") for i in graph.initializer)


def _parts(model, data, **kw):
    from onnxq.fallback import output_cosine
    from onnxq.simulate.loss_parts import float_inputs, loss_parts

    feeds = [{"x": data["x"][i : i + 16]} for i in range(0, 128, 16)]
    state = quantize_state(model, data, **kw)
    metric = output_cosine(model, feeds)
    fp32, int8 = metric(model), metric(state.model)
    assert fp32 == pytest.approx(100.0) and int8 < fp32 - 0.01

    def widened():
        state16 = quantize_state(model, data, activation_dtype="int16", format="qdq", **kw)
        return emulate(state16).fixed()

    return loss_parts(emulate(state), metric, fp32, int8, float_inputs(model), widened)


def test_loss_parts_find_a_fragile_input_in_the_inputs():
    parts = _parts(*_fragile_mlp(), **KW)
    assert parts.rounded_inputs == ("x",)
    assert parts.fp32 - parts.inputs >= 0.8 * parts.loss  # the input's grid alone
    assert parts.fp32 - parts.weights <= 0.1 * parts.loss  # 16-bit activations: nearly fp32
    assert "rounding the inputs (x)" in parts.advice()
    assert "inputs on their 8-bit grid alone" in parts.line()
    # the same int8 model in float arithmetic: on this model the ties move nothing
    assert abs(parts.exact - parts.int8) <= 0.05 * parts.loss and parts.ties() is None
    assert "the same int8 in float arithmetic" in parts.line()


def test_loss_parts_say_when_rounding_ties_move_the_metric():
    from onnxq.simulate.loss_parts import LossParts

    # MobileNetV2's figures: 91.80% with onnxruntime's kernels, 90.82% computed in float
    parts = LossParts(fp32=100.0, int8=91.80, inputs=None, weights=None, exact=90.82)
    assert "moves 0.9800 on rounding ties alone" in parts.ties()
    assert parts.to_dict()["exact"] == 90.82
    assert LossParts(100.0, 91.80, None, None, exact=89.0).ties() is not None
    assert LossParts(100.0, 91.80, None, None, exact=91.5).ties() is None  # < a tenth
    assert LossParts(100.0, 91.80, None, None).ties() is None  # not measured


def test_loss_parts_find_an_outlier_weight_in_the_weights():
    parts = _parts(*_weight_outlier_mlp(), per_channel=False, **KW)
    assert parts.fp32 - parts.weights >= 0.8 * parts.loss  # int16 activations do not help
    assert parts.fp32 - parts.inputs <= 0.1 * parts.loss  # the input's grid is harmless
    assert "int8 weights alone still lose" in parts.advice()


def test_loss_parts_without_a_float_input_or_an_int16_model():
    from onnxq.core.errors import ConfigError
    from onnxq.simulate.loss_parts import loss_parts

    model, data = _fragile_mlp()
    state = quantize_state(model, data, **KW)

    def refused():
        raise ConfigError("this target runs no int16 activations")

    parts = loss_parts(emulate(state), lambda m: 90.0, 100.0, 80.0, set(), refused)
    assert parts.inputs is None and parts.weights is None and parts.advice() is None
    assert parts.notes == (
        "no float input is read on an 8-bit grid",
        "int16 activations: not measured (this target runs no int16 activations)",
    )
    assert parts.to_dict()["inputs"] is None and "-" in parts.line()
    assert parts.exact == 90.0  # the emulation with every switch on, as the metric scored it


def test_the_noise_is_the_metric_apart_between_two_calibrations_on_the_halves():
    import onnxq
    from onnxq.fallback import output_cosine
    from onnxq.tools.debug import calibration_noise

    model, data = _deep_fragile_mlp()
    feeds = [{"x": data["x"][i : i + 16]} for i in range(0, 256, 16)]
    metric = output_cosine(model, feeds)
    kw = {"progress": False}
    even, _ = onnxq.quantize(model, feeds[0::2], **kw)
    odd, _ = onnxq.quantize(model, feeds[1::2], **kw)
    noise = calibration_noise(model, feeds, metric, kw)
    assert noise == pytest.approx(abs(metric(even) - metric(odd)), abs=1e-12)
    assert calibration_noise(model, feeds[:1], metric, kw) is None


def test_a_loss_within_the_noise_is_nothing_to_fix(tmp_path, monkeypatch):
    from onnxq.tools import debug as debug_module

    model, data = _deep_fragile_mlp()
    monkeypatch.setattr(debug_module, "calibration_noise", lambda *a: 1e9)
    fix = tmp_path / "fix.toml"
    result = debug_module.debug(model, data, output=fix, batch_size=16, budget=5)
    assert result.loss > 0 and result.fixed is None and not fix.exists()
    assert result.steps[1:] == []  # no bisection ran
    assert "within the noise" in result.summary()


def test_a_fix_slower_than_fp32_says_so(tmp_path, monkeypatch):
    from onnxq.tools import debug as debug_module

    model, data = _deep_fragile_mlp()

    # every int8 model measured slower than fp32 (the float model has no QuantizeLinear)
    def fake_ms(m, feeds):
        return 5.0 if any(n.op_type == "QuantizeLinear" for n in m.graph.node) else 1.0

    monkeypatch.setattr(debug_module, "latency_ms", fake_ms)
    result = debug_module.debug(model, data, output=tmp_path / "fix.toml", batch_size=16)
    assert result.chosen and result.fixed_ms == 5.0
    line = next(x for x in result.summary().splitlines() if x.startswith("speed:"))
    assert "slower than fp32's" in line and result.to_dict()["fp32_ms"] == 1.0


def test_an_eval_that_cannot_be_loaded_is_refused_before_any_data_is_read(tmp_path, monkeypatch):
    from onnxq.core.errors import ConfigError
    from onnxq.tools.debug import debug

    model, data = _fragile_mlp()
    monkeypatch.chdir(tmp_path)
    read = []

    def batches():
        read.append(1)
        yield {"x": data["x"][:16]}

    with pytest.raises(ConfigError, match="eval 'nowhere:score': cannot import module"):
        debug(model, batches(), eval="nowhere:score", output=tmp_path / "fix.toml")
    assert not read and not (tmp_path / "fix.toml").exists()
