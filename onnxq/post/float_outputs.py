"""Float outputs: an int8 MatMul/Gemm whose result only float ops read writes it in float.

QLinearMatMul rounds its result to int8 with one per-tensor output scale. When every reader
dequantizes that result at once (a float bias Add, a residual Add, LayerNormalization, GELU), the
rounding buys no int8 edge and costs precision: next to one outlier channel, every other channel
of the output keeps a few levels (a 3-layer BERT-class encoder on padded batches: embedding
cosine 0.966 with the rounding, 0.997 without). Such a node computes in int8 and writes float:

* ``QLinearMatMul`` becomes onnxruntime's ``MatMulIntegerToFloat`` (com.microsoft), and a float
  bias Add reading only it (a constant of one value per output column) is folded into it;
* ``QGemm`` drops its output scale and zero point (the contrib op then outputs float).

An output grid that starts at zero is kept: its clipping may be a Relu folded into it.

Works on the requantized QOperator model, before the output format's lowering (the QDQ lowering
writes these as DQ → MatMul/Gemm with no QuantizeLinear after them, int16 operands included;
QOperator output has 8-bit operands only).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from onnxq.core.optable import FLOAT_OUTPUT_QOPS, MS_DOMAIN
from onnxq.io.graph import tensor_array


def float_outputs(model: onnx.ModelProto) -> list[str]:
    """Rewrite ``model`` in place; returns the names of the nodes now writing float."""
    g = model.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    graph_outputs = {o.name for o in g.output}
    inits = {i.name: i for i in g.initializer}
    changed: list[str] = []
    drop: set[int] = set()
    released: set[str] = set()  # constants the rewritten nodes no longer read
    for n in list(g.node):
        if n.op_type not in FLOAT_OUTPUT_QOPS or n.output[0] in graph_outputs:
            continue
        users = readers.get(n.output[0], [])
        if not users or any(u.op_type != "DequantizeLinear" for u in users):
            continue  # an int8 reader needs the int8 result
        if n.op_type == "QGemm" and len(n.input) < 8:
            continue  # already float
        if _clips_at_zero(n, inits):
            continue  # a folded (or removed) Relu/Relu6 lives in the output's clipping
        out = users[0].output[0]
        for u in users[1:]:  # several DQs of one result: their readers read the first
            for r in readers.get(u.output[0], []):
                r.input[:] = [out if x == u.output[0] else x for x in r.input]
        drop.update(id(u) for u in users)
        released.update(x for x in n.input if x in inits)
        released.update(x for u in users for x in u.input[1:] if x in inits)
        if n.op_type == "QGemm":
            del n.input[7:]
            n.output[0] = out
        else:
            _to_integer_to_float(n, out, readers, inits, graph_outputs, drop)
        changed.append(n.name)
    if changed:
        kept = [n for n in g.node if id(n) not in drop]
        del g.node[:]
        g.node.extend(kept)
        # the output scale and zero point (and the dropped DQs' constants) nothing reads now:
        # onnxruntime warned about each at load
        read = _read_names(g) | graph_outputs
        dead = {x for x in released if x not in read}
        if dead:
            live = [i for i in g.initializer if i.name not in dead]
            del g.initializer[:]
            g.initializer.extend(live)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return changed


def _read_names(graph: onnx.GraphProto) -> set[str]:
    """Every name a node of ``graph`` or of its subgraphs reads."""
    from onnxq.io.graph import graphs_of

    names: set[str] = set()
    for node in graph.node:
        names.update(node.input)
        for _, sub in graphs_of(node):
            names |= _read_names(sub)
    return names


def _to_integer_to_float(
    n: onnx.NodeProto,
    out: str,
    readers: dict[str, list[onnx.NodeProto]],
    inits: dict[str, onnx.TensorProto],
    graph_outputs: set[str],
    drop: set[int],
) -> None:
    """``QLinearMatMul`` → ``MatMulIntegerToFloat`` writing ``out`` (and its bias Add's output)."""
    a, a_scale, a_zp, b, b_scale, b_zp = n.input[:6]
    inputs = [a, b, a_scale, b_scale, a_zp, b_zp]
    users = readers.get(out, [])
    bias = _bias_of(users[0], out, inits) if len(users) == 1 and out not in graph_outputs else None
    if bias is not None and _columns(inits.get(b)) == int(inits[bias].dims[0]):
        inputs.append(bias)
        out = users[0].output[0]
        drop.add(id(users[0]))
    name = n.name
    n.Clear()
    n.CopyFrom(helper.make_node("MatMulIntegerToFloat", inputs, [out], name=name, domain=MS_DOMAIN))


def _clips_at_zero(n: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    """Whether the output grid starts at 0 (see :func:`starts_at_zero`)."""
    zp = inits.get(n.input[-1] if n.op_type == "QLinearMatMul" else n.input[8])
    return zp is None or starts_at_zero(tensor_array(zp))


def starts_at_zero(zero_point: np.ndarray) -> bool:
    """Whether the zero point is its dtype's minimum.

    The grid's clipping at 0 may then be a Relu or Relu6 the quantizer folded into it (or the
    requantize pass removed), so the rounding must stay.
    """
    zp = np.asarray(zero_point)
    return int(zp.reshape(-1)[0]) == int(np.iinfo(zp.dtype).min)


def _bias_of(node: onnx.NodeProto, x: str, inits: dict[str, onnx.TensorProto]) -> str | None:
    """The constant 1-D float operand of an ``Add(x, bias)``, else None."""
    if node.op_type != "Add" or len(node.input) != 2 or x not in node.input:
        return None
    other = node.input[1] if node.input[0] == x else node.input[0]
    init = inits.get(other)
    if init is None or len(init.dims) != 1 or init.data_type != onnx.TensorProto.FLOAT:
        return None
    return other


def _columns(weight: onnx.TensorProto | None) -> int:
    """The output columns of a constant [K, N] weight (-1 when not constant)."""
    if weight is None or len(weight.dims) != 2:
        return -1
    return int(weight.dims[1])
