"""The benchmarks run: exposure_cost times the tensors calibration observes (its rows)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN, make_model
from onnx import helper as oh

import onnxq

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path, *extra):
    model = onnx.load(str(DIGITS_CNN))
    dims = [d.dim_value or 1 for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(0).uniform(0, 1, (12, *dims[1:])).astype(np.float32)
    np.savez(tmp_path / "calib.npz", **{model.graph.input[0].name: x})
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.exposure_cost",
            str(DIGITS_CNN),
            "--data",
            str(tmp_path / "calib.npz"),
            "--samples",
            "8",
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


def test_exposure_cost_times_the_tensors_of_a_real_pass(tmp_path):
    head, *rows = _run(tmp_path)
    observed = int(head.split(" tensors observed")[0].split()[-1])
    assert "8 feeds" in head and observed > 0  # the names of the pass were caught
    labels = [r.strip().split("  ")[0] for r in rows[1:]]
    assert labels == [
        "floor, 1 thread",
        "exposed, 1 thread",
        "reduced, 1 thread",
        "exposed, default threads",
        "reduced, default threads",
        "exposed, 2 runs of 1 thread",
        "floor, 1 thread, no layout transforms",
        "exposed, 1 thread, no layout transforms",
    ]
    assert all("x the floor" in r for r in rows[1:])


def test_exposure_cost_times_openvino_on_the_same_tensors(tmp_path):
    pytest.importorskip("openvino", reason="pip install openvino")
    head, *rows = _run(tmp_path, "--openvino")
    labels = [r.strip().split("  ")[0] for r in rows[1:]]
    assert labels[-3:] == ["OpenVINO floor", "OpenVINO exposed", "OpenVINO reduced"]
    assert all("x the floor" in r for r in rows[-3:])


def _whole_process(tmp_path, *variants):
    data = np.load(ROOT / "onnxq" / "demo" / "digits.npz")
    np.savez(tmp_path / "calib.npz", input=(data["calib"][:8] / 16.0).astype(np.float32))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.whole_process", "--model", str(DIGITS_CNN)]
        + ["--data", str(tmp_path / "calib.npz"), "--rounds", "1", "--variants", *variants],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [r.split("|")[1:-1] for r in done.stdout.strip().splitlines()[2:]]
    return {cells[1].strip(): [c.strip() for c in cells] for cells in rows}


def test_whole_process_times_each_variant_in_a_process_of_its_own(tmp_path):
    rows = _whole_process(tmp_path, "onnxq", "onnxq-nearest", "ort")
    assert set(rows) == {"onnxq", "onnxq-nearest", "ort"}
    for cells in rows.values():
        wall, peak = float(cells[2].split()[0]), float(cells[3].split()[0])
        assert wall > 0 and peak > 50  # a whole Python process with numpy and onnxruntime
        assert cells[4] == "–"  # no NNCF row to compare with


def test_whole_process_reads_batches_of_different_shapes_from_a_folder(tmp_path):
    # a padded-batch encoder's batches differ in sequence length: they cannot be one .npz
    r = np.random.default_rng(0)
    nodes = [oh.make_node("MatMul", ["x", "w"], ["m"]), oh.make_node("Relu", ["m"], ["y"])]
    inits = {"w": r.normal(0, 1, (8, 4)).astype(np.float32)}
    model = make_model(nodes, [("x", ["n", "seq", 8])], [("y", ["n", "seq", 4])], inits)
    onnx.save(model, tmp_path / "m.onnx")
    folder = tmp_path / "batches"
    folder.mkdir()
    for i, length in enumerate((3, 5, 7)):
        np.savez(folder / f"{i}.npz", x=r.normal(0, 1, (2, length, 8)).astype(np.float32))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.whole_process", "--model", str(tmp_path / "m.onnx")]
        + ["--data", str(folder), "--rounds", "1", "--variants", "onnxq", "ort"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = done.stdout.strip().splitlines()[2:]
    assert len(rows) == 2 and not any("failed" in row for row in rows), done.stdout


def test_whole_process_compares_with_nncf(tmp_path):
    pytest.importorskip("nncf", reason='pip install -e ".[bench]"')
    rows = _whole_process(tmp_path, "onnxq", "nncf")
    assert rows["nncf"][4] == "1.00×" and rows["onnxq"][4].endswith("×")


def test_the_fastest_variant_at_least_as_good_as_nncf_respects_the_metric_direction():
    from benchmarks.whole_process import fastest_as_good

    walls = {"onnxq": 9.0, "onnxq-nearest": 4.0, "nncf": 6.0}
    higher = {"onnxq": 92.0, "onnxq-nearest": 90.0, "nncf": 90.0}  # a tie counts
    assert fastest_as_good(walls, higher, True) == "onnxq-nearest"
    assert fastest_as_good(walls, {**higher, "onnxq-nearest": 89.9}, True) == "onnxq"
    cer = {"onnxq": 0.1, "onnxq-nearest": 0.5, "nncf": 0.3}  # lower is better
    assert fastest_as_good(walls, cer, False) == "onnxq"
    assert fastest_as_good(walls, {**cer, "onnxq": 0.4}, False) is None
    assert fastest_as_good(walls, {"onnxq": 1.0}, True) is None  # no NNCF score


def test_whole_process_scores_each_variant_of_a_zoo_model():
    nncf = importlib.util.find_spec("nncf") is not None
    variants = ["onnxq-nearest", "ort", *(["nncf"] if nncf else [])]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.whole_process", "digits_cnn", "--rounds", "1"]
        + ["--variants", *variants],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [[c.strip() for c in r.split("|")[1:-1]] for r in done.stdout.strip().splitlines()[2:]]
    scores = {cells[1]: float(cells[6]) for cells in rows[:-1]}
    assert set(scores) == set(variants)
    assert all(90.0 < x <= 100.0 for x in scores.values()), done.stdout  # digits accuracy, %
    last = rows[-1][1]
    assert last.startswith("fp32: ") and ("at least NNCF's: " in last) == nncf, last


def test_nncf_runs_without_torch_as_on_a_machine_without_it(tmp_path):
    # NNCF imports torch whenever it is installed (2.5 s and 310 MiB of its whole process):
    # its process in the comparison cannot see it
    from benchmarks.whole_process import without_torch

    nncf = importlib.util.find_spec("nncf") is not None
    probe = "import sys\ntry:\n    import torch\nexcept ImportError:\n    print('hidden')\n"
    if nncf:
        probe += "import nncf\nprint('torch' in sys.modules)\n"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=without_torch(tmp_path),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == (["hidden", "False"] if nncf else ["hidden"])


def test_leave_family_out_picks_the_recipe_without_the_family_it_scores():
    from benchmarks.leave_family_out import RECIPES, ranks, table

    a, b = RECIPES[0], RECIPES[1]

    def row(family, best, worst_for_a=False):
        losses = {r: 1.0 for r in RECIPES}
        losses[best] = 0.1
        if worst_for_a:
            losses[a] = 9.0
        return {**losses, "fixed": 0.5, "auto": 0.2, "family": family}

    rows = {
        "m1": row("cnn", a),
        "m2": row("cnn", a),
        "t1": row("text", b, worst_for_a=True),
    }
    # the others tie for ranks 2 to len(RECIPES): each gets their mean
    tied = (2 + len(RECIPES)) / 2
    assert ranks(rows["m1"])[a] == 1 and ranks(rows["m1"])[b] == pytest.approx(tied)
    lines = table(rows).splitlines()
    # without "cnn", only t1 chooses: b; without "text", the CNNs choose a (9.0 loss on t1)
    assert f"| cnn | m1 | {b} | 1.000 |" in lines[2]
    assert f"| text | t1 | {a} | 9.000 | 0.500 | 0.200 | {b} (0.100) |" in lines[4]


def test_calibration_times_the_ranges_alone_beside_the_defaults():
    # the defaults' calibrate step also gathers optimized rounding's Hessians and the bias
    # correction's sums: the figure held against the exposure floor is the ranges' alone
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.calibration", "--samples", "16"]
        + ["--methods", "minmax", "--models", "residual_cnn", "--workers", "1"]
        + ["--ray", "0", "--no-nncf", "--ranges"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    table = [r for r in done.stdout.splitlines() if r.startswith("| residual_cnn")]
    head = next(r for r in done.stdout.splitlines() if r.startswith("| model"))
    cells = dict(zip(head.split("|")[1:-1], table[0].split("|")[1:-1], strict=True))
    default = float(cells[" onnxq-w1 calibrate s (× floor) "].split()[0])
    alone = float(cells[" onnxq-ranges calibrate s (× floor) "].split()[0])
    assert 0 < alone < default
    assert "as fast as" not in done.stdout  # one process each: no workers comparison


def test_zoo_run_of_some_models_keeps_the_other_rows_of_the_scoreboard():
    # `python -m benchmarks.zoo mtcnn_pnet` rewrote docs/benchmark.* with that model alone
    from benchmarks.zoo import markdown, measured_by, merged

    def result(model: str, metric: float, run: dict | None) -> dict:
        row = {"seconds": 1.0, "rss_mib": 100.0, "error": "", "metric": metric, "bytes": 1024}
        res = {"model": model, "metric": "accuracy", "unit": "%", "higher_is_better": True}
        res["variants"] = {"fp32": {**row, "metric": 100.0}, "onnxq": row}
        return res | ({"run": run} if run else {})

    earlier = [result("a", 90.0, None), result("b", 80.0, None), result("c", 70.0, None)]
    run = measured_by(7, 1)
    board = merged(earlier, [result("b", 85.0, run), result("d", 60.0, run)], ["d", "c", "b", "a"])
    assert [r["model"] for r in board] == ["d", "c", "b", "a"]  # the manifest's order
    assert [r["variants"]["onnxq"]["metric"] for r in board] == [60.0, 70.0, 85.0, 90.0]
    text = markdown(board, 7)
    assert f"d, b: {run['date']}" in text and "c, a: an earlier run" in text
    assert "different runs" not in markdown(earlier, 7)  # one run: the header as it was


def test_a_zoo_run_merges_its_rows_into_the_files_on_disk(tmp_path):
    # the run itself failed after the benchmark: it passed the manifest where its model
    # names were wanted ("'Manifest' object is not iterable")
    import json

    from benchmarks.zoo import measured_by, update_scoreboard

    def result(model: str, metric: float) -> dict:
        row = {"seconds": 1.0, "rss_mib": 100.0, "error": "", "metric": metric, "bytes": 1024}
        res = {"model": model, "metric": "accuracy", "unit": "%", "higher_is_better": True}
        return res | {"variants": {"fp32": {**row, "metric": 100.0}, "onnxq": row}}

    (tmp_path / "benchmark.json").write_text(json.dumps([result("a", 90.0), result("b", 80.0)]))
    new = result("b", 85.0) | {"run": measured_by(5, 1)}
    text = update_scoreboard(tmp_path, [new], ["a", "b"], 5)
    board = json.loads((tmp_path / "benchmark.json").read_text())
    assert [(r["model"], r["variants"]["onnxq"]["metric"]) for r in board] == [
        ("a", 90.0),
        ("b", 85.0),
    ]
    assert (tmp_path / "benchmark.md").read_text() == text and "| b " in text
    assert (tmp_path / "benchmark.png").stat().st_size > 0


def test_the_latency_feed_joins_only_feeds_shaped_alike(tmp_path):
    # a decoder's calibration feeds are its steps, each prefix a token longer: joining them
    # for the latency batch failed ("all the input array dimensions ... must match")
    import onnx
    from onnx import TensorProto
    from onnx import helper as h

    from benchmarks.zoo import _batched

    graph = h.make_graph(
        [h.make_node("Identity", ["prefix"], ["y"])],
        "g",
        [h.make_tensor_value_info("prefix", TensorProto.INT64, ["N", "T"])],
        [h.make_tensor_value_info("y", TensorProto.INT64, ["N", "T"])],
    )
    path = tmp_path / "m.onnx"
    onnx.save(h.make_model(graph), str(path))
    feeds = [{"prefix": np.full((1, t), t, np.int64)} for t in (1, 2, 1, 3, 1)]
    out = _batched(path, feeds, 2)
    assert out["prefix"].shape == (2, 1) and (out["prefix"] == 1).all()


def test_latency_rounds_change_who_runs_after_whom():
    # in a fixed (or rotated) order the variant after fp32 always ran after fp32, and ran a
    # few % slower whatever its model
    from benchmarks.latency import interleaved

    log: list[str] = []
    calls = {k: (lambda k=k: log.append(k)) for k in ("fp32", "onnxq", "ort", "nncf")}
    times = interleaved(40, calls, warmup=2)
    assert {k: len(v) for k, v in times.items()} == dict.fromkeys(calls, 40)
    rounds = [log[8 + 4 * i : 12 + 4 * i] for i in range(40)]
    after_fp32 = {r[r.index("fp32") + 1] for r in rounds if r[-1] != "fp32"}
    assert after_fp32 == {"onnxq", "ort", "nncf"}
    assert {r[0] for r in rounds} == set(calls)
    # a block of quick runs goes on until its seconds are spent
    assert len(interleaved(1, calls, warmup=0, seconds=0.02)["ort"]) > 1


def test_variants_prints_the_line_saying_what_a_budget_left_out():
    """The ablation's budget table reads its 'left out' and 'estimated' columns from it."""
    from benchmarks.variants import budget_lines
    from onnxq.demo import demo_files

    path, data = demo_files()
    calib = {"input": data["calib"][:16]}
    _, tight = onnxq.quantize(str(path), calib, progress=False, budget=0.001)
    lines = budget_lines(tight.summary())
    assert len(lines) == 1
    assert "estimated" in lines[0] and "left out bias-correction, rounding" in lines[0]
    _, plain = onnxq.quantize(str(path), calib, progress=False, recipe="fixed")
    assert budget_lines(plain.summary()) == []


def test_profile_calibration_times_each_part_of_a_real_calibrate_step():
    """The profile wraps the calibrate step's own functions: a change of their signatures
    (Statistics.add took keyword options) must not leave it failing with a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.profile_calibration", str(DIGITS_CNN)]
        + ["--samples", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    for part in ("calibrate step", "inference (waited)", "ranges", "hessians", "rounding pass"):
        assert part in done.stdout


def test_profile_calibration_names_a_data_folder_it_cannot_read(tmp_path):
    """A folder of batches (the encoder's padded batches) is refused in one line, not with a
    traceback from numpy.load."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.profile_calibration", str(DIGITS_CNN)]
        + ["--data", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert f"--data {tmp_path}: expected one .npz file" in done.stderr
    assert "Traceback" not in done.stderr
