"""Optimized weight rounding: each weight rounded so the layer's *output* error is smallest.

Rounding every weight to its nearest grid point makes each weight's error small, not the
layer's: the errors of the K weights a row sums add up in the output. With the layer's inputs
``x`` (rows of the calibration data) the output error of one row ``w`` rounded to ``q`` is

    E[((q − w)·x)²] = (q − w)ᵀ H (q − w),   H = E[x xᵀ]  (K × K)

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", 2023; built on Optimal Brain Quantization) rounds the columns one at a time and
moves each column's rounding error onto the columns not rounded yet, in the proportions that
minimize the error above given ``H⁻¹``. Columns go in order of decreasing ``H_jj`` (inputs
with the most energy first), and the update is applied a block of columns at a time.

Rows never compete (each output channel's error is its own), so for every row the result
keeps whichever of GPTQ and nearest rounding has the smaller error under ``H``: the pass can
only lower the error it reports. Scales and zero points are not changed, and every value
stays inside the grid the layer's kernel allows (±63 for 7-bit weights).

Inputs are the float model's (the layer's calibration inputs). A grouped convolution has one
``H`` per group (a depthwise convolution: one 9 × 9 matrix per channel), so the arrays here
are batched over groups: weights ``(G, M, K)`` and Hessians ``(G, K, K)``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from onnxq.solve.lapack import available as lapack_available
from onnxq.solve.lapack import cholesky_in_place
from onnxq.solve.sums import PairSum

#: dampening added to H's diagonal, as a fraction of its mean (keeps H⁻¹ well conditioned)
DAMPING = 0.01
#: columns rounded between two updates of the remaining columns
BLOCK = 128


@dataclass(frozen=True)
class Grid:
    """The integer grid of one weight: per row scale and zero point, and the allowed values."""

    scale: np.ndarray  # (G, M)
    zero_point: np.ndarray  # (G, M)
    lo: int
    hi: int

    def round(self, w: np.ndarray, col: int | None = None) -> np.ndarray:
        """Nearest grid integers of ``w`` ((G, M) column ``col`` or the whole (G, M, K))."""
        s = self.scale if col is not None else self.scale[..., None]
        z = self.zero_point if col is not None else self.zero_point[..., None]
        return np.clip(np.round(w / s) + z, self.lo, self.hi)

    def value(self, q: np.ndarray, col: int | None = None) -> np.ndarray:
        """The real value of grid integers ``q``."""
        s = self.scale if col is not None else self.scale[..., None]
        z = self.zero_point if col is not None else self.zero_point[..., None]
        return (q - z) * s


@dataclass(frozen=True)
class Rounded:
    """The integers chosen for one weight and the output error before and after."""

    q: np.ndarray  # (G, M, K) grid integers
    #: relative output error E[(Δw·x)²] / E[(w·x)²] of nearest rounding and of the result
    error_nearest: float
    error: float
    #: rows where GPTQ's rounding was kept (the rest kept nearest rounding)
    rows_changed: int


def output_error(w: np.ndarray, dq: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Per row ``(dq − w)ᵀ H (dq − w)``, shape (G, M)."""
    d = dq - w
    return np.einsum("gmk,gkl,gml->gm", d, h, d, optimize=True)


def gptq(w: np.ndarray, h: np.ndarray, grid: Grid) -> np.ndarray:
    """GPTQ's grid integers for weights ``w`` (G, M, K) under Hessians ``h`` (G, K, K)."""
    w = np.asarray(w, np.float64)
    h = np.asarray(h, np.float64)
    groups, _, k = w.shape
    # an input that never varies: its column rounds to nearest and moves no error elsewhere
    diag = np.einsum("gkk->gk", h)
    diag = diag + np.where(diag <= 0, 1.0, 0.0)
    diag += DAMPING * np.mean(diag, axis=1)[:, None]
    order = np.argsort(-diag, axis=1, kind="stable")
    w = np.take_along_axis(w, order[:, None, :], axis=2)
    # its rows give each column's update; H is reordered in a new array that only the factor
    # holds, which lets it go once factored (K × K float64 a group)
    u = upper_factor_of_inverse(_reordered(h, order, diag), own=True)
    # columns as rows (G, K, M): the loop reads and updates contiguous memory, the same
    # arithmetic element by element (K = 2,304: 0.54 -> 0.43 s)
    wt = np.ascontiguousarray(np.swapaxes(w, 1, 2))
    pivots = np.einsum("gkk->gk", u)[:, :, None]  # u[g, j, j], one (G, 1) column each
    qt = np.empty_like(wt)
    # Grid.round and Grid.value written out on preallocated arrays: the same operations in the
    # same order (the same bits), without two calls and six fresh arrays per column
    # (MobileNetV2's 52 layers: 1.17 -> 1.03 s; the updates and factors dominate wider layers)
    s, z = grid.scale, grid.zero_point
    err = np.empty_like(s)
    for start in range(0, k, BLOCK):
        stop = min(start + BLOCK, k)
        errors = np.empty((groups, w.shape[1], stop - start))
        for j in range(start, stop):
            col, qj = wt[:, j, :], qt[:, j, :]
            np.divide(col, s, out=qj)
            np.round(qj, out=qj)
            np.add(qj, z, out=qj)
            np.clip(qj, grid.lo, grid.hi, out=qj)
            np.subtract(qj, z, out=err)
            np.multiply(err, s, out=err)
            np.subtract(col, err, out=err)
            np.divide(err, pivots[:, j], out=err)
            if j + 1 < stop:
                # row j of U past its diagonal (contiguous): element by element, so the
                # same bits as reading it from a transposed copy, without that copy
                wt[:, j + 1 : stop, :] -= err[:, None, :] * u[:, j, j + 1 : stop, None]
            errors[:, :, j - start] = err
        if stop < k:
            wt[:, stop:, :] -= np.swapaxes(np.matmul(errors, u[:, start:stop, stop:]), 1, 2)
    inverse = np.argsort(order, axis=1, kind="stable")
    return np.take_along_axis(np.swapaxes(qt, 1, 2), inverse[:, None, :], axis=2)


def _reordered(h: np.ndarray, order: np.ndarray, diag: np.ndarray) -> np.ndarray:
    """``h``'s rows and columns in ``order`` (one gather: a new array), ``diag`` its diagonal."""
    groups, k = order.shape
    out = h[np.arange(groups)[:, None, None], order[:, :, None], order[:, None, :]]
    out[:, np.arange(k), np.arange(k)] = np.take_along_axis(diag, order, axis=1)
    return out


def upper_factor_of_inverse(h: np.ndarray, own: bool = False) -> np.ndarray:
    """U, upper triangular with ``Uᵀ U = H⁻¹``, for symmetric positive definite ``h`` (G, K, K).

    With ``P`` the reversal of the K axes and ``P H P = L Lᵀ`` (Cholesky), ``U = P L⁻¹ P``:
    one Cholesky and one triangular inverse, a third of the work of inverting ``H`` and then
    factoring ``H⁻¹`` (2,304 inputs: about 0.65 → 0.3 s).

    ``own``: the caller hands ``h`` over (an array nobody else reads). It is then reversed and
    factored in place (onnxq.solve.lapack: numpy's own ``dpotrf``, the same bits) where its
    matrices are large, so the factor takes no memory beside it; otherwise numpy factors a
    copy and ``h`` is let go of once factored. The inverse is built over the factor and
    reversed in place: about two K × K arrays a group are alive at most, the result included
    (numpy's Cholesky alone held four: its input, its column-major copy, its result and the
    caller's ``H``).
    """
    k = h.shape[-1]
    if own and k >= IN_PLACE_INPUTS and _factors_in_place(h):
        _reverse_in_place(h)
        cholesky_in_place(h)
        lower = h
    else:
        lower = np.ascontiguousarray(np.linalg.cholesky(h[:, ::-1, ::-1]))  # it is: no copy
    del h
    _lower_inverse(lower, in_place=True)
    _reverse_in_place(lower)
    return lower


#: weight inputs from which a Hessian handed over is factored in place (1 MiB a matrix and up;
#: below it numpy's batched Cholesky is faster and the copies are small)
IN_PLACE_INPUTS = 384


def _factors_in_place(h: np.ndarray) -> bool:
    """Whether ``h`` can be factored where it is (:func:`~onnxq.solve.lapack.cholesky_in_place`)."""
    fits = h.dtype == np.float64 and h.flags.c_contiguous and h.flags.writeable
    return fits and lapack_available()


def _reverse_in_place(a: np.ndarray) -> None:
    """``a[:, ::-1, ::-1]`` written over ``a`` (contiguous (G, K, K)), with half a matrix spare.

    Reversing both axes reverses each matrix's flat order: the first half of the values swaps
    with the reversed second half (an odd middle value stays). Copies only: the same values
    as a reversed copy, without a second K × K array.
    """
    flat = a.reshape(a.shape[0], -1)  # a view: ``a`` is contiguous
    n = flat.shape[1]
    half = n // 2
    head = flat[:, :half].copy()
    flat[:, :half] = flat[:, : n - half - 1 : -1]
    flat[:, n - half :] = head[:, ::-1]


#: size below which a triangular block is inverted directly
_DIRECT = 64


def _lower_inverse(lower: np.ndarray, in_place: bool = False) -> np.ndarray:
    """The inverse of lower triangular ``lower`` (G, K, K), by halves (matrix products).

    ``[[A, 0], [B, C]]⁻¹ = [[A⁻¹, 0], [−C⁻¹ B A⁻¹, C⁻¹]]``; numpy has no triangular inverse.
    ``in_place``: written over ``lower`` (returned); the halves below are new arrays either
    way, so the products see the same operands (the same bits).
    """
    k = lower.shape[-1]
    if k <= _DIRECT:
        inverse = np.tril(np.linalg.inv(lower))
        if in_place:
            lower[...] = inverse
            return lower
        return inverse
    half = k // 2
    a_inv = _lower_inverse(lower[:, :half, :half])
    c_inv = _lower_inverse(lower[:, half:, half:])
    # −C⁻¹ (B A⁻¹), each piece placed as soon as it is no longer read: at most three quarter
    # blocks beside ``lower``, not five (the same products, the same bits)
    right = np.matmul(lower[:, half:, :half], a_inv)
    out = lower if in_place else np.empty_like(lower)
    out[:, :half, :half] = a_inv
    del a_inv
    corner = np.matmul(c_inv, right)
    del right
    np.negative(corner, out=corner)
    out[:, half:, half:] = c_inv
    out[:, :half, half:] = 0.0
    out[:, half:, :half] = corner
    return out


def round_weight(w: np.ndarray, h: np.ndarray, grid: Grid) -> Rounded:
    """The better of GPTQ and nearest rounding per row of ``w`` (G, M, K) under ``h``."""
    w = np.asarray(w, np.float64)
    h = np.asarray(h, np.float64)
    nearest = grid.round(w)
    optimized = gptq(w, h, grid)
    e_near = output_error(w, grid.value(nearest), h)
    e_opt = output_error(w, grid.value(optimized), h)
    better = e_opt < e_near
    q = np.where(better[..., None], optimized, nearest)
    signal = float(np.einsum("gmk,gkl,gml->", w, h, w, optimize=True))
    scale = max(signal, 1e-30)
    return Rounded(
        q,
        float(e_near.sum()) / scale,
        float(np.where(better, e_opt, e_near).sum()) / scale,
        int(np.count_nonzero(better)),
    )


@dataclass(frozen=True)
class ConvShape:
    """What turns a Conv's input into the rows its weight multiplies."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    #: begin pads then end pads, as ONNX writes them
    pads: tuple[int, ...]
    group: int
    #: ``SAME_UPPER`` or ``SAME_LOWER``: the pads follow each input's size (:meth:`at`)
    auto_pad: str = "NOTSET"

    def at(self, spatial: tuple[int, ...]) -> ConvShape:
        """The shape with the explicit pads an input of ``spatial`` size gets.

        ``SAME_*`` pads so that the output is ``ceil(input / stride)``, the odd one at the end
        (``SAME_UPPER``) or at the beginning (``SAME_LOWER``), as ONNX defines them.
        """
        if self.auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
            return self
        begin, end = [], []
        for size, k, s, d in zip(spatial, self.kernel, self.strides, self.dilations, strict=True):
            total = max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size)
            small, big = total // 2, total - total // 2
            begin.append(small if self.auto_pad == "SAME_UPPER" else big)
            end.append(big if self.auto_pad == "SAME_UPPER" else small)
        return replace(self, pads=(*begin, *end), auto_pad="NOTSET")


#: multiply-adds one layer's Hessian may cost (G·K² per row), and rows per weight input: they
#: bound the rows it takes in all
MAC_BUDGET = 1 << 31
ROWS_PER_INPUT_TOTAL = 256
ROWS_PER_INPUT_GROUPED = 32
#: rows one batch gives a Hessian when the number of batches is unknown: ROWS_PER_INPUT per
#: weight input, within [MIN_ROWS, MAX_ROWS] (a strided sample of the output positions past it)
ROWS_PER_INPUT = 16
MIN_ROWS, MAX_ROWS = 256, 4096
#: output positions a sample keeps up to which its patches are gathered, not cut as windows
SPARSE_POSITIONS = 64
#: rows buffered before they are added to the Hessian (one product for many small batches),
#: and the most bytes one layer's buffer holds (every layer of the model buffers at once)
FLUSH_ROWS = 4096
FLUSH_BYTES = 4 << 20
#: bytes of rows handed to :class:`Products` and not multiplied yet, past which the caller waits
QUEUED_BYTES = 16 << 20


def row_cap(k: int) -> int:
    """Rows one batch contributes to a Hessian of ``k`` inputs (number of batches unknown)."""
    return int(min(MAX_ROWS, max(MIN_ROWS, ROWS_PER_INPUT * k)))


def total_rows(groups: int, k: int) -> int:
    """Rows a Hessian of ``groups`` × ``k`` × ``k`` takes in all.

    The multiply-add budget, at most :data:`ROWS_PER_INPUT_TOTAL` per input (a depthwise 9 × 9
    Hessian is settled long before), at least 2k.
    """
    per_input = ROWS_PER_INPUT_GROUPED if groups > 1 else ROWS_PER_INPUT_TOTAL
    return int(max(2 * k, min(MAC_BUDGET // max(groups * k * k, 1), per_input * k)))


def conv_patches(x: np.ndarray, conv: ConvShape, cap: int) -> np.ndarray:
    """The input patches a Conv reads, ``(G, C/G · prod(kernel), rows)`` in its weight's order.

    About ``cap`` rows (output positions) when the batch has more: the same positions of
    every sample, spread evenly over each sample's positions in raster order
    (:func:`spread_positions`), and every ``ceil(N / cap)``-th sample when there are more
    samples than rows. A regular grid of every s-th position in each direction kept a
    quarter of a 2-D layer's positions where the share was just under all of them (83 of
    100 at 10×10 gave 25). Three ways to cut them, all giving the same values: few
    positions, or positions reading under half the input, are gathered through index arrays
    (:func:`_sparse_patches`); a 1×1 unpadded kernel reads its input as it is (a strided
    view); the rest is a strided copy of sliding windows over the padded input. Per call on
    2 cores: EfficientNet-Lite's 5×5 depthwise layers at 8×8 with 4 rows a sample took
    740 µs as windows, 220 µs gathered; a 3×3 layer of 64 channels keeping all 1,600
    positions of 40×40 took 420 µs as windows, 2,500 µs gathered.
    """
    x = np.asarray(x)
    n = x.shape[0]
    spatial = len(conv.kernel)
    conv = conv.at(x.shape[2:])
    begin, end = conv.pads[:spatial], conv.pads[spatial:]
    extent = tuple((k - 1) * d + 1 for k, d in zip(conv.kernel, conv.dilations, strict=True))
    out_shape = tuple(
        max(0, (x.shape[2 + i] + begin[i] + end[i] - extent[i]) // conv.strides[i] + 1)
        for i in range(spatial)
    )
    positions = math.prod(out_shape)
    kept, cap = positions, max(cap, 1)
    if n * positions > cap:
        # the samples are chosen before padding: padding the whole batch copied all of it (a
        # depthwise layer's 16 × 144 × 120 × 120 input for 36 positions of each sample)
        x = x[:: max(1, -(-n // cap))]
        kept = min(positions, -(-cap // x.shape[0]))
    read = math.prod(conv.kernel) * kept
    # The Hessian's float32 product takes its bits from the rows' memory layout too (numpy's
    # matmul picks its kernel by strides): every way below gives C order, as the windows'
    # copy does for these layers (one position a sample can be a view of the input in another
    # order: left to the windows), so the Hessians keep their bits.
    if kept < positions and read * 2 < math.prod(x.shape[2:]):
        return _sparse_patches(x, conv, out_shape, kept)
    if all(k == 1 for k in conv.kernel) and not any(begin) and not any(end):
        return _pointwise_patches(x, conv, out_shape, kept)
    if 1 < kept <= SPARSE_POSITIONS:
        return np.ascontiguousarray(_sparse_patches(x, conv, out_shape, kept))
    return _window_patches(x, conv, out_shape, kept)


@functools.lru_cache(maxsize=256)
def spread_positions(positions: int, kept: int) -> np.ndarray:
    """``kept`` of ``positions`` flat output positions, evenly spread, in increasing order.

    The middle of each of ``kept`` equal runs of the raster order: all of them when ``kept``
    is ``positions``, every other one at half, and no two the same.
    """
    if kept >= positions:
        out = np.arange(positions)
    else:
        out = (2 * np.arange(kept) + 1) * positions // (2 * kept)
    out.setflags(write=False)
    return out


def _window_patches(
    x: np.ndarray, conv: ConvShape, out_shape: tuple[int, ...], kept: int
) -> np.ndarray:
    """:func:`conv_patches` as a copy of the sliding windows over the padded input."""
    c = x.shape[1]
    spatial = len(conv.kernel)
    begin, end = conv.pads[:spatial], conv.pads[spatial:]
    extent = tuple((k - 1) * d + 1 for k, d in zip(conv.kernel, conv.dilations, strict=True))
    if any(begin) or any(end):
        x = np.pad(x, [(0, 0), (0, 0), *zip(begin, end, strict=True)])
    axes = tuple(range(2, 2 + spatial))
    win = np.lib.stride_tricks.sliding_window_view(x, extent, axis=axes)
    win = win[(slice(None), slice(None), *(slice(None, None, s) for s in conv.strides))]
    dilated: tuple[Any, ...] = (Ellipsis, *(slice(None, None, d) for d in conv.dilations))
    win = win[dilated]
    order = (1, *range(2 + spatial, 2 + 2 * spatial), 0, *range(2, 2 + spatial))
    patches = win.transpose(order)  # (C, *kernel, N, *out): positions innermost, as stored
    positions = math.prod(out_shape)
    if kept < positions:  # the kept windows, (C, *kernel, N, kept), in C order
        at = np.unravel_index(spread_positions(positions, kept), out_shape)
        patches = np.ascontiguousarray(patches[(Ellipsis, *at)])
    k = c // conv.group * int(np.prod(conv.kernel))
    return patches.reshape(conv.group, k, -1)


def _pointwise_patches(
    x: np.ndarray, conv: ConvShape, out_shape: tuple[int, ...], kept: int
) -> np.ndarray:
    """:func:`conv_patches` of a 1×1 kernel without padding, at ``kept`` spread positions.

    Output position ``o`` reads input ``o · stride`` alone, so the rows are a strided slice of
    the input (a view when every position is kept and the batch holds one sample).
    """
    n, c = x.shape[:2]
    x = x[(slice(None), slice(None), *(slice(None, None, s) for s in conv.strides))]
    x = x.reshape(n, c, -1)
    positions = math.prod(out_shape)
    if kept < positions:
        x = x[:, :, spread_positions(positions, kept)]
    return x.transpose(1, 0, 2).reshape(conv.group, c // conv.group, -1)


def _sparse_patches(
    x: np.ndarray, conv: ConvShape, out_shape: tuple[int, ...], kept: int
) -> np.ndarray:
    """:func:`conv_patches` at ``kept`` spread output positions, without padding the input.

    One gather of the input positions the kept windows read (``kernel × kept`` of them,
    padding as zeros), through index arrays made once per layer shape: a few positions of a
    large input copy a fraction of it, and a batch of one sample costs a few numpy calls.
    Calibration asks every layer for a few rows of each batch when the data's size is known:
    MobileNetV2's 1×1 layers took 81 µs a call with a gather per axis, 14 µs now.
    """
    n, c = x.shape[:2]
    flat, outside = _gather_index(x.shape[2:], conv, out_shape, kept)
    taken = x.reshape(n, c, -1)[:, :, flat]  # (N, C, K·O): kernel offset, then position
    if outside is not None:
        taken = np.where(outside, np.float32(0), taken)
    offsets = math.prod(conv.kernel)
    taken = taken.reshape(n, c, offsets, flat.size // offsets)
    # (N, C, K, O) -> (C, K, N, O), as conv_patches orders them
    return taken.transpose(1, 2, 0, 3).reshape(conv.group, c // conv.group * offsets, -1)


@functools.lru_cache(maxsize=256)
def _gather_index(
    shape: tuple[int, ...], conv: ConvShape, out_shape: tuple[int, ...], kept: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Flat input indices ``(K·O,)`` of the kept windows and where they fall in the padding.

    ``K`` runs over the kernel offsets (first axis slowest), ``O`` over the kept output
    positions (:func:`spread_positions`, in raster order); indices in the padding point at
    the nearest edge and are zeroed by the mask (None: the windows stay inside).
    """
    spatial = len(conv.kernel)
    at = np.unravel_index(spread_positions(math.prod(out_shape), kept), out_shape)
    inside: np.ndarray = np.ones((), bool)
    flat: np.ndarray = np.zeros((), np.intp)
    for i in range(spatial):
        starts = at[i] * conv.strides[i] - conv.pads[i]
        idx = (np.arange(conv.kernel[i]) * conv.dilations[i])[:, None] + starts[None, :]
        # axis i's (kernel_i, kept) positions, placed to broadcast to (k1, .., kS, kept)
        place = [1] * (spatial + 1)
        place[i], place[spatial] = idx.shape
        idx = idx.reshape(place)
        inside = inside & (idx >= 0) & (idx < shape[i])
        flat = flat * shape[i] + np.clip(idx, 0, shape[i] - 1)
    flat = flat.reshape(-1)
    flat.setflags(write=False)
    if inside.all():
        return flat, None
    outside = ~inside.reshape(-1)
    outside.setflags(write=False)
    return flat, outside


def dense_patches(x: np.ndarray, cap: int) -> np.ndarray:
    """The rows a MatMul/Gemm weight multiplies, as ``(1, K, rows)``, strided past ``cap``."""
    rows = np.asarray(x).reshape(-1, np.shape(x)[-1])
    return rows[:: max(1, -(-len(rows) // cap))][:cap].T[None]


def _upper_rows(k: int) -> Iterator[tuple[int, slice]]:
    """Each row ``i`` of a ``k × k`` matrix with where its upper part (``i:``) lies packed.

    The packed upper triangle (diagonal included) holds the rows' upper parts one after the
    other: ``k (k + 1) / 2`` values. Copied a row at a time, without index arrays (those of
    a 2,304-input layer were 21 MB of int64 a Hessian size, kept for every size seen).
    """
    start = 0
    for i in range(k):
        yield i, slice(start, start + k - i)
        start += k - i


def add_upper(full: np.ndarray, packed: np.ndarray | None) -> np.ndarray:
    """``packed`` plus the packed upper triangles of ``full`` (G, k, k), in float64.

    ``packed`` None: a new float64 array of them. Element by element, so the same values as
    packing ``full`` first and adding (or casting) the packed copy, without that copy.
    """
    groups, k = full.shape[0], full.shape[-1]
    if packed is None:
        packed = np.empty((groups, k * (k + 1) // 2), np.float64)
        for i, span in _upper_rows(k):
            packed[:, span] = full[:, i, i:]
        return packed
    for i, span in _upper_rows(k):
        packed[:, span] += full[:, i, i:]
    return packed


def symmetric(packed: np.ndarray, k: int) -> np.ndarray:
    """The (G, k, k) symmetric matrices whose upper triangles :func:`add_upper` packed."""
    out = np.empty((packed.shape[0], k, k), packed.dtype)
    for i, span in _upper_rows(k):  # row i from the diagonal, and column i below it
        row = packed[:, span]
        out[:, i, i:] = row
        out[:, i + 1 :, i] = row[:, 1:]
    return out


class Products:
    """One thread that multiplies the Hessians' rows while the calling thread goes on.

    The calibrate pass folds every batch on one thread (ranges, histograms, Hessians) while
    onnxruntime runs the next ones; the Hessians' float32 products were most of that thread's
    time, with a core idle beside it. The jobs run one at a time in the order they were handed
    in, so every Hessian sees the same operations in the same order as on the calling thread:
    the same bits. At most :data:`QUEUED_BYTES` of rows wait; past it :meth:`submit` waits for
    the oldest jobs. An error in a job is raised by :meth:`HessianObserver.hessian` (or by
    :func:`products_beside` when the pass ends).
    """

    def __init__(self, max_bytes: int = QUEUED_BYTES):
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="onnxq-hessians")
        self._queued: collections.deque[tuple[Future[None], int]] = collections.deque()
        self._bytes = 0

    def full(self, nbytes: int) -> bool:
        """Whether a job of ``nbytes`` would wait for the jobs before it (:meth:`submit`)."""
        while self._queued and self._queued[0][0].done():
            self._retire_oldest()
        return bool(self._queued) and self._bytes + nbytes > self.max_bytes

    def submit(self, job: Callable[[], None], nbytes: int) -> Future[None]:
        """Run ``job`` after the jobs handed in before it; ``nbytes``: the rows it holds."""
        while self.full(nbytes):
            self._retire_oldest()
        future = self._pool.submit(job)
        self._queued.append((future, nbytes))
        self._bytes += nbytes
        return future

    def _retire_oldest(self) -> None:
        """Wait for the oldest job (raising its error) and stop counting its rows."""
        done, size = self._queued.popleft()
        self._bytes -= size
        done.result()

    def close(self) -> None:
        """Wait for every job (raising the first error) and stop the thread."""
        try:
            while self._queued:
                self._retire_oldest()
        finally:
            self._pool.shutdown(wait=True)


@contextlib.contextmanager
def products_beside(taps: Iterable[Any]) -> Iterator[None]:
    """The Hessians among ``taps`` multiply their rows on one thread of their own meanwhile.

    On leaving, every product is done (and an error in one raised); the observers multiply
    on their caller's thread again.
    """
    hessians = [t for t in taps if isinstance(t, HessianObserver)]
    if not hessians:
        yield
        return
    worker = Products()
    for h in hessians:
        h.worker = worker
    try:
        yield
    finally:
        try:
            for h in hessians:
                h._wait()
        finally:
            for h in hessians:
                h.worker = None
            worker.close()


class HessianObserver:
    """Accumulates ``H = E[x xᵀ]`` per group from a layer's input batches.

    ``groups`` × ``inputs``: the Hessian's shape (G, K); ``batches``: how many batches the data
    has, when known. The layer takes about :func:`total_rows` rows in all, spread evenly over
    the batches (else up to :func:`row_cap` from each of the first batches until it has them).
    Each batch gives its rows from itself alone (positions spread evenly over each sample); rows are
    buffered within a block of batches up to :data:`FLUSH_BYTES` or :data:`FLUSH_ROWS` (and
    sooner when all layers' buffers pass onnxq.calibrate.statistics.PENDING_BYTES) and
    multiplied as one float32 product per group (relative error ~1e-7), the block's products
    summed in float64 in their fixed order (a function of the block's batches alone), and each
    block's sum added to an order-independent float64 sum (:class:`~onnxq.solve.sums.PairSum`):
    calibration split over workers by blocks gives the same Hessian as one process.
    """

    def __init__(
        self, conv: ConvShape | None, groups: int, inputs: int, batches: int | None = None
    ):
        self.conv = conv
        self.inputs = inputs
        total = total_rows(groups, inputs)
        per_batch = row_cap(inputs) if not batches else -(-total // batches)
        self.per_batch = int(min(MAX_ROWS, max(1, per_batch)))
        #: the batches that give rows: the first ones, each its share (by index, so a batch
        #: gives the same rows whichever process sees it)
        self.batches_used = -(-total // self.per_batch)
        self.total = self.per_batch * self.batches_used
        #: the number of batches is not known: every batch gives rows (up to ``per_batch``)
        #: until the layer has ``total``, however few a batch holds (batches of one sample
        #: gave a 14 × 14 layer 196 rows each, counted as 4,096)
        self.by_rows = not batches
        self._gathered = 0
        self.sum = PairSum()
        self.rows = 0
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._pending_bytes = 0
        #: the open block's sum of products (float64, the upper triangle: :func:`upper`),
        #: added to ``sum`` when the block closes
        self._block_sum: np.ndarray | None = None
        self._seen = 0
        self._block: int | None = None
        #: where the products run (:func:`products_beside`); None: on the caller's thread
        self.worker: Products | None = None
        self._jobs: list[Future[None]] = []

    def observe(self, x: np.ndarray, index: int | None = None, block: int | None = None) -> None:
        """Add batch ``index`` of the layer's input (by default the next one).

        ``block``: the block of consecutive batches it belongs to (default: its own). Rows are
        buffered within a block only, so the sums are the same when blocks go to different
        processes (onnxq.calibrate.shards).
        """
        if index is None:
            index = self._seen
        self._seen = index + 1
        block = index if block is None else block
        if block != self._block:
            self._flush()
            self._block = block
        if self._has_rows(index):
            return
        x = np.asarray(x, np.float32)
        if self.conv is None:
            cols = dense_patches(x, self.per_batch)
        else:
            cols = conv_patches(x, self.conv, self.per_batch)
        if not cols.shape[2]:
            return
        self._pending.append(cols)
        self._pending_rows += cols.shape[2]
        self._pending_bytes += cols.nbytes
        self._gathered += cols.shape[2]
        # the batch that gives the last rows multiplies them now, not when the Hessian is
        # taken: the same product (nothing joins it), without every layer's buffer held to
        # the end of the stream (95 MB on a YOLOv8n at 320 px)
        last = self._has_rows(index + 1)
        if last or self._pending_rows >= FLUSH_ROWS or self._pending_bytes >= FLUSH_BYTES:
            self._product()

    def _has_rows(self, index: int) -> bool:
        """Whether the layer needs no rows from batch ``index`` (its rows are all in)."""
        if self.by_rows:
            return self._gathered >= self.total
        return index >= self.batches_used

    @property
    def pending_bytes(self) -> int:
        """Bytes of rows buffered, waiting for their product."""
        return self._pending_bytes

    @property
    def pending_rows(self) -> int:
        """Rows buffered, waiting for their product."""
        return self._pending_rows

    def multiply(self) -> None:
        """Add the buffered rows to the open block's sum now (the caller bounds all buffers)."""
        self._product()

    def close_block(self) -> None:
        """Close the open block now (the next batch starts another)."""
        self._flush()

    def _product(self) -> None:
        """Add the buffered rows' ``x xᵀ`` to the open block's sum (now, or on the worker)."""
        if not self._pending:
            return
        pending, nbytes = self._pending, self._pending_bytes
        self._pending, self._pending_rows, self._pending_bytes = [], 0, 0
        self._run(functools.partial(self._multiply, pending), nbytes)

    def _multiply(self, pending: list[np.ndarray]) -> None:
        """The product of ``pending``'s rows, added to the open block's sum.

        A plain float64 sum: within a block the order of the products is fixed. Only the upper
        triangle is summed and kept (the product is symmetric: numpy computes ``A Aᵀ`` as one
        triangle, mirrored): half the memory of every layer's Hessian while calibrating.
        """
        cols = np.concatenate(pending, axis=2)
        del pending[:]
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is seen by its user
            full = np.matmul(cols, np.swapaxes(cols, 1, 2))
        if self._block_sum is not None and not self._block_sum.flags.writeable:
            self._block_sum = self._block_sum.copy()  # a shard's, back from Ray's object store
        self._block_sum = add_upper(full, self._block_sum)
        self.rows += cols.shape[2]

    def _flush(self) -> None:
        """Close the block: its sum goes to the order-independent sum once.

        A PairSum addition is seven passes over a float64 ``K × K`` array (71 ms for a Hessian
        of 2,304 inputs, 3.4× the product of 455 rows it added): one per block, not one per
        product, took OriNet's calibrate step from 2.5 to 1.3 s.
        """
        self._product()
        if self._jobs or self._block_sum is not None:  # else no block is open
            self._run(self._close_block, 0)

    def _close_block(self) -> None:
        if self._block_sum is not None:
            self.sum.add(self._block_sum, own=True)
            self._block_sum = None

    def _run(self, job: Callable[[], None], nbytes: int) -> None:
        """``job`` now, or after this observer's earlier jobs on :attr:`worker`."""
        if self.worker is None:
            self._wait()
            job()
            return
        while self._jobs and self._jobs[0].done():
            self._jobs.pop(0).result()
        if not self._jobs and self.worker.full(nbytes):
            job()  # the worker is behind and nothing of this Hessian waits there: no order
            return  # to keep, so the caller's thread does this one rather than wait
        self._jobs.append(self.worker.submit(job, nbytes))

    def _wait(self) -> None:
        """Until every product handed to the worker is in the sums (its error raised)."""
        while self._jobs:
            self._jobs.pop(0).result()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a shard's observer sent back) with its products done, without the worker."""
        self._wait()
        state = dict(self.__dict__)
        state["worker"], state["_jobs"] = None, []
        return state

    def merge(self, other: HessianObserver) -> None:
        """Fold in another shard's rows."""
        self._flush()
        self._wait()
        other._flush()
        other._wait()
        self.sum.merge(other.sum)
        self.rows += other.rows

    def release(self) -> None:
        """Let go of the accumulated sums (after :meth:`hessian` was taken)."""
        self._wait()
        self.sum = PairSum()
        self._block_sum = None
        self._pending = []

    def hessian(self) -> np.ndarray | None:
        """The mean ``x xᵀ`` per group (G, K, K), or None before any batch."""
        self._flush()
        self._wait()
        if self.sum.empty:
            return None
        packed = self.sum.value()
        packed /= max(self.rows, 1)
        return symmetric(packed, self.inputs)
