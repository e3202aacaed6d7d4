"""AverageMax calibration: moving average of per-batch extrema (robust to rare outliers)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from onnxq.core.callbacks import ObserverCallback
from onnxq.core.errors import CalibrationError, ConfigError


class AverageMaxObserver:
    """``r ← r + c·(batch extreme − r)`` per batch, ``c = momentum``; ``c = None`` is the mean.

    With ``momentum=None`` (default) the result is the plain mean of per-batch minima and maxima
    over all batches, independent of batch order: the sums are kept exactly (as fractions), so
    shards merged in any order give the same bits as one pass.
    """

    def __init__(self, momentum: float | None = None) -> None:
        if momentum is not None and not 0.0 < momentum <= 1.0:
            raise ConfigError(f"AverageMax momentum {momentum} must be in (0, 1]")
        self.momentum = momentum
        self.count = 0
        self.rmin = 0.0
        self.rmax = 0.0
        #: exact sums of the per-batch extrema (the mean, momentum None)
        self._sums = (Fraction(0), Fraction(0))

    def observe(self, x: np.ndarray) -> None:
        """Fold one batch's extrema into the averages."""
        if not x.size:
            return
        lo, hi = float(np.min(x)), float(np.max(x))
        self.count += 1
        if self.momentum is None:
            self._sums = (self._sums[0] + Fraction(lo), self._sums[1] + Fraction(hi))
            self.rmin = float(self._sums[0] / self.count)
            self.rmax = float(self._sums[1] / self.count)
            return
        c = 1.0 if self.count == 1 else self.momentum
        self.rmin += c * (lo - self.rmin)
        self.rmax += c * (hi - self.rmax)

    def merge(self, other: AverageMaxObserver) -> None:
        """Fold in another shard's batches (the mean only: a moving average has an order)."""
        if self.momentum is not None or other.momentum is not None:
            raise CalibrationError(
                "AverageMax with a momentum depends on the order of the batches, so shards "
                "cannot be merged: calibrate in one process (--workers 1) or without momentum"
            )
        self.count += other.count
        self._sums = (self._sums[0] + other._sums[0], self._sums[1] + other._sums[1])
        if self.count:
            self.rmin = float(self._sums[0] / self.count)
            self.rmax = float(self._sums[1] / self.count)

    def compute(self, dtype: str = "uint8", symmetric: bool = False) -> tuple[float, float]:
        """The averaged extrema."""
        return float(self.rmin), float(self.rmax)

    def nbytes(self) -> int:
        """Three numbers."""
        return 24


class AverageMaxCallback(ObserverCallback):
    """Calibrate every activation with :class:`AverageMaxObserver`."""

    observer_key = "average_max"

    def __init__(self, momentum: float | None = None) -> None:
        self.momentum = momentum
        if momentum is not None:
            self.observer_key = f"average_max@{momentum}"
        AverageMaxObserver(momentum)  # validate early

    def make_observer(self) -> AverageMaxObserver:
        """A fresh AverageMax observer."""
        return AverageMaxObserver(self.momentum)
