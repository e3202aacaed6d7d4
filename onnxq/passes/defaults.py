"""What ``auto`` runs: the default algorithms, each with the models it is chosen for.

One table for the four algorithms whose option defaults to ``auto``. Each entry names the
option, the test ``auto`` applies to the model (its kind, read from the graph by
``onnxq.prepare.kind``, and the resolved options), the setting that runs it regardless and
the one that leaves it out. The passes ask :func:`picks`; the time budget
(``onnxq.passes.budget``) and the repeated quantizations of If branches and of the
accuracy-driven fallback (:func:`settle`) read the same table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from onnxq.calibrate.dataset import HeldBack
from onnxq.options import QuantizeOptions
from onnxq.passes.manager import State


@dataclass(frozen=True)
class Default:
    """One algorithm ``auto`` may run."""

    #: the QuantizeOptions field that sets it
    option: str
    #: whether ``auto`` picks it for this model
    picks: Callable[[State], bool]
    #: the setting that runs it by name, and the one that leaves it out
    on: str
    off: str


DEFAULTS: dict[str, Default] = {
    # sequential for CNNs (fast when a budget leaves it out); transformers gained nothing
    "bias-correction": Default("bias_correction", lambda s: s.kind == "cnn", "sequential", "fast"),
    # CNNs with per-tensor weights (per-channel weights need no equal channel ranges)
    "equalization": Default(
        "equalization", lambda s: s.kind == "cnn" and not s.options.per_channel, "on", "off"
    ),
    "smoothquant": Default("smoothquant", lambda s: s.kind == "transformer", "on", "off"),
    "rounding": Default(
        "rounding", lambda s: s.kind in ("cnn", "transformer"), "optimized", "nearest"
    ),
}


def picks(algorithm: str, state: State) -> bool:
    """Whether ``auto`` picks ``algorithm`` for this model (before any time budget)."""
    return DEFAULTS[algorithm].picks(state)


def settle(options: QuantizeOptions, over_budget: dict[str, str]) -> QuantizeOptions:
    """``options`` with the budget's choice written out, for the quantizations that repeat it.

    The If branches and the trials of the accuracy-driven fallback follow the main
    quantization's plan instead of timing and planning again, and its recipe (the one chosen
    on held-back batches is written into the options: onnxq.passes.choose) instead of
    choosing again.
    """
    off: dict[str, Any] = {DEFAULTS[n].option: DEFAULTS[n].off for n in over_budget}
    recipe = "fixed" if options.recipe == "auto" else options.recipe
    return replace(options, budget=None, recipe=recipe, **off)


def bias_mode(state: State) -> str:
    """The bias correction that runs: ``fast``, ``layerwise``, ``sequential`` or ``none``.

    auto: sequential for CNNs (fast when the time budget leaves it out), none otherwise. On the
    zoo's CNNs sequential raised EfficientNet-Lite1 from 91.80 to 94.53% top-1 agreement and
    MobileNetV2 from 89.26 to 92.77%, and cut their KL divergence from fp32 2.8×; on the
    transformers it changed nothing or lost (docs/ablation.md).
    """
    o = state.options
    if o.bias_correction == "auto":
        if not picks("bias-correction", state):
            return "none"
        return "fast" if "bias-correction" in state.over_budget else "sequential"
    return o.bias_correction


def choosing(state: State) -> bool:
    """Whether the recipe is chosen on held-back batches (the data was split for it)."""
    return isinstance(state.dataset, HeldBack)


def runs(algorithm: str, state: State) -> bool:
    """Whether ``algorithm`` runs: asked for by name, or picked by ``auto`` and within budget."""
    d = DEFAULTS[algorithm]
    setting = getattr(state.options, d.option)
    if setting == d.on:
        return True
    return setting == "auto" and d.picks(state) and algorithm not in state.over_budget
