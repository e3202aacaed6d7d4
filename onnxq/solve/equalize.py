"""Cross-layer equalization: numpy for scaling a chain of convolutions.

Two convolutions joined by a positively homogeneous function f (f(x / s) = f(x) / s for
s > 0: none, Relu, LeakyRelu, zero padding) compute the same thing when the first one's
output channel i is divided by s_i (its weight row and bias) and the second one's input
channel i is multiplied by s_i (Nagel et al., "Data-Free Quantization Through Weight
Equalization and Bias Correction", 2019, section 4.1). With

    s_i = sqrt(r1_i / r2_i)

(r1_i the largest |weight| of the first layer's output channel i, r2_i that of the second
layer's input channel i) both become sqrt(r1_i · r2_i): a weight grid shared by a whole
tensor no longer spends its range on one outlier channel. The activation between the layers
is divided by s too, and one scale covers all its channels: s_i is kept ≥ a_i / max_j a_j,
a_i the channel's largest |value| on the calibration data, both before the activation (the
first layer's output and bias) and after it (what the second layer reads), so no channel
outgrows the widest one (a channel with weights ≈ 0, or one a Relu never lets through,
would otherwise be divided by ≈ 0). A Clip(0, hi) is homogeneous only
with a per-channel bound: its output becomes Min(Relu(x), hi / s_i), exact in float.

Bias absorption then moves a constant c_i out of the activation between the two layers: the
first bias loses c_i and the second gains Σ W2[:, i] · c_i. That is exact when nothing in
between clips at the bottom (no activation: any c; Relu or Clip: only where the input stays
≥ c_i, so c_i is the channel's minimum on the calibration data) and the second convolution
pads nothing (a padded border would read 0, not −c_i). The activation's range, which one
scale covers for every channel, then shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: rounds of equalizing every pair of a chain (a layer in two pairs moves twice per round)
MAX_ROUNDS = 32
#: a round that moves no scale by more than this factor ends the iteration
CONVERGED = 1e-4


def output_ranges(w: np.ndarray) -> np.ndarray:
    """Largest |weight| of each output channel (axis 0) of a Conv weight."""
    return np.abs(w).reshape(w.shape[0], -1).max(axis=1)


def input_ranges(w: np.ndarray, groups: int) -> np.ndarray:
    """Largest |weight| reading each input channel of a Conv weight [O, C/groups, ...]."""
    o, k = w.shape[:2]
    per = np.abs(w).reshape(groups, o // groups, k, -1).max(axis=(1, 3))  # [groups, k]
    return per.reshape(groups * k)


def scale_inputs(w: np.ndarray, groups: int, s: np.ndarray) -> np.ndarray:
    """``w`` with input channel i multiplied by ``s[i]``."""
    o, k = w.shape[:2]
    per = s.reshape(groups, 1, k, *([1] * (w.ndim - 2)))
    return (w.reshape(groups, o // groups, *w.shape[1:]) * per).reshape(w.shape)


def equalizing_scales(r1: np.ndarray, r2: np.ndarray) -> np.ndarray:
    """s_i = sqrt(r1_i / r2_i); 1 where either channel is all zeros."""
    ok = (r1 > 0) & (r2 > 0)
    s = np.ones_like(r1, dtype=np.float64)
    s[ok] = np.sqrt(r1[ok] / r2[ok])
    return s


@dataclass
class Layer:
    """One convolution's weight [O, C/groups, ...] and bias [O] (float64, updated in place)."""

    weight: np.ndarray
    bias: np.ndarray
    groups: int


@dataclass
class Link:
    """Layer ``first`` feeds layer ``second`` through a homogeneous function."""

    first: str
    second: str
    #: product of every scale applied to the channels between the two layers
    scale: np.ndarray
    #: the smallest product allowed per channel: the activation between the layers, which one
    #: scale covers for all channels, must not outgrow its widest channel (a nearly constant
    #: channel, weights ≈ 0, would otherwise be divided by ≈ 0)
    floor: np.ndarray


def equalize(layers: dict[str, Layer], links: list[Link]) -> int:
    """Equalize every link, in order, until the scales stop moving; returns the rounds run.

    A layer may be the second of one link and the first of the next (a chain): its columns
    and rows move in turn, which converges to ranges balanced along the whole chain.
    """
    for rounds in range(1, MAX_ROUNDS + 1):
        moved = 0.0
        for link in links:
            a, b = layers[link.first], layers[link.second]
            s = equalizing_scales(output_ranges(a.weight), input_ranges(b.weight, b.groups))
            s = np.maximum(link.scale * s, link.floor) / link.scale
            shape = (-1,) + (1,) * (a.weight.ndim - 1)
            a.weight /= s.reshape(shape)
            a.bias /= s
            b.weight = scale_inputs(b.weight, b.groups, s)
            link.scale *= s
            moved = max(moved, float(np.max(np.abs(np.log(s)))))
        if moved < CONVERGED:
            return rounds
    return MAX_ROUNDS


def activation_floor(peak: np.ndarray) -> np.ndarray:
    """:attr:`Link.floor` from each channel's largest |activation| (0 where never active)."""
    top = float(peak.max()) if peak.size else 0.0
    return peak / top if top > 0 else np.zeros_like(peak)


def absorb(first: Layer, second: Layer, c: np.ndarray) -> None:
    """Move ``c`` (per channel between the layers) from ``first``'s bias into ``second``'s."""
    first.bias -= c
    w = second.weight
    o, k = w.shape[:2]
    per_in = w.reshape(second.groups, o // second.groups, k, -1).sum(axis=3)  # [g, O/g, k]
    second.bias += np.einsum("gok,gk->go", per_in, c.reshape(second.groups, k)).reshape(o)


def spread(r: np.ndarray) -> float:
    """How unequal the channel ranges of a weight are: largest over median (1 = equal)."""
    live = r[r > 0]
    return float(live.max() / np.median(live)) if live.size else 1.0
