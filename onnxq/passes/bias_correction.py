"""Bias correction: the mean output shift of rounded weights, taken out of the biases.

Needs ``state.quantizer``, the solved ``state.values`` and ``state.calibrator`` holding the
per-channel input means that :func:`requests` asked the calibrate pass to collect. Leaves
``state.biases`` (corrected float biases by name; materialize derives the int32 biases from
them) and ``state.bias_corrections`` (per bias: the largest shift removed, in steps of the
layer's output scale), which the report lists.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxq.match.dfpattern import node_attr
from onnxq.passes.manager import PassResult, State
from onnxq.solve.bias_correction import Layer, expected_shift, input_axis
from onnxq.solve.qparams import QParams


def _layers(q: Any) -> list[tuple[Any, Any, str, str, Any]]:
    """(record, bias derivation, kind, input tensor, float node) of every layer with a bias."""
    nodes = {n.name: n for n in q.float_graph.nodes}
    out = []
    for rec in q.records:
        node = nodes.get(rec.node)
        if rec.bias is None or node is None or len(rec.inputs) != 2:
            continue
        if node.op == "Gemm" and int(node_attr(node, "transA") or 0):
            continue  # the input's channels are its rows: not corrected
        kind = "conv" if node.op == "Conv" else "dense"
        out.append((rec, q.biases[rec.bias], kind, rec.inputs[0].tensor, node))
    return out


def active(state: State) -> bool:
    """Whether bias correction runs (``bias_correction`` fast, or auto on a CNN)."""
    o = state.options
    return o.bias_correction == "fast" or (o.bias_correction == "auto" and state.kind == "cnn")


def requests(state: State) -> dict[str, int]:
    """The inputs whose per-channel means the correction needs, with their channel axis."""
    if not active(state):
        return {}
    return {x: input_axis(kind) for _, _, kind, x, _ in _layers(state.quantizer)}


class BiasCorrection:
    """Subtract each layer's expected weight-rounding shift from its float bias."""

    name = "bias-correction"

    def run(self, state: State) -> PassResult:
        """Correct every bias whose input means were collected."""
        if not active(state):
            return PassResult(f"off ({state.options.bias_correction}, {state.kind} model)")
        q, values = state.quantizer, state.values
        for rec, b, kind, x, node in _layers(q):
            mean = state.calibrator.channel_mean(x) if state.calibrator is not None else None
            if mean is None:
                continue
            wq = rec.inputs[1]
            layer = Layer(
                kind,
                q.float_value(b.weight),
                QParams(values[wq.scale], values[wq.zero_point], wq.axis),
                group=int(node_attr(node, "group") or 1),
                transposed=node.op == "Gemm" and bool(int(node_attr(node, "transB") or 0)),
            )
            shift = expected_shift(layer, mean)
            bias = np.asarray(q.float_value(b.bias), np.float64).reshape(-1)
            state.biases[b.bias] = (bias - shift).astype(np.float32)
            out_scale = float(np.max(values[rec.outputs[0].scale]))
            state.bias_corrections[b.bias] = float(np.max(np.abs(shift))) / out_scale
        steps = list(state.bias_corrections.values())
        if not steps:
            return PassResult("nothing to correct")
        return PassResult(
            f"{len(steps)} biases corrected (largest shift {max(steps):.2f} output steps, "
            f"median {float(np.median(steps)):.2f})"
        )
