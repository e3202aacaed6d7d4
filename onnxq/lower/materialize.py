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
import onnx_graphsurgeon as gs
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
from onnxq.io.graph import copy_graph


@dataclass(frozen=True)
class Materialized:
    """A concrete model, the scales and zero points it holds, and the widened biases."""

    model: onnx.ModelProto
    #: scale and zero-point placeholders as written (after bias widening)
    values: dict[str, np.ndarray]
    #: bias -> how many of its channels had their weight scale widened
    widened: dict[str, int]


def materialize(
    q: Any,
    values: dict[str, np.ndarray],
    constants: dict[str, np.ndarray] | None = None,
    form: str | None = None,
) -> Materialized:
    """The template with ``values`` for the scale/zero-point placeholders and derived weights.

    Missing placeholders keep their defaults (scale 1, zero point 0). Biases that would
    overflow int32 enlarge their weight's scale (per channel) instead of being clipped.
    ``constants`` replaces float biases and weights by name (bias correction, optimized
    rounding: a rounded weight is the float value of its chosen integers, which quantize back
    to exactly those). ``form``: the template's ("qoperator" or "qdq"; None: the output
    format's).
    """
    template = q.template_of(form)
    solved = _Solved(q, values, constants, template.bias_grids)
    proto = onnx.ModelProto()
    proto.CopyFrom(template.model)
    for init in proto.graph.initializer:
        value = solved.value(init.name, tuple(init.dims))
        if value is not None:  # derived here, one at a time (never all held beside the model)
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    return Materialized(proto, solved.final, solved.widened)


def materialize_graph(
    q: Any, values: dict[str, np.ndarray], constants: dict[str, np.ndarray] | None = None
) -> tuple[gs.Graph, dict[str, np.ndarray], dict[str, int]]:
    """:func:`materialize` as a graph: a copy of the annotated graph holding the values.

    Returns the graph, the scales and zero points it holds and the widened biases. The passes
    after materialize edit this graph, and the pipeline exports it once (the same model as
    :func:`materialize`'s, imported).
    """
    template = q.template_of()
    solved = _Solved(q, values, constants, template.bias_grids)
    graph = copy_graph(template.graph)
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant):
            value = solved.value(t.name, tuple(t.shape))
            if value is not None:
                t.values = value
    return graph, solved.final, solved.widened


class _Solved:
    """The value of every placeholder, quantized weight and int32 bias of one materialization."""

    def __init__(
        self,
        q: Any,
        values: dict[str, np.ndarray],
        constants: dict[str, np.ndarray] | None,
        bias_grids: dict[str, tuple[str, str]],
    ):
        self.q, self.constants, self.bias_grids = q, constants or {}, bias_grids
        full = {}
        for name, ph in q.placeholders.items():
            if ph.kind not in ("scale", "zero_point"):
                continue
            value = values.get(name, ph.default())
            arr = np.asarray(value).astype(np.dtype(ph.dtype)).reshape(ph.shape)
            full[name] = arr
        _check_relu_folds(q.records, full)
        #: bias -> how many of its channels had their weight scale widened
        self.widened = _fit_biases(q, full, self.constant_of)
        #: each int32 bias's grid (input scale · weight scale)
        self.bias_scales: dict[str, np.ndarray] = {}
        for bname, b in q.biases.items():
            s = full[b.input_scale].astype(np.float64) * full[b.weight_scale].astype(np.float64)
            rounded = np.round(self.constant_of(b.bias) / s)
            full[bname] = np.clip(rounded, -(2**31), 2**31 - 1).astype(np.int32)
            self.bias_scales[bname] = s
        self.full = full
        #: scale and zero-point placeholders as written (after bias widening)
        self.final = {
            k: v for k, v in full.items() if q.placeholders[k].kind in ("scale", "zero_point")
        }

    def constant_of(self, name: str) -> np.ndarray:
        """A float constant as the algorithms left it (or the model's own)."""
        return self.constants[name] if name in self.constants else self.q.float_value(name)

    def value(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """What the template's constant ``name`` (of ``shape``) holds now; None: unchanged."""
        w = self.q.weights.get(name)
        if w is not None:
            qp = QParams(self.full[w.scale], self.full[w.zero_point], w.axis)
            return quantize(self.constant_of(w.weight), qp)
        if name in self.full:
            return self.full[name]
        if name in self.bias_grids:  # a QDQ bias's DequantizeLinear: its grid
            bias, kind = self.bias_grids[name]
            s = self.bias_scales[bias]
            return s.astype(np.float32) if kind == "scale" else np.zeros(s.shape, np.int32)
        if name in self.constants:  # a float layer's corrected bias
            return np.asarray(self.constants[name], np.float32).reshape(shape)
        return None


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
