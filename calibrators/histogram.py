"""Streaming histogram calibration: Percentile, Entropy (KL) and MSE.

One :class:`Histogram` per tensor holds ``bins`` counts over ``[-R, R]`` plus the exact minimum
and maximum. ``R`` starts at the first batch's largest magnitude and doubles when a later batch
exceeds it; doubling merges adjacent bins pairwise, which is exact, so the histogram never needs
the data again. Memory is ``bins × 8`` bytes per tensor whatever the number of samples.
"""

from __future__ import annotations

import numpy as np

from onnxq.calibration import ObserverCallback
from onnxq.errors import ConfigError
from onnxq.qparams import params_from_range, qrange

DEFAULT_BINS = 2048


class Histogram:
    """Counts of values in ``bins`` equal bins over ``[-R, R]``, grown by doubling ``R``."""

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
        """Add a batch of values."""
        x = np.asarray(x, np.float32).ravel()
        if not x.size:
            return
        self._cache.clear()
        lo, hi = float(x.min()), float(x.max())
        self.exact_zeros += int(x.size - np.count_nonzero(x))
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        need = max(-lo, hi)
        if need == 0.0:
            if self.half_range == 0.0:
                self.zeros += x.size
                return
        elif self.half_range == 0.0:
            self.half_range = need
            self.counts[self.bins // 2] += self.zeros
            self.zeros = 0
        while need > self.half_range:
            self._double()
        r = self.half_range
        pos = np.multiply(x, self.bins / (2 * r), dtype=np.float64)
        pos += self.bins / 2
        idx = pos.astype(np.int64)  # truncation is floor here: pos >= 0 up to rounding
        np.clip(idx, 0, self.bins - 1, out=idx)
        self.counts += np.bincount(idx, minlength=self.bins)

    def _double(self) -> None:
        merged = self.counts.reshape(-1, 2).sum(axis=1)
        self.counts = np.zeros(self.bins, np.int64)
        q = self.bins // 4
        self.counts[q : q + self.bins // 2] = merged
        self.half_range *= 2.0

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

    def __init__(self, bins: int = DEFAULT_BINS, candidates: int = 128):
        super().__init__(bins)
        self.candidates = candidates

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
        stride = max(1, (last - levels) // self.candidates)
        best_i, best_kl = last, np.inf
        for i in range(levels, last + 1, stride):
            kl = _kl_clipped(absh, i, levels)
            if kl < best_kl:
                best_i, best_kl = i, kl
        return best_i * width

    def _compute(self, dtype: str, symmetric: bool) -> tuple[float, float]:
        """Observed range clipped to ``±T``."""
        if self.total == 0 or self.half_range == 0.0:
            return 0.0, 0.0
        qmin, qmax = qrange(dtype)
        one_sided = self.min >= 0 or self.max <= 0
        levels = (qmax - qmin + 1) if one_sided else (qmax - qmin + 1) // 2
        t = self.threshold(levels)
        return max(self.min, -t), min(self.max, t)


def _kl_clipped(absh: np.ndarray, i: int, levels: int) -> float:
    p = absh[:i].copy()
    p[-1] += absh[i:].sum()
    starts = np.floor(np.arange(levels) * (i / levels)).astype(np.int64)
    mass = np.add.reduceat(absh[:i], starts)
    filled = np.add.reduceat((absh[:i] > 0).astype(np.float64), starts)
    per_bin = np.where(filled > 0, mass / np.maximum(filled, 1), 0.0)
    owner = np.repeat(np.arange(levels), np.diff(np.append(starts, i)))
    q = np.where(absh[:i] > 0, per_bin[owner], 0.0)
    ps, qs = p.sum(), q.sum()
    if ps == 0 or qs == 0:
        return np.inf
    p /= ps
    q /= qs
    mask = p > 0
    q_m = np.maximum(q[mask], 1e-12)
    return float(np.sum(p[mask] * np.log(p[mask] / q_m)))


class MSEObserver(Histogram):
    """The range ``α·[min, max]`` minimising the expected squared quantization error.

    For every ``α`` on a grid the bin centres are quantized and dequantized with the parameters
    the range gives (the real dtype, zero point and clipping), and the error is weighted by the
    bin counts: ``E(α) = Σ_b n_b (c_b − dq(q(c_b)))²``.
    """

    def __init__(self, bins: int = DEFAULT_BINS, grid: int = 100):
        super().__init__(bins)
        self.alphas = np.linspace(1.0 / grid, 1.0, grid)

    def _compute(self, dtype: str, symmetric: bool) -> tuple[float, float]:
        """The error-minimising range."""
        if self.total == 0 or self.half_range == 0.0:
            return 0.0, 0.0
        lo, hi = min(self.min, 0.0), max(self.max, 0.0)
        errors = [self.error(a * lo, a * hi, dtype, symmetric) for a in self.alphas]
        a = float(self.alphas[int(np.argmin(errors))])
        return a * lo, a * hi

    def error(self, lo: float, hi: float, dtype: str, symmetric: bool) -> float:
        """Expected squared error of quantizing the histogram with range [lo, hi]."""
        qp = params_from_range(lo, hi, dtype, symmetric)
        qmin, qmax = qrange(dtype)
        c = self.centers()
        scale, zp = float(qp.scale), float(qp.zero_point)
        dq = (np.clip(np.round(c / scale) + zp, qmin, qmax) - zp) * scale
        return float(np.sum(self.counts * (c - dq) ** 2))


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
