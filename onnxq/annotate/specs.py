"""The records annotation writes: quantized edges, rewritten groups, placeholders, decisions.

Plain frozen data (apart from the group record, which the rewrite fills in): the patterns write
them, calibration reads them, solving and lowering consume them. Nothing here imports the
Quantizer, so every stage can depend on this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class QTensor:
    """One quantized edge of a pattern: the float tensor, its quantized twin, its placeholders."""

    tensor: str
    quantized: str
    scale: str
    zero_point: str
    role: str  # "activation" | "weight"
    dtype: str
    axis: int | None = None
    symmetric: bool = False
    bits: int = 8


@dataclass
class PatternRecord:
    """What one rewritten group became; the Calibrator builds a CalibrationInfo from it."""

    pattern: Any  # the QuantizerPattern that matched (onnxq.annotate.rule)
    label: str
    nodes: list[str]
    inputs: list[QTensor]
    outputs: list[QTensor]
    qop: str
    relu_folded: bool = False
    bias: str | None = None

    @property
    def input_scale_zps(self) -> list[tuple[str, str]]:
        """(scale, zero point) placeholder names of every quantized input."""
        return [(q.scale, q.zero_point) for q in self.inputs]

    @property
    def output_scale_zps(self) -> list[tuple[str, str]]:
        """(scale, zero point) placeholder names of every quantized output."""
        return [(q.scale, q.zero_point) for q in self.outputs]


@dataclass(frozen=True)
class Placeholder:
    """An initializer of the template whose value calibration (or derivation) decides."""

    name: str
    kind: str  # "scale" | "zero_point" | "weight" | "bias"
    tensor: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightDerivation:
    """A quantized weight computed from its float constant once its scale is known."""

    weight: str
    scale: str
    zero_point: str
    axis: int | None


@dataclass(frozen=True)
class BiasDerivation:
    """An int32 bias computed as ``bias / (input scale · weight scale)`` once both are known."""

    bias: str
    input_scale: str
    weight_scale: str
    weight_axis: int | None
    weight: str = ""  # the float weight (its size gives the products per output)
    input_zero_point: str = ""
    input_dtype: str = "uint8"


@dataclass
class Decision:
    """Why one node of the float model is or is not quantized."""

    node: str
    op: str
    quantized: bool
    pattern: str = ""
    reason: str = ""
