"""The QDQ lowering: every annotated group written as DequantizeLinear → float op → QuantizeLinear.

:class:`QDQWriter` is the QOperator writer's sibling (onnxq.lower.qoperator): it writes the
same records by the same op table, each group of the table as its float op between
DequantizeLinear on every operand and one QuantizeLinear on its output::

    Q(Conv(DQ(xq, xs, xz), DQ(wq, ws, wz, axis=0), DQ(bq, xs·ws, 0, axis=0)), ys, yz)

The int8 weights and the int32 bias stay integer initializers; the bias's scale and zero point
are derived from the solved values with it (materialize). Only standard ONNX ops remain, which
TensorRT, OpenVINO, QNN and onnxruntime's QDQ fusion consume. The requantize pass then works
on this form as on the QOperator one (onnxq.post.requantize). Per-channel DequantizeLinear
needs opset 13: :func:`lower_qdq` refuses a lower opset (quantize raises the opset first).

:func:`to_qdq` un-fuses an existing QOperator model the same way (``onnxq convert``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper

from onnxq.core.errors import QuantizationError
from onnxq.core.optable import BY_QOP, MS_DOMAIN, Attrs, QOp
from onnxq.core.specs import PatternRecord, QTensor
from onnxq.io.graph import set_nodes, tensor_array
from onnxq.lower.qoperator import TemplateWriter
from onnxq.prepare.opset import default_opset

PER_CHANNEL_OPSET = 13


class QDQWriter(TemplateWriter):
    """Write each group of the op table as DQ on its operands → its float op → Q."""

    form = "qdq"

    def _qlinear(self, rec: PatternRecord) -> gs.Variable:
        """DQ(inputs) [, DQ(int32 bias)] → the table's float op → Q(output) → DQ."""
        low = rec.lowering
        assert low is not None
        spec = BY_QOP[low.op]
        attrs = dict(low.attrs)
        operands = [self._operand(spec, attrs, qt) for qt in rec.inputs]
        if low.bias is not None and spec.bias is not None:
            w = spec.triples.index(spec.weight) if spec.weight is not None else 0
            operands.append(self._bias(low.bias, rec.inputs[0], rec.inputs[w]))
        (yq,) = rec.outputs
        root = self.tensors[rec.root]
        computed = self.editor.variable(f"{yq.quantized}_float", np.float32, root.shape)
        node = self.editor.add_node(
            spec.float_op, operands, [computed], f"{rec.node}_quant", spec.float_attrs(attrs)
        )
        self.ops[node.name] = spec.qop
        y = self._output(yq, rec.root)
        self.editor.add_node(
            "QuantizeLinear",
            [computed, self.const(yq.scale), self.const(yq.zero_point)],
            [y],
            f"{yq.quantized}_QuantizeLinear",
        )
        return self.dequantize(yq, y, root)

    def _operand(self, spec: QOp, attrs: Attrs, qt: QTensor) -> gs.Variable:
        """The float value the op reads: its operand dequantized (a weight per channel)."""
        quantized, _, _ = self.operands(qt)
        per_channel = qt.role == "weight" and int(np.prod(self.placeholders[qt.scale].shape)) > 1
        axis = weight_axis(spec, attrs) if per_channel else None
        return self.dequantize(qt, quantized, self.tensors[qt.tensor], axis)

    def _bias(self, bias: str, x: QTensor, w: QTensor) -> gs.Variable:
        """DQ of the int32 bias on the grid s_x · s_w (per channel), zero point 0."""
        shape = np.broadcast_shapes(
            self.placeholders[x.scale].shape, self.placeholders[w.scale].shape
        )
        grid: list[gs.Tensor] = []
        for kind, value in (
            ("scale", np.ones(shape, np.float32)),
            ("zero_point", np.zeros(shape, np.int32)),
        ):
            name = self.editor.unique_name(f"{bias}_{kind}")
            self.bias_grids[name] = (bias, kind)
            grid.append(gs.Constant(name, value))
        out = self.editor.variable(f"{bias}_dequantized", np.float32, shape)
        self.editor.add_node(
            "DequantizeLinear",
            [self.const(bias), *grid],
            [out],
            f"{bias}_DequantizeLinear",
            {"axis": 0} if int(np.prod(shape)) > 1 else None,
        )
        return out


def weight_axis(spec: QOp, attrs: Attrs) -> int | None:
    """The axis ``spec``'s weight is quantized along (QGemm: by its transB)."""
    if spec.weight_axis is not None or spec.weight is None:
        return spec.weight_axis
    return 0 if int(attrs.get("transB", 0)) else 1


def lower_qdq(model: onnx.ModelProto, dedicated_pairs: bool = False) -> onnx.ModelProto:
    """The materialized, requantized QDQ model as written (``model``, edited in place).

    Opset domains no node uses are left out; ``dedicated_pairs``: one QuantizeLinear →
    DequantizeLinear pair per consumer (:func:`dedicated_qdq_pairs`).
    """
    check_per_channel_opset(model)
    _drop_unused_domains(model)
    return dedicated_qdq_pairs(model) if dedicated_pairs else model


def check_per_channel_opset(model: onnx.ModelProto) -> None:
    """Refuse per-channel DequantizeLinear below the opset that defines it."""
    per_channel = any(
        a.name == "axis"
        for n in model.graph.node
        if n.op_type == "DequantizeLinear"
        for a in n.attribute
    )
    if per_channel and default_opset(model) < PER_CHANNEL_OPSET:
        raise QuantizationError(
            f"per-channel DequantizeLinear needs opset {PER_CHANNEL_OPSET}, the model has "
            f"{default_opset(model)}; quantize with --per-tensor or let quantize raise the opset"
        )


def _drop_unused_domains(model: onnx.ModelProto) -> None:
    used = {d.domain for d in model.graph.node}
    keep = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(keep)


class _Builder:
    """Collects the nodes and initializers of the converted graph with unique names."""

    def __init__(self, model: onnx.ModelProto):
        self.inits = {i.name: i for i in model.graph.initializer}
        self.names = set(self.inits) | {o for n in model.graph.node for o in n.output}
        self.names |= {i.name for i in model.graph.input}
        self.nodes: list[onnx.NodeProto] = []
        self.new_inits: list[onnx.TensorProto] = []

    def name(self, base: str) -> str:
        name, k = base, 1
        while name in self.names:
            name, k = f"{base}_{k}", k + 1
        self.names.add(name)
        return name

    def value(self, name: str) -> np.ndarray:
        if name not in self.inits:
            raise QuantizationError(
                f"'{name}' is not a constant; QDQ export needs constant scales and zero points"
            )
        return tensor_array(self.inits[name])

    def const(self, base: str, value: np.ndarray) -> str:
        name = self.name(base)
        tensor = numpy_helper.from_array(value, name)
        self.new_inits.append(tensor)
        self.inits[name] = tensor
        return name

    def dq(self, x: str, scale: str, zp: str, axis: int | None = None) -> str:
        out = self.name(f"{x}_dequantized")
        attrs: dict[str, Any] = {}
        if axis is not None and self.value(scale).size > 1:
            attrs["axis"] = axis
        self.nodes.append(
            helper.make_node(
                "DequantizeLinear",
                [x, scale, zp],
                [out],
                name=self.name(f"{x}_DequantizeLinear"),
                **attrs,
            )
        )
        return out

    def q(self, x: str, scale: str, zp: str, out: str) -> None:
        self.nodes.append(
            helper.make_node(
                "QuantizeLinear", [x, scale, zp], [out], name=self.name(f"{out}_QuantizeLinear")
            )
        )

    def bias(self, node: onnx.NodeProto, b: str, x_scale: str, w_scale: str) -> str:
        """DQ of an int32 bias with scale s_x · s_w (per channel) and zero point 0."""
        scale = (self.value(x_scale).astype(np.float64) * self.value(w_scale)).astype(np.float32)
        s = self.const(f"{node.name}.bias_scale", scale)
        z = self.const(f"{node.name}.bias_zero_point", np.zeros(scale.shape, np.int32))
        return self.dq(b, s, z, axis=0)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _refuse(spec: QOp, n: onnx.NodeProto) -> None:
    """Nodes the QDQ form cannot express."""
    i, attrs = list(n.input), _attrs(n)
    if "channels_last" in spec.drops and int(attrs.get("channels_last", 0)):
        raise QuantizationError(
            f"{n.op_type} node '{n.name}' is channels-last; QDQ export handles NCHW only"
        )
    if spec.float_output_ok:
        return
    if len(i) < spec.output + 2 or not i[spec.output]:
        raise QuantizationError(
            f"{n.op_type} node '{n.name}' has a float output; QDQ export expects quantized outputs"
        )


def unfuse(b: _Builder, n: onnx.NodeProto, spec: QOp) -> None:
    """``n`` as DequantizeLinear on each operand → the float op → QuantizeLinear."""
    _refuse(spec, n)
    i = list(n.input)
    ins = [
        b.dq(
            i[k],
            i[k + 1],
            i[k + 2],
            axis=weight_axis(spec, _attrs(n)) if k == spec.weight else None,
        )
        for k in spec.triple_positions(len(i))
    ]
    if spec.bias is not None and len(i) > spec.bias and i[spec.bias]:
        w = spec.weight if spec.weight is not None else 0
        ins.append(b.bias(n, i[spec.bias], i[1], i[w + 1]))
    quantized = len(i) >= spec.output + 2 and bool(i[spec.output])
    y = b.name(f"{n.output[0]}_float") if quantized else n.output[0]
    b.nodes.append(
        helper.make_node(spec.float_op, ins, [y], name=n.name, **spec.float_attrs(_attrs(n)))
    )
    if quantized:
        b.q(y, i[spec.output], i[spec.output + 1], n.output[0])


def unfuse_integer_to_float(b: _Builder, n: onnx.NodeProto) -> None:
    """``MatMulIntegerToFloat`` as DQ(A), DQ(B) → MatMul [→ Add(bias)], writing float."""
    a, w, a_scale, w_scale, a_zp, w_zp, *rest = list(n.input) + [""] * (7 - len(n.input))
    ins = [b.dq(a, a_scale, a_zp), b.dq(w, w_scale, w_zp, axis=1)]
    bias = rest[0] if rest else ""
    y = b.name(f"{n.output[0]}_matmul") if bias else n.output[0]
    b.nodes.append(helper.make_node("MatMul", ins, [y], name=n.name))
    if bias:
        b.nodes.append(
            helper.make_node("Add", [y, bias], [n.output[0]], name=b.name(f"{n.name}_bias"))
        )


def to_qdq(model: onnx.ModelProto) -> onnx.ModelProto:
    """The QDQ form of a QOperator model (the argument is not modified)."""
    b = _Builder(model)
    for node in model.graph.node:
        spec = BY_QOP.get(node.op_type)
        if node.op_type == "MatMulIntegerToFloat" and node.domain == MS_DOMAIN:
            unfuse_integer_to_float(b, node)
        elif spec is None:
            b.nodes.append(node)
        else:
            unfuse(b, node, spec)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    set_nodes(out.graph, b.nodes)
    out.graph.initializer.extend(b.new_inits)
    check_per_channel_opset(out)
    _drop_unused_domains(out)
    return out


def dedicated_qdq_pairs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every consumer of a quantized tensor its own QuantizeLinear → DequantizeLinear pair.

    TensorRT fuses a Q/DQ pair into the layer that reads it; a QuantizeLinear shared by several
    consumers is quantized once and must be kept apart (the TensorRT target's convention, as
    onnxruntime's ``DedicatedQDQPair`` option). Values are unchanged: the copies are identical.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in out.graph.node:
        for x in node.input:
            readers.setdefault(x, []).append(node)
    outputs = {o.name for o in out.graph.output}
    nodes: list[onnx.NodeProto] = []
    taken = {o for n in out.graph.node for o in n.output} | {t.name for t in out.graph.initializer}
    for node in out.graph.node:
        nodes.append(node)
        if node.op_type != "QuantizeLinear" or node.output[0] in outputs:
            continue
        users = readers.get(node.output[0], [])
        if len(users) < 2 or any(u.op_type != "DequantizeLinear" for u in users):
            continue
        for k, user in enumerate(users[1:], 1):
            name = f"{node.output[0]}_pair{k}"
            while name in taken:
                name += "_"
            taken.add(name)
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = f"{node.name}_pair{k}"
            copy.output[0] = name
            user.input[0] = name
            nodes.append(copy)
    set_nodes(out.graph, nodes)
    return out
