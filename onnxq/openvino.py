"""OpenVINO output: the float graph with FakeQuantize on every quantized edge and weight.

FakeQuantize is in domain org.openvinotoolkit, the form NNCF and OpenVINO's own tools produce.

For a tensor quantized with scale ``s`` and zero point ``z`` to ``[qmin, qmax]``
(``seeds/003``, design.md §3)::

    level_range = qmax − qmin              levels = level_range + 1
    input_high  = (qmax − z) · s           input_low = input_high − s · level_range
    output_low, output_high = input_low, input_high

Weights get per-channel bounds shaped to broadcast along their channel axis. A tensor produced
by a quantized op is read quantized by all its consumers (as the QOperator model's
DequantizeLinear output is); an input tensor only by the quantized ops. Biases stay float:
OpenVINO keeps them in its accumulators. Run the model with the OpenVINO runtime
(``pip install openvino``); onnxruntime does not implement FakeQuantize.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxq.graph import GraphEditor, export_model, import_graph, producer
from onnxq.qparams import qrange

if TYPE_CHECKING:
    from onnxq.quantizer import QTensor, Quantizer

OV_DOMAIN = "org.openvinotoolkit"


def fq_bounds(
    scale: np.ndarray,
    zero_point: np.ndarray,
    dtype: str,
    qmin: int | None = None,
    qmax: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """(input_low, input_high, levels) of FakeQuantize for an affine quantizer."""
    lo, hi = qrange(dtype)
    lo = lo if qmin is None else qmin
    hi = hi if qmax is None else qmax
    s = np.asarray(scale, np.float64)
    z = np.asarray(zero_point, np.float64)
    level_range = hi - lo
    high = (hi - z) * s
    low = high - s * level_range
    return low.astype(np.float32), high.astype(np.float32), level_range + 1


def to_fakequantize(
    quantizer: Quantizer, weight_qrange: tuple[int, int] | None = None
) -> onnx.ModelProto:
    """The FakeQuantize model of ``quantizer``'s last materialized parameters."""
    values = quantizer.final_values
    graph = import_graph(quantizer.float_model)
    editor = GraphEditor(graph)
    tensors = graph.tensors()
    group_nodes = {n for rec in quantizer.records for n in rec.nodes}
    produced = {q.tensor for rec in quantizer.records for q in rec.outputs}
    by_tensor = {q.tensor: q for rec in quantizer.records for q in rec.outputs}
    done: set[str] = set()
    for rec in quantizer.records:
        for qt in [*rec.inputs, *rec.outputs]:
            if qt.tensor in done:
                continue
            done.add(qt.tensor)
            t = tensors[qt.tensor]
            if qt.role == "weight":
                _fq_weight(editor, t, qt, values, group_nodes, weight_qrange)
            else:
                # like the requantize pass: data that reached this op through MaxPool, Split…
                # from a quantized op keeps that op's parameters
                source = _pass_through_source(t, by_tensor) or qt
                _fq_activation(
                    editor, graph, t, source, values, group_nodes, all_readers=qt.tensor in produced
                )
    editor.finish()
    return export_model(graph, quantizer.float_model)


def _pass_through_source(t: gs.Tensor, outputs: dict[str, QTensor]) -> QTensor | None:
    from onnxq.requantize import CARRIERS

    node = producer(t)
    seen = False
    while node is not None and node.op in CARRIERS and node.inputs:
        seen = True
        t = node.inputs[0]
        node = producer(t)
    return outputs.get(t.name) if seen else None


def _fq_node(
    editor: GraphEditor,
    x: gs.Tensor,
    low: np.ndarray,
    high: np.ndarray,
    levels: int,
    name: str,
    out: gs.Variable | None = None,
) -> gs.Variable:
    lo = editor.constant(f"{name}/input_low", low)
    hi = editor.constant(f"{name}/input_high", high)
    out = out if out is not None else editor.variable(f"{name}/fq", np.float32, x.shape)
    editor.add_node(
        "FakeQuantize",
        [x, lo, hi, lo, hi],
        [out],
        f"{name}/FakeQuantize",
        {"levels": int(levels)},
        OV_DOMAIN,
    )
    return out


def _fq_activation(
    editor: GraphEditor,
    graph: gs.Graph,
    t: gs.Tensor,
    qt: QTensor,
    values: dict[str, np.ndarray],
    group_nodes: set[str],
    all_readers: bool,
) -> None:
    low, high, levels = fq_bounds(values[qt.scale], values[qt.zero_point], qt.dtype)
    if all_readers and producer(t) is not None:
        # every reader (and a graph output, which keeps its name) sees the quantized value:
        # the producer now writes t/float and FakeQuantize writes t
        pre = editor.variable(f"{t.name}/float", np.float32, t.shape)
        editor.replace_producer(pre, t)
        _fq_node(editor, pre, low, high, levels, t.name, out=t)
        return
    out = _fq_node(editor, t, low, high, levels, t.name)
    for node in [n for n in t.outputs if n.name in group_nodes]:
        for i, inp in enumerate(node.inputs):
            if inp is t:
                editor.set_input(node, i, out)


def _fq_weight(
    editor: GraphEditor,
    t: gs.Tensor,
    qt: QTensor,
    values: dict[str, np.ndarray],
    group_nodes: set[str],
    weight_qrange: tuple[int, int] | None,
) -> None:
    lo_q, hi_q = weight_qrange or qrange(qt.dtype, narrow=False)
    low, high, levels = fq_bounds(values[qt.scale], values[qt.zero_point], qt.dtype, lo_q, hi_q)
    w = np.asarray(t.values if isinstance(t, gs.Constant) else 0)
    if qt.axis is not None and low.ndim == 1:
        shape = [1] * w.ndim
        shape[qt.axis] = -1
        low, high = low.reshape(shape), high.reshape(shape)
    out = _fq_node(editor, t, low, high, levels, t.name)
    for node in list(t.outputs):
        if node.name in group_nodes:
            for i, inp in enumerate(node.inputs):
                if inp is t:
                    editor.set_input(node, i, out)
