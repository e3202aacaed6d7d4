"""The recipe chosen on held-back calibration batches (onnxq.passes.choose)."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from helpers import make_model, rng, run
from onnx import helper as h

import onnxq
from onnxq.calibrate.dataset import ArrayDataset, HeldBack
from onnxq.calibrate.sources import as_dataset
from onnxq.core.errors import ConfigError
from onnxq.passes import choose as choose_module
from onnxq.simulate.heldback import beats, gain


def _cnn(samples: int = 64):
    """Conv → Relu → Conv → Relu → GlobalAveragePool → Gemm, on inputs with a few outliers."""
    r = rng(11)
    nodes = [
        h.make_node("Conv", ["x", "W1", "B1"], ["y1"], "c1", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["y1"], ["r1"], "relu1"),
        h.make_node("Conv", ["r1", "W2", "B2"], ["y2"], "c2", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["y2"], ["r2"], "relu2"),
        h.make_node("GlobalAveragePool", ["r2"], ["p"], "pool"),
        h.make_node("Flatten", ["p"], ["f"], "flat"),
        h.make_node("Gemm", ["f", "W3", "B3"], ["logits"], "fc", transB=1),
    ]
    inits = {
        "W1": r.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "B1": r.normal(0, 0.1, 8).astype(np.float32),
        "W2": r.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32),
        "B2": r.normal(0, 0.1, 8).astype(np.float32),
        "W3": r.normal(0, 0.3, (5, 8)).astype(np.float32),
        "B3": r.normal(0, 0.1, 5).astype(np.float32),
    }
    model = make_model(nodes, [("x", ["N", 3, 12, 12])], [("logits", None)], inits)
    x = r.normal(0, 1, (samples, 3, 12, 12)).astype(np.float32)
    x[:, :, 0, 0] *= 4  # a corner of outliers: the MSE and MinMax ranges differ
    return model, {"x": x}


def test_every_eighth_batch_is_held_back_and_never_fitted_on():
    data = {"x": np.arange(40, dtype=np.float32).reshape(40, 1)}
    ds = HeldBack(as_dataset(data, None), 8)
    fitted = [int(f["x"][0, 0]) for f in ds.batches()]
    held = [int(f["x"][0, 0]) for f in ds.held()]
    assert held == [7, 15, 23, 31, 39]
    assert sorted(fitted + held) == list(range(40)) and not set(fitted) & set(held)
    assert ds.num_batches() == 35 and len(fitted) == 35
    ds.reset()
    assert [int(f["x"][0, 0]) for f in ds.batches()] == fitted  # the same split on every read


def test_the_default_chooses_on_held_back_batches_and_reports_every_candidate():
    model, data = _cnn()
    q, report = onnxq.quantize(model, data, progress=False)
    choice = report.choice
    assert choice["held_back_batches"] == 8 and choice["held_back_samples"] == 8
    assert report.calibration.samples == 56  # the held-back samples are not calibrated on
    names = [c["recipe"] for c in choice["candidates"]]
    assert names[0] == choice["auto"] == "mse/optimized/sequential"
    assert {
        "minmax/optimized/fast",
        "percentile/optimized/fast",
        "mse/nearest/fast",
        "mse/optimized/none",
    } <= set(names)
    assert not any(n.startswith("entropy/") for n in names)
    assert len(names) == len(set(names)) and choice["chosen"] in names
    auto = choice["candidates"][0]
    assert auto["vs_auto_db"] == 0.0 and all(c["seconds"] > 0 for c in choice["candidates"])
    best = max(choice["candidates"], key=lambda c: c["sqnr_db"])
    chosen = next(c for c in choice["candidates"] if c["recipe"] == choice["chosen"])
    # the choice: the best candidate when it is above auto's pick by more than the noise
    if best["vs_auto_db"] > best["noise_db"]:
        assert chosen is best
    else:
        assert chosen is auto
    assert "recipe: " in report.summary()
    assert any(p.name == "choose" for p in report.passes)
    assert isinstance(model, onnx.ModelProto)


def test_every_pass_a_candidate_runs_hands_its_freed_memory_back(monkeypatch):
    """As the pass manager does after each pass: the sequential correction's held tensors
    went back only after the whole choice (EfficientNet-Lite1 peaked at 595 MiB, 521 now)."""
    handed: list[str] = []
    monkeypatch.setattr(choose_module, "release_shared_arena", lambda: handed.append("arena"))
    monkeypatch.setattr(choose_module, "trim_heap", lambda: handed.append("heap"))
    model, data = _cnn()
    _, report = onnxq.quantize(model, data, progress=False)
    # every candidate runs the solve at least: one hand-back (arena, then heap) a pass each
    rounds = len(handed) // 2
    assert rounds >= len(report.choice["candidates"]) and handed == ["arena", "heap"] * rounds


def test_the_report_lists_every_read_of_the_data_and_why():
    """One calibration stream feeds ranges, Hessians and the correction's float sums; the
    sequential correction reads the first samples once more (a candidate of the choice), and
    a layerwise correction needs the solved grids: one more stream, said so."""
    model, data = _cnn()
    _, report = onnxq.quantize(model, data, progress=False)
    reads = report.data_reads
    assert reads[0]["pass"] == "calibrate" and reads[0]["batches"] == 56
    assert "Hessians" in reads[0]["why"] and "sequential bias correction" in reads[0]["why"]
    assert [r["pass"] for r in reads[1:]] == [
        "bias-correction (candidate mse/optimized/sequential)"
    ]
    assert reads[1]["batches"] == 56  # the first 64 samples of the 56 fitted on: all of them
    assert report.to_dict()["data_reads"] == reads
    assert "data read 2 time(s):" in report.summary(verbose=True)
    _, pinned = onnxq.quantize(
        model, data, progress=False, recipe="fixed", bias_correction="layerwise"
    )
    assert [(r["pass"], r["batches"]) for r in pinned.data_reads] == [
        ("calibrate", 64),
        ("bias-correction", 64),
    ]
    assert "solved int8 grids" in pinned.data_reads[1]["why"]


def test_outputs_fp32_computes_as_nan_are_left_out_of_the_scores():
    """A second output that is NaN wherever the input is negative (a float Sqrt, the same in
    both models): every candidate still has a finite score, and the choice a reason."""
    model, data = _cnn()
    g = model.graph
    g.node.append(h.make_node("Sqrt", ["x"], ["root"], "root"))
    g.output.append(h.make_tensor_value_info("root", onnx.TensorProto.FLOAT, ["N", 3, 12, 12]))
    _, report = onnxq.quantize(model, data, progress=False)
    scores = [c["sqnr_db"] for c in report.choice["candidates"]]
    assert all(np.isfinite(scores)) and min(scores) > 10
    assert "nan" not in report.summary()
    hole = next(w for w in report.warnings if w.startswith("fp32's output 'root'"))
    assert "left out of every SQNR" in hole and "is NaN or ±Inf in" in hole


def test_the_score_is_what_onnxruntime_computes_from_the_written_model():
    # the held-back score of the chosen candidate is the written QDQ model's own output SQNR
    model, data = _cnn()
    q, report = onnxq.quantize(model, data, progress=False, format="qdq")
    held = {"x": data["x"][7::8]}
    ref, got = run(model, held)[0], run(q, held)[0]
    per_sample = [
        -10 * np.log10(np.sum((g - r) ** 2) / np.sum(r**2)) for g, r in zip(got, ref, strict=True)
    ]
    chosen = next(c for c in report.choice["candidates"] if c["recipe"] == report.choice["chosen"])
    assert abs(float(np.mean(per_sample)) - chosen["sqnr_db"]) < 0.5


def test_fewer_than_32_batches_fit_on_all_and_say_why():
    model, data = _cnn(24)
    q, report = onnxq.quantize(model, data, progress=False)
    assert "24 calibration batches" in report.choice["skipped"]
    assert "recipe: not chosen on held-back samples (24 calibration batches" in report.summary(
        verbose=True
    )
    assert report.calibration.samples == 24
    fixed, _ = onnxq.quantize(model, data, progress=False, recipe="fixed")
    assert q.SerializeToString() == fixed.SerializeToString()


def test_a_pinned_recipe_is_its_three_options_fitted_on_every_batch():
    model, data = _cnn()
    pinned, report = onnxq.quantize(model, data, progress=False, recipe="minmax/nearest/fast")
    same, _ = onnxq.quantize(
        model,
        data,
        progress=False,
        method="minmax",
        rounding="nearest",
        bias_correction="fast",
    )
    assert pinned.SerializeToString() == same.SerializeToString()
    assert report.calibration.samples == 64 and "pinned by" in report.choice["skipped"]


def test_a_bad_recipe_names_the_option_and_the_choices(tmp_path):
    model, data = _cnn()
    with pytest.raises(ConfigError, match=r"recipe='mse/rounded/fast' is unknown.*nearest"):
        onnxq.quantize(model, data, progress=False, recipe="mse/rounded/fast")
    from onnxq.cli import main

    src, npz = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(model, str(src))
    np.savez(npz, **data)
    code = main(["quantize", str(src), "--data", str(npz), "-o", str(tmp_path / "q.onnx"),
                 "--recipe", "best"])  # fmt: skip
    assert code == 2 and not (tmp_path / "q.onnx").exists()


def test_minmax_read_from_the_histograms_equals_the_minmax_method():
    # the MinMax candidate costs no stream of its own: its ranges are the MSE histograms'
    # exact extremes, the same values the minmax method calibrates
    model, data = _cnn()
    kw = dict(progress=False, rounding="nearest", bias_correction="none")
    a, ra = onnxq.quantize(model, data, recipe="minmax/nearest/none", **kw)
    b, rb = onnxq.quantize(model, ArrayDataset(data), method="minmax", recipe="fixed", **kw)
    assert a.SerializeToString() == b.SerializeToString()
    _, searched = onnxq.quantize(model, data, **kw)
    # the search saw the same MinMax ranges on 7/8 of the data, and chose or not on evidence
    assert "minmax/nearest/none" in [c["recipe"] for c in searched.choice["candidates"]]


def _fake_scores(monkeypatch, scores):
    """Score each candidate by its recipe name, from ``scores``."""
    monkeypatch.setattr(choose_module, "emulate", lambda s, **_: s)
    monkeypatch.setattr(
        choose_module, "sqnr", lambda s, held, refs: np.asarray(scores(s.options.recipe, held))
    )


def test_a_candidate_replaces_auto_only_above_the_noise(monkeypatch):
    model, data = _cnn()
    noise = rng(3).normal(0, 1, 8)

    def clear(name, held):  # nearest rounding: 2 dB better on every held-back batch
        return 20 + noise + (2.0 if "/nearest/" in name else 0.0)

    _fake_scores(monkeypatch, clear)
    _, report = onnxq.quantize(model, data, progress=False)
    assert report.choice["chosen"] == "mse/nearest/fast"  # the best of those with nearest
    assert report.choice["why"].startswith("above auto's pick")

    def unclear(name, held):  # better on average, by less than the batches' spread shows
        spread = rng(4).normal(0, 3, 8)
        return 20 + noise + (0.5 + spread if "/nearest/" in name else 0.0)

    _fake_scores(monkeypatch, unclear)
    _, report = onnxq.quantize(model, data, progress=False)
    assert report.choice["chosen"] == report.choice["auto"]
    assert "within the noise" in report.summary()


def test_gain_and_noise_are_the_paired_mean_and_twice_its_standard_error():
    a = np.array([10.0, 11.0, 12.0, 13.0])
    b = a - np.array([1.0, 2.0, 1.0, 2.0])
    mean, noise = gain(a, b)
    assert mean == pytest.approx(1.5)
    assert noise == pytest.approx(2 * np.std([1, 2, 1, 2], ddof=1) / 2)
    assert beats(a, b) and not beats(b, a)
    assert not beats(a[:1], b[:1])  # one batch: nothing is above its noise


def test_the_check_after_quantizing_runs_on_the_held_back_batches(monkeypatch):
    from onnxq.simulate import checks

    seen = []
    real = checks.accuracy_warnings

    def spy(float_model, model, feeds, session, outputs, advice=None):
        seen.append((feeds, outputs))
        return real(float_model, model, feeds, session, outputs, advice)

    monkeypatch.setattr(checks, "accuracy_warnings", spy)
    model, data = _cnn()
    onnxq.quantize(model, data, progress=False)
    feeds, outputs = seen[-1]
    held = data["x"][7::8][: len(feeds)]
    assert len(feeds) == 4 and all(np.array_equal(f["x"][0], x) for f, x in zip(feeds, held))
    assert np.allclose(outputs[0]["logits"], run(model, {"x": held[:1]})[0], atol=1e-5)


def test_the_first_batches_fp32_outputs_are_kept_only_where_nothing_is_held_back(monkeypatch):
    import onnxq.passes.calibrate as calibrate_pass

    made = []
    real = calibrate_pass.Calibrator

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(calibrate_pass, "Calibrator", spy)
    model, data = _cnn()
    _, report = onnxq.quantize(model, data, progress=False)
    assert report.choice["chosen"] and made[-1].reference == []  # the check reads held-back
    _, report = onnxq.quantize(model, data, progress=False, recipe="fixed")
    assert len(made[-1].reference) == 4  # no held-back batches: the check reads these


def test_the_verification_session_keeps_no_memory_arena():
    from onnxq.passes.verify import verify

    model, data = _cnn()
    q, _ = onnxq.quantize(model, data, progress=False, recipe="fixed")
    assert not verify(q).get_session_options().enable_cpu_mem_arena


def test_a_loaded_range_table_with_data_fits_on_every_batch(tmp_path):
    model, data = _cnn()
    table = tmp_path / "ranges.json"
    first, _ = onnxq.quantize(model, data, progress=False, recipe="fixed", save_ranges=table)
    again, report = onnxq.quantize(model, data, progress=False, load_ranges=table)
    # the table sets the ranges: no split, no candidates (MinMax from histograms never made)
    assert "load_ranges given" in report.choice["skipped"] and again.graph.node


def _metric_module(tmp_path, monkeypatch, model) -> None:
    """``choicemetric``: evaluations of a written model on 64 samples of its own.

    ``errors`` scores each sample by its squared output error (so the *worst* model wins: a
    choice SQNR would never make), ``worst`` is their mean, ``constant`` gives every model 1.
    """
    onnx.save(model, str(tmp_path / "float.onnx"))
    np.save(tmp_path / "eval.npy", rng(5).normal(0, 1, (64, 3, 12, 12)).astype(np.float32))
    (tmp_path / "choicemetric.py").write_text(
        "import numpy as np, onnxruntime as ort\n"
        "def errors(path):\n"
        "    x = np.load('eval.npy')\n"
        "    f = ort.InferenceSession('float.onnx').run(None, {'x': x})[0]\n"
        "    q = ort.InferenceSession(path).run(None, {'x': x})[0]\n"
        "    return ((f - q) ** 2).mean(axis=1)\n"
        "def worst(path):\n"
        "    return float(errors(path).mean())\n"
        "def constant(path):\n"
        "    return 1\n"
        "def table(path):\n"
        "    return [[1.0, 2.0]]\n"
        "def nan(path):\n"
        "    return float('nan')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_your_metric_scores_each_candidate_as_the_model_it_writes(tmp_path, monkeypatch):
    model, data = _cnn()
    _metric_module(tmp_path, monkeypatch, model)
    q, report = onnxq.quantize(model, data, progress=False, metric="choicemetric:worst")
    choice = report.choice
    rows = {c["recipe"]: c for c in choice["candidates"]}
    assert choice["metric"] == "choicemetric:worst" and len(rows) >= 5
    assert all(r["metric_noise"] is None for r in rows.values())  # one number: noise unknown
    # the metric decides, not the held-back SQNR: the candidate with the largest error wins
    best = max(rows.values(), key=lambda r: r["metric"])
    assert choice["chosen"] == best["recipe"] != choice["auto"]
    assert all(r["sqnr_db"] is None for r in rows.values())  # nothing held back
    # and the model written is the one that was scored
    import choicemetric

    out = tmp_path / "q.onnx"
    onnx.save(q, str(out))
    assert choicemetric.worst(str(out)) == pytest.approx(best["metric"], rel=0, abs=0)
    line = next(x for x in report.summary().splitlines() if x.startswith("recipe: "))
    assert "by choicemetric:worst" in line and "noise unknown" in line


def test_per_sample_scores_are_judged_against_their_noise(tmp_path, monkeypatch):
    model, data = _cnn()
    _metric_module(tmp_path, monkeypatch, model)
    _, report = onnxq.quantize(model, data, progress=False, metric="choicemetric:errors")
    rows = report.choice["candidates"]
    auto = rows[0]
    assert auto["metric_vs_auto"] == 0.0
    for r in rows[1:]:
        assert r["metric_noise"] is not None and r["metric_noise"] > 0
    best = max(rows, key=lambda r: r["metric"])
    if best["metric_vs_auto"] > best["metric_noise"]:
        assert report.choice["chosen"] == best["recipe"]
    else:
        assert report.choice["chosen"] == auto["recipe"]


def test_a_metric_that_cannot_tell_the_candidates_apart_writes_auto_s_pick(tmp_path, monkeypatch):
    """Finishing every candidate into a model leaves nothing behind in the pipeline's state."""
    model, data = _cnn()
    _metric_module(tmp_path, monkeypatch, model)
    default, _ = onnxq.quantize(model, data, progress=False, recipe="fixed")
    q, report = onnxq.quantize(model, data, progress=False, metric="choicemetric:constant")
    assert report.choice["chosen"] == report.choice["auto"]
    assert q.SerializeToString() == default.SerializeToString()


def test_a_metric_the_choice_cannot_use_is_refused_or_reported(tmp_path, monkeypatch):
    model, data = _cnn()
    _metric_module(tmp_path, monkeypatch, model)
    for pinned, words in (
        ({"recipe": "fixed"}, "recipe='fixed' pins one recipe"),
        ({"budget": 60}, "budget turns the choice off"),
        (
            {"method": "minmax", "rounding": "nearest", "bias_correction": "fast"},
            "all set",
        ),
    ):
        with pytest.raises(ConfigError, match=rf"metric scores the recipe choice.*{words}"):
            onnxq.quantize(model, data, progress=False, metric="choicemetric:worst", **pinned)
    for bad, words in (("table", r"\[\[1.0, 2.0\]\]"), ("nan", "nan")):
        expected = rf"metric 'choicemetric:{bad}' returned {words}; it must"
        with pytest.raises(ConfigError, match=expected):
            onnxq.quantize(model, data, progress=False, metric=f"choicemetric:{bad}")
    # data that can be read once only (the candidates read it again): said, not ignored
    once = iter([{"x": data["x"][i : i + 1]} for i in range(40)])
    _, report = onnxq.quantize(model, once, progress=False, metric="choicemetric:worst")
    assert any("metric was not used" in w and "read once only" in w for w in report.warnings)
    from onnxq.cli import main

    npz = tmp_path / "d.npz"
    np.savez(npz, **data)
    code = main(["quantize", "float.onnx", "--data", str(npz), "-o", "q.onnx",
                 "--metric", "choicemetric:worst", "--recipe", "fixed"])  # fmt: skip
    assert code == 2 and not (tmp_path / "q.onnx").exists()


def test_scored_by_your_metric_nothing_is_held_back(tmp_path, monkeypatch):
    """Your metric reads its own data: every candidate fits on every batch, even 16 of them."""
    model, data = _cnn(16)
    _metric_module(tmp_path, monkeypatch, model)
    _, report = onnxq.quantize(model, data, progress=False, metric="choicemetric:worst")
    assert report.choice["held_back_batches"] == 0 and report.calibration.samples == 16
    assert all(c["sqnr_db"] is None for c in report.choice["candidates"])
    assert report.choice["chosen"] != report.choice["auto"]
    _, report = onnxq.quantize(model, data, progress=False)
    assert "16 calibration batches, fewer than the 32" in report.choice["skipped"]


def test_a_bar_names_the_pass_and_the_candidate_under_way(capsys):
    """After calibrating, the rounding, corrections and candidates took 10-36 s without a word."""
    model, data = _cnn()
    onnxq.quantize(model, data, progress=True)
    err = capsys.readouterr().err
    assert "quantizing" in err and re.search(r"\d+/\d+ ", err) and "step" in err
    assert "choosing the recipe" in err and "minmax/optimized/fast" in err


def test_from_python_the_metric_may_be_the_function_itself(tmp_path, monkeypatch):
    model, data = _cnn()
    _metric_module(tmp_path, monkeypatch, model)
    import choicemetric

    calls = []

    def worst(path):
        calls.append(path)
        return choicemetric.worst(path)

    by_function, report = onnxq.quantize(model, data, progress=False, metric=worst)
    by_name, _ = onnxq.quantize(model, data, progress=False, metric="choicemetric:worst")
    assert by_function.SerializeToString() == by_name.SerializeToString()
    assert report.choice["metric"].endswith(
        ":test_from_python_the_metric_may_be_the_function_itself.<locals>.worst"
    )
    assert len(calls) == len(report.choice["candidates"])
    import json

    json.dumps(report.to_dict())  # the report names the function, it does not hold it
    with pytest.raises(ConfigError, match="metric is a int; give 'module:function' or a function"):
        onnxq.quantize(model, data, progress=False, metric=3)


def test_a_metric_that_cannot_be_loaded_is_refused_before_any_data_is_read(tmp_path, monkeypatch):
    model, data = _cnn()
    monkeypatch.chdir(tmp_path)
    read = []

    def batches():
        read.append(1)
        yield from ({"x": data["x"][i : i + 1]} for i in range(40))

    with pytest.raises(ConfigError, match="metric 'nowhere:score': cannot import module"):
        onnxq.quantize(model, batches(), progress=False, metric="nowhere:score")
    assert not read


def test_a_metric_failing_on_fakequantize_models_is_told_what_they_are(tmp_path, monkeypatch):
    model, data = _cnn()
    _metric_module(tmp_path, monkeypatch, model)
    with pytest.raises(ConfigError, match="openvino models: run them with OpenVINO"):
        onnxq.quantize(model, data, progress=False, metric="choicemetric:worst", format="openvino")
