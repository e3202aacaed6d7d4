"""MinMax calibration: the range is the extreme values seen over all batches."""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxq.core.callbacks import CalibrationInfo, ObserverCallback
from onnxq.core.specs import QTensor


class MinMaxObserver:
    """Running ``rmin = min over batches of min(x)``, ``rmax = max over batches of max(x)``."""

    def __init__(self) -> None:
        self.rmin = np.inf
        self.rmax = -np.inf

    def observe(self, x: np.ndarray) -> None:
        """Fold one batch into the running extrema."""
        if x.size:
            self.rmin = min(self.rmin, float(np.min(x)))
            self.rmax = max(self.rmax, float(np.max(x)))

    def observe_range(self, x: np.ndarray, lo: float, hi: float) -> None:
        """Fold in a batch whose extremes the caller found already."""
        self.rmin = min(self.rmin, lo)
        self.rmax = max(self.rmax, hi)

    def merge(self, other: MinMaxObserver) -> None:
        """Fold in another shard's extrema (exact: the same as one pass over both)."""
        self.rmin = min(self.rmin, other.rmin)
        self.rmax = max(self.rmax, other.rmax)

    def compute(self, dtype: str = "uint8", symmetric: bool = False) -> tuple[float, float]:
        """The extrema seen (0, 0 when nothing was observed)."""
        if self.rmin > self.rmax:
            return 0.0, 0.0
        return float(self.rmin), float(self.rmax)

    def nbytes(self) -> int:
        """Two floats."""
        return 16


class MinMaxCallback(ObserverCallback):
    """Calibrate every activation with :class:`MinMaxObserver`."""

    observer_key = "minmax"

    def make_observer(self) -> MinMaxObserver:
        """A fresh MinMax observer."""
        return MinMaxObserver()


class ExtremaCallback(ObserverCallback):
    """MinMax ranges read from the observers of a histogram method, without a stream of its own.

    Every histogram keeps the exact extremes of what it counted, so after one calibration
    stream for ``base`` (MSE, say) the MinMax ranges of the same samples are known too: the
    held-back choice (onnxq.passes.choose) weighs both.
    """

    def __init__(self, base: ObserverCallback):
        self.observer_key = base.observer_key

    def observed(self, info: CalibrationInfo, qt: QTensor) -> MinMaxObserver:
        """A MinMax observer holding the tensor's histogram's extremes (never sampled)."""
        histogram: Any = info.observer(qt.tensor)
        extrema = MinMaxObserver()
        extrema.rmin, extrema.rmax = histogram.min, histogram.max
        return extrema
