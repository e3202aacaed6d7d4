"""Calibration cost and quality: onnxq vs onnxruntime.quantize_static and NNCF, one run.

    python -m benchmarks.calibration [--samples 64 256 1024] [--methods minmax entropy percentile]
                                     [--models residual_cnn fashion_cnn zoo:mobilenetv2_dogs]
                                     [--workers 1 2] [--ranges] [--markdown FILE]

Every (tool, method, sample count, model) runs in its own process, so peak RSS (``VmHWM``,
benchmarks.memory) is that run's alone. Every tool reads the same feeds from a generator (the
data set itself is never held in memory by the harness for the two small models).

* the floor (``fp32``): plain float inference of the same feeds in onnxruntime at its default
  threads, the least a calibration pass can cost; onnxq's calibrate step (its own timer, the
  ``calibrate N.NNs`` of the CLI summary) is reported as a ratio to it, for each ``--workers``
  count and for ``--ray`` tasks on a local cluster started for the run (its start-up is in
  the step; the feeds are written to a folder of .npz files first, untimed, for the tasks to
  read); onnxruntime's and NNCF's whole quantization (they time no step apart) likewise. With
  the defaults the step also gathers optimized rounding's Hessians and the bias correction's
  sums; ``--ranges`` adds ``onnxq-ranges``, one process gathering the ranges alone (``rounding
  nearest``, no bias correction, ``--recipe fixed``), the figure to hold against the runtime's
  exposure floor (benchmarks.exposure_cost).
* ``residual_cnn``: the 5-conv residual CNN of ``latency.py`` with a 1×3×64×64 input and seeded
  random weights; quality is the top-1 agreement with fp32 on 500 held-out inputs.
* ``fashion_cnn``: the trained Fashion-MNIST CNN of ``models/``; quality is test accuracy (10k).
* ``zoo:NAME``: a zoo model with its recipe's calibration feeds (at most ``n`` of them; the
  zoo's own batches), prepared before any timer starts and held in memory (so every tool's
  peak RSS holds them too); quality is not measured here (``benchmarks.zoo`` does).

onnxruntime runs QOperator with its defaults otherwise; its Entropy and Percentile use its own
defaults (128 bins for Entropy, as quantize_static sets them). onnxq uses 2048 bins. NNCF runs
``nncf.quantize`` at its defaults (its own method: reported under every method's row).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.memory import peak_rss_bytes

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def _source(model: str):
    """(model path, feed generator factory, evaluation function or None)."""
    import onnx

    from benchmarks.latency import residual_cnn

    if model.startswith("zoo:"):
        from benchmarks.zoo import _setup

        _, entry, recipe, files = _setup(model[4:])

        def zoo_feeds(n: int):
            # the recipe decodes and resizes all n at once: done on the first call, before
            # any timer starts (worker() draws one sample first), so that no tool's time
            # holds the preprocessing and the floor's does not either
            if len(prepared) < n:
                prepared[:] = recipe.calibration(max(n, 1))[:n]
            yield from prepared[:n]

        prepared: list = []

        return files["model"], zoo_feeds, None
    if model == "residual_cnn":
        path = Path(tempfile.gettempdir()) / "onnxq_bench_residual_cnn.onnx"
        if not path.exists():
            onnx.save(residual_cnn(64, 32), str(path))

        def samples(n: int):
            rng = np.random.default_rng(0)
            for _ in range(n):
                yield {"x": rng.uniform(0, 1, (1, 3, 64, 64)).astype(np.float32)}

        def evaluate(q_path: str) -> float:
            rng = np.random.default_rng(99)
            x = rng.uniform(0, 1, (500, 3, 64, 64)).astype(np.float32)
            f = _run(str(path), x)
            q = _run(q_path, x)
            return float((f.argmax(1) == q.argmax(1)).mean())

        return path, samples, evaluate
    from models import datasets

    path = ROOT / "models" / "fashion_cnn.onnx"

    def fashion_samples(n: int):
        xtr = datasets.fashion()[0]
        for i in range(n):
            yield {"image": xtr[i : i + 1]}

    def fashion_eval(q_path: str) -> float:
        _, _, xte, yte = datasets.fashion()
        return float((_run(q_path, xte).argmax(1) == yte).mean())

    return path, fashion_samples, fashion_eval


def _run(path: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return np.concatenate(
        [sess.run(None, {name: x[i : i + 250]})[0] for i in range(0, len(x), 250)]
    )


def _floor(path: Path, feeds) -> float:
    """Seconds of plain fp32 inference of ``feeds`` (onnxruntime's default threads)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feeds = list(feeds)
    sess.run(None, feeds[0])  # warm-up, as onnxq's session has run before its timer stops
    start = time.perf_counter()
    for f in feeds:
        sess.run(None, f)
    return time.perf_counter() - start


def _feed_folder(feeds, folder: Path) -> str:
    """``feeds`` written one per .npz file (the folder a Ray task reads its share of)."""
    folder.mkdir()
    for i, feed in enumerate(feeds):
        np.savez(folder / f"{i:06d}.npz", **feed)
    return str(folder)


def worker(tool: str, method: str, n: int, model: str) -> dict:
    """One quantization (or the floor) in this process: seconds, peak RSS, quality."""
    path, samples, evaluate = _source(model)
    next(iter(samples(n)), None)  # a zoo recipe prepares its samples here, untimed
    out = Path(tempfile.mkdtemp()) / "q.onnx"
    rss_before = peak_rss_bytes() / 1024
    step = None
    t = time.perf_counter()
    if tool == "fp32":
        step = _floor(path, samples(n))
    elif tool.startswith("onnxq"):
        import onnxq

        workers = int(tool.split("-w")[1]) if "-w" in tool else 1
        # the range statistics alone: no Hessians, no correction sums, nothing held back
        alone = (
            {"rounding": "nearest", "bias_correction": "none", "recipe": "fixed"}
            if tool == "onnxq-ranges"
            else {}
        )
        data, ray = (lambda: samples(n)), None
        if tool.startswith("onnxq-ray"):  # tasks read their own files: one .npz per feed
            data, ray = _feed_folder(samples(n), out.parent / "feeds"), ""
            t = time.perf_counter()  # writing the folder is not onnxq's time
        _, report = onnxq.quantize(
            str(path),
            data,
            method=method,
            output=str(out),
            progress=False,
            workers=workers,
            ray=ray,
            **alone,
        )
        step = report.seconds["calibrate"]
    elif tool == "nncf":
        from benchmarks.zoo import _nncf

        _nncf(Path(path), list(samples(n)), out, "cnn")
    else:
        from onnxruntime.quantization import (
            CalibrationDataReader,
            CalibrationMethod,
            QuantFormat,
            quantize_static,
        )

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.it = samples(n)

            def get_next(self):  # noqa: ANN201
                return next(self.it, None)

        cm = {
            "minmax": CalibrationMethod.MinMax,
            "entropy": CalibrationMethod.Entropy,
            "percentile": CalibrationMethod.Percentile,
        }[method]
        quantize_static(
            str(path), str(out), Reader(), quant_format=QuantFormat.QOperator, calibrate_method=cm
        )
    seconds = time.perf_counter() - t
    rss = peak_rss_bytes() / 1024
    quality = None
    if tool != "fp32" and evaluate is not None:
        quality = evaluate(str(out))
    return {
        "seconds": seconds,
        "step": step,
        "rss_mib": rss / 1024,
        "rss_before_mib": rss_before / 1024,
        "quality": quality,
    }


def _call(tool: str, method: str, n: int, model: str) -> dict | None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.calibration", "--worker", tool, method, str(n), model],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        print(f"{tool} {method} {n} {model} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--methods", nargs="+", default=["minmax", "entropy", "percentile"])
    ap.add_argument("--models", nargs="+", default=["residual_cnn", "fashion_cnn"])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--ray", type=int, default=2, help="Ray tasks on a local cluster (0: leave Ray out)"
    )
    ap.add_argument("--no-nncf", action="store_true", help="leave NNCF out")
    ap.add_argument(
        "--ranges",
        action="store_true",
        help="also onnxq-ranges: the calibrate step gathering the ranges alone (the defaults "
        "also gather optimized rounding's Hessians and the bias correction's sums in it)",
    )
    ap.add_argument("--markdown", default=None, help="also write the table here")
    ap.add_argument("--worker", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        tool, method, n, model = args.worker
        print(json.dumps(worker(tool, method, int(n), model)))
        return 0
    onnxq_tools = [f"onnxq-w{w}" for w in args.workers]
    if args.ray:
        onnxq_tools.append(f"onnxq-ray-w{args.ray}")
    if args.ranges:
        onnxq_tools.append("onnxq-ranges")
    rows = []
    for model in args.models:
        for n in args.samples:
            floor = _call("fp32", "minmax", n, model)
            nncf = None if args.no_nncf else _call("nncf", "minmax", n, model)
            for method in args.methods:
                res = {t: _call(t, method, n, model) for t in onnxq_tools}
                res["ort"] = _call("ort", method, n, model) if method != "mse" else None
                res["nncf"], res["fp32"] = nncf, floor
                rows.append((model, method, n, res))
                print(_line(model, method, n, res, onnxq_tools), flush=True)
    text = _table(rows, onnxq_tools, args.methods, args.models)
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


def _ratio(a: dict | None, key: str, floor: dict | None) -> float | None:
    if a is None or floor is None or a.get(key) is None or not floor["step"]:
        return None
    return a[key] / floor["step"]


def _line(model: str, method: str, n: int, res: dict, tools: list[str]) -> str:
    parts = [f"{model} {method} {n}: floor {_fmt(res['fp32'] and res['fp32']['step'])}s"]
    for t in tools:
        r = res[t]
        parts.append(
            f"{t} calibrate {_fmt(r and r['step'])}s "
            f"({_fmt(_ratio(r, 'step', res['fp32']), '.1f')}x floor)"
        )
    for t in ("ort", "nncf"):
        r = res[t]
        parts.append(f"{t} {_fmt(r and r['seconds'], '.1f')}s")
    return " | ".join(parts)


def _table(rows: list, tools: list[str], methods: list[str], models: list[str]) -> str:
    head = (
        ["model", "method", "samples", "fp32 inference s"]
        + [f"{t} calibrate s (× floor)" for t in tools]
        + [f"{t} peak MiB" for t in tools]
        + ["ort total s (× floor)", "nncf total s (× floor)", "ort peak MiB", "nncf peak MiB"]
        + [f"{t} quality" for t in tools[:1]]
        + ["ort quality", "nncf quality"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, method, n, res in rows:
        floor = res["fp32"]
        cells = [model, method, str(n), _fmt(floor and floor["step"], ".3f")]
        for t in tools:
            r = res[t]
            cells.append(f"{_fmt(r and r['step'])} ({_fmt(_ratio(r, 'step', floor), '.1f')}×)")
        cells += [_fmt(res[t] and res[t]["rss_mib"], ".0f") for t in tools]
        for t in ("ort", "nncf"):
            r = res[t]
            cells.append(
                f"{_fmt(r and r['seconds'])} ({_fmt(_ratio(r, 'seconds', floor), '.1f')}×)"
            )
        cells += [_fmt(res[t] and res[t]["rss_mib"], ".0f") for t in ("ort", "nncf")]
        for t in (tools[0], "ort", "nncf"):
            r = res[t]
            q = r and r["quality"]
            cells.append(_fmt(None if q is None else 100 * q))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    # the targets: flat memory in the number of samples, workers against one process
    for model in models:
        for method in methods:
            sel = {n: r for m, me, n, r in rows if m == model and me == method}
            for t in tools:
                got = {n: r[t] for n, r in sel.items() if r[t] is not None}
                if len(got) > 1:
                    lo, hi = min(got), max(got)
                    growth = got[hi]["rss_mib"] / got[lo]["rss_mib"]
                    lines.append(
                        f"- {model} {method} {t}: peak RSS at {hi} samples is {growth:.3f}× "
                        f"that at {lo}"
                    )
            scaling = [t for t in tools if t != "onnxq-ranges"]  # workers against one process
            if len(scaling) > 1:
                for n, r in sel.items():
                    one, more = r[scaling[0]], r[scaling[-1]]
                    if one and more and more["step"]:
                        lines.append(
                            f"- {model} {method} {n}: {scaling[-1]} calibrates "
                            f"{one['step'] / more['step']:.2f}× as fast as {scaling[0]}"
                        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
