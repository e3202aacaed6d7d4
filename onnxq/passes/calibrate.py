"""Calibrate: values for every placeholder, from data (or a saved range table).

Needs ``state.quantizer`` and ``state.data`` (or ``state.dataset`` opened by an earlier pass).
Leaves ``state.values``, ``state.dataset`` and
``state.calibrator`` (its report, ranges and the fp32 reference outputs the checks reuse).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from onnxq.calibrate.calibration import Calibrator
from onnxq.calibrate.dataset import HeldBack
from onnxq.calibrate.ranges import read_channel_means, read_ranges
from onnxq.calibrators import method_callback
from onnxq.core.callbacks import CalibrationCallback, RangeTableCallback
from onnxq.passes.manager import CHECK_BATCHES, PassResult, State, record_read, release
from onnxq.passes.stream import open_dataset


class Calibrate:
    """Stream the data through the float model and ask every rule's callback for values.

    ``channel_means``: a later pass's request for per-channel input means (tensor -> channel
    axis), collected in the same stream; ``taps``: later passes' requests for observers of
    tensors (each: tensor -> objects with ``observe(array, index=, block=)`` and
    ``merge(other)``), fed every batch of the same stream.
    """

    name = "calibrate"

    def __init__(
        self,
        channel_means: Callable[[State], dict[str, int]] | None = None,
        taps: Sequence[Callable[[State], dict[str, list[Any]]]] = (),
    ):
        self.channel_means = channel_means
        self.taps = taps

    def run(self, state: State) -> PassResult:
        """Choose the placeholder values."""
        o, q = state.options, state.quantizer
        if o.load_ranges is not None:
            cb: CalibrationCallback = RangeTableCallback(
                read_ranges(o.load_ranges), f"'{o.load_ranges}'"
            )
            node_callbacks = {}
        else:
            cb = o.callback or method_callback(o.method, o.percentile, o.bins)
            node_callbacks = {
                n: method_callback(m, o.percentile, o.bins) for n, m in q.node_methods.items()
            }
        if not (o.load_ranges is not None and state.data is None):
            open_dataset(state)  # an earlier pass may have opened it already
        calibrator = Calibrator(q, state.dataset, cb, o.progress, node_callbacks)
        calibrator.workers, calibrator.threads = o.workers, o.threads
        if o.ray is not None and o.load_ranges is None:
            from onnxq.calibrate.cluster import ShardedData

            calibrator.ray_data = ShardedData.of(state.data, o.batch_size, o.samples, o.preprocess)
            calibrator.ray_address = o.ray or None
        checked = o.output_format.runtime == "onnxruntime"
        # the check after quantizing runs on the held-back batches where there are some: the
        # first batches' fp32 outputs need not be kept (PP-OCRv5's detector: 4 maps of 33 MB)
        held = isinstance(state.dataset, HeldBack) and state.dataset.every > 0
        calibrator.reference_batches = CHECK_BATCHES if checked and not held else 0
        if self.channel_means is not None:
            calibrator.channel_axes = self.channel_means(state)
        for request in self.taps:
            for tensor, observers in request(state).items():
                calibrator.taps.setdefault(tensor, []).extend(observers)
        if o.load_ranges is not None:
            calibrator.loaded_means = read_channel_means(o.load_ranges)
        state.values = calibrator.calibrate()
        calibrator.release()
        release(state)
        state.calibrator = calibrator
        rep = calibrator.report
        if rep.batches:
            gathered = ["the ranges"]
            if state.hessians:
                gathered.append("optimized rounding's Hessians")
            if calibrator.channel_axes:
                gathered.append("the layers' input means (fast bias correction)")
            if state.output_sums:
                gathered.append("the float layers' output means (sequential bias correction)")
            record_read(state, "calibrate", rep.batches, ", ".join(gathered))
        return PassResult(f"{len(state.values)} values from {rep.samples} samples")
