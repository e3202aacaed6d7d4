"""``budget``: default algorithms that do not fit in the time given are left out, and said so."""

import subprocess
import sys

import numpy as np
import pytest
from test_transformer import _encoder, _padded

import onnxq
from onnxq.core.errors import ConfigError
from onnxq.demo import demo_files
from onnxq.passes import budget as budget_pass


def _digits(n: int = 32):
    path, data = demo_files()
    return str(path), {"input": data["calib"][:n]}


def _bytes(model) -> bytes:
    return model.SerializeToString(deterministic=True)


def test_a_generous_budget_keeps_every_default_and_changes_nothing():
    path, calib = _digits()
    # a budget fixes the recipe (the held-back search is not budgeted): fixed here too
    plain, _ = onnxq.quantize(path, calib, progress=False, recipe="fixed")
    q, report = onnxq.quantize(path, calib, progress=False, budget=1e6)
    assert _bytes(q) == _bytes(plain)
    assert report.budget["kept"] == ["bias-correction", "rounding"]
    assert report.budget["left_out"] == []
    assert report.budget["float_pass_seconds"] > 0
    assert "sequential" in report.algorithms["bias-correction"]
    assert "every default algorithm fit" in report.summary(verbose=True)
    assert [r["pass"] for r in report.data_reads][:2] == ["budget", "calibrate"]
    assert report.data_reads[0]["batches"] == 1


def test_a_tight_budget_leaves_the_costly_defaults_out_as_if_the_cheap_ones_were_asked():
    path, calib = _digits()
    # a budget fixes the recipe (the held-back search is not budgeted): fixed here too
    cheap, _ = onnxq.quantize(
        path, calib, progress=False, rounding="nearest", bias_correction="fast", recipe="fixed"
    )
    q, report = onnxq.quantize(path, calib, progress=False, budget=0.001)
    assert _bytes(q) == _bytes(cheap)
    assert report.budget["left_out"] == ["bias-correction", "rounding"]
    assert report.algorithms["rounding"].startswith("off (auto, over the 0.001 s budget")
    assert (
        "fast (sequential left out: over the 0.001 s budget" in report.algorithms["bias-correction"]
    )
    assert not any("sqnr_db" in v for v in report.rounding.values())
    line = next(x for x in report.summary(verbose=True).splitlines() if x.startswith("budget"))
    assert (
        "left out bias-correction, rounding (bias_correction='sequential' "
        "rounding='optimized' to run them anyway)" in line
    )


def test_an_algorithm_asked_for_by_name_runs_whatever_the_budget():
    path, calib = _digits()
    q, report = onnxq.quantize(path, calib, progress=False, budget=0.001, rounding="optimized")
    assert report.budget["asked"] == ["rounding"]
    assert report.budget["left_out"] == ["bias-correction"]
    assert any("sqnr_db" in v for v in report.rounding.values())


def test_smoothquant_is_weighed_on_a_transformer():
    model = _encoder(outlier=40.0)
    calib = _padded(6, 1)
    off, _ = onnxq.quantize(model, calib, progress=False, smoothquant="off", rounding="nearest")
    q, report = onnxq.quantize(model, calib, progress=False, budget=0.001)
    assert report.budget["wanted"] == ["smoothquant", "rounding"]
    assert report.budget["left_out"] == ["smoothquant", "rounding"]
    assert not report.smoothing
    assert _bytes(q) == _bytes(off)
    _, full = onnxq.quantize(model, calib, progress=False, budget=1e6)
    assert full.budget["kept"] == ["smoothquant", "rounding"] and full.smoothing


def test_the_estimates_follow_the_measured_float_pass(monkeypatch):
    """Kept in priority order while they fit: with a 1 s float pass, 11 s leaves room for the
    required steps (calibration 4 passes + 1 + 1 s) and for neither the sequential bias
    correction (6 passes: the 32 samples are within its 64) nor rounding (5.5)."""
    path, calib = _digits()
    monkeypatch.setattr(budget_pass, "pass_seconds", lambda state: (1.0, "as set by the test"))
    _, report = onnxq.quantize(path, calib, progress=False, budget=11.0)
    plan = report.budget
    assert plan["reserved_seconds"] == 6.0
    assert plan["estimates"] == {"bias-correction": 6.0, "rounding": 5.5}
    assert plan["left_out"] == ["bias-correction", "rounding"]
    # MinMax calibrates in 3 passes: room for the bias correction, not for rounding after it
    _, report = onnxq.quantize(path, calib, progress=False, budget=12.5, method="minmax")
    plan = report.budget
    assert plan["reserved_seconds"] == 5.0 and plan["kept"] == ["bias-correction"]
    assert 11.0 <= plan["estimated_seconds"] <= 12.5
    _, report = onnxq.quantize(path, calib, progress=False, budget=19.0, method="minmax")
    assert report.budget["kept"] == ["bias-correction", "rounding"]


def test_the_sequential_estimate_counts_only_the_samples_it_runs(monkeypatch):
    path, _ = _digits()
    _, data = demo_files()
    calib = {"input": data["calib"]}  # 200 samples
    timed = budget_pass.pass_seconds  # opens the data, whose length sets the share

    def one_second(state):
        timed(state)
        return 1.0, "as set by the test"

    monkeypatch.setattr(budget_pass, "pass_seconds", one_second)
    _, report = onnxq.quantize(path, calib, progress=False, budget=1e6, rounding="nearest")
    assert report.budget["estimates"] == {"bias-correction": 6.0 * 64 / 200}


def test_data_of_unknown_length_runs_every_default_and_says_why():
    path, calib = _digits(8)

    # one-shot data cannot be read again: the sequential correction falls back to fast
    def feeds():
        return iter([{"input": calib["input"][i : i + 1]} for i in range(8)])

    # the same one-shot source with the fast correction asked for: the Hessians' rows depend
    # on how the data is batched (a batch of unknown count gives up to row_cap() of them)
    plain, _ = onnxq.quantize(path, feeds(), progress=False, bias_correction="fast")
    q, report = onnxq.quantize(path, feeds(), progress=False, budget=0.001)
    assert "one-shot data source" in report.budget["note"]
    assert "fast (the data cannot be read again)" in report.algorithms["bias-correction"]
    assert any("sqnr_db" in v for v in report.rounding.values())
    assert _bytes(q) == _bytes(plain)


def test_the_fallback_trials_repeat_the_first_plan():
    path, calib = _digits()
    _, report = onnxq.quantize(path, calib, progress=False, budget=0.001, max_drop=100.0)
    assert report.budget["left_out"] == ["bias-correction", "rounding"]
    assert report.algorithms["rounding"].startswith("off (auto, over the")


@pytest.mark.parametrize("bad", [0, -1, float("nan"), True, "10"])
def test_a_bad_budget_is_refused(bad):
    path, calib = _digits(4)
    with pytest.raises(ConfigError, match=r"budget=.* must be a number of seconds > 0"):
        onnxq.quantize(path, calib, progress=False, budget=bad)


def test_cli(tmp_path):
    path, calib = _digits(16)
    data = tmp_path / "calib.npz"
    np.savez(data, **calib)
    out = tmp_path / "q.onnx"
    base = [sys.executable, "-m", "onnxq.cli", "quantize", path, "-o", str(out)]
    base += ["--data", str(data)]
    r = subprocess.run(base + ["--budget", "0.001"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (
        "left out bias-correction, rounding (--bias-correction sequential --rounding optimized "
        "to run them anyway)" in r.stdout
    )
    r = subprocess.run(base + ["--budget", "-3"], capture_output=True, text=True)
    assert r.returncode == 2 and "--budget -3.0 must be a number of seconds > 0" in r.stderr
    assert "Traceback" not in r.stderr
