"""SmoothQuant: move activation outliers into the weights of the layers that read them.

A MatMul ``y = x @ W`` whose input ``x`` has a few channels far larger than the rest (the
outlier dimensions of transformer encoders) loses most of its int8 resolution to them. For a
per-channel factor ``s`` (one per input channel ``j``), ``y = (x / s) @ (s W)`` exactly, in
float; the smoothed ``x / s`` has flatter channels, and ``s W`` takes the spread, which
per-channel weight quantization handles well. ``s_j = max|x_j|^alpha / max|W_j|^(1-alpha)``
(Xiao et al., 2023), with ``alpha`` chosen per layer: the one whose int8 ``x / s`` times int8
``s W`` is closest to the float output on rows of the calibration inputs, or none at all when
smoothing does not help.

Pure numpy: the pass (``onnxq.passes.smoothquant``) collects the statistics and rewrites the
graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the alphas tried for each layer (0: no migration is tried separately as "none")
ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
#: smoothing factors are kept in this range (a dead channel or weight row keeps s = 1)
S_RANGE = (1e-4, 1e4)


@dataclass(frozen=True)
class Smoothing:
    """The choice for one input tensor: alpha (None: left alone), s and the errors measured."""

    alpha: float | None
    scales: np.ndarray
    #: relative output error (int8 against float) without and with the chosen smoothing
    error_before: float
    error_after: float


def smoothing_scales(act_absmax: np.ndarray, weight_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """``s_j = a_j^alpha / w_j^(1-alpha)``; 1 where either is zero."""
    a = np.asarray(act_absmax, np.float64)
    w = np.asarray(weight_absmax, np.float64)
    live = (a > 0) & (w > 0)
    s = np.ones_like(a)
    s[live] = a[live] ** alpha / w[live] ** (1.0 - alpha)
    return np.clip(s, *S_RANGE)


def fake_quant_activation(x: np.ndarray, lo: float, hi: float, levels: int = 256) -> np.ndarray:
    """``x`` through asymmetric per-tensor int8 over ``[min(lo, 0), max(hi, 0)]``."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = (hi - lo) / (levels - 1) if hi > lo else 1.0
    zero = np.round(-lo / scale)
    q = np.clip(np.round(x / scale) + zero, 0, levels - 1)
    return (q - zero) * scale


def fake_quant_weight(w: np.ndarray, bits: int) -> np.ndarray:
    """``w`` [K, N] through symmetric int quantization per output column."""
    top = 2 ** (bits - 1) - 1
    scale = np.abs(w).max(axis=0, keepdims=True) / top
    scale = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(w / scale), -top, top) * scale


def output_error(
    rows: np.ndarray,
    lo: float,
    hi: float,
    weights: list[np.ndarray],
    s: np.ndarray,
    bits: int,
    refs: list[np.ndarray],
) -> float:
    """Relative error of int8 ``(x/s) @ (s W)`` against float ``x @ W``, over every weight.

    ``refs``: the float products ``rows @ W``, one per weight (they do not depend on ``s``:
    :func:`choose` computes them once for all its alphas).
    """
    xs = rows / s
    xq = fake_quant_activation(xs, lo, hi)
    num = den = 0.0
    for w, ref in zip(weights, refs, strict=True):
        got = xq @ fake_quant_weight(w * s[:, None], bits)
        num += float(np.sum((got - ref) ** 2))
        den += float(np.sum(ref**2))
    return float(np.sqrt(num / den)) if den > 0 else 0.0


def choose(
    rows: np.ndarray,
    act_absmax: np.ndarray,
    act_min: np.ndarray,
    act_max: np.ndarray,
    weights: list[np.ndarray],
    bits: int,
    alphas: tuple[float, ...] = ALPHAS,
) -> Smoothing:
    """The alpha (or none) with the smallest output error on ``rows`` ([R, K], float64).

    ``act_absmax``, ``act_min``, ``act_max``: per-channel statistics of the input over the whole
    calibration set; ``weights``: every [K, N] weight reading the input (one s serves them all).
    """
    rows = np.asarray(rows, np.float64)
    w_absmax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
    one = np.ones(len(act_absmax))
    refs = [rows @ w for w in weights]
    before = output_error(rows, act_min.min(), act_max.max(), weights, one, bits, refs)
    best = Smoothing(None, one, before, before)
    for alpha in alphas:
        s = smoothing_scales(act_absmax, w_absmax, alpha)
        lo, hi = (act_min / s).min(), (act_max / s).max()
        err = output_error(rows, lo, hi, weights, s, bits, refs)
        if err < best.error_after:
            best = Smoothing(alpha, s, before, err)
    return best
