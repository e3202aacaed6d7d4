"""Shared by the scripts that quantize one zoo model several ways and compare the results.

    from zoo_variants import load, variants
    model, files, recipe = load("rapidocr_v4_rec")
    for options, run, seconds in variants(model, files, recipe, ['{}', '{"rounding": "nearest"}']):
        ...

``variants`` quantizes the model once per JSON set of ``quantize`` options (over the manifest's
own ``quantize`` options, target ``ort-cpu``) on the zoo's calibration data and yields the
options, a runner of the int8 model (``feeds -> outputs``) and the quantize time in seconds.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from onnxq.api import quantize  # noqa: E402
from onnxq.tools.zoo import fetch, load_manifest, make_recipe, runner  # noqa: E402


def load(name: str) -> tuple[Any, dict[str, Path], Any]:
    """The manifest entry of zoo model ``name``, its fetched files and its data recipe."""
    manifest = load_manifest(ROOT / "models" / "manifest.toml")
    model = manifest.models[name]
    files = fetch(manifest, model, lambda _: None)
    return model, files, make_recipe(manifest, model, files)


def variants(
    model: Any, files: dict[str, Path], recipe: Any, options: Sequence[str]
) -> Iterator[tuple[dict[str, Any], Callable[[dict], list], float]]:
    """Per JSON set of options: (the options, a runner of the int8 model, quantize seconds)."""
    calibration = recipe.calibration(model.calibration)
    for text in options or ["{}"]:
        extra = json.loads(text)
        start = time.perf_counter()
        q, _ = quantize(
            str(files["model"]),
            calibration,
            target="ort-cpu",
            progress=False,
            **{**model.quantize, **extra},
        )
        yield extra, runner(q), time.perf_counter() - start
