"""onnxq.patterns.binary: Add / Mul of two quantized activations → QLinearAdd / QLinearMul."""

import pytest
from convctx import CONV_RULES, between_convs
from onnx import helper as h
from rulecheck import check_rule

from onnxq.patterns.binary import AddPattern, MulPattern


@pytest.mark.parametrize("rule, op", [(AddPattern, "Add"), (MulPattern, "Mul")])
def test_binary_rule_between_convs(rule, op):
    model = between_convs([h.make_node(op, ["a", "b"], ["t"], name="bin")], two_inputs=True)
    check_rule(model, rule, {"bin"}, {rule.qop: 1, op: 0}, context=CONV_RULES, min_sqnr=25)
