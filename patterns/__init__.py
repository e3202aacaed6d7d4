"""The pattern library: every QuantizerPattern onnxq ships.

Conv, dense, Add, Mul, pooling, activations, Concat, Gather, and QDQ islands (ConvTranspose,
Conv → HardSwish) for QDQ and OpenVINO output; GELU kept whole for QOperator output.

``default_patterns(callback)`` returns one instance of every rule, largest first.
"""

from __future__ import annotations

from onnxq.core.callbacks import CalibrationCallback
from onnxq.patterns import activation, binary, concat, conv, dense, gather, gelu, island, pool
from onnxq.patterns.activation import (
    LeakyReluPattern,
    MatMulActivationsPattern,
    SigmoidPattern,
    SoftmaxPattern,
)
from onnxq.patterns.binary import AddPattern, BinaryPattern, MulPattern
from onnxq.patterns.concat import ConcatPattern
from onnxq.patterns.conv import ConvBiasPattern, ConvPattern
from onnxq.patterns.dense import GemmBiasPattern, GemmPattern, MatMulAddPattern, MatMulPattern
from onnxq.patterns.gather import GatherPattern
from onnxq.patterns.gelu import GeluPattern
from onnxq.patterns.island import (
    ConvBiasHardActivationPattern,
    ConvHardActivationPattern,
    ConvTransposeBiasPattern,
    ConvTransposePattern,
)
from onnxq.patterns.pool import AveragePoolPattern, GlobalAveragePoolPattern
from onnxq.patterns.rule import QuantizerPattern

__all__ = [
    "GatherPattern",
    "GeluPattern",
    "ConcatPattern",
    "SoftmaxPattern",
    "SigmoidPattern",
    "MatMulActivationsPattern",
    "LeakyReluPattern",
    "AddPattern",
    "AveragePoolPattern",
    "BinaryPattern",
    "ConvBiasHardActivationPattern",
    "ConvBiasPattern",
    "ConvHardActivationPattern",
    "ConvTransposeBiasPattern",
    "ConvTransposePattern",
    "ConvPattern",
    "GemmBiasPattern",
    "GemmPattern",
    "GlobalAveragePoolPattern",
    "MatMulAddPattern",
    "MatMulPattern",
    "MulPattern",
    "default_patterns",
]


def default_patterns(callback: CalibrationCallback | None = None) -> list[QuantizerPattern]:
    """One instance of every rule, each calibrated by ``callback`` (None: the Calibrator's)."""
    rules = [
        *gelu.RULES,
        *island.RULES,
        *conv.RULES,
        *dense.RULES,
        *binary.RULES,
        *pool.RULES,
        *activation.RULES,
        *concat.RULES,
        *gather.RULES,
    ]
    return [rule(callback) for rule in rules]
