"""What one pass over the calibration data gathers, foldable batch by batch and mergeable.

:class:`Statistics` holds the observers of every tensor (ranges), the taps of later passes
(optimized rounding's Hessians), per-channel sums (bias correction) and the counters of the
report. One process folds its batches in with :meth:`Statistics.add`; shards of the data
(``--workers``, Ray) each fold their own and :meth:`Statistics.merge` adds them up:

* MinMax and AverageMax (without momentum): exact, so the ranges are byte-identical to one pass;
* histograms (Percentile, Entropy, MSE): counts are added on the coarser of the two grids, a
  bin of the finer one moving whole to the bin holding its centre: within one bin;
* channel sums and Hessians: sums kept as float64 pairs (onnxq.solve.sums), so their order
  does not show in the result; each batch gives the same rows to a Hessian wherever it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxq.core.errors import CalibrationError
from onnxq.solve.bias_correction import channel_means
from onnxq.solve.sums import PairSum

#: bytes of rows all layers' Hessians buffer at once (each buffers up to 4 MiB for one product:
#: 115 MiB on a ResNet-50 of 53 layers)
PENDING_BYTES = 32 << 20


@dataclass
class Statistics:
    """Observers per tensor, taps, channel sums and counts of one pass (or of merged shards)."""

    #: tensor -> its observers (ranges), in a fixed order
    observers: dict[str, list[Any]]
    #: tensor -> observers a later pass streams over the same batches (Hessians)
    taps: dict[str, list[Any]] = field(default_factory=dict)
    #: tensor -> the axis of its channels, for per-channel sums
    channel_axes: dict[str, int] = field(default_factory=dict)
    #: tensor -> (Min or Max, constant): the data is observed as that one reader sees it
    clamps: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)
    #: tensor -> (per-channel sums, values per channel)
    channel_sums: dict[str, tuple[PairSum, int]] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=dict)
    #: tensors with at least one finite value seen (a tensor of NaN/Inf only is refused)
    finite: set[str] = field(default_factory=set)
    #: tensor -> {batch number: largest finite magnitude}, for the outlier check
    #: (:func:`outlier_batches`)
    extremes: dict[str, dict[int, float]] = field(default_factory=dict)
    batches: int = 0
    samples: int = 0
    #: consecutive batches that go to one process together (set from the first batch):
    #: the taps buffer within a block only, so their sums do not depend on the split
    block: int | None = None

    def add(
        self, names: list[str], outs: list[Any], samples: int, index: int, release: bool = False
    ) -> None:
        """Fold batch ``index`` in: ``outs`` are the values of ``names`` for ``samples`` samples.

        ``release``: each entry of ``outs`` is set to None once folded, so the batch's memory
        goes down while it is folded and onnxruntime fills the next batch's outputs beside it
        (nudenet_320n: the calibrate pass's heap peak 558 -> 513 MB).
        """
        if self.block is None:
            self.block = block_size(samples)
        self.batches += 1
        self.samples += samples
        if index % self.block == 0:  # a new block: no rows of the last one wait any longer
            for tap in self._buffering():
                tap.close_block()
        for position, name in enumerate(names):
            arr = np.asarray(outs[position])
            if release:
                outs[position] = None
            lo, hi = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
            finite = bool(np.isfinite(lo + hi))
            for tap in self.taps.get(name, ()) if finite else ():
                # the batch as the layer reads it (skipped with NaN/Inf)
                tap.observe(arr, index=index, block=index // self.block)
            if not finite:  # NaN or ±Inf inside
                bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
                self.nonfinite[name] = self.nonfinite.get(name, 0) + bad
                arr = arr[np.isfinite(arr)]
                if arr.size == 0:
                    continue
            self.finite.add(name)
            top = max(-lo, hi) if finite else float(np.abs(arr).max())
            self.extremes.setdefault(name, {})[index] = top
            observers = self.observers.get(name, ())
            clamp = self.clamps.get(name)
            if clamp is not None and finite and observers:
                arr = (np.minimum if clamp[0] == "Min" else np.maximum)(arr, clamp[1])
            known = finite and clamp is None and arr.size and arr.dtype == np.float32
            for obs in observers:
                if known and hasattr(obs, "observe_range"):
                    obs.observe_range(arr, lo, hi)  # the extremes found above, not again
                else:
                    obs.observe(arr)
            if name in self.channel_axes:
                self._add_channel_sums(name, arr)
        self._bound_pending()

    def _buffering(self) -> list[Any]:
        """The taps that buffer rows for one product (optimized rounding's Hessians)."""
        return [t for taps in self.taps.values() for t in taps if hasattr(t, "pending_rows")]

    def _bound_pending(self) -> None:
        """Multiply buffered rows until all taps hold at most :data:`PENDING_BYTES`.

        The buffers holding the most rows first (a product's fixed cost is per buffer, its
        work per row). Decided on the batches of the open block alone, so a shard holding
        that block (``--workers``, Ray) buffers the same rows: the same Hessians.
        """
        waiting = [t for t in self._buffering() if t.pending_bytes]
        total = sum(t.pending_bytes for t in waiting)
        for tap in sorted(waiting, key=lambda t: -t.pending_rows):  # stable: ties in order
            if total <= PENDING_BYTES:
                break
            total -= tap.pending_bytes
            tap.multiply()

    def _add_channel_sums(self, name: str, arr: np.ndarray) -> None:
        axis = self.channel_axes[name]
        if arr.ndim <= axis:
            return
        sums, count = channel_means(arr, axis)
        total, seen = self.channel_sums.get(name, (PairSum(), 0))
        total.add(sums)
        self.channel_sums[name] = (total, seen + count)

    def channel_totals(self) -> dict[str, tuple[np.ndarray, int]]:
        """{tensor: (per-channel sums, values per channel)}."""
        return {n: (s.value(), c) for n, (s, c) in self.channel_sums.items() if not s.empty}

    def merge(self, other: Statistics) -> None:
        """Add ``other``'s statistics (a shard of the same data, same observers) to these."""
        for kind, mine, theirs in (
            ("observers", self.observers, other.observers),
            ("taps", self.taps, other.taps),
        ):
            for name, observers in mine.items():
                others = theirs.get(name, [])
                if len(others) != len(observers):
                    raise CalibrationError(
                        f"cannot merge the {kind} of tensor '{name}': {len(others)} in one "
                        f"shard, {len(observers)} in the other (shards must observe alike)"
                    )
                for obs, shard in zip(observers, others):
                    merge_observer(obs, shard, name)
        for name, (sums, count) in other.channel_sums.items():
            total, seen = self.channel_sums.get(name, (PairSum(), 0))
            total.merge(sums)
            self.channel_sums[name] = (total, seen + count)
        for name, bad in other.nonfinite.items():
            self.nonfinite[name] = self.nonfinite.get(name, 0) + bad
        self.finite |= other.finite
        for name, tops in other.extremes.items():
            self.extremes.setdefault(name, {}).update(tops)
        self.batches += other.batches
        self.samples += other.samples


#: samples a block of batches holds at least (see Statistics.block)
BLOCK_SAMPLES = 128


def block_size(samples: int) -> int:
    """Batches per block, for batches of ``samples`` samples."""
    return max(1, BLOCK_SAMPLES // max(samples, 1))


def merge_observer(obs: Any, other: Any, tensor: str) -> None:
    """``obs.merge(other)``, or a clear error for an observer that cannot merge."""
    merge = getattr(obs, "merge", None)
    if merge is None:
        raise CalibrationError(
            f"the observer {type(obs).__name__} of tensor '{tensor}' has no merge(other) "
            "method, so its statistics cannot be gathered in shards: give it one, or "
            "calibrate in one process (--workers 1)"
        )
    if type(other) is not type(obs):
        raise CalibrationError(
            f"cannot merge a {type(other).__name__} into a {type(obs).__name__} (tensor '{tensor}')"
        )
    merge(other)


#: a batch whose largest magnitude is this many times the median batch's is an outlier
OUTLIER_RATIO = 1000.0
#: batches needed before a median batch means anything
OUTLIER_MIN_BATCHES = 4


def outlier_batches(tops: dict[int, float]) -> tuple[list[int], float]:
    """The batches of one tensor whose largest magnitude dwarfs the rest, and the median's.

    One bad sample (a pixel of 1e6 where the data stays within 1) sets the range of every
    tensor it reaches: an int8 grid that wide rounds the other samples to zero, and no
    histogram method sees past it (its bins are as wide as the range allows). Robust: the
    median batch, not the mean.
    """
    if len(tops) < OUTLIER_MIN_BATCHES:
        return [], 0.0
    median = float(np.median(list(tops.values())))
    if median <= 0.0:
        return [], median
    return sorted(b for b, t in tops.items() if t > OUTLIER_RATIO * median), median
