"""onnxq.patterns.conv: Conv (with or without bias, optionally → Relu/Clip) → QLinearConv."""

import numpy as np
from helpers import make_model
from onnx import helper as h
from rulecheck import check_rule

from onnxq.patterns.conv import ConvBiasPattern, ConvPattern

W = np.random.default_rng(0).normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)
B = np.random.default_rng(1).normal(0, 0.3, 4).astype(np.float32)


def test_conv_bias_and_relu_become_one_qlinearconv():
    nodes = [
        h.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        h.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], {"W": W, "B": B})
    run = check_rule(model, ConvBiasPattern, {"conv", "relu"}, {"QLinearConv": 1, "Relu": 0})
    conv = next(n for n in run.model.graph.node if n.op_type == "QLinearConv")
    assert len(conv.input) == 9  # the int32 bias rides along


def test_conv_without_bias():
    nodes = [h.make_node("Conv", ["x", "W"], ["y"], strides=[2, 2], name="conv")]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], {"W": W})
    check_rule(model, ConvPattern, {"conv"}, {"QLinearConv": 1, "Conv": 0})
