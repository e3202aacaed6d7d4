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

In QDQ form the op's QuantizeLinear and the DequantizeLinear after it go: DQ → MatMul/Gemm
with no QuantizeLinear after them (int16 operands included; QOperator output has 8-bit
operands only).

Works on the requantized model, before the output format's lowering.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.core.optable import FLOAT_OUTPUT_QOPS, MS_DOMAIN
from onnxq.io.graph import GraphEditor, constant_value, producer
from onnxq.post.requantize import output_grid, output_quantizer, quantized_op


def float_outputs(graph: gs.Graph, qdq_ops: dict[str, str] | None = None) -> list[str]:
    """Rewrite ``graph`` in place (through its editor, left tidied); the nodes now writing float.

    ``qdq_ops``: in QDQ form, the float ops the template wrote for groups, by name
    (:attr:`onnxq.lower.qoperator.Template.ops`).
    """
    qdq_ops = qdq_ops or {}
    editor = GraphEditor(graph)
    graph_outputs = {id(t) for t in graph.outputs}
    changed: list[str] = []
    for n in list(graph.nodes):
        found = quantized_op(n, qdq_ops)
        if found is None or found[0].qop not in FLOAT_OUTPUT_QOPS or not n.outputs:
            continue
        spec = found[0]
        q = None if n.op == spec.qop else output_quantizer(n)  # QDQ form: its quantizer
        if n.op != spec.qop and q is None:
            continue
        rounded = (q if q is not None else n).outputs[0]
        if id(rounded) in graph_outputs:
            continue
        users = list(rounded.outputs)
        if not users or any(_int8_reader(u, qdq_ops) for u in users):
            continue  # an int8 reader needs the int8 result
        grid = output_grid(n, spec)
        if grid is None:
            continue  # already float (QGemm without its output pair)
        zp = constant_value(grid[1])
        if zp is None or starts_at_zero(zp):
            continue  # a folded (or removed) Relu/Relu6 lives in the output's clipping
        out = users[0].outputs[0]
        for u in users[1:]:  # several DQs of one result: their readers read the first
            for reader in list(u.outputs[0].outputs):
                for i, t in enumerate(reader.inputs):
                    if t is u.outputs[0]:
                        editor.set_input(reader, i, out)
        for u in users:
            editor.remove_node(u)
        if q is not None:  # QDQ form: the float op writes what its quantizer's reader did
            editor.remove_node(q)
            if not spec.float_output_ok:
                _bias_after(editor, n, out, graph_outputs)
        elif spec.float_output_ok:  # the op writes float without its output pair
            while len(n.inputs) > spec.output:
                n.inputs.pop()
        else:
            out = _integer_to_float(editor, n, out, graph_outputs)
        n.outputs[0] = out
        changed.append(n.name)
    if changed:
        editor.finish()
    return changed


def _int8_reader(node: gs.Node, qdq_ops: dict[str, str]) -> bool:
    """Whether ``node`` reads an int8 result as int8.

    A QLinear op does, and in QDQ form a DequantizeLinear that is a group's operand (the float
    ops of groups are in ``qdq_ops``); any other DequantizeLinear is a float reader's.
    """
    if node.op != "DequantizeLinear":
        return True
    return any(r.name in qdq_ops for r in node.outputs[0].outputs)


def _bias_after(editor: GraphEditor, n: gs.Node, out: gs.Variable, graph_outputs: set[int]) -> None:
    """A QDQ-form MatMul's bias Add reads the product first, as its QOperator form writes it.

    (``MatMulIntegerToFloat`` takes the bias in; un-fused it is ``Add(product, bias)``, and
    onnxruntime's fusions of the two orders round differently.)
    """
    users = list(out.outputs)
    bias = _bias(users[0], out) if len(users) == 1 and id(out) not in graph_outputs else None
    dq = producer(n.inputs[1])  # the weight's
    b = dq.inputs[0] if dq is not None and dq.op == "DequantizeLinear" else None
    columns = b.shape[1] if isinstance(b, gs.Constant) and len(b.shape) == 2 else -1
    if bias is not None and columns == bias.shape[0] and users[0].inputs[0] is not out:
        editor.set_input(users[0], 1, users[0].inputs[0])
        editor.set_input(users[0], 0, out)


def _integer_to_float(
    editor: GraphEditor, n: gs.Node, out: gs.Variable, graph_outputs: set[int]
) -> gs.Variable:
    """``n`` (QLinearMatMul) as MatMulIntegerToFloat; the tensor it writes (its bias Add's)."""
    a, a_scale, a_zp, b, b_scale, b_zp = n.inputs[:6]
    inputs = [a, b, a_scale, b_scale, a_zp, b_zp]
    users = list(out.outputs)
    bias = _bias(users[0], out) if len(users) == 1 and id(out) not in graph_outputs else None
    # the bias has one value per output column of the constant [K, N] weight (read: its shape)
    columns = b.shape[1] if isinstance(b, gs.Constant) and len(b.shape) == 2 else -1
    if bias is not None and columns == bias.shape[0]:
        add = users[0]
        inputs.append(bias)
        out = add.outputs[0]
        editor.remove_node(add)
    n.op, n.domain, n.attrs = "MatMulIntegerToFloat", MS_DOMAIN, {}
    n.inputs.clear()
    n.inputs.extend(inputs)
    return out


def _bias(node: gs.Node, x: gs.Tensor) -> gs.Constant | None:
    """The constant 1-D float operand of an ``Add(x, bias)``, else None."""
    if node.op != "Add" or len(node.inputs) != 2 or not any(t is x for t in node.inputs):
        return None
    other = node.inputs[1] if node.inputs[0] is x else node.inputs[0]
    if not isinstance(other, gs.Constant) or len(other.shape) != 1:
        return None
    return other if other.dtype == np.float32 else None


def starts_at_zero(zero_point: np.ndarray) -> bool:
    """Whether the zero point is its dtype's minimum.

    The grid's clipping at 0 may then be a Relu or Relu6 the quantizer folded into it (or the
    requantize pass removed), so the rounding must stay.
    """
    zp = np.asarray(zero_point)
    return int(zp.reshape(-1)[0]) == int(np.iinfo(zp.dtype).min)
