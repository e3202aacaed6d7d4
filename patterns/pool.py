"""Average pooling on int8 data: → com.microsoft QLinearGlobalAveragePool / QLinearAveragePool.

MaxPool needs no pattern: it commutes with the affine map, so the requantize pass carries int8
through it. Averaging does not commute with rounding, so it needs these kernels.
"""

from __future__ import annotations

from onnxq.patterns.base import ActivationPattern


class GlobalAveragePoolPattern(ActivationPattern):
    """GlobalAveragePool of an activation (the head of most CNNs)."""

    name = "global-average-pool"
    op_type = "GlobalAveragePool"
    qop = "QLinearGlobalAveragePool"


class AveragePoolPattern(ActivationPattern):
    """AveragePool of an activation, with its pooling attributes."""

    name = "average-pool"
    op_type = "AveragePool"
    qop = "QLinearAveragePool"


# GlobalAveragePool(x) -> DQ(QLinearGlobalAveragePool(Q(x), ys, yz))
# AveragePool(x)       -> DQ(QLinearAveragePool(Q(x), ys, yz))
RULES = [GlobalAveragePoolPattern, AveragePoolPattern]
