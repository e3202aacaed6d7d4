"""The pattern library: QuantizerPatterns for Conv, dense, Add and Mul.

``default_patterns(callback)`` returns one instance of every rule, largest first.
"""

from __future__ import annotations

from onnxq.calibration import CalibrationCallback
from onnxq.patterns.binary import AddPattern, BinaryPattern, MulPattern
from onnxq.patterns.conv import ConvBiasPattern, ConvPattern
from onnxq.patterns.dense import GemmBiasPattern, GemmPattern, MatMulAddPattern, MatMulPattern
from onnxq.quantizer import QuantizerPattern

__all__ = [
    "AddPattern",
    "BinaryPattern",
    "ConvBiasPattern",
    "ConvPattern",
    "GemmBiasPattern",
    "GemmPattern",
    "MatMulAddPattern",
    "MatMulPattern",
    "MulPattern",
    "default_patterns",
]


def default_patterns(callback: CalibrationCallback | None = None) -> list[QuantizerPattern]:
    """One instance of every rule, each calibrated by ``callback`` (None: the Calibrator's)."""
    from onnxq.patterns import binary, conv, dense

    rules = [*conv.RULES, *dense.RULES, *binary.RULES]
    return [rule(callback) for rule in rules]
