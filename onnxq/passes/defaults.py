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
    quantization's plan instead of timing and planning again.
    """
    off: dict[str, Any] = {DEFAULTS[n].option: DEFAULTS[n].off for n in over_budget}
    return replace(options, budget=None, **off)


def runs(algorithm: str, state: State) -> bool:
    """Whether ``algorithm`` runs: asked for by name, or picked by ``auto`` and within budget."""
    d = DEFAULTS[algorithm]
    setting = getattr(state.options, d.option)
    if setting == d.on:
        return True
    return setting == "auto" and d.picks(state) and algorithm not in state.over_budget
