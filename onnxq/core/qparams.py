"""Quantization parameters and the arithmetic that produces them (pure numpy).

Affine quantization: ``q = clip(round(x / scale) + zero_point, qmin, qmax)`` and
``x ≈ (q - zero_point) * scale``. Rounding is half-to-even, as in ONNX QuantizeLinear.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from onnxq.core.errors import CalibrationError

#: smallest scale ever produced; keeps constant or all-zero tensors valid
MIN_SCALE = float(np.finfo(np.float32).tiny) * 2**20
INT32_MAX = 2**31 - 1

_RANGES = {
    "uint8": (0, 255),
    "int8": (-128, 127),
    "int16": (-32768, 32767),
    "uint16": (0, 65535),
    "int32": (-(2**31), INT32_MAX),
}


def qrange(dtype: str, narrow: bool = False) -> tuple[int, int]:
    """(qmin, qmax) of an integer type; ``narrow`` drops the lowest value (int8 → [-127, 127])."""
    try:
        lo, hi = _RANGES[np.dtype(dtype).name]
    except KeyError:
        raise CalibrationError(
            f"quantized dtype {dtype!r} is not supported; use uint8, int8, int16 or uint16"
        ) from None
    return (lo + 1 if narrow and lo < 0 else lo), hi


@dataclass(frozen=True)
class QParams:
    """A validated (scale, zero point) pair, per tensor (scalar) or per channel along ``axis``."""

    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None = None

    def __post_init__(self) -> None:
        scale = np.asarray(self.scale, dtype=np.float32)
        zp = np.asarray(self.zero_point)
        if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
            raise CalibrationError(
                f"invalid quantization scale {scale.tolist()}: a scale must be finite and > 0"
            )
        if scale.shape != zp.shape:
            raise CalibrationError(
                f"scale shape {scale.shape} and zero-point shape {zp.shape} differ"
            )
        if scale.ndim > 1 or (scale.ndim == 1 and self.axis is None):
            raise CalibrationError("per-channel parameters must be 1-D with an axis")
        lo, hi = qrange(zp.dtype.name)
        if np.any(zp < lo) or np.any(zp > hi):
            raise CalibrationError(f"zero point {zp.tolist()} is outside [{lo}, {hi}]")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "zero_point", zp)

    @property
    def dtype(self) -> np.dtype:
        """The quantized integer type (the zero point's type)."""
        return self.zero_point.dtype


def params_from_range(
    rmin: np.ndarray | float,
    rmax: np.ndarray | float,
    dtype: str = "uint8",
    symmetric: bool = False,
    axis: int | None = None,
    narrow: bool = False,
) -> QParams:
    """Scale and zero point covering [rmin, rmax] (elementwise for per-channel ranges).

    The range is first widened to contain 0 so that 0 is exactly representable:
    ``rmin = min(rmin, 0)``, ``rmax = max(rmax, 0)``. Asymmetric:
    ``scale = (rmax - rmin) / (qmax - qmin)``, ``zp = round(qmin - rmin / scale)``.
    Symmetric: ``scale = max(|rmin|, |rmax|) / ((qmax - qmin) / 2)`` and ``zp`` the middle of the
    range (0 for signed types, 128 for uint8). A zero-width range gets scale 1 (any value works).
    """
    lo_arr = np.minimum(np.asarray(rmin, dtype=np.float64), 0.0)
    hi_arr = np.maximum(np.asarray(rmax, dtype=np.float64), 0.0)
    if not (np.all(np.isfinite(lo_arr)) and np.all(np.isfinite(hi_arr))):
        raise CalibrationError(
            f"calibration range [{rmin}, {rmax}] is not finite: the data holds NaN or Inf values"
        )
    qmin, qmax = qrange(dtype, narrow)
    if symmetric:
        absmax = np.maximum(-lo_arr, hi_arr)
        scale = absmax / ((qmax - qmin) / 2.0)
        zp = np.full_like(scale, 0.0 if qmin < 0 else (qmin + qmax + 1) // 2)
    else:
        scale = (hi_arr - lo_arr) / float(qmax - qmin)
        safe = np.where(scale > 0, scale, 1.0)
        zp = np.clip(np.round(qmin - lo_arr / safe), qmin, qmax)
    scale = np.where(scale > MIN_SCALE, scale, np.where(scale > 0, MIN_SCALE, 1.0))
    zp_arr = zp.astype(np.dtype(dtype))
    return QParams(scale.astype(np.float32), zp_arr, axis if scale.ndim == 1 else None)


#: elements quantized at a time: float64 temporaries of a whole 400 MB weight were 1.6 GB
QUANTIZE_CHUNK = 1 << 22


def quantize(x: np.ndarray, qp: QParams) -> np.ndarray:
    """Quantize ``x`` with ``qp`` (broadcast along ``qp.axis`` when per channel)."""
    scale, zp = _broadcast(qp, x.ndim)
    lo, hi = qrange(qp.dtype.name)
    x = np.asarray(x)
    if x.ndim == 0 or x.size <= QUANTIZE_CHUNK:
        q = np.round(x.astype(np.float64) / scale) + zp
        return np.clip(q, lo, hi).astype(qp.dtype)
    out = np.empty(x.shape, qp.dtype)
    for part, (s, z) in row_slices(x, QUANTIZE_CHUNK, scale, zp):
        q = x[part].astype(np.float64)
        q /= s
        np.round(q, out=q)
        q += z
        np.clip(q, lo, hi, out=q)
        out[part] = q
    return out


def dequantize(q: np.ndarray, qp: QParams) -> np.ndarray:
    """Inverse map ``(q - zp) * scale`` in float32 (a large ``q`` in slices, the same values)."""
    scale, zp = _broadcast(qp, q.ndim)
    q = np.asarray(q)
    if q.ndim == 0 or q.size <= QUANTIZE_CHUNK:
        return ((q.astype(np.float64) - zp) * scale).astype(np.float32)
    out = np.empty(q.shape, np.float32)
    for part, (s, z) in row_slices(q, QUANTIZE_CHUNK, scale, zp):
        out[part] = (q[part].astype(np.float64) - z) * s
    return out


def row_slices(
    x: np.ndarray, elements: int, *per_row: np.ndarray
) -> Iterator[tuple[slice, list[np.ndarray]]]:
    """Slices of ``x``'s first axis of about ``elements`` values each, and ``per_row`` cut to match.

    An array of ``x``'s rank with more than one row is cut with the slice; any other applies
    whole. An elementwise computation done slice by slice gives the same values as on the whole
    array, with temporaries of one slice.
    """
    rows = max(1, elements // max(x.size // x.shape[0], 1))
    for start in range(0, x.shape[0], rows):
        part = slice(start, start + rows)
        yield part, [v[part] if v.ndim == x.ndim and v.shape[0] != 1 else v for v in per_row]


def _broadcast(qp: QParams, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    scale = qp.scale.astype(np.float64)
    zp = qp.zero_point.astype(np.float64)
    if qp.axis is not None and scale.ndim == 1:
        shape = [1] * ndim
        shape[qp.axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return scale, zp


def weight_params(
    weight: np.ndarray, axis: int | None, dtype: str = "int8", narrow: bool = True, bits: int = 8
) -> QParams:
    """Symmetric weight parameters: per channel along ``axis`` or per tensor when None.

    ``scale_c = max|W_c| / qmax`` with zero point 0 (narrow range [-127, 127] by default, so
    that -qmax..qmax is symmetric and the int8×uint8 products cannot saturate asymmetrically).
    ``bits=7`` uses [-63, 63] (stored as int8): u8×s7 pairs cannot overflow the int16
    accumulators of AVX2/AVX-512 without VNNI.
    """
    w = np.asarray(weight, dtype=np.float32)
    if not np.all(np.isfinite(w)):
        raise CalibrationError("weight holds NaN or Inf values; fix the model before quantizing")
    # one row per channel (per tensor: one row), read for the range and for an exact grid
    rows = w.reshape(1, -1) if axis is None else np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    if axis is None:
        absmax = np.asarray(np.max(np.abs(w)) if w.size else 0.0)
    else:
        absmax = np.max(np.abs(rows), axis=1) if rows.size else np.zeros(w.shape[axis])
    if bits < 8:
        scale = np.maximum(np.asarray(absmax, np.float64) / (2 ** (bits - 1) - 1), MIN_SCALE)
        scale = np.where(scale > MIN_SCALE, scale, 1.0).astype(np.float32)
        qp = QParams(scale, np.zeros(scale.shape, np.dtype(dtype)), axis if scale.ndim else None)
        top = 2 ** (bits - 1) - 1
    else:
        qp = params_from_range(-absmax, absmax, dtype, symmetric=True, axis=axis, narrow=narrow)
        top = qrange(dtype)[1]
    if qrange(dtype)[0] >= 0 or not w.size:
        return qp
    exact = grid_scales(rows, np.asarray(absmax, np.float64).reshape(-1), top)
    if exact is None:
        return qp
    scale = np.where(np.isnan(exact), qp.scale.reshape(-1), exact).astype(np.float32)
    return QParams(scale.reshape(qp.scale.shape), qp.zero_point, qp.axis)


def grid_scales(rows: np.ndarray, absmax: np.ndarray, top: int) -> np.ndarray | None:
    """Per row: the finest scale that holds every value exactly in [-top, top], else NaN.

    A weight already on a coarse grid keeps it: for weights 0, 1, ..., 15 (the expectation
    over 16 bins of YOLOv8's box head, where it is quantized) ``max|W| / 127`` puts 1 at 8.47
    steps, rounded to 8 (0.945), and every box edge moved with it. Values that are whole
    multiples ``k·d`` of their smallest nonzero magnitude ``d``, with ``max k <= top``, are exact
    at scale ``d / floor(top / max k)``. None when no row is (the scale of the range stands).
    Trained weights are never on such a grid (their smallest magnitude is far below max/127),
    so one pass finds the smallest magnitudes and the rest is done only for rows that can be.
    """
    smallest = np.empty(rows.shape[0])
    for part, _ in row_slices(rows, QUANTIZE_CHUNK):
        a = np.abs(rows[part])
        smallest[part] = np.min(np.where(a > 0, a, np.inf), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = absmax / smallest
    candidates = np.flatnonzero(np.isfinite(smallest) & (np.round(steps) <= top))
    if not candidates.size:
        return None
    out = np.full(rows.shape[0], np.nan)
    for i in candidates:
        k = np.abs(rows[i].astype(np.float64)) / smallest[i]
        if np.all(np.abs(k - np.round(k)) <= 1e-6 * np.maximum(k, 1.0)):
            out[i] = smallest[i] / (top // round(steps[i]))
    return None if np.all(np.isnan(out)) else out


def accumulation_bound(
    products: int, weight_qmax: int, input_dtype: str | np.dtype, input_zero_point: np.ndarray
) -> int:
    """Largest |Σ (x_q − zp)·w_q| an int32 accumulator can reach over ``products`` terms.

    ``max(zp − qmin, qmax − zp) · weight_qmax · products``: the kernel adds this to the int32
    bias, so bias and accumulation must fit int32 *together* (a dead channel after a folded
    BatchNormalization, gamma ≈ 0 and beta ≠ 0, otherwise wraps around). 0 for 16-bit inputs:
    no runtime has int16 integer kernels, A16W8 runs dequantized in float.
    """
    if np.dtype(input_dtype).itemsize > 1:
        return 0
    lo, hi = qrange(np.dtype(input_dtype).name)
    zp = np.asarray(input_zero_point, np.int64).reshape(-1)
    reach = int(max(np.max(zp - lo), np.max(hi - zp))) if zp.size else hi - lo
    return reach * int(weight_qmax) * int(products)


#: the int32 value a dead channel's bias is given (see :func:`fit_dead_channels`): 2^24 keeps
#: the bias exact to 6e-8 and the requantization multiplier large enough for fixed-point kernels
DEAD_CHANNEL_BIAS = float(2**24)


def fit_dead_channels(
    bias: np.ndarray, input_scale: np.ndarray, weight_scale: np.ndarray, dead: np.ndarray
) -> np.ndarray:
    """Weight scale of the channels whose weights are all zero, chosen for their bias.

    A dead channel (pruned, or gamma ≈ 0 folded from a BatchNormalization) outputs its bias
    alone, and its weights quantize to 0 at any scale; the scale only sets the bias grid
    ``s_x·s_w``. The default 1.0 put a bias of 0.62 on a grid of 0.79 (it came out 0.79, the
    layer at 23 dB where per-tensor weights gave 50). Here the bias lands on
    :data:`DEAD_CHANNEL_BIAS` exactly.
    """
    ws = np.asarray(weight_scale, np.float32)
    b = np.abs(np.asarray(bias, np.float64)).reshape(-1)
    dead = np.asarray(dead, bool).reshape(-1)
    if ws.ndim == 0 or ws.size != b.size or not np.any(dead & (b > 0)):
        return ws
    fitted = b / (float(np.asarray(input_scale)) * DEAD_CHANNEL_BIAS)
    use = dead & (b > 0) & (fitted > MIN_SCALE)
    return np.where(use, fitted, ws).astype(np.float32)


def widen_for_bias(
    bias: np.ndarray,
    input_scale: np.ndarray,
    weight_scale: np.ndarray,
    limit: int = INT32_MAX,
    where: str = "a bias",
) -> np.ndarray:
    """Weight scale enlarged (per channel) so that ``|b / (s_x s_w)| <= limit``.

    ``limit`` is INT32_MAX less :func:`accumulation_bound`, so the bias plus the worst-case sum
    of products stays inside int32. Clipping an overflowing bias would silently change the model;
    a larger weight scale costs weight precision on that channel only (a channel whose bias
    needs it is nearly constant anyway).
    """
    if limit < 1:
        raise CalibrationError(
            f"{where}: the sum of products alone can exceed int32 (reduced length too long "
            "for 8-bit integer kernels); exclude the node to keep it float"
        )
    need = np.abs(np.asarray(bias, np.float64)) / (float(np.asarray(input_scale)) * limit)
    need = need * (1 + 1e-6)  # stay below the limit after rounding the scale to float32
    ws = np.asarray(weight_scale, np.float64)
    if ws.ndim == 0:  # per-tensor weight scale: the worst channel decides
        need = np.asarray(need.max() if need.size else 0.0)
    return np.maximum(ws, need).astype(np.float32)
