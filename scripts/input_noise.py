"""How much a zoo model's own metric moves when only its float inputs are perturbed.

    python scripts/input_noise.py mobilenetv2_dogs [--snr 50 45 40]

The float model, run on the zoo's evaluation samples with seeded Gaussian noise added to every
float input (its standard deviation the input's, times 10^(−SNR/20)): how far the metric of
the *float* model falls under noise of a given signal-to-noise ratio. An 8-bit grid over an
input of range R adds uniform noise of R/255/√12 (about 41.6 dB on images in [−1, 1]); a model
that loses points of its metric at 45 dB loses them in int8 before any layer computes, and
``onnxq debug`` shows the same as its "inputs on their 8-bit grid alone" part. Metrics are the
zoo's (higher is better as printed, CER lower).
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

from zoo_variants import load  # noqa: E402

from onnxq.tools.zoo import runner  # noqa: E402


def noisy(run: Any, snr_db: float, std: dict[str, float], seed: int = 0) -> Any:
    """``run`` with Gaussian noise at ``snr_db`` added to the float inputs named in ``std``."""
    gen = np.random.default_rng(seed)

    def perturbed(feeds: dict[str, np.ndarray]) -> Any:
        out = {}
        for name, value in feeds.items():
            if name in std and np.issubdtype(value.dtype, np.floating):
                sigma = std[name] * 10 ** (-snr_db / 20)
                value = (value + gen.normal(0, sigma, value.shape)).astype(value.dtype)
            out[name] = value
        return out

    return lambda feeds: run(perturbed(feeds))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a zoo model's name")
    ap.add_argument("--snr", type=float, nargs="+", default=[60, 50, 45, 40, 35])
    args = ap.parse_args(argv)
    model, files, recipe = load(args.model)
    run = runner(files["model"])
    std: dict[str, list[float]] = {}
    for feed in recipe.calibration(model.calibration):
        for name, value in feed.items():
            if np.issubdtype(np.asarray(value).dtype, np.floating):
                std.setdefault(name, []).append(float(np.std(value)))
    sigma = {name: float(np.mean(v)) for name, v in std.items()}
    print(f"{args.model}: fp32 {recipe.evaluate(run, model.evaluation):.2f}", flush=True)
    for snr in args.snr:
        value = recipe.evaluate(noisy(run, snr, sigma), model.evaluation)
        print(f"  Gaussian input noise at {snr:g} dB: {value:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
