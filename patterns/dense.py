"""Dense patterns: Gemm, MatMul with a constant weight, MatMul followed by Add of a bias."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.core.optable import QOp
from onnxq.pattern import (
    DFPattern,
    Match,
    MatchResult,
    constant_value,
    is_constant,
    is_op,
    node_attr,
    tensor_shape,
)
from onnxq.patterns.base import WeightedPattern


class _DenseBase(WeightedPattern):
    def weight_channel_axis(self, node: gs.Node, weight: np.ndarray) -> int:
        """Output columns: axis 1 of a (K, N) weight, axis 0 when Gemm has transB=1."""
        if node.op == "Gemm" and int(node_attr(node, "transB") or 0) == 1:
            return 0
        return weight.ndim - 1

    def check(self, m: Match) -> MatchResult:
        """2-D weight; 2-D input for QGemm; a bias that is one value per output column."""
        res = super().check(m)
        if not res.ok:
            return res
        weight = m.tensor(self.w)
        wshape = tensor_shape(weight)
        if wshape is None or len(wshape) != 2:
            return MatchResult.fail(f"weight '{weight.name}' has shape {wshape}, expected 2-D")
        node = m.node(self.core)
        n_out = wshape[self.weight_channel_axis(node, _value(weight))]
        if self.uses_qgemm(m):
            xshape = tensor_shape(m.tensor(self.x))
            if xshape is None or len(xshape) != 2:
                return MatchResult.fail(
                    f"input '{m.tensor(self.x).name}' has rank "
                    f"{'unknown' if xshape is None else len(xshape)}; QGemm with a bias needs a "
                    "2-D input (the MatMul alone can still be quantized)"
                )
        if self.b is not None:
            b = np.asarray(_value(m.tensor(self.b)))
            if b.size != n_out or (b.ndim > 1 and b.shape[-1] != n_out):
                return MatchResult.fail(
                    f"bias '{m.tensor(self.b).name}' has shape {b.shape}, "
                    f"expected one value per output column ({n_out})"
                )
        return MatchResult(m)

    def uses_qgemm(self, m: Match) -> bool:
        """Gemm and MatMul+bias become com.microsoft QGemm; MatMul alone QLinearMatMul."""
        return True

    def qop_for(self, m: Match) -> str:
        """QGemm with a bias (or from Gemm), QLinearMatMul for a MatMul alone."""
        return "QGemm" if self.uses_qgemm(m) else "QLinearMatMul"

    def qop_attrs(self, node: gs.Node, spec: QOp) -> dict[str, Any]:
        """Gemm's alpha and transposes go to QGemm; a MatMul (+ Add) has none."""
        return super().qop_attrs(node, spec) if node.op == spec.float_op else {}

    def bias_value(self, m: Match, node: gs.Node) -> np.ndarray | None:
        """Gemm's C is scaled by beta and divided by alpha (QGemm applies alpha to A·B + C)."""
        b = super().bias_value(m, node)
        if b is not None and node.op == "Gemm":
            alpha = float(node_attr(node, "alpha") or 1.0)
            beta = float(node_attr(node, "beta") or 1.0)
            b = (b * beta / alpha).astype(np.float32)
        return b


def _value(t: gs.Tensor) -> np.ndarray:
    value = constant_value(t)
    assert value is not None
    return value


class GemmPattern(_DenseBase):
    """Gemm(x, W) with a constant weight (transB 0 or 1), optionally followed by Relu."""

    name = "gemm"
    op_type = "Gemm"


class GemmBiasPattern(_DenseBase):
    """Gemm(x, W, C) with constant weight and bias, optionally followed by Relu."""

    name = "gemm+bias"
    op_type = "Gemm"
    has_bias = True


class MatMulAddPattern(_DenseBase):
    """MatMul(x, W) → Add(·, b) with constant W and b: dense + bias, optionally → Relu."""

    name = "matmul+add"
    op_type = "MatMul"

    def build(self) -> DFPattern:
        """MatMul(x, W) → Add(·, b): the core stays the MatMul, the constant bias commutes."""
        self.b = is_constant()
        return is_op("Add")(self.core, self.b)


class MatMulPattern(_DenseBase):
    """MatMul(x, W) with a constant 2-D weight → QLinearMatMul, optionally → Relu."""

    name = "matmul"
    op_type = "MatMul"

    def uses_qgemm(self, m: Match) -> bool:
        """MatMul without bias uses QLinearMatMul, which takes inputs of any rank."""
        return False


# Gemm(x, W[, C]) [→ Relu]          -> DQ(QGemm(Q(x), Wq, Cq, ys, yz)),  Cq = round(β·C/α / (sx·sw))
# MatMul(x, W) → Add(b) [→ Relu]    -> DQ(QGemm(Q(x), Wq, bq, ys, yz))   (2-D x)
# MatMul(x, W) [→ Relu]             -> DQ(QLinearMatMul(Q(x), Wq, ys, yz))
RULES = [MatMulAddPattern, GemmBiasPattern, GemmPattern, MatMulPattern]
