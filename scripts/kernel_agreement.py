"""How well does one int8 model agree with itself under two exact readings of its arithmetic?

    python scripts/kernel_agreement.py mobilenetv2_dogs efficientnet_lite1

A zoo model, quantized with the defaults as QDQ, run twice by onnxruntime on the zoo's
evaluation samples: as it runs it (the DequantizeLinear → op → QuantizeLinear groups fused into
integer kernels, which requantize their int32 sums), and with graph optimizations off (each
QuantizeLinear, DequantizeLinear and float op as the ONNX spec writes it). Both are the same
model; they differ only where a value lands within a rounding of a grid point. For each model:
the zoo metric of each run, and between the two runs the output SQNR and the top-1 agreement of
a classifier's first output (N × classes). A model whose two runs disagree on x% of the samples
has no int8 top-1 that is defined better than that on them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import onnxruntime as ort  # noqa: E402
from zoo_variants import load  # noqa: E402

from onnxq.api import quantize  # noqa: E402


def sessions(model: Any) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    """The model as onnxruntime runs it, and with every graph optimization off."""
    data = model.SerializeToString()
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    providers = ["CPUExecutionProvider"]
    return (
        ort.InferenceSession(data, providers=providers),
        ort.InferenceSession(data, plain, providers=providers),
    )


def compare(name: str) -> str:
    """The line printed for zoo model ``name``."""
    model, files, recipe = load(name)
    q, _ = quantize(
        str(files["model"]),
        recipe.calibration(model.calibration),
        target="ort-cpu",
        progress=False,
        **{**model.quantize, "format": "qdq"},
    )
    fused, plain = sessions(q)
    pairs: list[tuple[np.ndarray, np.ndarray]] = []

    def both(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        a, b = fused.run(None, feeds), plain.run(None, feeds)
        pairs.append((np.asarray(a[0], np.float64), np.asarray(b[0], np.float64)))
        return a

    metric = recipe.evaluate(both, model.evaluation)
    other = recipe.evaluate(lambda feeds: plain.run(None, feeds), model.evaluation)
    a = np.concatenate([p[0].reshape(len(p[0]), -1) for p in pairs])
    b = np.concatenate([p[1].reshape(len(p[1]), -1) for p in pairs])
    sqnr = 10 * np.log10(np.sum(a**2) / max(np.sum((a - b) ** 2), 1e-300))
    line = f"{name}: metric fused {metric:.2f}, unfused {other:.2f}; fused vs unfused: "
    line += f"output SQNR {sqnr:.1f} dB"
    if all(p[0].ndim == 2 for p in pairs):
        agree = 100 * np.mean(a.argmax(-1) == b.argmax(-1))
        line += f", top-1 agreement {agree:.2f}% of {len(a)}"
    return line


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="zoo models")
    args = ap.parse_args(argv)
    for name in args.models:
        print(compare(name), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
