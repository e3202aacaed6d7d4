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


def activation_codes(
    x: np.ndarray, lo: float, hi: float, levels: int = 256
) -> tuple[np.ndarray, float]:
    """``x`` on the asymmetric per-tensor int8 grid over ``[min(lo, 0), max(hi, 0)]``.

    Returns ``(q - zero, scale)``: the codes less the zero point (integers, float64) and the
    step, so that ``codes * scale`` is the fake-quantized ``x``.
    """
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = (hi - lo) / (levels - 1) if hi > lo else 1.0
    zero = np.round(-lo / scale)
    q = np.divide(x, scale)
    np.round(q, out=q)
    q += zero
    np.clip(q, 0, levels - 1, out=q)
    q -= zero
    return q, scale


def fake_quant_activation(x: np.ndarray, lo: float, hi: float, levels: int = 256) -> np.ndarray:
    """``x`` through asymmetric per-tensor int8 over ``[min(lo, 0), max(hi, 0)]``."""
    codes, scale = activation_codes(x, lo, hi, levels)
    return codes * scale


def weight_codes(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``w`` [K, N] on a symmetric grid per output column: (integer codes, scales [1, N])."""
    top = 2 ** (bits - 1) - 1
    scale = np.abs(w).max(axis=0, keepdims=True) / top
    scale = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(w / scale), -top, top), scale


def fake_quant_weight(w: np.ndarray, bits: int) -> np.ndarray:
    """``w`` [K, N] through symmetric int quantization per output column."""
    codes, scale = weight_codes(w, bits)
    return codes * scale


#: integers float32 holds exactly: a product of integer matrices whose every partial sum stays
#: below this is exact in float32 whatever order the BLAS adds in
_EXACT_F32 = 2**24
#: fewer inputs a slice than this: the float64 product is the faster exact one
_MIN_SLICE = 256


def scaled_product(a: np.ndarray, b: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``(a @ b) * scale`` for integer-valued ``a`` and ``b``: the exact product, scaled once.

    The product runs in float32 (under half the time of float64) over slices of the inner axis
    short enough that no partial sum can reach 2**24 (``|a|max · |b|max`` per term), so each
    slice is exact whatever order the BLAS adds in; slices are added in float64 (exact below
    2**53). Codes too wide for slices of :data:`_MIN_SLICE` inputs take float64 throughout.
    """
    per_term = float(np.abs(a).max(initial=0.0)) * float(np.abs(b).max(initial=0.0))
    k = a.shape[1]
    step = k if per_term == 0 else int((_EXACT_F32 - 1) // per_term)
    if step < min(k, _MIN_SLICE):
        return np.multiply(a.astype(np.float64) @ b.astype(np.float64), scale)
    a32, b32 = a.astype(np.float32, copy=False), b.astype(np.float32, copy=False)
    if step >= k:
        return np.multiply(a32 @ b32, scale, dtype=np.float64)
    total = (a32[:, :step] @ b32[:step]).astype(np.float64)
    for start in range(step, k, step):
        total += a32[:, start : start + step] @ b32[start : start + step]
    total *= scale
    return total


def output_error(
    rows: np.ndarray,
    lo: float,
    hi: float,
    weight: np.ndarray,
    s: np.ndarray,
    bits: int,
    ref: np.ndarray,
) -> float:
    """Relative error of int8 ``(x/s) @ (s W)`` against float ``x @ W``.

    ``weight``: [K, N], every reader's weight side by side (each column has its own scale);
    ``ref``: the float product ``rows @ W`` (it does not depend on ``s``: :func:`choose`
    computes it once for all its alphas). The int8 product is taken on the integer codes,
    exactly (:func:`scaled_product`).
    """
    codes, x_scale = activation_codes(rows / s, lo, hi)
    codes = codes.astype(np.float32)  # integers of at most 8 bits: exact
    w_codes, w_scale = weight_codes(weight * s[:, None], bits)
    diff = scaled_product(codes, w_codes, x_scale * w_scale)
    diff -= ref
    den = float(np.einsum("ij,ij->", ref, ref))
    return float(np.sqrt(np.einsum("ij,ij->", diff, diff) / den)) if den > 0 else 0.0


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
    calibration set; ``weights``: every [K, N] weight reading the input (one s serves them all;
    the error is over all their outputs).
    """
    rows = np.asarray(rows, np.float64)
    weight = np.concatenate(weights, axis=1)
    w_absmax = np.abs(weight).max(axis=1)
    one = np.ones(len(act_absmax))
    ref = rows @ weight
    before = output_error(rows, act_min.min(), act_max.max(), weight, one, bits, ref)
    best = Smoothing(None, one, before, before)
    for alpha in alphas:
        s = smoothing_scales(act_absmax, w_absmax, alpha)
        lo, hi = (act_min / s).min(), (act_max / s).max()
        err = output_error(rows, lo, hi, weight, s, bits, ref)
        if err < best.error_after:
            best = Smoothing(alpha, s, before, err)
    return best
