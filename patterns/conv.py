"""Conv patterns: Conv(x, W[, b]) [→ Relu] → QLinearConv."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.patterns.base import WeightedPattern


class _ConvBase(WeightedPattern):
    qop = "QLinearConv"

    def weight_channel_axis(self, node: gs.Node, weight: np.ndarray) -> int:
        """Conv weights are (M, C/group, k...): output channels on axis 0."""
        return 0


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
