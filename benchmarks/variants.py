"""One zoo model quantized several ways: the metric and the quantize time of each option set.

    python -m benchmarks.variants MODEL [MODEL ...] --options '{}' '{"rounding": "nearest"}'

Each JSON object is a set of ``onnxq.quantize`` keyword arguments, applied over the manifest's
own options for the model (target ``ort-cpu``); ``{}`` is the default. For every model and
option set it prints the zoo metric of the int8 model (the scoreboard's), fp32's, and the
quantize time in seconds, one line each, and under it what a ``budget`` left out (the
summary's budget line). The ablation page's tables come from this command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and print one line per model and option set."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="zoo model names (onnxq zoo list)")
    ap.add_argument(
        "--options", nargs="+", default=["{}"], help="JSON objects of quantize() arguments"
    )
    args = ap.parse_args(argv)
    from onnxq.tools.zoo import load_manifest, noise_text, run_model

    manifest = load_manifest(ROOT / "models" / "manifest.toml")
    sets = [json.loads(text) for text in args.options]
    for name in args.models:
        model = manifest.select([name])[0]
        for options in sets:
            result = run_model(manifest, model, log=lambda s: print(s, file=sys.stderr), **options)
            print(
                f"{name}  {json.dumps(options)}  {result.metric}: int8 {result.int8:.2f}"
                f"{result.unit}{noise_text(result.noise)} (fp32 {result.fp32:.2f}{result.unit})  "
                f"{result.seconds:.1f} s",
                flush=True,
            )
            for line in budget_lines(result.summary):
                print(f"    {line}", flush=True)
    return 0


def budget_lines(summary: str) -> list[str]:
    """The lines of a quantize summary that say what a ``budget`` kept and left out."""
    return [line for line in summary.splitlines() if line.startswith("budget ")]


if __name__ == "__main__":
    sys.exit(main())
