"""The QOperator lowering: every annotated group written as Q → QLinear op → DQ.

The rules only annotate (``onnxq.patterns.rule``); this module writes the groups into the
float graph, in the order they were annotated, from their records and the op table
(``onnxq.core.optable``): which op, in which domain, and where each (tensor, scale, zero point)
triple, the output pair and the bias go. The result is the *template*: a valid model whose
scales, zero points and quantized weights are placeholder initializers that
``Quantizer.materialize`` fills in. The QDQ template is its sibling, written from the same
records by the same table (onnxq.lower.qdq), and FakeQuantize is written from the records
and solved values directly (onnxq.lower.fakequantize).

One QuantizeLinear is written per activation edge and dtype, shared by every group reading it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from onnxq.core.optable import BY_QOP, QOp
from onnxq.core.specs import PatternRecord, Placeholder, QTensor
from onnxq.io.graph import GraphEditor, export_model, unfilled

#: int8 weights larger than this are left without data in the template
UNFILLED_BYTES = 2**20


def slots(
    spec: QOp, triples: Sequence[list[gs.Tensor]], output: list[gs.Tensor], bias: gs.Tensor | None
) -> list[gs.Tensor | None]:
    """The inputs of ``spec``'s op in table order; absent optional inputs are None."""
    if spec.variadic:
        return [*output, *(t for triple in triples for t in triple)]
    at: dict[int, gs.Tensor] = {}
    for position, triple in zip(spec.triples, triples):
        for k, t in enumerate(triple):
            at[position + k] = t
    at[spec.output], at[spec.output + 1] = output
    if bias is not None and spec.bias is not None:
        at[spec.bias] = bias
    return [at.get(i) for i in range(max(at) + 1)]


@dataclass(frozen=True)
class Template:
    """The annotation written in one form, with placeholders for everything solving decides."""

    model: onnx.ModelProto
    #: the same as a graph: materialize fills a copy of it
    graph: gs.Graph
    #: constants derived besides the placeholders (:attr:`TemplateWriter.bias_grids`)
    bias_grids: dict[str, tuple[str, str]]
    #: the node written for each group of the op table: its name -> the QLinear op it is
    #: (in QDQ form the float op; onnxq.post.requantize.quantized_op reads them)
    ops: dict[str, str]


class TemplateWriter:
    """Write annotated groups into ``graph`` (a copy of the float graph the rules annotated).

    Each group of the op table becomes its QLinear op; :class:`onnxq.lower.qdq.QDQWriter`
    writes the same groups in QDQ form. Islands and tables are written alike by both.
    """

    #: the form of the template this writer writes (a key of the quantizer's templates)
    form = "qoperator"

    def __init__(self, graph: gs.Graph, editor: GraphEditor, placeholders: dict[str, Placeholder]):
        self.graph, self.editor, self.placeholders = graph, editor, placeholders
        self.tensors = graph.tensors()
        self.nodes = {n.name: n for n in graph.nodes}
        self._consts: dict[str, gs.Constant] = {}
        self._quantized: dict[str, gs.Variable] = {}
        #: constants derived from the solved values besides the placeholders (the QDQ form's
        #: int32-bias scales and zero points): name -> (bias placeholder, "scale" | "zero_point")
        self.bias_grids: dict[str, tuple[str, str]] = {}
        #: name of the node written for each group of the op table -> its QLinear op
        self.ops: dict[str, str] = {}

    def write_all(self, records: Sequence[PatternRecord], base: onnx.ModelProto) -> Template:
        """Write every record, in order (each group's output replaces its float root).

        ``base``: the float model (the template's opsets and metadata).
        """
        for rec in records:
            root = self.tensors[rec.root]
            self.editor.replace_producer(root, self.write(rec))
        graph = self.editor.finish()
        return Template(export_model(graph, base), graph, self.bias_grids, self.ops)

    def write(self, rec: PatternRecord) -> gs.Variable:
        """Write one group; return the float tensor (a DequantizeLinear output) it produces."""
        assert rec.lowering is not None, f"{rec.label} '{rec.node}' has no lowering"
        kind = rec.lowering.kind
        if kind == "qlinear":
            return self._qlinear(rec)
        if kind == "island":
            return self._island(rec)
        if kind == "table":
            return self._table(rec)
        raise ValueError(f"unknown lowering kind {kind!r} of {rec.label} '{rec.node}'")

    # the three kinds of group ---------------------------------------------------------------

    def _qlinear(self, rec: PatternRecord) -> gs.Variable:
        """Q(inputs) → the QLinear op of the table → DQ(output)."""
        low = rec.lowering
        assert low is not None
        spec = BY_QOP[low.op]
        triples = [self.operands(qt) for qt in rec.inputs]
        (yq,) = rec.outputs
        y = self._output(yq, rec.root)
        bias = self.const(low.bias) if low.bias is not None else None
        inputs = slots(spec, triples, [self.const(yq.scale), self.const(yq.zero_point)], bias)
        node = self.editor.add_node(
            spec.qop, inputs, [y], f"{rec.node}_quant", dict(low.attrs), spec.domain
        )
        self.ops[node.name] = spec.qop
        return self.dequantize(yq, y, self.tensors[rec.root])

    def _island(self, rec: PatternRecord) -> gs.Variable:
        """DQ(x), DQ(W) → the float op and its activations → Q(y) → DQ."""
        low = rec.lowering
        assert low is not None
        xq, wq = rec.inputs
        (yq,) = rec.outputs
        x = self.operands(xq)[0]
        y = self._output(yq, rec.root)
        xf = self.dequantize(xq, x, self.tensors[xq.tensor])
        wf = self.dequantize(wq, self.const(wq.quantized), self.tensors[wq.tensor], wq.axis)
        ins: list[gs.Tensor] = [xf, wf]
        if low.bias is not None:
            ins.append(self.tensors[low.bias])
        out = self._float_copy(self.nodes[rec.node], ins)
        for name in low.activations:  # read the op's float output: no Q/DQ between them
            act = self.nodes[name]
            out = self._float_copy(act, [out, *act.inputs[1:]])
        self.editor.add_node(
            "QuantizeLinear",
            [out, self.const(yq.scale), self.const(yq.zero_point)],
            [y],
            f"{rec.root}_island_QuantizeLinear",
        )
        return self.dequantize(yq, y, self.tensors[rec.root])

    def _table(self, rec: PatternRecord) -> gs.Variable:
        """Gather(int8 table, indices) → DequantizeLinear (per column: axis -1)."""
        (wq,) = rec.inputs
        node, root = self.nodes[rec.node], self.tensors[rec.root]
        rows = self.editor.variable(f"{rec.root}_quantized", np.int8, root.shape)
        self.editor.add_node(
            "Gather",
            [self.const(wq.quantized), node.inputs[1]],
            [rows],
            f"{rec.node}_quant",
            {"axis": 0},
        )
        return self.dequantize(wq, rows, root, axis=-1 if wq.axis is not None else None)

    # tensors --------------------------------------------------------------------------------

    def const(self, name: str) -> gs.Constant:
        """The template initializer of placeholder ``name`` (its default value until solved).

        An int8 weight over :data:`UNFILLED_BYTES` has no data in the template: materialize
        derives it from the float weight (its zeros were a quarter of a model's weights).
        """
        if name not in self._consts:
            ph = self.placeholders[name]
            dtype = np.dtype(ph.dtype)
            if ph.kind == "weight" and int(np.prod(ph.shape)) * dtype.itemsize > UNFILLED_BYTES:
                values: Any = LazyValues(unfilled(name, dtype, ph.shape))
            else:
                values = ph.default()
            self._consts[name] = gs.Constant(name, values)
        return self._consts[name]

    def operands(self, qt: QTensor) -> list[gs.Tensor]:
        """``[quantized tensor, scale, zero point]``; an activation is quantized on first use."""
        if qt.role == "weight":
            quantized: gs.Tensor = self.const(qt.quantized)
        else:
            quantized = self._quantize(qt)
        return [quantized, self.const(qt.scale), self.const(qt.zero_point)]

    def _quantize(self, qt: QTensor) -> gs.Variable:
        """The QuantizeLinear of an activation edge (one per edge and dtype)."""
        if qt.quantized not in self._quantized:
            tensor = self.tensors[qt.tensor]
            var = gs.Variable(qt.quantized, dtype=np.dtype(qt.dtype), shape=tensor.shape)
            self.editor.add_node(
                "QuantizeLinear",
                [tensor, self.const(qt.scale), self.const(qt.zero_point)],
                [var],
                name=f"{qt.tensor}_QuantizeLinear",
            )
            self._quantized[qt.quantized] = var
        return self._quantized[qt.quantized]

    def _output(self, qt: QTensor, root: str) -> gs.Variable:
        return gs.Variable(qt.quantized, dtype=np.dtype(qt.dtype), shape=self.tensors[root].shape)

    def dequantize(
        self, qt: QTensor, quantized: gs.Tensor, like: gs.Tensor, axis: int | None = None
    ) -> gs.Variable:
        """DequantizeLinear of ``quantized``; the result replaces float tensor ``like``."""
        out = self.editor.variable(like.name + "_dequantized", np.float32, like.shape)
        self.editor.add_node(
            "DequantizeLinear",
            [quantized, self.const(qt.scale), self.const(qt.zero_point)],
            [out],
            name=f"{like.name}_DequantizeLinear",
            attrs={"axis": axis} if axis is not None else None,
        )
        return out

    def _float_copy(self, node: gs.Node, inputs: list[gs.Tensor]) -> gs.Variable:
        """A float copy of ``node`` inside an island, reading ``inputs``; its output."""
        y = node.outputs[0]
        out = self.editor.variable(f"{y.name}_island", np.float32, y.shape)
        self.editor.add_node(node.op, inputs, [out], f"{node.name}_island", dict(node.attrs))
        return out
