"""The records annotation writes: quantized edges, rewritten groups, placeholders, decisions.

Plain frozen data, apart from the Decision a report may annotate: the rules write them,
calibration reads them, solving and lowering consume them. Nothing here imports the
Quantizer, so every stage can depend on this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


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


@dataclass(frozen=True)
class Lowering:
    """How a group is written in the QOperator template (``onnxq.lower.qoperator``).

    ``kind`` is ``qlinear`` (one op of the op table, ``onnxq.core.optable``), ``island`` (DQ → the
    float op and its activations → Q, for runtimes that fuse them) or ``table`` (a constant
    table gathered in int8, dequantized after).
    """

    kind: str
    #: the quantized op written: a QOperator op of the op table (``qlinear``), else the float op
    op: str
    #: attributes of the written op, in order
    attrs: tuple[tuple[str, Any], ...] = ()
    #: the int32 bias placeholder (``qlinear``) or the float bias tensor (``island``)
    bias: str | None = None
    #: ``island``: the activation nodes after the float op, in the match's order
    activations: tuple[str, ...] = ()


@dataclass(frozen=True)
class PatternRecord:
    """One annotated group: what is quantized, with which specs, and how it is lowered.

    Rules write it; calibration builds a CalibrationInfo from it, solving and reports read it
    and the QOperator lowering writes the group from it. Frozen: nothing changes it after
    annotation.
    """

    pattern: Any  # the QuantizerPattern that matched (onnxq.patterns.rule)
    label: str
    nodes: tuple[str, ...]
    inputs: tuple[QTensor, ...]
    outputs: tuple[QTensor, ...]
    #: the float node the group is named by (the op it quantizes)
    node: str
    #: the float tensor the group produces
    root: str
    relu_folded: bool = False
    bias: str | None = None
    lowering: Lowering | None = None

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

    def default(self) -> np.ndarray:
        """Its value until solved: scale 1, everything else 0."""
        if self.kind == "scale":
            return np.ones(self.shape, np.float32)
        return np.zeros(self.shape, np.dtype(self.dtype))


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


def user_nodes(names: Iterable[str], derived: Mapping[str, str]) -> tuple[str, ...]:
    """``names`` as the caller's model names them, in order, each once.

    A node a pass wrote in place of another becomes that one
    (``onnxq.passes.manager.State.derived``).
    """
    return tuple(dict.fromkeys(derived.get(n, n) for n in names))
