"""The shared body of quantizer patterns: weighted ops (Conv, dense) and binary ops (Add, Mul).

Conv and dense differ only in the weight's output-channel axis and the QLinear op they emit,
so both derive from :class:`WeightedPattern` and vary :meth:`WeightedPattern.weight_channel_axis`
and :meth:`WeightedPattern.emit`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.calibration import CalibrationCallback
from onnxq.pattern import (
    DFPattern,
    Match,
    MatchResult,
    is_constant,
    is_op,
    node_attr,
    tensor_shape,
    wildcard,
)
from onnxq.quantizer import PatternRecord, QTensor, QuantizerPattern


def with_relu(core: DFPattern) -> tuple[DFPattern, DFPattern]:
    """``core`` optionally followed by Relu: returns (pattern, the Relu call pattern)."""
    relu = is_op("Relu")(core)
    return relu | core, relu


class WeightedPattern(QuantizerPattern):
    """``op(x, W[, b]) [→ Relu]`` with a constant weight: Q(x) → QLinear op → DQ.

    A rule is data: subclasses set ``op_type`` and ``has_bias``; the constructor builds
    ``self.x``, ``self.w``, ``self.b`` (None without bias), ``self.core`` (the op's call
    pattern), ``self.relu`` and ``self.pattern``. :meth:`build` may be overridden for larger
    subgraphs (MatMul → Add).
    """

    op_type = ""
    has_bias = False

    def __init__(self, calibration_callback: CalibrationCallback | None = None):
        super().__init__(calibration_callback)
        self.x, self.w = wildcard(), is_constant()
        self.b: DFPattern | None = is_constant() if self.has_bias else None
        self.core: DFPattern = is_op(self.op_type)(self.x, self.w, self.b)
        self.pattern, self.relu = with_relu(self.build())

    def build(self) -> DFPattern:
        """The pattern before the optional Relu (default: the op itself)."""
        return self.core

    def weight_channel_axis(self, node: gs.Node, weight: np.ndarray) -> int:
        """The axis of ``weight`` that indexes output channels (per-channel scales run on it)."""
        raise NotImplementedError

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
        """Add the QLinear node computing ``y_var`` from the quantized operands."""
        raise NotImplementedError

    def bias_value(self, m: Match, node: gs.Node) -> np.ndarray | None:
        """The float bias as a 1-D array of output channels, or None."""
        if self.b is None:
            return None
        return np.asarray(
            m.tensor(self.b).values
            if isinstance(m.tensor(self.b), gs.Constant)
            else _const(m.tensor(self.b)),
            np.float32,
        ).reshape(-1)

    def check(self, m: Match) -> MatchResult:
        """The weight must be float32 and the Relu foldable."""
        res = self.float_output_check(m)
        if not res.ok:
            return res
        if self.relu in m and self.quantizer.config.activation_symmetric:
            return MatchResult.fail(
                "a Relu folds only into an asymmetric output range (zero "
                "point at qmin); activations are symmetric"
            )
        w = _const(m.tensor(self.w))
        if w.dtype != np.float32:
            return MatchResult.fail(
                f"weight '{m.tensor(self.w).name}' is {w.dtype}, expected float32"
            )
        return MatchResult(m)

    def quantize_match(self, m: Match) -> gs.Tensor | None:
        """Q(x), int8 W, int32 b, the QLinear op, then DQ of the (Relu-folded) output."""
        q = self.quantizer
        node = m.node(self.core)
        weight = m.tensor(self.w)
        xq = q.quantize_input(m.tensor(self.x))
        wq = q.quantize_weight(weight, self.weight_channel_axis(node, _const(weight)))
        bias_value = self.bias_value(m, node)
        bias = q.quantize_bias(node, bias_value, xq, wq) if bias_value is not None else None
        yq, y_var = q.quantize_output(m.root)
        qnode = self.emit(m, node, xq, wq, bias, yq, y_var)
        q.record(
            PatternRecord(
                self,
                self.label(),
                [n.name for n in m.nodes],
                [xq, wq],
                [yq],
                qnode.name,
                relu_folded=self.relu in m,
                bias=None if bias is None else bias.name,
            )
        )
        return q.dequantize(yq, y_var, m.root)


def _const(t: gs.Tensor) -> np.ndarray:
    if isinstance(t, gs.Constant):
        return np.asarray(t.values)
    node = t.inputs[0]
    value = node.attrs["value"]
    return np.asarray(value.values if isinstance(value, gs.Constant) else value)


def attrs_without(node: gs.Node, *names: str) -> dict[str, Any]:
    """The node's attributes minus ``names``."""
    return {k: v for k, v in node.attrs.items() if k not in names}


def is_constant_tensor(t: gs.Tensor) -> bool:
    """True for initializers and Constant-node outputs."""
    if isinstance(t, gs.Constant):
        return True
    return bool(t.inputs) and t.inputs[0].op == "Constant"


__all__ = [
    "WeightedPattern",
    "attrs_without",
    "is_constant_tensor",
    "node_attr",
    "tensor_shape",
    "with_relu",
]
