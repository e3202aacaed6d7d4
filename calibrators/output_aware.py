"""Output-aware calibration: choose each layer's output range by the error it causes.

Pattern by pattern in topological order (so earlier layers are already quantized):

1. the inputs get the base method's parameters (MinMax unless told otherwise);
2. ``get_quantized_layer_inputs`` gives the integer inputs the QLinear op really receives in the
   partly quantized model, for a fixed subset of calibration batches kept by the Calibrator;
3. the layer's own float subgraph, with int8-rounded weights, runs once on the dequantized inputs
   (onnxruntime, a model of just that layer), giving the op's pre-rounding output;
4. every candidate output range ``α·[lo, hi]`` is evaluated in numpy on those cached arrays
   against ``get_unquantized_layer_outputs`` (the float model); the least squared error wins.

So each layer costs one run of the partly quantized model on the subset, one run of a one-layer
model, and a vectorised search; no candidate ever runs the whole model. This is the reason the
TVM RFC keeps a DequantizeLinear after every quantized op.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxq.calibrators.minmax import MinMaxCallback
from onnxq.core.callbacks import CalibrationInfo, Observer, ObserverCallback
from onnxq.core.qparams import QParams, dequantize, params_from_range, quantize
from onnxq.io.session import make_session


class OutputAwareCallback(ObserverCallback):
    """Output ranges searched on the layer's quantized output; inputs from ``base``."""

    def __init__(
        self,
        base: ObserverCallback | None = None,
        batches: int = 8,
        grid: int = 26,
        low: float = 0.5,
    ):
        self.base = base or MinMaxCallback()
        self.observer_key = self.base.observer_key
        self.feeds_needed = batches
        self.alphas = np.linspace(low, 1.0, grid)
        self._layers: dict[str, Any] = {}

    def make_observer(self) -> Observer:
        """The base method's observer."""
        return self.base.make_observer()

    def calibrate_pattern(self, calibration_info: CalibrationInfo) -> dict[str, np.ndarray]:
        """Inputs as the base method; every output by the least error of the layer's output."""
        info = calibration_info
        values: dict[str, np.ndarray] = {}
        for qt in info.inputs:
            self._set(values, qt, self._base_params(info, qt))
        info.calibrator.merge(info.record, values)
        feeds = info.calibrator.sample_feeds
        # no layer to run from quantized inputs: no feeds, no quantized output, or no float
        # input (an embedding Gather reads a weight and int64 ids; an empty one-layer model
        # failed to load in onnxruntime: "OrtValue indexes should have been populated")
        if not feeds or not info.outputs or not any(q.role == "activation" for q in info.inputs):
            for qt in info.outputs:
                self._set(values, qt, self._base_params(info, qt))
            return values
        acc = self._layer_outputs(info, feeds)
        refs = [
            np.concatenate([info.get_unquantized_layer_outputs(f)[k].ravel() for f in feeds])
            for k in range(len(info.outputs))
        ]
        for qt, a, ref in zip(info.outputs, acc, refs):
            lo, hi = info.observer(qt.tensor).compute(qt.dtype, qt.symmetric)
            best, best_err = None, np.inf
            for alpha in self.alphas:
                cand = (lo if lo >= 0 else alpha * lo, alpha * hi)
                qp = params_from_range(cand[0], cand[1], qt.dtype, qt.symmetric)
                err = float(np.mean((dequantize(quantize(a, qp), qp) - ref) ** 2))
                if err < best_err:
                    best, best_err = (cand, qp), err
            assert best is not None
            info.calibrator.ranges.setdefault(qt.tensor, (float(best[0][0]), float(best[0][1])))
            self._set(values, qt, best[1])
        return values

    def _base_params(self, info: CalibrationInfo, qt: Any) -> QParams:
        if qt.role == "weight":
            return info.weight_params(qt)
        if qt.scale in info.values:
            return QParams(info.values[qt.scale], info.values[qt.zero_point])
        lo, hi = self.base.activation_range(info, qt)
        info.calibrator.ranges.setdefault(qt.tensor, (float(lo), float(hi)))
        return params_from_range(lo, hi, qt.dtype, qt.symmetric)

    @staticmethod
    def _set(values: dict[str, np.ndarray], qt: Any, qp: QParams) -> None:
        values[qt.scale], values[qt.zero_point] = qp.scale, qp.zero_point

    def _layer_outputs(self, info: CalibrationInfo, feeds: list[dict]) -> list[np.ndarray]:
        """Float outputs of the layer computed from its quantized inputs and int8 weights, flat."""
        session = self._layer_session(info)
        outs: list[list[np.ndarray]] = [[] for _ in info.outputs]
        for f in feeds:
            qin = info.get_quantized_layer_inputs(f)
            layer_feed = {}
            for qt, value in zip(info.inputs, qin):
                if qt.role == "activation":
                    qp = QParams(info.values[qt.scale], info.values[qt.zero_point])
                    layer_feed[qt.tensor] = dequantize(value, qp)
            res = session.run([q.tensor for q in info.outputs], layer_feed)
            for k, r in enumerate(res):
                outs[k].append(r)
        # flat: batches of padded text differ in length past the batch axis (the error is a
        # mean over elements, and the flat arrays hold them in the same order)
        return [np.concatenate([r.ravel() for r in o]) for o in outs]

    def _layer_session(self, info: CalibrationInfo) -> Any:
        """A one-layer float model with int8-rounded weights (built once per layer)."""
        key = info.record.node
        if key in self._layers:
            return self._layers[key]
        float_model = info.calibrator.quantizer.float_model
        ins = [q.tensor for q in info.inputs if q.role == "activation"]
        outs = [q.tensor for q in info.outputs]
        sub = onnx.utils.Extractor(float_model).extract_model(ins, outs)
        for qt in info.inputs:
            if qt.role != "weight":
                continue
            qp = QParams(info.values[qt.scale], info.values[qt.zero_point], qt.axis)
            rounded = dequantize(quantize(info.constant(qt.tensor), qp), qp)
            for init in sub.graph.initializer:
                if init.name == qt.tensor:
                    init.CopyFrom(numpy_helper.from_array(rounded, qt.tensor))
        self._layers[key] = make_session(sub)
        return self._layers[key]
