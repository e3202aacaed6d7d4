"""Materialize: the template with solved values, and the int8 weights and int32 biases they imply.

Scales and zero points come from calibration and solving; quantized weights and biases are
derived here from their float constants (``WeightDerivation``, ``BiasDerivation``), after the
accumulator rules: a bias that would overflow int32 widens its channel's weight scale instead
of being clipped, and a dead (all-zero) weight channel gets the scale that keeps its bias exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxq.core.errors import CalibrationError
from onnxq.core.qparams import (
    INT32_MAX,
    QParams,
    accumulation_bound,
    fit_dead_channels,
    qrange,
    quantize,
    widen_for_bias,
)


@dataclass(frozen=True)
class Materialized:
    """A concrete model, the scales and zero points it holds, and the widened biases."""

    model: onnx.ModelProto
    #: scale and zero-point placeholders as written (after bias widening)
    values: dict[str, np.ndarray]
    #: bias -> how many of its channels had their weight scale widened
    widened: dict[str, int]


def materialize(
    q: Any, values: dict[str, np.ndarray], constants: dict[str, np.ndarray] | None = None
) -> Materialized:
    """The template with ``values`` for the scale/zero-point placeholders and derived weights.

    Missing placeholders keep their defaults (scale 1, zero point 0). Biases that would
    overflow int32 enlarge their weight's scale (per channel) instead of being clipped.
    ``constants`` replaces float biases and weights by name (bias correction, optimized
    rounding: a rounded weight is the float value of its chosen integers, which quantize back
    to exactly those).
    """

    def constant_of(name: str) -> np.ndarray:
        return constants[name] if constants and name in constants else q.float_value(name)

    full = {}
    for name, ph in q.placeholders.items():
        if ph.kind not in ("scale", "zero_point"):
            continue
        value = values.get(name, ph.default())
        arr = np.asarray(value).astype(np.dtype(ph.dtype)).reshape(ph.shape)
        full[name] = arr
    _check_relu_folds(q.records, full)
    widened = _fit_biases(q, full, constant_of)
    for bname, b in q.biases.items():
        s = full[b.input_scale].astype(np.float64) * full[b.weight_scale].astype(np.float64)
        rounded = np.round(constant_of(b.bias) / s)
        full[bname] = np.clip(rounded, -(2**31), 2**31 - 1).astype(np.int32)
    final = {k: v for k, v in full.items() if q.placeholders[k].kind in ("scale", "zero_point")}
    proto = onnx.ModelProto()
    proto.CopyFrom(q.template)
    for init in proto.graph.initializer:
        w = q.weights.get(init.name)
        if w is not None:  # derived here, one at a time (never all held beside the model)
            qp = QParams(full[w.scale], full[w.zero_point], w.axis)
            init.CopyFrom(numpy_helper.from_array(quantize(constant_of(w.weight), qp), init.name))
        elif init.name in full:
            init.CopyFrom(numpy_helper.from_array(full[init.name], init.name))
        elif constants and init.name in constants:  # a float layer's corrected bias
            value = np.asarray(constants[init.name], np.float32).reshape(tuple(init.dims))
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    return Materialized(proto, final, widened)


def _check_relu_folds(records: Any, full: dict[str, np.ndarray]) -> None:
    for rec in records:
        if not rec.relu_folded:
            continue
        for out in rec.outputs:
            lo = qrange(out.dtype)[0]
            if int(full[out.zero_point]) != lo:
                raise CalibrationError(
                    f"{rec.label} '{rec.node}' folds a Relu into output '{out.tensor}', which "
                    f"needs zero point {lo}, but calibration set {int(full[out.zero_point])}; "
                    "calibrate the output with a range starting at 0"
                )


def _fit_biases(
    q: Any, full: dict[str, np.ndarray], constant_of: Callable[[str], np.ndarray]
) -> dict[str, int]:
    """Widen weight scales so every int32 bias and accumulation fits; bias -> channels widened.

    A dead (all-zero) per-channel weight gets the scale that keeps its bias exact.
    """
    widened: dict[str, int] = {}
    for b in q.biases.values():
        fb = constant_of(b.bias)
        products = q.float_value(b.weight).size // max(fb.size, 1)
        qmax = 2 ** (q.config.weight_bits - 1) - 1
        bound = accumulation_bound(products, qmax, b.input_dtype, full[b.input_zero_point])
        if b.weight_axis is not None and b.weight:  # per channel: dead channels free
            wc = np.moveaxis(constant_of(b.weight), b.weight_axis, 0)
            dead = ~np.any(wc.reshape(wc.shape[0], -1), axis=1)
            full[b.weight_scale] = fit_dead_channels(
                fb, full[b.input_scale], full[b.weight_scale], dead
            )
        before = full[b.weight_scale]
        full[b.weight_scale] = widen_for_bias(
            fb, full[b.input_scale], before, INT32_MAX - bound, f"bias '{b.bias}'"
        )
        n_widened = int(np.count_nonzero(full[b.weight_scale] != before))
        if n_widened:
            widened[b.bias] = n_widened
    return widened
