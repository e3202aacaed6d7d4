"""Output formats: QOperator (what the Quantizer builds) and standard ONNX QDQ.

QDQ rewrites every int8 op back into its float op between DequantizeLinear and QuantizeLinear:
``QLinearConv(xq, xs, xz, wq, ws, wz, ys, yz, bq)`` becomes
``Q(Conv(DQ(xq, xs, xz), DQ(wq, ws, wz, axis=0), DQ(bq, xs·ws, 0, axis=0)), ys, yz)``; the
int8 weights and the int32 bias stay integer initializers. Only standard ONNX ops remain, which
TensorRT, OpenVINO, QNN and onnxruntime's QDQ fusion consume. Per-channel DequantizeLinear needs
opset 13; :func:`to_qdq` refuses a lower opset (quantize raises the opset first).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxq.core.errors import QuantizationError
from onnxq.core.optable import BY_QOP, MS_DOMAIN, QOp
from onnxq.io.graph import set_nodes, tensor_array
from onnxq.prepare.opset import default_opset

PER_CHANNEL_OPSET = 13


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


def _weight_axis(spec: QOp, n: onnx.NodeProto) -> int | None:
    if spec.weight_axis is not None or spec.weight is None:
        return spec.weight_axis
    return 0 if int(_attrs(n).get("transB", 0)) else 1  # QGemm


def unfuse(b: _Builder, n: onnx.NodeProto, spec: QOp) -> None:
    """``n`` as DequantizeLinear on each operand → the float op → QuantizeLinear."""
    _refuse(spec, n)
    i = list(n.input)
    ins = [
        b.dq(i[k], i[k + 1], i[k + 2], axis=_weight_axis(spec, n) if k == spec.weight else None)
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
    has_axis = False
    b = _Builder(model)
    for node in model.graph.node:
        spec = BY_QOP.get(node.op_type)
        before = len(b.nodes)
        if node.op_type == "MatMulIntegerToFloat" and node.domain == MS_DOMAIN:
            unfuse_integer_to_float(b, node)
        elif spec is None:
            b.nodes.append(node)
            continue
        else:
            unfuse(b, node, spec)
        has_axis |= any(
            a.name == "axis"
            for n in b.nodes[before:]
            for a in n.attribute
            if n.op_type == "DequantizeLinear"
        )
    if has_axis and default_opset(model) < PER_CHANNEL_OPSET:
        raise QuantizationError(
            f"per-channel DequantizeLinear needs opset {PER_CHANNEL_OPSET}, the model has "
            f"{default_opset(model)}; quantize with --per-tensor or let quantize raise the opset"
        )
    out = onnx.ModelProto()
    out.CopyFrom(model)
    set_nodes(out.graph, b.nodes)
    out.graph.initializer.extend(b.new_inits)
    used = {d.domain for d in out.graph.node}
    keep = [o for o in out.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del out.opset_import[:]
    out.opset_import.extend(keep)
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
