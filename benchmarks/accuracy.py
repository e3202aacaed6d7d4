"""Accuracy of fp32 vs onnxq int8 (every method) vs onnxruntime.quantization int8, one run.

    cd benchmarks && python accuracy.py [--calib 300]

Same calibration samples and test set for every variant; prints a Markdown table.
onnxruntime is run with quantize_static in QOperator format, its defaults (``ort``) and
``per_channel=True`` (``ort-pc``), MinMax calibration.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import onnxq
from benchmarks.latency import ort_qoperator
from models import datasets
from onnxq.calibrators import METHODS

ROOT = Path(__file__).resolve().parents[1]


def accuracy(path_or_model, x: np.ndarray, y: np.ndarray) -> float:
    src = (
        path_or_model.SerializeToString()
        if isinstance(path_or_model, onnx.ModelProto)
        else (str(path_or_model))
    )
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    out = np.concatenate([sess.run(None, {name: x[i : i + 500]})[0] for i in range(0, len(x), 500)])
    return float((out.argmax(1) == y).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", type=int, default=300)
    args = ap.parse_args()
    xtr, _, xte, yte = datasets.digits()
    cases = {
        "digits_mlp": (datasets.nhwc(xtr), datasets.nhwc(xte), yte),
        "digits_cnn": (xtr, xte, yte),
    }
    if datasets.fashion_available():
        ftr, _, fte, fy = datasets.fashion()
        cases["fashion_cnn"] = (ftr, fte, fy)
    header = ["fp32", *METHODS, "ort", "ort-pc"]
    print("| model | " + " | ".join(header) + " |")
    print("|---" * (len(header) + 1) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (calib, x, y) in cases.items():
            path = ROOT / "models" / f"{name}.onnx"
            feeds = {onnx.load(str(path)).graph.input[0].name: calib[: args.calib]}
            a32 = accuracy(path, x, y)
            row = [a32]
            for method in METHODS:
                q, _ = onnxq.quantize(str(path), feeds, method=method, progress=False)
                row.append(accuracy(q, x, y))
            for pc in (False, True):
                out = Path(tmp) / f"{name}.{pc}.onnx"
                ort_qoperator(path, calib[: args.calib], out, pc)
                row.append(accuracy(out, x, y))
            best = max(range(len(METHODS)), key=lambda k: (row[1 + k], -k))
            cells = [f"{100 * a32:.2f}"] + [
                (f"**{100 * (a - a32):+.2f}**" if k == best else f"{100 * (a - a32):+.2f}")
                for k, a in enumerate(row[1:])
            ]
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(
        "\nint8 columns: difference to fp32 in points; bold: the best onnxq method (first on ties)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
