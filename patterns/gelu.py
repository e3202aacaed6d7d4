"""GELU kept whole for QOperator output, so that it runs as one onnxruntime kernel.

A GELU written out as ``x · 0.5 · (1 + erf(x / √2))`` has Mul and Add nodes other patterns could
quantize one by one. For QOperator output this pattern claims the whole subgraph and leaves it
float; :func:`onnxq.prepare.fusions.fuse_gelu` then writes it as one ``com.microsoft.Gelu``
node, the kernel onnxruntime itself would fuse it into in a float graph. QDQ and OpenVINO output
keep the ops as they are (their runtimes do their own fusions).
"""

from __future__ import annotations

from typing import Any

import onnx_graphsurgeon as gs

from onnxq.pattern import Match, MatchResult
from onnxq.patterns.rule import QuantizerPattern
from onnxq.prepare.fusions import GeluFusion


class GeluPattern(QuantizerPattern):
    """The written-out GELU, left float as one unit (QOperator output)."""

    name = "gelu"

    def __init__(self, calibration_callback: Any = None):
        super().__init__(calibration_callback)
        self.pattern = GeluFusion().pattern

    def check(self, m: Match) -> MatchResult:
        """QOperator output only."""
        if not self.quantizer.config.output.whole_gelu:
            return MatchResult.fail(
                "GELU is kept whole for QOperator output only; QDQ and OpenVINO runtimes fuse it "
                "themselves"
            )
        return self.float_output_check(m)

    def quantize_match(self, m: Match) -> gs.Tensor | None:
        """Leave it float (fused into one Gelu node after requantization)."""
        self.quantizer.leave_float(
            self,
            m,
            "part of a GELU kept float and written as one com.microsoft.Gelu node: onnxruntime "
            "fuses GELU in a float graph, but not behind a DequantizeLinear",
        )
        return None


# Div/Mul(x, √2) → Erf → Add(1) → Mul(x) → Mul(0.5) -> left float; com.microsoft.Gelu(x) after
# requantization (QOperator output)
RULES = [GeluPattern]
