"""Element-wise activations and attention MatMul on int8 data (between quantized neighbours).

Sigmoid and Softmax have a known output range, so their output parameters are fixed rather than
calibrated: scale 1/255 with zero point 0 (uint8) or −128 (int8), so that both 0 and 1.0 are on
the grid (1/256, TFLite's choice, wrote a saturated 1.0 as 0.996: a bias on every saturated
gate); with symmetric int8 activations (zero point 0, TensorRT) scale 1/127; the same rule for
any activation type (int16: 1/65535 with zero point −32768, or 1/32767 symmetric:
onnxq.patterns.base.unit_range). A calibrated output range inside [0, 1] gets its finer grid
instead (see ActivationPattern.fixed_output).
"""

from __future__ import annotations

from onnxq.patterns.base import ActivationPattern


class SigmoidPattern(ActivationPattern):
    """Sigmoid with a fixed output scale."""

    name = "sigmoid"
    op_type = "Sigmoid"
    qop = "QLinearSigmoid"
    fold_relu = False
    fixed_output = True


class LeakyReluPattern(ActivationPattern):
    """LeakyRelu with its alpha."""

    name = "leaky-relu"
    op_type = "LeakyRelu"
    qop = "QLinearLeakyRelu"
    fold_relu = False


class SoftmaxPattern(ActivationPattern):
    """Softmax with a fixed output scale."""

    name = "softmax"
    op_type = "Softmax"
    qop = "QLinearSoftmax"
    fold_relu = False
    fixed_output = True


class MatMulActivationsPattern(ActivationPattern):
    """MatMul of two activations (attention scores and context): both inputs quantized."""

    name = "matmul-activations"
    op_type = "MatMul"
    qop = "QLinearMatMul"
    arity = 2
    domain = ""


# Sigmoid(x)   -> DQ(QLinearSigmoid(Q(x), 1/255, 0))
# LeakyRelu(x) -> DQ(QLinearLeakyRelu(Q(x), ys, yz))
# Softmax(x)   -> DQ(QLinearSoftmax(Q(x), 1/255, 0))
# MatMul(a, b) -> DQ(QLinearMatMul(Q(a), Q(b), ys, yz))      (b not constant)
RULES = [SigmoidPattern, LeakyReluPattern, SoftmaxPattern, MatMulActivationsPattern]
