"""Ingest of already-quantized models: recognise Q/DQ and retarget without calibration.

A QDQ model (a PyTorch QAT export, another tool's output, onnxq's own ``--format qdq``) is turned
into QOperator form with one dataflow pattern per op of the op table (``onnxq.core.optable``):

    Q(Conv(DQ(x), DQ(W), [DQ(b)]) [→ Relu], ys, yz)   → QLinearConv(x, …, W, …, ys, yz, b')
    Q(Gemm(DQ(a), DQ(B), [DQ(C)]), ys, yz)              → com.microsoft QGemm
    Q(Add(DQ(a), DQ(b)), ys, yz)                        → com.microsoft QLinearAdd
    …and so on for every non-variadic op of the table (MatMul, Mul, the pools, Sigmoid,
    LeakyRelu, Softmax): the table gives the slots, the domain and the attributes.

Weights must be constant integers (a Q of a float constant is folded first); a bias is
re-expressed as int32 at scale s_x·s_w. What matches nothing stays as it was (standard Q/DQ
around a float op, still valid) and the report names it. Then the requantize pass folds the
DQ→Q pairs left between quantized ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxq.core.errors import ConfigError, ModelError
from onnxq.core.optable import CARRIERS, INTEGER_OPS, MS_DOMAIN, TABLE, QOp, qops
from onnxq.core.qparams import qrange
from onnxq.io.graph import (
    GraphEditor,
    all_graphs,
    constant_value,
    export_model,
    import_graph,
)
from onnxq.lower.fakequantize import qdq_to_fakequantize
from onnxq.lower.qdq import to_qdq
from onnxq.lower.qoperator import slots
from onnxq.pattern import (
    DFPattern,
    DFPatternCallback,
    Match,
    MatchResult,
    is_constant,
    is_op,
    node_attr,
    rewrite,
    wildcard,
)
from onnxq.post.requantize import Requantizer
from onnxq.prepare.opset import default_opset
from onnxq.prepare.preprocess import preprocess

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
#: ops that make a model QOperator (the table's QLinear ops, and integer ops)
QOPERATOR_OPS = qops() | INTEGER_OPS


def quantized_form(model: onnx.ModelProto) -> str | None:
    """``"qoperator"``, ``"qdq"`` or None (a float model)."""
    ops = {n.op_type for n in model.graph.node}
    if ops & QOPERATOR_OPS:
        return "qoperator"
    if ops & QDQ_OPS:
        return "qdq"
    return None


def _dq(x: DFPattern, scale: DFPattern, zp: DFPattern) -> DFPattern:
    return is_op("DequantizeLinear")(x, scale, zp)


class FuseRule(DFPatternCallback):
    """``Q(op(DQ(a), DQ(b), … [, DQ(bias)]) [→ Relu]) → QLinear op``, for one op of the table.

    The op table (``onnxq.core.optable``) gives everything: the float op, how many (tensor, scale,
    zero point) triples it takes and which one is a constant weight, the bias slot, the
    output pair, the domain and the attributes.
    """

    def __init__(self, spec: QOp, opset: int) -> None:
        super().__init__()
        self.spec, self.opset = spec, opset
        self.name = f"Q({spec.float_op}(DQ…))"
        self.ys, self.yz = is_constant(), is_constant()
        self.dqs = [
            _dq(
                is_constant() if k == spec.weight and spec.constant_weight else wildcard(),
                is_constant(),
                is_constant(),
            )
            for k in spec.triples
        ]
        self.bias = _dq(is_constant(), is_constant(), is_constant())
        core: DFPattern = is_op(spec.float_op)(*self.dqs)
        if spec.bias is not None:
            core = is_op(spec.float_op)(*self.dqs, self.bias) | is_op(spec.float_op)(
                *self.dqs, None
            )
        self.core = core
        self.relu = is_op("Relu")(core)
        self.pattern = is_op("QuantizeLinear")(self.relu | core, self.ys, self.yz)

    def check(self, m: Match) -> MatchResult:
        """Constant scales; a Relu folds only where the output zero point is the minimum."""
        if self.relu in m:
            zp = constant_value(m.tensor(self.yz))
            if zp is None or int(zp.reshape(-1)[0]) != qrange(zp.dtype.name)[0]:
                return MatchResult.fail(
                    "a Relu before QuantizeLinear folds only when the output "
                    "zero point is the type's minimum"
                )
        for t in m.nodes:
            if t.op in ("DequantizeLinear", "QuantizeLinear"):
                scale = constant_value(t.inputs[1])
                if scale is None:
                    return MatchResult.fail(f"{t.op} node '{t.name}' has a non-constant scale")
        return MatchResult(m)

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        """The QLinear op reading the DQs' integer inputs, writing the Q's integer output."""
        m = self.match
        node = next(n for n in m.nodes if n.op == self.spec.float_op)
        triples = [list(m.node(dq).inputs[:3]) for dq in self.dqs]
        bias = None
        if self.bias in m:  # QGemm computes alpha·(A·B + C): C' = beta·C / alpha
            w = triples[self.spec.triples.index(self.spec.weight or 0)]
            factor = float(node_attr(node, "beta") or 1.0) / float(node_attr(node, "alpha") or 1.0)
            bias = _bias(self.editor, m, self.bias, triples[0][1], w[1], node.name, factor)
        inputs = slots(self.spec, triples, [m.tensor(self.ys), m.tensor(self.yz)], bias)
        y = self.editor.variable(m.root.name + "_qop", m.root.dtype, m.root.shape)
        attrs = self.spec.qop_attrs(dict(node.attrs), self.opset)
        self.editor.add_node(
            self.spec.qop, inputs, [y], f"{node.name}_quant", attrs, self.spec.domain
        )
        return y


class FloatOutputRule(DFPatternCallback):
    """``MatMul|Gemm(DQ(a), DQ(W) [, DQ(bias)])`` with a float result → an int8 op writing float.

    No QuantizeLinear reads the result: ``MatMulIntegerToFloat``, or ``QGemm`` without an
    output scale, as onnxq.post.float_outputs writes them.
    """

    def __init__(self, spec: QOp, opset: int) -> None:
        super().__init__()
        self.spec, self.opset = spec, opset
        self.name = f"{spec.float_op}(DQ…) → float"
        self.dqs = [
            _dq(wildcard(), is_constant(), is_constant()),
            _dq(is_constant(), is_constant(), is_constant()),
        ]
        self.bias = _dq(is_constant(), is_constant(), is_constant())
        core: DFPattern = is_op(spec.float_op)(*self.dqs)
        if spec.float_op == "Gemm":
            core = core | is_op("Gemm")(*self.dqs, self.bias)
        self.pattern = core

    def check(self, m: Match) -> MatchResult:
        """No QuantizeLinear reads the result (that is the QLinear rule's); 8-bit operands."""
        if any(u.op == "QuantizeLinear" for u in m.root.outputs):
            return MatchResult.fail("a QuantizeLinear reads the result: the QLinear form applies")
        for dq in self.dqs:
            zp = constant_value(m.node(dq).inputs[2])
            if zp is None or zp.dtype not in (np.int8, np.uint8):
                return MatchResult.fail("MatMulIntegerToFloat and QGemm take 8-bit operands")
        return MatchResult(m)

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        """The int8 op reading the DQs' integer inputs, writing the float result."""
        m = self.match
        node = next(n for n in m.nodes if n.op == self.spec.float_op)
        (a, a_s, a_z), (w, w_s, w_z) = (list(m.node(dq).inputs[:3]) for dq in self.dqs)
        y = self.editor.variable(m.root.name + "_qop", m.root.dtype, m.root.shape)
        if self.spec.float_op == "MatMul":
            inputs: list[gs.Tensor | None] = [a, w, a_s, w_s, a_z, w_z]
            op, domain, attrs = "MatMulIntegerToFloat", MS_DOMAIN, {}
        else:
            bias = None
            if self.bias in m:
                factor = float(node_attr(node, "beta") or 1.0) / float(
                    node_attr(node, "alpha") or 1.0
                )
                bias = _bias(self.editor, m, self.bias, a_s, w_s, node.name, factor)
            inputs = [a, a_s, a_z, w, w_s, w_z, bias]
            while inputs and inputs[-1] is None:
                inputs.pop()
            op, domain = self.spec.qop, self.spec.domain
            attrs = self.spec.qop_attrs(dict(node.attrs), self.opset)
        self.editor.add_node(op, inputs, [y], f"{node.name}_quant", attrs, domain)
        return y


def _bias(
    editor: GraphEditor,
    m: Match,
    dq: DFPattern,
    x_scale: gs.Tensor,
    w_scale: gs.Tensor,
    node_name: str,
    factor: float = 1.0,
) -> gs.Constant:
    """The bias re-expressed as int32 at scale s_x·s_w (whatever scale it was stored with)."""
    node = m.node(dq)
    values = [constant_value(t) for t in node.inputs[:3]]
    q, s, z = (np.asarray(v) for v in values)
    real = (q.astype(np.float64) - z.astype(np.float64)) * s.astype(np.float64) * factor
    target = np.asarray(constant_value(x_scale), np.float64) * np.asarray(
        constant_value(w_scale), np.float64
    )
    bq = np.clip(np.round(real / target), -(2**31), 2**31 - 1).astype(np.int32)
    return editor.constant(f"{node_name}.bias_quantized", bq.reshape(-1))


def _dedicated_dq(graph: gs.Graph) -> None:
    """Give every consumer of a shared DequantizeLinear its own copy (a match owns its DQ)."""
    editor = GraphEditor(graph)
    for dq in [n for n in graph.nodes if n.op == "DequantizeLinear"]:
        out = dq.outputs[0]
        users = list(out.outputs)
        for user in users[1:]:
            copy = editor.variable(out.name, out.dtype, out.shape)
            editor.add_node("DequantizeLinear", list(dq.inputs), [copy], dq.name, dict(dq.attrs))
            for i, t in enumerate(user.inputs):
                if t is out:
                    editor.set_input(user, i, copy)
    editor.finish()


def qdq_rules(opset: int) -> list[DFPatternCallback]:
    """One rule per op of the table (a variadic op such as QLinearConcat is left as Q/DQ)."""
    rules: list[DFPatternCallback] = [FuseRule(spec, opset) for spec in TABLE if not spec.variadic]
    rules += [FloatOutputRule(spec, opset) for spec in TABLE if spec.float_op in ("MatMul", "Gemm")]
    return rules


@dataclass
class ConvertReport:
    """What the conversion did."""

    source: str
    target: str
    converted: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """A few lines for a terminal."""
        lines = [f"{self.source} → {self.target}: {len(self.converted)} ops converted"]
        for node, reason in self.left.items():
            lines.append(f"  left as Q/DQ around a float op: {node}: {reason}")
        return "\n".join(lines)


def qdq_to_qoperator(model: onnx.ModelProto) -> tuple[onnx.ModelProto, ConvertReport]:
    """QOperator form of a QDQ model; unmatched float ops keep their Q/DQ."""
    model = preprocess(model)
    graph = import_graph(model)
    _dedicated_dq(graph)
    float_ops = {n.name: n for n in graph.nodes if n.op not in QDQ_OPS}
    res = rewrite(qdq_rules(default_opset(model)), graph)
    report = ConvertReport("qdq", "qoperator")
    converted = {n.name for g in res.rewritten for n in g.nodes if n.op not in QDQ_OPS}
    report.converted = sorted(converted)
    first = res.partitions[0] if res.partitions else None
    for name, node in float_ops.items():
        if name in converted or node.op == "Relu" or node.op in CARRIERS:
            continue
        qs = [u.name for o in node.outputs for u in o.outputs if u.op == "QuantizeLinear"]
        from_dq = any(t.inputs and t.inputs[0].op == "DequantizeLinear" for t in node.inputs)
        if not qs and not from_dq:
            continue  # a float op outside the quantized region
        reasons = [a.reason for q in qs for a in first.reasons_for(q)] if first else []
        report.left[name] = reasons[0] if reasons else f"no QLinear form for {node.op} here"
    out = export_model(graph, model)
    return Requantizer().requantize(out), report


def convert(model: onnx.ModelProto, target: str) -> tuple[onnx.ModelProto, ConvertReport]:
    """Retarget a quantized model to ``target`` (qoperator, qdq, openvino) without calibration."""
    if target not in ("qoperator", "qdq", "openvino"):
        raise ConfigError(
            f"convert --format {target!r} is not supported; convert retargets to "
            "qoperator, qdq or openvino"
        )
    source = quantized_form(model)
    if source is None:
        bodies = all_graphs(model.graph)[1:]
        if any(n.op_type in QDQ_OPS | QOPERATOR_OPS for g in bodies for n in g.node):
            raise ModelError(
                "the model's quantized ops sit in its If/Loop/Scan bodies, which convert does "
                "not read; quantize the float model again with the format you want (--format)"
            )
        raise ModelError(
            "the model holds no QuantizeLinear/DequantizeLinear or QLinear ops: it "
            "is a float model; use `onnxq quantize` with calibration data"
        )
    if target == "openvino":
        qdq = to_qdq(model) if source == "qoperator" else model
        fq, converted = qdq_to_fakequantize(qdq)
        return fq, ConvertReport(source, target, converted)
    if source == target:
        return model, ConvertReport(source, target)
    if source == "qoperator":
        return to_qdq(model), ConvertReport(
            source, target, [n.name for n in model.graph.node if n.op_type in QOPERATOR_OPS]
        )
    return qdq_to_qoperator(model)
