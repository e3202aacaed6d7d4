"""Streaming histogram calibration: Percentile, Entropy (KL) and MSE.

One :class:`Histogram` per tensor holds ``bins`` counts over ``[-R, R]`` plus the exact minimum
and maximum. ``R`` is a power of two, the smallest above the first batch's largest magnitude,
and doubles when a later batch reaches it; doubling merges adjacent bins pairwise, which is
exact (the bin width is a power of two, so a value's bin index halves exactly), so the histogram
never needs the data again and is the same for any order of the batches: shards of the data
(``--workers``) merge into the histogram of one pass. Memory is ``bins × 8`` bytes per tensor
whatever the number of samples.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from onnxq.core.callbacks import CalibrationInfo, ObserverCallback
from onnxq.core.errors import CalibrationError, ConfigError
from onnxq.core.qparams import params_from_range, qrange
from onnxq.core.specs import QTensor

DEFAULT_BINS = 2048
#: values of one sample (one row of the leading axis) a histogram takes at least; past
#: :data:`SAMPLE_FROM` times that, a strided sample of them (:func:`sample`)
SAMPLE_VALUES = 16384
#: the smallest stride used: primes from here on share no factor with the sizes of tensor axes
#: (products of 2, 3, 5 and 7 in practice), so a sample does not keep to a few columns
SAMPLE_FROM = 11
_CHUNK = 1 << 15
_SCRATCH: list[np.ndarray] = []


def _scratch() -> tuple[np.ndarray, np.ndarray]:
    """Two reusable buffers of ``_CHUNK`` float32 / intp values (one pair per process)."""
    if not _SCRATCH:
        _SCRATCH.extend([np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.intp)])
    return _SCRATCH[0], _SCRATCH[1]


@functools.cache
def _stride(per_row: int) -> int:
    """The largest prime ≥ :data:`SAMPLE_FROM` keeping at least SAMPLE_VALUES of ``per_row``."""
    want = per_row // SAMPLE_VALUES
    for s in range(want, SAMPLE_FROM - 1, -1):
        if all(s % d for d in range(2, int(s**0.5) + 1)):
            return s
    return 1


def sample(x: np.ndarray) -> np.ndarray:
    """The values a histogram counts: every one, or a strided sample of each sample's.

    Ranges need the shape of the distribution, not every value: a tensor of more than
    SAMPLE_FROM × SAMPLE_VALUES values a sample keeps every s-th of them (s prime, at least
    SAMPLE_VALUES kept), row by row of the leading axis, so that the values kept do not depend
    on how the samples are batched. The extremes are taken from all values by the caller.
    """
    rows = x.shape[0] if x.ndim > 1 else 1
    per_row = x.size // rows if rows else 0
    stride = _stride(per_row) if per_row else 1
    if stride == 1:
        return x.ravel()
    return x.reshape(rows, per_row)[:, ::stride].ravel()


#: the narrowest range a histogram spans: its bins per unit must fit in float32 (values of
#: 1e-37 overflowed them), and ranges this small get onnxq's smallest scale anyway
MIN_HALF_RANGE = 2.0**-100


def power_above(value: float) -> float:
    """The smallest power of two strictly above ``value`` (> 0)."""
    mantissa, exponent = np.frexp(value)  # value = mantissa · 2**exponent, mantissa in [0.5, 1)
    return float(np.ldexp(1.0, int(exponent))) if mantissa > 0 else 0.0


def _doubled(counts: np.ndarray) -> np.ndarray:
    """``counts`` on a grid twice as wide: adjacent bins added pairwise, centred (exact)."""
    bins = counts.size
    out = np.zeros(bins, np.int64)
    q = bins // 4
    out[q : q + bins // 2] = counts.reshape(-1, 2).sum(axis=1)
    return out


class Histogram:
    """Counts of values in ``bins`` equal bins over ``[-R, R]``, grown by doubling ``R``."""

    #: count :func:`sample`'s values instead of every one: for ranges that weigh the whole
    #: distribution (MSE); the far tail that Percentile and Entropy read needs every value
    sampled = False

    def __init__(self, bins: int = DEFAULT_BINS):
        if bins < 64 or bins % 2:
            raise ConfigError(f"--bins {bins} must be an even number >= 64")
        self.bins = bins
        self.counts = np.zeros(bins, np.int64)
        self.half_range = 0.0
        self.zeros = 0  # values seen while the range was still 0
        self.exact_zeros = 0  # all values exactly 0 (they quantize exactly at any range)
        self.min = np.inf
        self.max = -np.inf
        self._cache: dict[tuple[str, bool], tuple[float, float]] = {}

    def compute(self, dtype: str = "uint8", symmetric: bool = False) -> tuple[float, float]:
        """The range for ``dtype``, computed once per (dtype, symmetric) until more data."""
        key = (dtype, symmetric)
        if key not in self._cache:
            self._cache[key] = self._compute(dtype, symmetric)
        return self._cache[key]

    def _compute(self, dtype: str, symmetric: bool) -> tuple[float, float]:
        return float(self.min), float(self.max)

    def observe(self, x: np.ndarray) -> None:
        """Add a batch of values (samples on the leading axis, see :func:`sample`)."""
        x = np.asarray(x, np.float32)
        if x.size:
            self.observe_range(x, float(x.min()), float(x.max()))

    def observe_range(self, x: np.ndarray, lo: float, hi: float) -> None:
        """Add a batch of finite values whose extremes ``lo``, ``hi`` the caller knows.

        The counts are of :func:`sample`'s values when :attr:`sampled`; the extremes of all.
        """
        x = np.asarray(x, np.float32)
        x = sample(x) if self.sampled else x.ravel()
        if not x.size:
            return
        self._cache.clear()
        # x == 0 then a count of the booleans: 3-4x faster than count_nonzero on float32
        self.exact_zeros += int(np.count_nonzero(x == 0))
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        need = max(-lo, hi)
        if need == 0.0:
            if self.half_range == 0.0:
                self.zeros += x.size
                return
        elif self.half_range == 0.0:
            self.half_range = max(power_above(need), MIN_HALF_RANGE)
            self.counts[self.bins // 2] += self.zeros
            self.zeros = 0
        while need >= self.half_range:
            self._double()
        # bins per unit: a power of two (the range is), so x·k is exact in float32 and its
        # floor is the bin below the centre, with no float64 copy of the batch
        k = np.float32(self.bins / (2 * self.half_range))
        # fixed-size chunks through reused scratch buffers: no fresh large allocations (and their
        # page faults) per batch, and the working set stays in cache. Counts start at the bin
        # of the batch's lowest value (the same float32 product as the values'), so a small
        # tensor (a Loop body's iteration) pays for its values, not for every bin; floor writes
        # the indices directly (one pass fewer than flooring in place and converting)
        pos, idx = _scratch()
        lowest = int(np.floor(np.float32(lo) * k))
        at = lowest + self.bins // 2  # |x| < R: every index plus bins // 2 is in [0, bins)
        for start in range(0, x.size, _CHUNK):
            part = x[start : start + _CHUNK]
            n = part.size
            np.multiply(part, k, out=pos[:n])
            np.floor(pos[:n], out=idx[:n], casting="unsafe")
            idx[:n] -= lowest
            found = np.bincount(idx[:n])
            self.counts[at : at + found.size] += found

    def bounded(self, lo: float, hi: float) -> Histogram:
        """A copy whose values outside ``[lo, hi]`` sit at the bound instead.

        For a tensor whose readers saturate outside the bound: the error of a clipped value is
        measured from where the reader sees it. Searching the unbounded histogram and cutting
        afterwards let the far side steer the range (an MSE range of [-15, 4] chosen for a
        Conv's mass below -3, cut to [-3, 4] for its HardSwish, clipped the top for nothing).
        """
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._cache = {}
        other.counts = self.counts.copy()
        other.min = min(max(self.min, lo), hi)
        other.max = max(min(self.max, hi), lo)
        if not lo <= 0.0 <= hi:
            other.exact_zeros = 0
        if self.half_range > 0.0:
            e = self.edges()
            first = int(np.clip(np.searchsorted(e, lo, side="right") - 1, 0, self.bins - 1))
            last = int(np.clip(np.searchsorted(e, hi, side="right") - 1, 0, self.bins - 1))
            other.counts[first] += other.counts[:first].sum()
            other.counts[:first] = 0
            other.counts[last] += other.counts[last + 1 :].sum()
            other.counts[last + 1 :] = 0
        return other

    def _double(self) -> None:
        self.counts = _doubled(self.counts)
        self.half_range *= 2.0

    def merge(self, other: Histogram) -> None:
        """Fold in another shard's histogram of the same number of bins (exact).

        Both ranges are powers of two: the narrower is doubled to the wider and the counts
        added, which gives the histogram one pass over both shards' values would have.
        """
        if other.bins != self.bins:
            raise CalibrationError(
                f"cannot merge a histogram of {other.bins} bins into one of {self.bins}"
            )
        self._cache.clear()
        self.exact_zeros += other.exact_zeros
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        if other.half_range == 0.0:
            self._add_unplaced(other.zeros)
            return
        theirs, r = other.counts.copy(), other.half_range
        theirs[self.bins // 2] += other.zeros
        if self.half_range == 0.0:
            zeros, self.zeros = self.zeros, 0
            self.counts, self.half_range = theirs, r
            self.counts[self.bins // 2] += zeros
            return
        while r < self.half_range:
            theirs, r = _doubled(theirs), r * 2.0
        while self.half_range < r:
            self._double()
        if r != self.half_range:
            raise CalibrationError(
                f"cannot merge histograms over ±{r} and ±{self.half_range}: their ranges "
                "must be powers of two (histograms of this version of onnxq)"
            )
        self.counts = self.counts + theirs

    def _add_unplaced(self, zeros: int) -> None:
        """Values of exactly 0 seen by a shard whose range was still 0."""
        if self.half_range == 0.0:
            self.zeros += zeros
        else:
            self.counts[self.bins // 2] += zeros

    @property
    def total(self) -> int:
        """Number of values observed."""
        return int(self.counts.sum()) + self.zeros

    def edges(self) -> np.ndarray:
        """Bin edges (``bins + 1`` values)."""
        r = self.half_range
        return np.linspace(-r, r, self.bins + 1)

    def centers(self) -> np.ndarray:
        """Bin centres."""
        e = self.edges()
        return (e[:-1] + e[1:]) / 2

    def quantile(self, q: float) -> float:
        """Value below which a fraction ``q`` of the observations lie (linear within a bin)."""
        if self.half_range == 0.0:
            return 0.0
        cdf = np.cumsum(self.counts) / max(self.counts.sum(), 1)
        i = int(np.searchsorted(cdf, q, side="left"))
        i = min(i, self.bins - 1)
        prev = cdf[i - 1] if i > 0 else 0.0
        frac = (q - prev) / (cdf[i] - prev) if cdf[i] > prev else 0.0
        e = self.edges()
        return float(e[i] + frac * (e[i + 1] - e[i]))

    def nbytes(self) -> int:
        """Bytes retained."""
        return int(self.counts.nbytes) + 40


class PercentileObserver(Histogram):
    """Range ``[q(1 - p), q(p)]`` of the histogram, ``p`` the percentile (default 99.999)."""

    def __init__(self, percentile: float = 99.999, bins: int = DEFAULT_BINS):
        if not 50.0 < percentile <= 100.0:
            raise ConfigError(f"--percentile {percentile} must be in (50, 100]")
        super().__init__(bins)
        self.percentile = percentile

    def _compute(self, dtype: str, symmetric: bool) -> tuple[float, float]:
        """The percentile range, clipped to the observed extremes."""
        if self.total == 0:
            return 0.0, 0.0
        p = self.percentile / 100.0
        lo = max(self.min, self.quantile(1.0 - p)) if self.min < 0 else self.min
        hi = min(self.max, self.quantile(p)) if self.max > 0 else self.max
        return lo, hi


class EntropyObserver(Histogram):
    """The clipping threshold minimising KL(P‖Q) between the clipped and quantized histograms.

    The signed histogram is folded into ``|x|`` (exact, since bins are symmetric about 0). For
    each candidate threshold ``T`` (bin ``i``): P is the histogram up to ``i`` with the outliers
    added to the last bin; Q merges P into ``levels`` quantization levels and spreads each level's
    mass evenly over its non-empty bins. ``levels`` is the number of quantized values on one side
    of zero: 128 for two-sided data, the full 256 when the data never goes below zero. Exact
    zeros are left out of the search: zero is always exactly representable.
    """

    def __init__(self, bins: int = DEFAULT_BINS):
        super().__init__(bins)

    def threshold(self, levels: int) -> float:
        """The KL-optimal threshold on ``|x|``."""
        half = self.bins // 2
        absh = (self.counts[half:] + self.counts[:half][::-1]).astype(np.float64)
        # exact zeros (a Relu's or padding's) are represented exactly whatever the threshold;
        # left in, their spike in the first bin drags the threshold down
        absh[0] = max(absh[0] - self.exact_zeros, 0.0)
        nz = np.nonzero(absh)[0]
        if not nz.size:
            return 0.0
        last = int(nz[-1]) + 1
        width = self.half_range / half
        if last <= levels:
            return last * width
        candidates = np.arange(levels, last + 1)
        kl = _kl_all(absh, candidates, levels)
        # ties (spiky data each chunk reproduces exactly, KL 0 from the first candidate on) go
        # to the widest threshold: KL cannot see what clipping costs, so clip no more than needed
        best = int(np.flatnonzero(kl <= np.min(kl) + 1e-12)[-1])
        return float(candidates[best]) * width

    def _compute(self, dtype: str, symmetric: bool) -> tuple[float, float]:
        """Observed range clipped to ``±T``."""
        if self.total == 0 or self.half_range == 0.0:
            return 0.0, 0.0
        qmin, qmax = qrange(dtype)
        one_sided = self.min >= 0 or self.max <= 0
        levels = (qmax - qmin + 1) if one_sided else (qmax - qmin + 1) // 2
        t = self.threshold(levels)
        return max(self.min, -t), min(self.max, t)


def _kl_all(absh: np.ndarray, candidates: np.ndarray, levels: int) -> np.ndarray:
    """KL(P‖Q) for every candidate threshold bin ``i`` at once, from cumulative sums.

    Inside a level's chunk Q is constant on the non-empty bins, so
    ``Σ_k P_k log q_k = Σ_chunks log(M/n) · Σ_chunk P_k`` and ``Σ_k P_k log P_k`` comes from a
    cumulative sum of ``h log h``; each candidate costs O(levels) instead of O(bins).
    """
    h = absh
    total = float(h.sum())
    hlogh = np.where(h > 0, h * np.log(np.where(h > 0, h, 1.0)), 0.0)
    cum_h = np.concatenate([[0.0], np.cumsum(h)])
    cum_hl = np.concatenate([[0.0], np.cumsum(hlogh)])
    cum_nz = np.concatenate([[0], np.cumsum(h > 0)])
    i = candidates[:, None].astype(np.int64)
    j = np.arange(levels)[None, :]
    start = (j * i) // levels
    end = ((j + 1) * i) // levels
    mass = cum_h[end] - cum_h[start]
    filled = cum_nz[end] - cum_nz[start]
    log_q = np.where(
        (filled > 0) & (mass > 0),
        np.log(np.where(mass > 0, mass, 1.0) / np.maximum(filled, 1)),
        0.0,
    )
    end_excl = end.copy()
    end_excl[:, -1] = i[:, 0] - 1  # the last bin also carries the outliers: handled apart
    inner = cum_h[end_excl] - cum_h[start]
    i1 = i[:, 0]
    last_h = h[i1 - 1]
    p_last = last_h + (total - cum_h[i1])
    q_total = cum_h[i1]
    sum_plogp = cum_hl[i1 - 1] + np.where(
        p_last > 0, p_last * np.log(np.maximum(p_last, 1e-300)), 0.0
    )
    # a candidate with no mass below it (near-discrete data: every value in a few far bins)
    # has no Q at all; it was NaN, and argmin picks the first NaN: a 0.25 dB threshold
    empty = q_total <= 0
    q_total = np.where(empty, 1.0, q_total)
    sum_plogq = np.sum(inner * log_q, axis=1) - np.log(q_total) * cum_h[i1 - 1]
    q_last = np.where(last_h > 0, mass[:, -1] / np.maximum(filled[:, -1], 1), 0.0)
    q_last_hat = np.maximum(q_last / q_total, 1e-12)
    kl = (sum_plogp / total - np.log(total)) - (
        sum_plogq / total + (p_last / total) * np.log(q_last_hat)
    )
    return np.where(empty | ~np.isfinite(kl), np.inf, kl)


class MSEObserver(Histogram):
    """The range ``α·[min, max]`` minimising the expected squared quantization error.

    For every ``α`` on a grid the bin centres are quantized and dequantized with the parameters
    the range gives (the real dtype, zero point and clipping), and the error is weighted by the
    bin counts: ``E(α) = Σ_b n_b (c_b − dq(q(c_b)))²``. The counts are of a strided sample of
    each large tensor (:func:`sample`): the error weighs the whole distribution, which the
    sample keeps, and the grid of ``α`` scales the exact extremes.
    """

    sampled = True

    def __init__(self, bins: int = DEFAULT_BINS, grid: int = 100):
        super().__init__(bins)
        self.alphas = np.linspace(1.0 / grid, 1.0, grid)

    def _compute(self, dtype: str, symmetric: bool) -> tuple[float, float]:
        """The error-minimising range."""
        if self.total == 0 or self.half_range == 0.0:
            return 0.0, 0.0
        lo, hi = min(self.min, 0.0), max(self.max, 0.0)
        errors = self.errors(self.alphas * lo, self.alphas * hi, dtype, symmetric)
        a = float(self.alphas[int(np.argmin(errors))])
        return a * lo, a * hi

    def errors(self, lo: np.ndarray, hi: np.ndarray, dtype: str, symmetric: bool) -> np.ndarray:
        """Expected squared error of quantizing the histogram with each range [lo_i, hi_i].

        One (ranges × bins) array: the whole grid costs one numpy pass, not one per range.
        """
        qp = params_from_range(np.asarray(lo), np.asarray(hi), dtype, symmetric, axis=0)
        qmin, qmax = qrange(dtype)
        c = self.centers()[None, :]
        scale = qp.scale.astype(np.float64).reshape(-1, 1)
        zp = qp.zero_point.astype(np.float64).reshape(-1, 1)
        dq = (np.clip(np.round(c / scale) + zp, qmin, qmax) - zp) * scale
        return np.sum(self.counts * (c - dq) ** 2, axis=1)


class PercentileCallback(ObserverCallback):
    """Calibrate activations to a percentile range of a streaming histogram."""

    def __init__(self, percentile: float = 99.999, bins: int = DEFAULT_BINS):
        PercentileObserver(percentile, bins)  # validate early
        self.percentile, self.bins = percentile, bins
        self.observer_key = f"percentile@{percentile}/{bins}"

    def make_observer(self) -> PercentileObserver:
        """A fresh histogram."""
        return PercentileObserver(self.percentile, self.bins)


class EntropyCallback(ObserverCallback):
    """Calibrate activations to the KL-optimal threshold of a streaming histogram."""

    def __init__(self, bins: int = DEFAULT_BINS):
        Histogram(bins)
        self.bins = bins
        self.observer_key = f"entropy/{bins}"

    def make_observer(self) -> EntropyObserver:
        """A fresh histogram."""
        return EntropyObserver(self.bins)


class MSECallback(ObserverCallback):
    """Calibrate activations to the range minimising the expected quantization error."""

    def __init__(self, bins: int = DEFAULT_BINS):
        Histogram(bins)
        self.bins = bins
        self.observer_key = f"mse/{bins}"

    def make_observer(self) -> MSEObserver:
        """A fresh histogram."""
        return MSEObserver(self.bins)


#: what a histogram holds: every observer reading it needs these and nothing else
_COUNTED = ("bins", "counts", "half_range", "zeros", "exact_zeros", "min", "max")


class HistogramViewCallback(ObserverCallback):
    """One histogram method's ranges read from another's histograms, without a stream of its own.

    Every histogram method counts the same bins (the grid depends only on the data and
    ``bins``), so after one calibration stream for ``base`` (MSE, say) the Percentile and
    Entropy ranges of the same samples can be read from it: the held-back choice
    (onnxq.passes.choose) weighs the Percentile ones. ``base`` counts a strided sample of large
    tensors where ``method`` alone would count every value (:attr:`Histogram.sampled`), so its
    far tail is that sample's.
    """

    def __init__(self, base: ObserverCallback, method: ObserverCallback):
        self.observer_key = base.observer_key
        self.method = method

    def observed(self, info: CalibrationInfo, qt: QTensor) -> Histogram:
        """``method``'s observer holding the tensor's counts (shared, not copied)."""
        counted: Any = info.observer(qt.tensor)
        view: Any = self.method.make_observer()
        if view.bins != counted.bins:
            raise CalibrationError(
                f"cannot read {qt.tensor}'s histogram of {counted.bins} bins as one of "
                f"{view.bins}: give both methods the same --bins"
            )
        for name in _COUNTED:
            setattr(view, name, getattr(counted, name))
        return view
