"""Depthwise scaling: give every channel of a depthwise convolution's input the whole int8 grid.

A depthwise convolution reads each input channel with its own filter, but its input is
quantized with one scale per tensor. When a few channels span far more than the rest (the
large activations of PP-LCNet's learnable affine blocks: one channel of PP-OCRv5's detector
reaches 307 where the median channel spans 7.5), the others fall onto a few steps. Scaling
input channel ``c`` by ``s_c`` and the filters reading it by ``1 / s_c`` leaves the float
model unchanged; with a scale per output channel the filters quantize exactly as well as
before, so the gain is free: channel ``c`` now sees a step ``s_c`` times finer.

``s_c`` stretches the channel's own range ``[lo_c, hi_c]`` until it touches the bounds
``[L, H]`` of the scaled tensor: ``H`` is the tensor's largest value (no channel is scaled down),
``L`` is chosen among its own minimum and up to ``-H``. A tensor with a small negative side
(HardSwish reaches -0.375) whose negative side stays put cannot stretch a channel that reaches
it; a wider ``L`` coarsens the step for all but lets every channel fill the grid. The choice is
the ``L`` with the least int8 noise the convolution's output gets (step² times the filter energy
of each channel over ``s_c²``). ``s_c`` is capped at :data:`MAX_SCALE` (a nearly dead channel
would otherwise take a factor of thousands, and its bias, divided by a far smaller weight
scale, the int32 accumulator).

Pure numpy: the pass (``onnxq.passes.depthwise_scaling``) collects the ranges and rewrites the
graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the largest factor a channel takes
MAX_SCALE = 256.0
#: the least gain (dB of the quantization noise the convolution sees) that rewrites an input
MIN_GAIN_DB = 1.0


@dataclass(frozen=True)
class Scaling:
    """The factors of one input (1 where a channel keeps its range) and the gain they give."""

    scales: np.ndarray
    #: the channel range spread (largest channel's |range| over the smallest live one's),
    #: before and after
    spread_before: float
    spread_after: float
    #: the int8 noise the convolution's output gets from its input: its drop, in dB (the
    #: input's step is unchanged, channel c's shrinks by s_c, weighted by its filter energy)
    gain_db: float


#: the lower bounds tried, as fractions of -H between the tensor's own minimum and -H
LOWER_STEPS = 12


def channel_scales(lo: np.ndarray, hi: np.ndarray, top: float, bottom: float) -> np.ndarray:
    """Per channel, the largest factor (≥ 1, ≤ MAX_SCALE) keeping ``s·[lo, hi]`` in bounds."""
    lo = np.minimum(np.asarray(lo, np.float64), 0.0)
    hi = np.maximum(np.asarray(hi, np.float64), 0.0)
    with np.errstate(divide="ignore"):
        up = np.where(hi > 0, top / np.where(hi > 0, hi, 1.0), np.inf)
        down = np.where(lo < 0, bottom / np.where(lo < 0, lo, 1.0), np.inf)
    s = np.minimum(np.minimum(up, down), MAX_SCALE)
    return np.where(np.isfinite(s) & (s >= 1.0), s, 1.0)


def spread(lo: np.ndarray, hi: np.ndarray) -> float:
    """Largest channel span over the smallest non-zero one (1 for a single live channel)."""
    span = np.maximum(np.abs(lo), np.abs(hi))
    live = span[span > 0]
    return float(live.max() / live.min()) if live.size else 1.0


def noise(lo: np.ndarray, hi: np.ndarray, s: np.ndarray, energy: np.ndarray) -> float:
    """The int8 noise power the convolution's output gets, up to a constant factor."""
    span = float(np.max(s * hi, initial=0.0)) - float(np.min(s * lo, initial=0.0))
    step = max(span, 0.0)
    return step**2 * float(np.sum(energy / s**2))


def choose(lo: np.ndarray, hi: np.ndarray, filter_energy: np.ndarray) -> Scaling:
    """The factors for one input: per-channel ``lo``/``hi`` over the calibration data.

    ``filter_energy[c]``: the sum of squares of every filter weight reading channel ``c``.
    """
    lo = np.asarray(lo, np.float64)
    hi = np.asarray(hi, np.float64)
    energy = np.asarray(filter_energy, np.float64)
    top = max(float(hi.max(initial=0.0)), 0.0)
    bottom = min(float(lo.min(initial=0.0)), 0.0)
    one = np.ones_like(lo)
    before = noise(lo, hi, one, energy)
    best, best_noise = one, before
    if top > 0:
        first = min(-bottom / top, 1.0)
        fractions = [first] if first <= 0 else list(np.geomspace(first, 1.0, LOWER_STEPS))
        for f in fractions:
            s = channel_scales(lo, hi, top, -f * top if f > 0 else bottom)
            n = noise(lo, hi, s, energy)
            if n < best_noise:
                best, best_noise = s, n
    gain = 10.0 * np.log10(before / best_noise) if before > 0 and best_noise > 0 else 0.0
    return Scaling(best, spread(lo, hi), spread(lo * best, hi * best), float(gain))
