"""onnxq.patterns.concat: Concat inside the quantized region → QLinearConcat."""

from convctx import CONV_RULES, between_convs
from onnx import helper as h
from rulecheck import check_rule

from onnxq.patterns.concat import ConcatPattern


def test_concat_of_two_convs_into_a_conv():
    import numpy as np

    model = between_convs(
        [h.make_node("Concat", ["a", "b"], ["t"], axis=1, name="cat")], two_inputs=True
    )
    w3 = next(i for i in model.graph.initializer if i.name == "W3")
    w3.CopyFrom(
        __import__("onnx").numpy_helper.from_array(
            np.random.default_rng(3).normal(0, 0.3, (2, 8, 1, 1)).astype(np.float32), "W3"
        )
    )
    check_rule(
        model,
        ConcatPattern,
        {"cat"},
        {"com.microsoft:QLinearConcat": 1, "Concat": 0},
        context=CONV_RULES,
        min_sqnr=25,
    )
