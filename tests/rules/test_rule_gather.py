"""onnxq.patterns.gather: an embedding table stored int8, its rows gathered exactly."""

import numpy as np
import onnx
from onnx import helper as h
from rulecheck import check_rule

from onnxq.patterns.dense import MatMulPattern
from onnxq.patterns.gather import GatherPattern


def test_embedding_table_is_int8():
    g = np.random.default_rng(0)
    graph = h.make_graph(
        [
            h.make_node("Gather", ["E", "ids"], ["e"], axis=0, name="embed"),
            h.make_node("MatMul", ["e", "W"], ["y"], name="proj"),
        ],
        "g",
        [h.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N", 7])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 7, 8])],
        [
            onnx.numpy_helper.from_array(g.normal(0, 1, (50, 16)).astype(np.float32), "E"),
            onnx.numpy_helper.from_array(g.normal(0, 0.3, (16, 8)).astype(np.float32), "W"),
        ],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    run = check_rule(
        model,
        GatherPattern,
        {"embed"},
        {"Gather": 1, "MatMulIntegerToFloat": 1},
        context=(MatMulPattern,),
    )
    table = {i.name: i for i in run.model.graph.initializer}["E_quantized"]
    assert table.data_type == onnx.TensorProto.INT8
