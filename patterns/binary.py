"""Add and Mul of two activations: → com.microsoft QLinearAdd / QLinearMul."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxq.graph import MS_DOMAIN, producer
from onnxq.pattern import DFPattern, Match, MatchResult, is_op, wildcard
from onnxq.patterns.base import is_constant_tensor, with_relu
from onnxq.quantizer import PatternRecord, QuantizerPattern


class BinaryPattern(QuantizerPattern):
    """``op(a, b) [→ Relu]`` on two activations."""

    op_type = ""
    qop = ""

    def __init__(self, calibration_callback=None):
        super().__init__(calibration_callback)
        self.a, self.b = wildcard(), wildcard()
        self.core: DFPattern = is_op(self.op_type)(self.a, self.b)
        self.pattern, self.relu = with_relu(self.core)

    def check(self, m: Match) -> MatchResult:
        """Both operands must be activations (a constant operand is a bias or a scale)."""
        res = self.float_output_check(m)
        if not res.ok:
            return res
        for p in (self.a, self.b):
            t = m.tensor(p)
            if is_constant_tensor(t):
                return MatchResult.fail(
                    f"operand '{t.name}' is a constant; {self.op_type} is "
                    "quantized only between two activations"
                )
        if self.relu in m and self.quantizer.config.activation_symmetric:
            return MatchResult.fail("a Relu folds only into an asymmetric output range")
        return MatchResult(m)

    def quantize_match(self, m: Match) -> gs.Tensor | None:
        """Q(a), Q(b) → QLinear op → DQ, unless no neighbour is quantized (a pure round trip)."""
        q = self.quantizer
        a, b = m.tensor(self.a), m.tensor(self.b)
        neighbours = [producer(a), producer(b), *m.root.outputs]
        if not any(self.in_group(n) for n in neighbours):
            q.leave_float(
                self,
                m,
                f"{self.op_type} sits between float neighbours: quantizing it "
                "alone would only add Q/DQ round trips",
            )
            return None
        node = m.node(self.core)
        aq, bq = q.quantize_input(a), q.quantize_input(b)
        yq, y_var = q.quantize_output(m.root)
        inputs = [*q.operands(aq), *q.operands(bq), q.const(yq.scale), q.const(yq.zero_point)]
        qnode = q.add_node(self.qop, inputs, [y_var], f"{node.name}_quant", {}, MS_DOMAIN)
        q.record(
            PatternRecord(
                self,
                self.label(),
                [n.name for n in m.nodes],
                [aq, bq],
                [yq],
                qnode.name,
                relu_folded=self.relu in m,
            )
        )
        return q.dequantize(yq, y_var, m.root)


class AddPattern(BinaryPattern):
    """Add of two activations (residual connections), optionally followed by Relu."""

    name = "add"
    op_type = "Add"
    qop = "QLinearAdd"


class MulPattern(BinaryPattern):
    """Mul of two activations (gating), optionally followed by Relu."""

    name = "mul"
    op_type = "Mul"
    qop = "QLinearMul"


# Add(a, b) [→ Relu] -> DQ(QLinearAdd(Q(a), Q(b), ys, yz))
# Mul(a, b) [→ Relu] -> DQ(QLinearMul(Q(a), Q(b), ys, yz))
RULES = [AddPattern, MulPattern]
