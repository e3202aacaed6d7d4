"""onnxq.patterns.activation: Sigmoid, LeakyRelu, Softmax and MatMul of two activations."""

import numpy as np
import pytest
from convctx import CONV_RULES, between_convs
from helpers import make_model
from onnx import helper as h
from rulecheck import check_rule

from onnxq.patterns.activation import (
    LeakyReluPattern,
    MatMulActivationsPattern,
    SigmoidPattern,
    SoftmaxPattern,
)
from onnxq.patterns.dense import MatMulPattern

CASES = {
    SigmoidPattern: h.make_node("Sigmoid", ["a"], ["t"], name="act"),
    LeakyReluPattern: h.make_node("LeakyRelu", ["a"], ["t"], alpha=0.2, name="act"),
    SoftmaxPattern: h.make_node("Softmax", ["a"], ["t"], axis=1, name="act"),
}


@pytest.mark.parametrize("rule", list(CASES), ids=lambda r: r.name)
def test_activation_rule_between_convs(rule):
    model = between_convs([CASES[rule]])
    check_rule(
        model,
        rule,
        {"act"},
        {f"com.microsoft:{rule.qop}": 1, rule.op_type: 0},
        context=CONV_RULES,
        min_sqnr=25,
    )


def test_matmul_of_two_activations():
    """Attention scores: Q·Kᵀ of two projected activations."""
    g = np.random.default_rng(0)
    inits = {k: g.normal(0, 0.3, (16, 16)).astype(np.float32) for k in ("Wq", "Wk", "Wo")}
    nodes = [
        h.make_node("MatMul", ["x", "Wq"], ["q"], name="proj_q"),
        h.make_node("MatMul", ["x", "Wk"], ["k"], name="proj_k"),
        h.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
        h.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        h.make_node("MatMul", ["s", "Wo"], ["y"], name="out"),
    ]
    inits["Wo"] = g.normal(0, 0.3, (6, 16)).astype(np.float32)
    model = make_model(nodes, [("x", ["N", 6, 16])], [("y", None)], inits)
    check_rule(
        model,
        MatMulActivationsPattern,
        {"scores"},
        {"QLinearMatMul": 3, "com.microsoft:MatMulIntegerToFloat": 1},  # out writes float
        context=(MatMulPattern,),
        min_sqnr=25,
    )
