"""QDQ islands: ops onnxruntime CPU has no QLinear kernel for, quantized where runtimes fuse them.

TensorRT and OpenVINO fuse a convolution with the activation after it (HardSwish, HardSigmoid,
LeakyRelu, Relu) and run ConvTranspose in int8; onnxruntime's CPU provider has no QLinear form
of the hard activations (its QLinearLeakyRelu is a separate op) and no int8 ConvTranspose. For
the ``qdq`` and ``openvino`` formats these patterns write the group as an island of standard
ONNX::

    DQ(x_q) ─┐
    DQ(W_q) ─┴→ Conv | ConvTranspose (float bias) → [activation] → Q(y)

with no Q/DQ between the op and its activation: one rounding instead of two, and the Q/DQ
placement that lets those runtimes fuse the op and its activation. In QOperator output
(``ort-cpu``) the patterns do not apply; the explain entry says why.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.core.specs import Lowering, PatternRecord
from onnxq.pattern import DFPattern, Match, MatchResult, is_op
from onnxq.patterns.base import WeightedPattern, _const, with_relu

#: output formats whose runtimes consume a QDQ island
#: activations fused into the convolution before the output is quantized
FUSED = ("HardSwish", "HardSigmoid", "LeakyRelu")


def fused_activation(core: DFPattern) -> DFPattern:
    """``core`` followed by one of the :data:`FUSED` activations."""
    alternatives = [is_op(op)(core) for op in FUSED]
    out: DFPattern = alternatives[0]
    for alt in alternatives[1:]:
        out = out | alt
    return out


class IslandPattern(WeightedPattern):
    """``op(x, W[, b]) [→ activation]`` written as DQ → float op(s) → Q."""

    #: the activation is required (Conv: the plain form has its QLinearConv pattern)
    activation_required = False

    def build_pattern(self) -> tuple[DFPattern, DFPattern]:
        """(the whole pattern, the activation alternatives)."""
        _, relu = with_relu(self.core)
        act = relu | fused_activation(self.core)
        return (act if self.activation_required else act | self.core), act

    def __init__(self, calibration_callback: Any = None):
        super().__init__(calibration_callback)
        self.pattern, self.act = self.build_pattern()

    def check(self, m: Match) -> MatchResult:
        """QDQ or OpenVINO output, float32 weights."""
        if not self.quantizer.config.output.islands:
            return MatchResult.fail(
                f"onnxruntime CPU has no int8 kernel for {self._what(m)}; it is quantized as a "
                "QDQ island for --format qdq or openvino (runtimes that fuse it)"
            )
        res = self.float_output_check(m)
        if not res.ok:
            return res
        w = _const(m.tensor(self.w))
        if w.dtype != np.float32:
            return MatchResult.fail(
                f"weight '{m.tensor(self.w).name}' is {w.dtype}, expected float32"
            )
        return MatchResult(m)

    def _what(self, m: Match) -> str:
        core = m.node(self.core)
        return " followed by ".join([core.op] + [n.op for n in m.nodes if n is not core])

    def quantize_match(self, m: Match) -> PatternRecord | None:
        """Specs of DQ(x), DQ(W) → the float op and its activation → Q(y) → DQ."""
        q = self.quantizer
        node = m.node(self.core)
        x, weight = m.tensor(self.x), m.tensor(self.w)
        xq = q.quantize_input(x)
        wq = q.quantize_weight(weight, self.weight_channel_axis(node, _const(weight)))
        yq = q.quantize_output(m.root)
        acts = [n for n in m.nodes if n is not node]
        bias = m.tensor(self.b).name if self.b is not None else None
        lowering = Lowering("island", node.op, bias=bias, activations=tuple(a.name for a in acts))
        relu = bool(acts) and acts[0].op not in FUSED and not q.config.activation_symmetric
        return self.annotate(m, node, [xq, wq], [yq], lowering, relu_folded=relu)


class ConvTransposePattern(IslandPattern):
    """ConvTranspose (no bias), optionally followed by an activation."""

    name = "conv-transpose"
    op_type = "ConvTranspose"

    def weight_channel_axis(self, node: gs.Node, weight: np.ndarray) -> int:
        """Weights are (C_in, M/group, k...): output channels on axis 1 (group 1 only)."""
        return 1

    def check(self, m: Match) -> MatchResult:
        """Grouped ConvTranspose has no single output-channel axis: refused."""
        if int(m.node(self.core).attrs.get("group", 1)) != 1:
            return MatchResult.fail("grouped ConvTranspose (group > 1) is left float")
        return super().check(m)


class ConvTransposeBiasPattern(ConvTransposePattern):
    """ConvTranspose with a constant (float) bias."""

    name = "conv-transpose+bias"
    has_bias = True


class ConvHardActivationPattern(IslandPattern):
    """Conv → HardSwish / HardSigmoid / LeakyRelu (MobileNetV3, PP-LCNet, YOLO), no bias."""

    name = "conv+hard-activation"
    op_type = "Conv"
    activation_required = True

    def build_pattern(self) -> tuple[DFPattern, DFPattern]:
        """The activation is required."""
        act = fused_activation(self.core)
        return act, act

    def weight_channel_axis(self, node: gs.Node, weight: np.ndarray) -> int:
        """Conv weights are (M, C/group, k...)."""
        return 0


class ConvBiasHardActivationPattern(ConvHardActivationPattern):
    """Conv with bias → HardSwish / HardSigmoid / LeakyRelu."""

    name = "conv+bias+hard-activation"
    has_bias = True


# ConvTranspose(x, W[, b]) [→ act] -> DQ(Q(ConvTranspose(DQ(Q(x)), DQ(Wq), b) [→ act]))
# Conv(x, W[, b]) → HardSwish      -> DQ(Q(HardSwish(Conv(DQ(Q(x)), DQ(Wq), b))))  (or
#                                     HardSigmoid, LeakyRelu)
#                                     (--format qdq / openvino only)
RULES = [
    ConvBiasHardActivationPattern,
    ConvHardActivationPattern,
    ConvTransposeBiasPattern,
    ConvTransposePattern,
]
