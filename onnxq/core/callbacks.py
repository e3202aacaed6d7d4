"""What a calibration method implements, and what it sees of one pattern (the TVM RFC API).

* :class:`CalibrationCallback` — ``calibrate_pattern(info) -> {placeholder: value}``.
* :class:`ObserverCallback` — a callback backed by streaming observers (``onnxq.calibrators``).
* :class:`CalibrationInfo` — one pattern's view: placeholder names, observers, constants and
  ``get_(un)quantized_layer_inputs/outputs(feeds)``, answered by the running Calibrator
  (``onnxq.calibrate.calibration``), which this module does not import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from onnxq.core.errors import CalibrationError
from onnxq.core.qparams import QParams, params_from_range, weight_params
from onnxq.core.specs import PatternRecord, QTensor


class Observer(Protocol):
    """Accumulate statistics of one tensor (``observe``) and derive a range (``compute``).

    Calibrating in shards (``--workers``) also needs ``merge(other)``, which folds another
    observer's statistics of the same tensor into this one (every built-in observer has it;
    MinMax, AverageMax and the histograms merge into exactly what one pass gathers). Observers
    go to the worker processes by pickle.
    """

    def observe(self, x: np.ndarray) -> None:
        """Fold one batch of values into the statistics."""

    def compute(self, dtype: str = "uint8", symmetric: bool = False) -> tuple[float, float]:
        """The calibrated range ``(rmin, rmax)`` for quantizing to ``dtype``."""

    def nbytes(self) -> int:
        """Bytes of statistics retained (independent of the number of batches)."""


class CalibrationCallback:
    """Chooses placeholder values for a pattern: override :meth:`calibrate_pattern`."""

    #: a key shared by callbacks whose observers are interchangeable (None: no streaming pass)
    observer_key: str | None = None

    def make_observer(self) -> Observer:
        """A fresh observer for one tensor (only for callbacks with an ``observer_key``)."""
        raise NotImplementedError

    def calibrate_pattern(self, calibration_info: CalibrationInfo) -> dict[str, np.ndarray]:
        """Return ``{placeholder name: value}`` for the pattern's scales and zero points."""
        raise NotImplementedError


class ObserverCallback(CalibrationCallback):
    """Activations from their observers' ranges, weights symmetric per channel from the constant."""

    def calibrate_pattern(self, calibration_info: CalibrationInfo) -> dict[str, np.ndarray]:
        """Values for every quantized input and output of the pattern."""
        info = calibration_info
        values: dict[str, np.ndarray] = {}
        for qt in [*info.inputs, *info.outputs]:
            if qt.role == "weight":
                qp = info.weight_params(qt)
            else:
                lo, hi = self.activation_range(info, qt)
                info.calibrator.ranges.setdefault(qt.tensor, (float(lo), float(hi)))
                qp = params_from_range(lo, hi, qt.dtype, qt.symmetric)
            values[qt.scale] = qp.scale
            values[qt.zero_point] = qp.zero_point
        return values

    def activation_range(self, info: CalibrationInfo, qt: QTensor) -> tuple[float, float]:
        """The range of activation ``qt``: its observer's answer, cut to its readers' bound.

        The bound is where every consumer saturates (:meth:`Calibrator.saturation_bound`).
        """
        observer = self.observed(info, qt)
        bound = info.calibrator.saturation_bound(qt.tensor)
        if bound is None:
            return observer.compute(qt.dtype, qt.symmetric)
        seen = observer.compute(qt.dtype, qt.symmetric)
        if hasattr(observer, "bounded"):  # search the data as the reader sees it
            observer = observer.bounded(*bound)
        lo, hi = observer.compute(qt.dtype, qt.symmetric)
        # a side the data crosses ends exactly at the bound: the values beyond it cost nothing,
        # and a search that clips further (MSE scales both ends) moves the reader's flat part
        if seen[0] < bound[0]:
            lo = bound[0]
        if seen[1] > bound[1]:
            hi = bound[1]
        # clamped into the bound, even where the data lies wholly outside it
        return min(max(lo, bound[0]), bound[1]), max(min(hi, bound[1]), bound[0])

    def observed(self, info: CalibrationInfo, qt: QTensor) -> Any:
        """The observer whose ``compute`` gives ``qt``'s range (its tensor's, by default)."""
        return info.observer(qt.tensor)


class RangeTableCallback(ObserverCallback):
    """Activations from a saved range table (``--load-ranges``): no data pass at all."""

    observer_key = None

    def __init__(self, ranges: Mapping[str, tuple[float, float]], source: str = "the table"):
        self.ranges = dict(ranges)
        self.source = source

    def activation_range(self, info: CalibrationInfo, qt: QTensor) -> tuple[float, float]:
        """The saved range of ``qt``'s tensor."""
        try:
            return self.ranges[qt.tensor]
        except KeyError:
            raise CalibrationError(
                f"range table {self.source} has no entry for tensor "
                f"'{qt.tensor}'; calibrate this model again with "
                "--save-ranges"
            ) from None


class CalibrationInfo:
    """One pattern's view of calibration (the seed API of the TVM RFC)."""

    def __init__(self, calibrator: Any, record: PatternRecord):
        #: the running onnxq.calibrate.calibration.Calibrator
        self.calibrator = calibrator
        self.record = record
        self.pattern = record.pattern
        self.dataset_manager = calibrator.dataset_manager
        self.default_callback = calibrator.default_callback
        #: the callback that calibrates this pattern (per-node configuration included)
        self.callback = calibrator.callback_for(record)

    @property
    def inputs(self) -> list[QTensor]:
        """The pattern's quantized inputs (activations and weights, op order)."""
        return list(self.record.inputs)

    @property
    def outputs(self) -> list[QTensor]:
        """The pattern's quantized outputs."""
        return list(self.record.outputs)

    @property
    def input_scale_zps(self) -> list[tuple[str, str]]:
        """[(scale placeholder, zero-point placeholder)] per quantized input."""
        return self.record.input_scale_zps

    @property
    def output_scale_zps(self) -> list[tuple[str, str]]:
        """[(scale placeholder, zero-point placeholder)] per quantized output."""
        return self.record.output_scale_zps

    @property
    def values(self) -> dict[str, np.ndarray]:
        """Placeholder values chosen so far (earlier patterns in topological order)."""
        return self.calibrator.values

    def observer(self, tensor: str) -> Observer:
        """The streaming observer of ``tensor`` for this pattern's callback."""
        try:
            return self.calibrator.observers[(tensor, self.callback.observer_key or "")]
        except KeyError:
            raise CalibrationError(
                f"no statistics were collected for tensor '{tensor}'; the "
                "callback has no observer_key"
            ) from None

    def constant(self, tensor: str) -> np.ndarray:
        """Float value of a constant input (a weight)."""
        return self.calibrator.quantizer.float_value(tensor)

    def weight_params(self, qt: QTensor) -> QParams:
        """Symmetric parameters of weight ``qt`` (onnxq.core.qparams.weight_params).

        Computed once per calibrator and weight: the float weights do not change while it
        calibrates, and the recipe choice recalibrates with every range candidate.
        """
        key = (qt.tensor, qt.axis, qt.dtype, qt.bits)
        memo = getattr(self.calibrator, "weight_qparams", None)
        qp = memo.get(key) if memo is not None else None
        if qp is None:
            qp = weight_params(self.constant(qt.tensor), qt.axis, qt.dtype, bits=qt.bits)
            if memo is not None:
                memo[key] = qp
        return QParams(qp.scale.copy(), qp.zero_point.copy(), qp.axis)

    def get_unquantized_layer_inputs(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Float values of the pattern's inputs for one feed of the float model."""
        return self.calibrator.run_float([q.tensor for q in self.inputs], feeds)

    def get_unquantized_layer_outputs(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Float values of the pattern's outputs in the float model."""
        return self.calibrator.run_float([q.tensor for q in self.outputs], feeds)

    def get_quantized_layer_inputs(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Integer inputs of the quantized op, with the values chosen so far."""
        return self.calibrator.run_quantized([q.quantized for q in self.inputs], feeds)

    def get_quantized_layer_outputs(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Dequantized outputs of the pattern in the partly quantized model."""
        return self.calibrator.run_quantized([q.tensor for q in self.outputs], feeds)
