"""Conv patterns: Conv(x, W[, b]) [→ Relu] → QLinearConv."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.annotate.specs import QTensor
from onnxq.pattern import Match
from onnxq.patterns.base import WeightedPattern


class _ConvBase(WeightedPattern):
    def weight_channel_axis(self, node: gs.Node, weight: np.ndarray) -> int:
        """Conv weights are (M, C/group, k...): output channels on axis 0."""
        return 0

    def emit(
        self,
        m: Match,
        node: gs.Node,
        x: QTensor,
        w: QTensor,
        bias: gs.Tensor | None,
        y: QTensor,
        y_var: gs.Variable,
    ) -> gs.Node:
        """QLinearConv(x, xs, xz, w, ws, wz, ys, yz[, b]) with the Conv's attributes."""
        q = self.quantizer
        inputs = [*q.operands(x), *q.operands(w), q.const(y.scale), q.const(y.zero_point)]
        if bias is not None:
            inputs.append(bias)
        return q.add_node("QLinearConv", inputs, [y_var], f"{node.name}_quant", dict(node.attrs))


class ConvPattern(_ConvBase):
    """Conv without bias, optionally followed by Relu."""

    name = "conv"
    op_type = "Conv"


class ConvBiasPattern(_ConvBase):
    """Conv with a constant bias, optionally followed by Relu."""

    name = "conv+bias"
    op_type = "Conv"
    has_bias = True


# Conv(x, W) [→ Relu]     -> DQ(QLinearConv(Q(x), Wq, ys, yz))            (Relu: yz = qmin)
# Conv(x, W, b) [→ Relu]  -> DQ(QLinearConv(Q(x), Wq, ys, yz, bq)),  bq = round(b / (sx·sw))
RULES = [ConvBiasPattern, ConvPattern]
