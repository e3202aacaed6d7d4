"""``onnxq demo``: quantize the bundled digits CNN and compare it with fp32.

The package ships ``digits_cnn.onnx`` (trained by ``models/train.py`` on scikit-learn's digits,
upsampled to 28×28) and ``digits.npz`` (200 calibration images, 360 test images and labels, as
uint8 levels 0..16). The demo prints accuracy, size and single-thread batch-1 latency of both.
"""

from __future__ import annotations

import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxq.api import quantize
from onnxq.io.graph import load_model, serialize
from onnxq.io.paths import reads_of, refuse_collisions, writes_of


def demo_files() -> tuple[Path, dict[str, np.ndarray]]:
    """The demo model path and its data as float32 arrays (calib, test) plus labels."""
    root = resources.files("onnxq.demo")
    model = Path(str(root / "digits_cnn.onnx"))
    with np.load(str(root / "digits.npz")) as raw:
        data = {
            "calib": raw["calib"].astype(np.float32) / 16.0,
            "test": raw["test"].astype(np.float32) / 16.0,
            "labels": raw["labels"].astype(np.int64),
        }
    return model, data


def calibration_shard(shard: int = 0, shards: int = 1) -> dict[str, np.ndarray]:
    """The demo's calibration images, every ``shards``-th from ``shard``.

    A data source each Ray task opens itself: ``--ray --data onnxq.demo:calibration_shard``.
    """
    _, data = demo_files()
    return {"input": data["calib"][shard::shards]}


def _session(model: onnx.ModelProto, threads: int = 1) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(serialize(model), opts, providers=["CPUExecutionProvider"])


def accuracy(model: onnx.ModelProto, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of ``model`` on ``x`` (one batch)."""
    sess = _session(model, threads=0)
    name = sess.get_inputs()[0].name
    logits = sess.run(None, {name: x})[0]
    return float((logits.argmax(1) == y).mean())


def latency_ms(model: onnx.ModelProto, x: np.ndarray, runs: int) -> float:
    """Median single-thread, batch-1 latency in milliseconds after a warm-up."""
    sess = _session(model, threads=1)
    name = sess.get_inputs()[0].name
    sample = x[:1]
    for _ in range(20):
        sess.run(None, {name: sample})
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        sess.run(None, {name: sample})
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def run_demo(output: str | None = None, runs: int = 300) -> int:
    """Quantize the bundled model, print the comparison; optionally write the int8 model."""
    path, data = demo_files()
    refuse_collisions(reads_of("the demo model", path), writes_of("-o", output, model=True))
    fp32 = load_model(path)
    print(
        f"onnxq demo: {path.name}, calibrating on {len(data['calib'])} images, testing on "
        f"{len(data['test'])}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        target = output or str(Path(tmp) / "digits_cnn.int8.onnx")
        int8, report = quantize(fp32, {"input": data["calib"]}, output=target)
        size_fp32 = len(serialize(fp32))
        size_int8 = Path(target).stat().st_size
    print(report.summary())
    rows = []
    for label, model, size in (("fp32", fp32, size_fp32), ("int8", int8, size_int8)):
        acc = accuracy(model, data["test"], data["labels"])
        lat = latency_ms(model, data["test"], runs)
        rows.append((label, acc, size, lat))
    print(f"\n{'model':<6} {'accuracy':>9} {'size (KiB)':>11} {'latency (ms, 1 thread)':>23}")
    for label, acc, size, lat in rows:
        print(f"{label:<6} {acc * 100:>8.2f}% {size / 1024:>11.1f} {lat:>23.3f}")
    (_, a32, s32, l32), (_, a8, s8, l8) = rows
    print(
        f"\nint8 vs fp32: accuracy {100 * (a8 - a32):+.2f} points, size ×{s8 / s32:.2f}, "
        f"latency ×{l8 / l32:.2f}"
    )
    if output:
        print(f"wrote {output}")
    return 0
