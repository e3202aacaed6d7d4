"""Calibration cost and quality: onnxq vs onnxruntime.quantize_static, one run, same data.

    python -m benchmarks.calibration [--samples 64 256 1024] [--methods minmax entropy percentile]
                                     [--models residual_cnn fashion_cnn] [--markdown FILE]

Every (tool, method, sample count, model) runs in its own process, so peak RSS
(``ru_maxrss``) is that run's alone. Both tools read the same samples one at a time from a
generator (the data set itself is never held in memory by the harness), with batch 1.

* ``residual_cnn``: the 5-conv residual CNN of ``latency.py`` with a 1×3×64×64 input and seeded
  random weights; quality is the top-1 agreement with fp32 on 500 held-out inputs.
* ``fashion_cnn``: the trained Fashion-MNIST CNN of ``models/``; quality is test accuracy (10k).

onnxruntime runs QOperator with its defaults otherwise; its Entropy and Percentile use its own
defaults (128 bins for Entropy, as quantize_static sets them). onnxq uses 2048 bins.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def _source(model: str):
    """(model path, sample generator factory, evaluation function)."""
    import onnx

    from benchmarks.latency import residual_cnn

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


def worker(tool: str, method: str, n: int, model: str) -> dict:
    """One quantization in this process; returns seconds, peak RSS and quality."""
    path, samples, evaluate = _source(model)
    out = Path(tempfile.mkdtemp()) / "q.onnx"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    if tool == "onnxq":
        import onnxq

        onnxq.quantize(
            str(path), lambda: samples(n), method=method, output=str(out), progress=False
        )
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
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seconds": seconds,
        "rss_mib": rss / 1024,
        "rss_before_mib": rss_before / 1024,
        "quality": evaluate(str(out)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--methods", nargs="+", default=["minmax", "entropy", "percentile"])
    ap.add_argument("--models", nargs="+", default=["residual_cnn", "fashion_cnn"])
    ap.add_argument("--markdown", default=None, help="also write the table here")
    ap.add_argument("--worker", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        tool, method, n, model = args.worker
        print(json.dumps(worker(tool, method, int(n), model)))
        return 0
    rows = []
    for model in args.models:
        for method in args.methods:
            for n in args.samples:
                res = {}
                for tool in ("onnxq", "ort"):
                    proc = subprocess.run(
                        [sys.executable, __file__, "--worker", tool, method, str(n), model],
                        capture_output=True,
                        text=True,
                    )
                    if proc.returncode != 0:
                        print(proc.stderr[-2000:], file=sys.stderr)
                        return 1
                    res[tool] = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append((model, method, n, res))
                q, o = res["onnxq"], res["ort"]
                print(
                    f"{model} {method} {n}: onnxq {q['seconds']:.1f}s {q['rss_mib']:.0f} MiB "
                    f"q={q['quality']:.4f} | ort {o['seconds']:.1f}s {o['rss_mib']:.0f} MiB "
                    f"q={o['quality']:.4f}",
                    flush=True,
                )
    lines = [
        "| model | method | samples | onnxq s | ort s | onnxq peak MiB | ort peak MiB | "
        "ort/onnxq MiB | onnxq quality | ort quality |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, method, n, res in rows:
        q, o = res["onnxq"], res["ort"]
        lines.append(
            f"| {model} | {method} | {n} | {q['seconds']:.1f} | {o['seconds']:.1f} | "
            f"{q['rss_mib']:.0f} | {o['rss_mib']:.0f} | "
            f"{o['rss_mib'] / q['rss_mib']:.2f} | {100 * q['quality']:.2f} | "
            f"{100 * o['quality']:.2f} |"
        )
    # the two targets: flat memory, histogram methods within 2.5x of MinMax time
    for model in args.models:
        for method in args.methods:
            sel = {n: r for m, me, n, r in rows if m == model and me == method}
            if len(sel) > 1:
                lo, hi = min(sel), max(sel)
                growth = sel[hi]["onnxq"]["rss_mib"] / sel[lo]["onnxq"]["rss_mib"]
                lines.append(
                    f"- {model} {method}: onnxq peak RSS at {hi} samples is "
                    f"{growth:.3f}x that at {lo}"
                )
        mm = {n: r for m, me, n, r in rows if m == model and me == "minmax"}
        for method in args.methods:
            if method == "minmax":
                continue
            for n, r in ((n, r) for m, me, n, r in rows if m == model and me == method):
                if n in mm:
                    ratio = r["onnxq"]["seconds"] / mm[n]["onnxq"]["seconds"]
                    lines.append(f"- {model} {method} {n}: onnxq time {ratio:.2f}x its MinMax")
    lines.insert(2 + len(rows), "")
    text = "\n".join(lines)
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
