"""Fixed recipes judged on families they were not chosen on, against the held-back choice.

    python -m benchmarks.leave_family_out [MODEL ...] [--json FILE]

A family is the models one zoo recipe scores (the same task, data and metric: ``ocr-lines``,
``photo-classes``, ...). Each model is quantized with every fixed recipe of
:data:`RECIPES` (``--recipe RANGES/ROUNDING/BIAS``, fitted on every calibration sample), with
``--recipe fixed`` (auto's picks per model kind) and with the default (``auto``: chosen per
model on held-back samples), on its manifest's calibration samples, and scored on its
evaluation set. Then, family by family: the fixed recipe that would have been chosen for the
zoo **without that family** (the lowest mean rank of its loss over the other families'
models) and its loss on the family's models, beside auto's picks and the held-back choice.

A fixed default holds up where the recipe chosen without a family loses no more on it than
the others; the held-back choice holds up where it is never far from the best fixed recipe
in hindsight. Prints one Markdown table; ``--json`` also writes every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

#: the fixed recipes compared (RANGES/ROUNDING/BIAS)
RECIPES = (
    "mse/optimized/sequential",
    "mse/optimized/fast",
    "mse/optimized/none",
    "mse/nearest/fast",
    "minmax/optimized/fast",
    "minmax/nearest/none",
    "percentile/optimized/fast",
)
#: the two per-model rules: auto's picks per model kind, and the held-back choice
RULES = ("fixed", "auto")


def losses(names: list[str]) -> dict[str, dict[str, float]]:
    """Model -> recipe -> loss in metric points (positive: worse than fp32), and 'family'."""
    import onnx

    from onnxq.api import quantize
    from onnxq.tools.zoo import fetch, load_manifest, make_recipe, runner

    manifest = load_manifest(ROOT / "models" / "manifest.toml")
    out: dict[str, dict[str, float]] = {}
    for model in manifest.select(names or None):
        if model.expect != "quantize":
            continue
        files = fetch(manifest, model, lambda s: None)
        recipe = make_recipe(manifest, model, files)
        fp32 = recipe.evaluate(runner(files["model"]), model.evaluation)
        sign = 1.0 if recipe.higher_is_better else -1.0
        row: dict[str, float] = {}
        for name in (*RECIPES, *RULES):
            kw = {"progress": False, **model.quantize, "recipe": name}
            q, _ = quantize(str(files["model"]), recipe.calibration(model.calibration), **kw)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "q.onnx"
                onnx.save(q, str(path))
                int8 = recipe.evaluate(runner(path), model.evaluation)
            row[name] = sign * (fp32 - int8)
            print(f"{model.name} {name}: loss {row[name]:.4f}", file=sys.stderr, flush=True)
        out[model.name] = {**row, "family": model.recipe}  # type: ignore[dict-item]
    return out


def ranks(row: dict[str, float]) -> dict[str, float]:
    """Rank of each fixed recipe on one model by its loss (1 best; ties share the mean)."""
    values = np.array([row[r] for r in RECIPES])
    order = values.argsort(kind="stable")
    rank = np.empty(len(values))
    rank[order] = np.arange(1, len(values) + 1)
    for v in np.unique(values):  # ties: the mean rank
        rank[values == v] = rank[values == v].mean()
    return dict(zip(RECIPES, rank.tolist(), strict=True))


def table(rows: dict[str, dict[str, float]]) -> str:
    """The leave-family-out table, one line per model."""
    by_family: dict[str, list[str]] = defaultdict(list)
    for name, row in rows.items():
        by_family[str(row["family"])].append(name)
    rank_of = {name: ranks(row) for name, row in rows.items()}
    lines = [
        "| family | model | chosen without it | its loss | auto's picks | held-back choice "
        "| best fixed (loss) |",
        "|---|---|---|---|---|---|---|",
    ]
    for family, members in sorted(by_family.items()):
        others = [n for n in rows if rows[n]["family"] != family]
        if not others:
            continue
        without = min(RECIPES, key=lambda r: (np.mean([rank_of[n][r] for n in others]), r))
        for name in members:
            row = rows[name]
            best = min(RECIPES, key=lambda r: row[r])
            lines.append(
                f"| {family} | {name} | {without} | {row[without]:.3f} | {row['fixed']:.3f} "
                f"| {row['auto']:.3f} | {best} ({row[best]:.3f}) |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Quantize, score and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="zoo model names (default: all)")
    ap.add_argument("--json", type=Path, help="also write every loss here")
    args = ap.parse_args(argv)
    rows = losses(args.models)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    print("losses in metric points against fp32 (lower is better)\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
