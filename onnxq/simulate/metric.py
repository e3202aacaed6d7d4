"""The user's own evaluation: ``module:function`` called with a model file's path.

The function reads its own data and returns a number where higher is better (accuracy, mean
cosine, minus an error rate), or one such number per evaluation sample. The accuracy-driven
fallback measures its drops with it (the mean), and the recipe choice scores its candidates
with it (onnxq.passes.choose). Per-sample scores let a difference between two models be told
from the noise of the evaluation set (:func:`metric_gain`); a single number cannot say how
noisy it is.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx

from onnxq.core.errors import ConfigError
from onnxq.io.graph import save_scratch
from onnxq.io.loader import load_object
from onnxq.simulate.heldback import gain

#: a model's score: one value, or one value per evaluation sample (higher is better)
Metric = Callable[[onnx.ModelProto], np.ndarray]


def metric_label(ref: str | Callable[..., Any]) -> str:
    """How reports name a metric: ``module:function`` as given, a function by where it lives."""
    if isinstance(ref, str):
        return ref
    name = getattr(ref, "__qualname__", None) or type(ref).__name__
    return f"{getattr(ref, '__module__', None) or '?'}:{name}"


def user_metric(ref: str | Callable[..., Any], option: str, hint: str = "") -> Metric:
    """``ref`` (``module:function``, or from Python the function) as a :data:`Metric`.

    ``option``: the flag as the caller spells it, for errors; ``hint``: what the error of a
    failing call adds (what the models it is given are).
    """
    fn = load_object(ref, option) if isinstance(ref, str) else ref
    if not callable(fn):
        raise ConfigError(f"{option} {ref!r} is not a function")
    ref = metric_label(ref)

    def metric(model: onnx.ModelProto) -> np.ndarray:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.onnx")
            save_scratch(model, path)
            try:
                value = fn(path)
            except Exception as exc:  # the user's evaluation failed
                raise ConfigError(
                    f"{option} {ref!r} raised {type(exc).__name__}: {exc}"
                    + (f"; {hint}" if hint else "")
                ) from None
        try:
            scores = np.asarray(value, np.float64).reshape(-1)
        except (TypeError, ValueError):
            scores = np.empty(0)
        if scores.size == 0 or not np.all(np.isfinite(scores)) or np.ndim(value) > 1:
            raise ConfigError(
                f"{option} {ref!r} returned {_shown(value)}; it must return a finite number, "
                "or one finite number per evaluation sample (higher is better)"
            )
        return scores

    return metric


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def metric_gain(candidate: np.ndarray, incumbent: np.ndarray) -> tuple[float, float | None]:
    """(mean gain of ``candidate`` over ``incumbent``, its noise; None: unknown).

    With per-sample scores the noise is twice the standard error of the mean of the paired
    differences, as for the held-back SQNR (onnxq.simulate.heldback.gain); a metric returning
    one number has no measure of its noise (None).
    """
    if candidate.shape != incumbent.shape:
        raise ConfigError(
            f"the metric returned {incumbent.size} score(s) for one model and "
            f"{candidate.size} for another; return the same number of per-sample scores every "
            "time (or one number)"
        )
    mean, noise = gain(candidate, incumbent)
    return mean, noise if candidate.size > 1 else None


def metric_beats(candidate: np.ndarray, incumbent: np.ndarray) -> bool:
    """Whether ``candidate`` scores above ``incumbent`` by more than the noise (if known)."""
    mean, noise = metric_gain(candidate, incumbent)
    return mean > (noise if noise is not None else 0.0)
