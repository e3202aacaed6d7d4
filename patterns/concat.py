"""Concat of quantized feature maps → com.microsoft QLinearConcat (each input keeps its scale).

One output scale must cover every input's range. Where inputs of very different ranges meet
(pixel boxes concatenated with 0–1 scores at a detector's output), that scale would wipe out the
small ones, so Concat is quantized only inside the quantized region: every input produced by a
quantized op and some quantized op reading the result. Elsewhere it stays float, with the reason.
"""

from __future__ import annotations

from typing import Any

from onnxq.core.optable import BY_QOP
from onnxq.core.specs import Lowering, PatternRecord
from onnxq.pattern import Match, MatchResult, is_op
from onnxq.patterns.base import is_constant_tensor, quantized_downstream, quantized_upstream
from onnxq.patterns.rule import QuantizerPattern


class ConcatPattern(QuantizerPattern):
    """Concat(a₁, …, aₙ) of activations between quantized ops."""

    name = "concat"
    shares_scale = "Concat"

    def __init__(self, calibration_callback: Any = None):
        super().__init__(calibration_callback)
        self.pattern = is_op("Concat")

    def check(self, m: Match) -> MatchResult:
        """Float32 activations only."""
        res = self.float_output_check(m)
        if not res.ok:
            return res
        node = m.node(self.pattern)
        for t in node.inputs:
            if is_constant_tensor(t):
                return MatchResult.fail(
                    f"input '{t.name}' is a constant; Concat is quantized only on activations"
                )
        return MatchResult(m)

    def quantize_match(self, m: Match) -> PatternRecord | None:
        """Q(each input) → QLinearConcat → DQ, inside the quantized region only."""
        q = self.quantizer
        node = m.node(self.pattern)
        ins = list(node.inputs)
        if not all(quantized_upstream(self, t) for t in ins) or not quantized_downstream(
            self, m.root
        ):
            q.leave_float(
                self,
                m,
                "Concat is quantized only between quantized ops (all inputs "
                "and a reader): one output scale for inputs of different ranges "
                "would wipe out the small ones",
            )
            return None
        qins = [q.quantize_input(t) for t in ins]
        yq = q.quantize_output(m.root)
        attrs = self.qop_attrs(node, BY_QOP["QLinearConcat"])
        lowering = Lowering("qlinear", "QLinearConcat", tuple(attrs.items()))
        return self.annotate(m, node, qins, [yq], lowering)


# Concat(a, b, …) -> DQ(QLinearConcat(ys, yz, Q(a), Q(b), …))     (inside the quantized region)
RULES = [ConcatPattern]
