"""onnxq.patterns.gelu: a written-out GELU kept whole, then one com.microsoft.Gelu (QOperator)."""

import numpy as np
from helpers import make_model
from onnx import helper as h
from rulecheck import check_rule

from onnxq.patterns.binary import AddPattern, MulPattern
from onnxq.patterns.dense import MatMulPattern
from onnxq.patterns.gelu import GeluPattern


def test_erf_gelu_between_dense_layers():
    g = np.random.default_rng(0)
    inits = {
        "W1": g.normal(0, 0.3, (16, 16)).astype(np.float32),
        "W2": g.normal(0, 0.3, (16, 8)).astype(np.float32),
        "sqrt2": np.array(np.sqrt(2.0), np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
    }
    nodes = [
        h.make_node("MatMul", ["x", "W1"], ["a"], name="fc1"),
        h.make_node("Div", ["a", "sqrt2"], ["d"], name="div"),
        h.make_node("Erf", ["d"], ["e"], name="erf"),
        h.make_node("Add", ["e", "one"], ["p"], name="add"),
        h.make_node("Mul", ["a", "p"], ["m"], name="mul1"),
        h.make_node("Mul", ["m", "half"], ["t"], name="mul2"),
        h.make_node("MatMul", ["t", "W2"], ["y"], name="fc2"),
    ]
    model = make_model(nodes, [("x", ["N", 16])], [("y", None)], inits)
    run = check_rule(
        model,
        GeluPattern,
        set(),
        {"com.microsoft:Gelu": 1, "Erf": 0, "Div": 0},
        context=(MatMulPattern, MulPattern, AddPattern),
    )
    claimed = {d.node for d in run.report.decisions if d.pattern == "gelu"}
    assert claimed == {"div", "erf", "add", "mul1", "mul2"}  # kept float, as one kernel
    # the rule claims the subgraph so that no other rule takes it apart (the lowering then
    # fuses it); the reason names the rule
    reasons = {d.node: d.reason for d in run.report.decisions if d.pattern == "gelu"}
    assert all(reasons.values())
