"""Bias correction: the mean output shift of rounded weights, taken out of the biases.

Needs ``state.quantizer``, the solved ``state.values`` and ``state.calibrator`` holding the
per-channel input means that :func:`requests` asked the calibrate pass to collect. ``fast``
removes the shift of the weights' rounding, ``E[ΔW·x]``; ``layerwise`` streams the data once
more through the float model and removes the shift of the int8 layer on its int8 input,
``E[Wq·x̂] − E[W·x]`` (x̂: the input on its solved grid), which also covers the input grid's
clipping and rounding bias (it needs a data source that can be read again; otherwise it falls
back to fast and says so). Leaves
``state.constants`` (corrected float biases by name; materialize derives the int32 biases from
them) and ``state.bias_corrections`` (per bias: the largest shift removed, in steps of the
layer's output scale), which the report lists.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.io.session import make_session
from onnxq.match.dfpattern import node_attr
from onnxq.passes.manager import PassResult, State
from onnxq.solve.bias_correction import (
    Layer,
    channel_means,
    expected_shift,
    input_axis,
    layerwise_shift,
    output_mean,
)
from onnxq.solve.qparams import QParams, dequantize, quantize


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


def mode(state: State) -> str:
    """``fast``, ``layerwise`` or ``none`` for this model (auto: fast for CNNs).

    Layer-wise is not the CNN default: on MobileNetV2 it raised the logits' SQNR by 0.5 dB but
    not the top-1 agreement, for one more pass over the data (docs/ablation.md).
    """
    o = state.options
    if o.bias_correction == "auto":
        return "fast" if state.kind == "cnn" else "none"
    return o.bias_correction


def active(state: State) -> bool:
    """Whether bias correction runs."""
    return mode(state) != "none"


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
        layers = _layers(q)
        how = mode(state)
        floats = _float_layers(state)
        grids = {x: (_grid(values, qt), input_axis(kind)) for _, kind, x, _, qt in floats}
        if how == "layerwise":
            for rec, _, kind, x, _ in layers:
                grids[x] = (_grid(values, rec.inputs[0]), input_axis(kind))
        quantized = _quantized_input_means(state, grids)
        fallback = how == "layerwise" and not quantized and bool(layers)
        float_done = _correct_float_layers(state, floats, quantized)
        for rec, b, kind, x, node in layers:
            mean = state.calibrator.channel_mean(x) if state.calibrator is not None else None
            layer_wise = how == "layerwise" and x in quantized
            if mean is None and not layer_wise:
                continue
            wq = rec.inputs[1]
            layer = Layer(
                kind,
                q.float_value(b.weight),
                QParams(values[wq.scale], values[wq.zero_point], wq.axis),
                group=int(node_attr(node, "group") or 1),
                transposed=node.op == "Gemm" and bool(int(node_attr(node, "transB") or 0)),
                rounded=state.constants.get(b.weight),
            )
            if layer_wise:
                shift = layerwise_shift(layer, *quantized[x])
            elif mean is not None:
                shift = expected_shift(layer, mean)
            bias = np.asarray(q.float_value(b.bias), np.float64).reshape(-1)
            state.constants[b.bias] = (bias - shift).astype(np.float32)
            out_scale = float(np.max(values[rec.outputs[0].scale]))
            state.bias_corrections[b.bias] = float(np.max(np.abs(shift))) / out_scale
        steps = list(state.bias_corrections.values())
        floats_note = (
            f"; {float_done} float layer(s) corrected for their int8 input's grid"
            if float_done
            else ""
        )
        if not steps:
            return PassResult(f"nothing to correct{floats_note}")
        done = "fast (the data cannot be read again)" if fallback else how
        return PassResult(
            f"{len(steps)} biases corrected, {done} (largest shift {max(steps):.2f} output "
            f"steps, median {float(np.median(steps)):.2f}){floats_note}"
        )


def _grid(values: dict[str, Any], qt: Any) -> QParams:
    return QParams(values[qt.scale], values[qt.zero_point])


def _float_layers(state: State) -> list[tuple[Any, str, str, str, Any]]:
    """Every Conv/Gemm left float that reads a tensor the int8 model quantizes.

    As (float node, kind, input tensor, bias initializer, the input's QTensor); only layers with
    a constant weight and bias.
    """
    q = state.quantizer
    grouped = {n for rec in q.records for n in rec.nodes}
    grids: dict[str, Any] = {}
    for rec in q.records:
        for qt in [*rec.inputs, *rec.outputs]:
            if qt.role == "activation":
                grids.setdefault(qt.tensor, qt)
    out = []
    for node in q.float_graph.nodes:
        if node.name in grouped or node.op not in ("Conv", "Gemm") or len(node.inputs) < 3:
            continue
        if node.op == "Gemm" and int(node_attr(node, "transA") or 0):
            continue
        x, w, b = node.inputs[0], node.inputs[1], node.inputs[2]
        if x.name not in grids or not isinstance(w, gs.Constant) or not isinstance(b, gs.Constant):
            continue
        out_channels = w.shape[0] if node.op == "Conv" else None
        if node.op == "Gemm":
            out_channels = w.shape[0] if int(node_attr(node, "transB") or 0) else w.shape[1]
        if len(b.outputs) != 1 or int(np.prod(b.shape)) != out_channels:
            continue  # a shared or broadcast bias: left as it is
        kind = "conv" if node.op == "Conv" else "dense"
        out.append((node, kind, x.name, b.name, grids[x.name]))
    return out


def _correct_float_layers(
    state: State, layers: list[tuple[Any, str, str, str, Any]], means: dict[str, Any]
) -> int:
    """Subtract from each float layer's bias the shift its int8 input's grid causes."""
    done = 0
    for node, kind, x, bias_name, _ in layers:
        if x not in means:
            continue
        mean, quantized_mean = means[x]
        w = np.asarray(node.inputs[1].values)
        geometry = (
            int(node_attr(node, "group") or 1),
            node.op == "Gemm" and bool(int(node_attr(node, "transB") or 0)),
        )
        shift = output_mean(kind, w, quantized_mean, *geometry) - output_mean(
            kind, w, mean, *geometry
        )
        bias = np.asarray(node.inputs[2].values, np.float64)
        state.constants[bias_name] = (bias - shift.reshape(bias.shape)).astype(np.float32)
        done += 1
    return done


def _quantized_input_means(
    state: State, grids: dict[str, tuple[QParams, int]]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Input tensor -> (float channel means, channel means on its int8 grid), one more stream.

    ``grids``: tensor -> (its quantization, its channel axis). Empty when the data cannot be
    streamed again (a one-shot source, or ranges loaded).
    """
    ds = state.dataset
    if ds is None or not ds.replayable or not grids:
        return {}
    names = sorted(grids)
    sums: dict[str, list[Any]] = {}
    ds.reset()
    session = make_session(state.quantizer.float_model, expose=names)
    for feed in ds.batches():
        for x, arr in zip(names, session.run(names, feed), strict=True):
            arr = np.asarray(arr)
            qp, axis = grids[x]
            if arr.ndim <= (axis % max(arr.ndim, 1)) or not np.all(np.isfinite(arr)):
                continue
            f_sum, count = channel_means(arr, axis)
            q_sum, _ = channel_means(dequantize(quantize(arr, qp), qp), axis)
            acc = sums.setdefault(x, [0.0, 0.0, 0])
            acc[0], acc[1], acc[2] = acc[0] + f_sum, acc[1] + q_sum, acc[2] + count
    ds.reset()
    return {x: (f / max(n, 1), q / max(n, 1)) for x, (f, q, n) in sums.items()}
