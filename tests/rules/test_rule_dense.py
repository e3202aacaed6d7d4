"""onnxq.patterns.dense: MatMul, MatMul → Add and Gemm with a constant weight."""

import numpy as np
import pytest
from helpers import make_model
from onnx import helper as h
from rulecheck import check_rule

from onnxq.patterns.dense import GemmBiasPattern, GemmPattern, MatMulAddPattern, MatMulPattern

G = np.random.default_rng(0)
W, WT, B = (G.normal(0, 0.3, s).astype(np.float32) for s in ((16, 8), (8, 16), (8,)))

CASES = {
    "matmul": (
        MatMulPattern,
        [h.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        {"W": W},
        {"mm"},
        {"com.microsoft:MatMulIntegerToFloat": 1},  # only the graph output reads it
    ),
    "matmul+add": (
        MatMulAddPattern,
        [
            h.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
            h.make_node("Add", ["m", "B"], ["y"], name="add"),
        ],
        {"W": W, "B": B},
        {"mm", "add"},
        {"com.microsoft:QGemm": 1, "Add": 0},
    ),
    "gemm+bias": (
        GemmBiasPattern,
        [h.make_node("Gemm", ["x", "W", "B"], ["y"], transB=1, alpha=0.5, beta=2.0, name="g")],
        {"W": WT, "B": B},
        {"g"},
        {"com.microsoft:QGemm": 1, "Gemm": 0},
    ),
    "gemm": (
        GemmPattern,
        [h.make_node("Gemm", ["x", "W"], ["y"], name="g")],
        {"W": W},
        {"g"},
        {"com.microsoft:QGemm": 1, "Gemm": 0},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dense_rule(case):
    rule, nodes, inits, claims, writes = CASES[case]
    model = make_model(nodes, [("x", ["N", 16])], [("y", None)], inits)
    check_rule(model, rule, claims, writes)
