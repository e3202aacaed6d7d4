"""Ingest of already-quantized models: recognise Q/DQ and retarget without calibration.

A QDQ model (a PyTorch QAT export, another tool's output, onnxq's own ``--format qdq``) is turned
into QOperator form with dataflow patterns, one per op family:

    Q(Conv(DQ(x), DQ(W), [DQ(b)]) [→ Relu], ys, yz)   → QLinearConv(x, …, W, …, ys, yz, b')
    Q(MatMul(DQ(a), DQ(B)), ys, yz)                     → QLinearMatMul
    Q(Gemm(DQ(a), DQ(B), [DQ(C)]), ys, yz)              → com.microsoft QGemm
    Q(Add|Mul(DQ(a), DQ(b)), ys, yz)                    → com.microsoft QLinearAdd|QLinearMul
    Q(GlobalAveragePool|AveragePool(DQ(x)), ys, yz)     → com.microsoft QLinear…Pool

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

from onnxq.errors import ConfigError, ModelError
from onnxq.io.graph import MS_DOMAIN, GraphEditor, constant_value, export_model, import_graph
from onnxq.lower.fakequantize import qdq_to_fakequantize
from onnxq.lower.qdq import to_qdq
from onnxq.optable import INTEGER_OPS, qops
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
from onnxq.prepare.preprocess import preprocess
from onnxq.solve.qparams import qrange

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


class _QdqRule(DFPatternCallback):
    """``Q(op(DQ(...)...)) → QLinear op``: subclasses give the float op and build the int8 op."""

    def __init__(self) -> None:
        super().__init__()
        self.ys, self.yz = is_constant(), is_constant()

    def wrap(self, core: DFPattern, relu_ok: bool = True) -> DFPattern:
        self.core = core
        self.relu = is_op("Relu")(core)
        body = (self.relu | core) if relu_ok else core
        return is_op("QuantizeLinear")(body, self.ys, self.yz)

    def check(self, m: Match) -> MatchResult:
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

    def operands(self, m: Match, dq: DFPattern) -> list[gs.Tensor]:
        node = m.node(dq)
        return [node.inputs[0], node.inputs[1], node.inputs[2]]

    def out(self, m: Match) -> gs.Variable:
        return self.editor.variable(m.root.name + "_qop", m.root.dtype, m.root.shape)


class _ConvRule(_QdqRule):
    name = "Q(Conv(DQ…))"

    def __init__(self) -> None:
        super().__init__()
        self.x = _dq(wildcard(), is_constant(), is_constant())
        self.w = _dq(is_constant(), is_constant(), is_constant())
        self.b = _dq(is_constant(), is_constant(), is_constant())
        conv = is_op("Conv")(self.x, self.w, self.b) | is_op("Conv")(self.x, self.w, None)
        self.pattern = self.wrap(conv)

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        m = self.match
        conv = next(n for n in m.nodes if n.op == "Conv")
        xs = self.operands(m, self.x)
        ws = self.operands(m, self.w)
        inputs = [*xs, *ws, m.tensor(self.ys), m.tensor(self.yz)]
        if self.b in m:
            inputs.append(_bias(self.editor, m, self.b, xs[1], ws[1], conv.name))
        y = self.out(m)
        self.editor.add_node("QLinearConv", inputs, [y], f"{conv.name}_quant", dict(conv.attrs))
        return y


class _MatMulRule(_QdqRule):
    name = "Q(MatMul(DQ…))"

    def __init__(self) -> None:
        super().__init__()
        self.a = _dq(wildcard(), is_constant(), is_constant())
        self.b = _dq(wildcard(), is_constant(), is_constant())
        self.pattern = self.wrap(is_op("MatMul")(self.a, self.b))

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        m = self.match
        mm = next(n for n in m.nodes if n.op == "MatMul")
        inputs = [
            *self.operands(m, self.a),
            *self.operands(m, self.b),
            m.tensor(self.ys),
            m.tensor(self.yz),
        ]
        y = self.out(m)
        self.editor.add_node("QLinearMatMul", inputs, [y], f"{mm.name}_quant")
        return y


class _GemmRule(_QdqRule):
    name = "Q(Gemm(DQ…))"

    def __init__(self) -> None:
        super().__init__()
        self.a = _dq(wildcard(), is_constant(), is_constant())
        self.b = _dq(is_constant(), is_constant(), is_constant())
        self.c = _dq(is_constant(), is_constant(), is_constant())
        gemm = is_op("Gemm")(self.a, self.b, self.c) | is_op("Gemm")(self.a, self.b, None)
        self.pattern = self.wrap(gemm)

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        m = self.match
        gemm = next(n for n in m.nodes if n.op == "Gemm")
        alpha = float(node_attr(gemm, "alpha") or 1.0)
        beta = float(node_attr(gemm, "beta") or 1.0)
        xs, ws = self.operands(m, self.a), self.operands(m, self.b)
        bias = None
        if self.c in m:  # QGemm computes alpha·(A·B + C): C' = beta·C / alpha
            bias = _bias(self.editor, m, self.c, xs[1], ws[1], gemm.name, beta / alpha)
        inputs = [*xs, *ws, bias, m.tensor(self.ys), m.tensor(self.yz)]
        attrs = {
            "alpha": alpha,
            "transA": int(node_attr(gemm, "transA") or 0),
            "transB": int(node_attr(gemm, "transB") or 0),
        }
        y = self.out(m)
        self.editor.add_node("QGemm", inputs, [y], f"{gemm.name}_quant", attrs, MS_DOMAIN)
        return y


class _BinaryRule(_QdqRule):
    def __init__(self, op: str, qop: str) -> None:
        super().__init__()
        self.op, self.qop, self.name = op, qop, f"Q({op}(DQ…))"
        self.a = _dq(wildcard(), is_constant(), is_constant())
        self.b = _dq(wildcard(), is_constant(), is_constant())
        self.pattern = self.wrap(is_op(op)(self.a, self.b))

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        m = self.match
        node = next(n for n in m.nodes if n.op == self.op)
        inputs = [
            *self.operands(m, self.a),
            *self.operands(m, self.b),
            m.tensor(self.ys),
            m.tensor(self.yz),
        ]
        y = self.out(m)
        self.editor.add_node(self.qop, inputs, [y], f"{node.name}_quant", {}, MS_DOMAIN)
        return y


class _PoolRule(_QdqRule):
    def __init__(self, op: str, qop: str) -> None:
        super().__init__()
        self.op, self.qop, self.name = op, qop, f"Q({op}(DQ…))"
        self.x = _dq(wildcard(), is_constant(), is_constant())
        self.pattern = self.wrap(is_op(op)(self.x), relu_ok=False)

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        m = self.match
        node = next(n for n in m.nodes if n.op == self.op)
        inputs = [*self.operands(m, self.x), m.tensor(self.ys), m.tensor(self.yz)]
        y = self.out(m)
        self.editor.add_node(
            self.qop,
            inputs,
            [y],
            f"{node.name}_quant",
            {**node.attrs, "channels_last": 0},
            MS_DOMAIN,
        )
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


def qdq_rules() -> list[DFPatternCallback]:
    """One rule per op family."""
    return [
        _ConvRule(),
        _GemmRule(),
        _MatMulRule(),
        _BinaryRule("Add", "QLinearAdd"),
        _BinaryRule("Mul", "QLinearMul"),
        _PoolRule("GlobalAveragePool", "QLinearGlobalAveragePool"),
        _PoolRule("AveragePool", "QLinearAveragePool"),
    ]


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
    res = rewrite(qdq_rules(), graph)
    report = ConvertReport("qdq", "qoperator")
    converted = {n.name for g in res.rewritten for n in g.nodes if n.op not in QDQ_OPS}
    report.converted = sorted(converted)
    first = res.partitions[0] if res.partitions else None
    for name, node in float_ops.items():
        if name in converted or node.op in (
            "Relu",
            "MaxPool",
            "Reshape",
            "Flatten",
            "Transpose",
            "Squeeze",
            "Unsqueeze",
        ):
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
