"""A zoo model's calibration data and evaluation as ``module:function`` references.

For the commands that take them from any user (``--data``, ``onnxq debug --eval``,
``quantize --metric``), run from the repository's root::

    onnxq debug models/.cache/mobilenetv2_dogs.keras-h5.onnx \\
        --data models.zoo_eval:mobilenetv2_dogs_data --eval models.zoo_eval:mobilenetv2_dogs

``<name>_data()`` returns the model's calibration batches (the manifest's ``calibration``
count); ``<name>(path)`` scores the model file at ``path`` with the recipe's metric on the
manifest's ``evaluation`` samples (the figure ``onnxq zoo run`` prints, negated where lower is
better, e.g. CER, since these commands take higher as better); ``<name>_samples(path)``, for
the recipes whose metric is a mean over samples (all but the correlations and the speech
windows), the score of each sample (negated too), which lets ``quantize --metric`` tell a
difference from its noise. The model is fetched into the
cache on first use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from onnxq.tools import zoo


@functools.cache
def _recipe(name: str) -> tuple[Any, Any]:
    manifest = zoo.load_manifest()
    if name not in manifest.models:
        raise AttributeError(f"no zoo model named {name!r}")
    model = manifest.models[name]
    zoo.require_packages(model)
    files = zoo.fetch(manifest, model, lambda _: None)
    return model, zoo.make_recipe(manifest, model, files)


def model_path(name: str) -> Path:
    """Where the zoo's copy of ``name`` is (fetched on first use)."""
    manifest = zoo.load_manifest()
    return zoo.fetch(manifest, manifest.models[name], lambda _: None)["model"]


def __getattr__(attr: str) -> Callable[..., Any]:
    if attr.startswith("__"):
        raise AttributeError(attr)
    if attr.endswith("_data"):
        name = attr[: -len("_data")]

        def data() -> Any:
            model, recipe = _recipe(name)
            return recipe.calibration(model.calibration)

        return data

    if attr.endswith("_samples"):
        name = attr[: -len("_samples")]

        def samples(path: str) -> Any:
            model, recipe = _recipe(name)
            if getattr(recipe, "evaluate_samples", None) is None:
                raise AttributeError(f"the recipe of {name!r} scores no single samples")
            scores = recipe.evaluate_samples(zoo.runner_for(onnx.load(path)), model.evaluation)
            return scores if recipe.higher_is_better else -scores

        return samples

    def evaluate(path: str) -> float:
        model, recipe = _recipe(attr)
        value = float(recipe.evaluate(zoo.runner_for(onnx.load(path)), model.evaluation))
        return value if recipe.higher_is_better else -value

    return evaluate
