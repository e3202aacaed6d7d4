"""Whole processes: onnxq's CLI against NNCF and onnxruntime on the same model and samples.

    pip install -e ".[bench]"          # nncf
    python -m benchmarks.whole_process [MODEL ...] [--rounds 3]
    python -m benchmarks.whole_process --model m.onnx --data calib.npz [--kind transformer]

Each variant is its own process, started the way a user starts it (imports included), the
variants taking turns round after round; per variant the median wall time and peak RSS (the
kernel's accounting of that child, ``os.wait4``), and the ratio of the medians to NNCF's:

* ``onnxq``          ``onnxq quantize MODEL --data DATA -o OUT --quiet`` (the defaults);
* ``onnxq-fixed``    the same with ``--recipe fixed`` (auto's picks on every batch, no
                     held-back choice: what the choice costs is the difference);
* ``onnxq-nearest``  the same with ``--rounding nearest --bias-correction fast`` (without the
                     two algorithms that cost most: what they cost is the difference);
* ``nncf``           ``nncf.quantize`` at its defaults on the same samples, one per batch;
* ``ort``            ``onnxruntime.quantization.quantize_static`` at its defaults.

Zoo models (``models/manifest.toml``) are quantized on their manifest's calibration samples,
written once to an ``.npz`` in a scratch folder; ``--model``/``--data`` take your own.

For a zoo model each variant's model (the last round's) is also scored with the zoo metric on
the manifest's evaluation data (the scoreboard's, in a process of its own after the timings),
and a last line per model gives fp32's score and names the fastest variant scoring at least
NNCF's (no margin for noise: a tie counts): a speed ratio means something only beside what it
buys.

NNCF imports PyTorch at its own import whenever torch is installed, ONNX model or not (NNCF
3.4 on 2 cores: 2.5 s and 310 MiB for ``import nncf`` with torch, 1.0 s and 100 MiB
without). Its process therefore runs with torch hidden (a stub package that refuses to load
first on ``PYTHONPATH``), as on a machine without torch; ``--nncf-with-torch`` leaves it
visible.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VARIANTS = ("onnxq", "onnxq-fixed", "onnxq-nearest", "nncf", "ort")

_CHILD = """
import sys
import numpy as np, onnx
from pathlib import Path
variant, src, data, out, kind = sys.argv[1:6]
files = sorted(Path(data).glob("*.npz")) if Path(data).is_dir() else [Path(data)]
feeds = []
for path in files:  # a folder: batches of different shapes (padded to their own length)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    rows = len(next(iter(arrays.values())))
    feeds += [{k: v[i : i + 1] for k, v in arrays.items()} for i in range(rows)]
n = len(feeds)
if variant == "nncf":
    import nncf
    kw = {"subset_size": n}
    if kind == "transformer":
        kw["model_type"] = nncf.ModelType.TRANSFORMER
    model = onnx.load(src)
    if next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) < 10:
        from onnx import version_converter  # NNCF refuses these; its user converts first
        model = version_converter.convert_version(model, 13)
    onnx.save(nncf.quantize(model, nncf.Dataset(feeds), **kw), out)
else:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)
        def get_next(self):
            return next(self.it, None)
    quantize_static(src, out, Reader(), quant_format=QuantFormat.QDQ)
"""


def command(variant: str, model: Path, data: Path, out: Path, kind: str) -> list[str]:
    """The command line of one variant."""
    onnxq = [shutil.which("onnxq") or "onnxq", "quantize", str(model), "--data", str(data)]
    if variant == "onnxq":
        return [*onnxq, "-o", str(out), "--quiet"]
    if variant == "onnxq-fixed":
        return [*onnxq, "-o", str(out), "--quiet", "--recipe", "fixed"]
    if variant == "onnxq-nearest":
        fewer = ["--rounding", "nearest", "--bias-correction", "fast"]
        return [*onnxq, "-o", str(out), "--quiet", *fewer]
    return [sys.executable, "-c", _CHILD, variant, str(model), str(data), str(out), kind]


def without_torch(scratch: Path) -> dict[str, str]:
    """The environment of a process that cannot import torch (a stub package that refuses)."""
    stub = scratch / "no-torch" / "torch"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text('raise ImportError("torch is hidden by the benchmark")\n')
    path = os.pathsep.join(p for p in (str(stub.parent), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MiB, exit status) of one child process."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        if code:
            err.seek(0)
            last = err.read().decode(errors="replace").strip().splitlines()[-1:]
            print(f"  {' '.join(cmd[:4])}...: exit {code}: {last}", file=sys.stderr)
    peak = usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    return wall, peak, code


def zoo_case(name: str, scratch: Path) -> tuple[Path, Path, str]:
    """A zoo model's file, its calibration samples, and its kind.

    The samples are one .npz, or a folder of one .npz per batch where the batches differ in
    shape (a padded-batch encoder's sequence lengths); every variant reads them one sample
    per batch.

    Written by a process of its own: a child inherits its parent's peak RSS on Linux (it is
    kept across ``fork`` and ``execve``), so the parent stays small for every figure to be the
    child's.
    """
    subprocess.run(
        [sys.executable, "-m", "benchmarks.whole_process", "--prepare", name, str(scratch)],
        check=True,
    )
    kind = (scratch / f"{name}.kind").read_text()
    folder = scratch / f"{name}.batches"
    data = folder if folder.is_dir() else scratch / f"{name}.npz"
    return scratch / f"{name}.onnx", data, kind


def _prepare(name: str, scratch: Path) -> None:
    from benchmarks.zoo import _setup

    _, model, recipe, files = _setup(name)
    feeds = recipe.calibration(model.calibration)
    names = list(feeds[0])
    # one .npz where the batches join on their first axis; a folder where shapes differ or an
    # input is a scalar (silero-vad's sample rate), which has no axis to join on
    if all(np.ndim(f[k]) and f[k].shape[1:] == feeds[0][k].shape[1:] for f in feeds for k in names):
        arrays = {k: np.concatenate([f[k] for f in feeds]) for k in names}
        np.savez(scratch / f"{name}.npz", **arrays)
    else:
        folder = scratch / f"{name}.batches"
        folder.mkdir()
        for i, feed in enumerate(feeds):
            np.savez(folder / f"{i:05d}.npz", **feed)
    shutil.copy(files["model"], scratch / f"{name}.onnx")
    (scratch / f"{name}.kind").write_text(model.kind)


def _score(name: str, files: list[str]) -> None:
    """Print as JSON the zoo metric of fp32 and of each model file, in their order."""
    from benchmarks.zoo import _setup
    from onnxq.tools.zoo import runner

    _, model, recipe, paths = _setup(name)
    fp32 = recipe.evaluate(runner(paths["model"]), model.evaluation)
    each = [recipe.evaluate(runner(Path(f)), model.evaluation) for f in files]
    meta = {"metric": recipe.metric, "unit": recipe.unit, "higher": recipe.higher_is_better}
    print(json.dumps({"fp32": fp32, "files": each, **meta}))


def scores(name: str, files: dict[str, Path]) -> tuple[dict[str, float], str, bool] | None:
    """({variant or "fp32": zoo metric}, the metric's label, higher is better), or None.

    Scored by a process of its own (its peak would be inherited by the next child).
    """
    cmd = [sys.executable, "-m", "benchmarks.whole_process", "--score", name]
    proc = subprocess.run([*cmd, *(str(f) for f in files.values())], capture_output=True, text=True)
    if proc.returncode:
        last = proc.stderr.strip().splitlines()[-1:]
        print(f"  scoring {name}: exit {proc.returncode}: {last}", file=sys.stderr)
        return None
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {"fp32": got["fp32"], **dict(zip(files, got["files"], strict=True))}
    return out, f"{got['metric']}{' (' + got['unit'] + ')' if got['unit'] else ''}", got["higher"]


def fastest_as_good(
    walls: dict[str, float], metric: dict[str, float], higher: bool, peer: str = "nncf"
) -> str | None:
    """The fastest variant (not ``peer``) whose metric is at least ``peer``'s, or None."""
    if peer not in metric:
        return None
    sign = 1 if higher else -1
    good = [
        v for v in walls if v != peer and v in metric and sign * (metric[v] - metric[peer]) >= 0
    ]
    return min(good, key=lambda v: walls[v]) if good else None


def bench(
    label: str,
    model: Path,
    data: Path,
    kind: str,
    rounds: int,
    out: Path,
    variants: list[str],
    nncf_env: dict[str, str] | None = None,
    zoo: str | None = None,
) -> None:
    """Time every variant ``rounds`` times, taking turns, and print one row each.

    ``nncf_env``: the environment of NNCF's process (None: this one's). ``zoo``: the zoo
    model's name, whose metric then scores each variant's model.
    """
    runs: dict[str, list[tuple[float, float, int]]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            env = nncf_env if v == "nncf" else None
            runs[v].append(timed(command(v, model, data, out / f"{v}.onnx", kind), env))
    median = {
        v: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
        for v, rs in runs.items()
        if all(r[2] == 0 for r in rs)
    }
    base = median.get("nncf")
    scored = scores(zoo, {v: out / f"{v}.onnx" for v in median}) if zoo else None
    metric, label_of_metric, higher = scored if scored else ({}, "", True)
    for v in variants:
        if v not in median:
            print(f"| {label} | {v} | failed | | | | |")
            continue
        wall, peak = median[v]
        ratio = f"{wall / base[0]:.2f}× | {peak / base[1]:.2f}×" if base else "– | –"
        score = f"{metric[v]:.2f}" if v in metric else "–"
        row = f"| {label} | {v} | {wall:.2f} s | {peak:.0f} MiB | {ratio} | {score} |"
        print(row, flush=True)
    if metric:
        said = f"fp32: {metric['fp32']:.2f} ({label_of_metric})"
        if base and "nncf" in metric:
            walls = {v: w for v, (w, _) in median.items()}
            best = fastest_as_good(walls, metric, higher)
            ratio = f"{best}, {walls[best] / base[0]:.2f}× its wall time" if best else "none"
            said += f"; the fastest scoring at least NNCF's: {ratio}"
        print(f"| {label} | {said} | | | | | |", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; print a Markdown table."""
    if argv is None and sys.argv[1:2] == ["--prepare"]:
        _prepare(sys.argv[2], Path(sys.argv[3]))
        return 0
    if argv is None and sys.argv[1:2] == ["--score"]:
        _score(sys.argv[2], sys.argv[3:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="zoo models")
    ap.add_argument("--model", type=Path, help="your own model (with --data)")
    ap.add_argument(
        "--data", type=Path, help="its calibration samples: an .npz (axis 0), or a folder of them"
    )
    ap.add_argument("--kind", default="cnn", help="cnn or transformer (NNCF's model_type)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument(
        "--nncf-with-torch", action="store_true", help="let NNCF's process import torch"
    )
    args = ap.parse_args(argv)
    if (args.model is None) != (args.data is None) or not (args.models or args.model):
        ap.error("name zoo models, or give --model and --data")
    print("| model | variant | wall (median) | peak RSS | wall × NNCF | peak × NNCF | metric |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        env = None if args.nncf_with_torch else without_torch(scratch)
        if args.model is not None:
            case = (args.model, args.data, args.kind)
            bench(args.model.stem, *case, args.rounds, scratch, args.variants, env)
        for name in args.models:
            case = zoo_case(name, scratch)
            bench(name, *case, args.rounds, scratch, args.variants, env, zoo=name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
