"""onnxq.patterns.pool: (Global)AveragePool between quantized ops → QLinear(Global)AveragePool."""

import pytest
from convctx import CONV_RULES, between_convs
from onnx import helper as h
from rulecheck import check_rule

from onnxq.patterns.pool import AveragePoolPattern, GlobalAveragePoolPattern

CASES = {
    GlobalAveragePoolPattern: h.make_node("GlobalAveragePool", ["a"], ["t"], name="pool"),
    AveragePoolPattern: h.make_node(
        "AveragePool", ["a"], ["t"], kernel_shape=[2, 2], strides=[2, 2], name="pool"
    ),
}


@pytest.mark.parametrize("rule", list(CASES), ids=lambda r: r.name)
def test_pool_rule_between_convs(rule):
    model = between_convs([CASES[rule]])
    check_rule(
        model, rule, {"pool"}, {f"com.microsoft:{rule.qop}": 1, rule.op_type: 0}, context=CONV_RULES
    )
