"""Add and Mul of two activations: → com.microsoft QLinearAdd / QLinearMul."""

from __future__ import annotations

from onnxq.patterns.base import ActivationPattern


class BinaryPattern(ActivationPattern):
    """``op(a, b) [→ Relu]`` on two activations."""

    arity = 2


class AddPattern(BinaryPattern):
    """Add of two activations (residual connections), optionally followed by Relu."""

    name = "add"
    op_type = "Add"
    qop = "QLinearAdd"
    shares_scale = "Add"


class MulPattern(BinaryPattern):
    """Mul of two activations (gating), optionally followed by Relu."""

    name = "mul"
    op_type = "Mul"
    qop = "QLinearMul"


# Add(a, b) [→ Relu] -> DQ(QLinearAdd(Q(a), Q(b), ys, yz))
# Mul(a, b) [→ Relu] -> DQ(QLinearMul(Q(a), Q(b), ys, yz))
RULES = [AddPattern, MulPattern]
