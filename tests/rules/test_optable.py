"""The op table agrees with the rules that write QLinear ops and with the QDQ lowering."""

import numpy as np
import onnx
import pytest
from onnx import helper as h
from onnx import numpy_helper

from onnxq.core.optable import BY_QOP, TABLE
from onnxq.lower.qdq import to_qdq
from onnxq.patterns import default_patterns


def test_every_rule_writes_an_op_of_the_table():
    for rule in default_patterns():
        qop = getattr(rule, "qop", None)
        if not qop or not getattr(rule, "op_type", None):
            continue  # islands write float ops; dense rules choose QGemm or QLinearMatMul
        assert qop in BY_QOP, f"{rule.name} writes {qop}, which the op table lacks"
        assert BY_QOP[qop].float_op == rule.op_type, rule.name


@pytest.mark.parametrize("spec", [q for q in TABLE if not q.variadic], ids=lambda q: q.qop)
def test_qdq_unfuses_each_op_by_its_slots(spec):
    """Each table entry un-fuses into DQ per triple → its float op → Q of its output pair."""
    n_in = spec.output + 2 + (1 if spec.bias is not None and spec.bias > spec.output else 0)
    names = [f"i{k}" for k in range(max(n_in, (spec.bias or 0) + 1))]
    inits = []
    for k, name in enumerate(names):
        zp = any(k == t + 2 for t in spec.triples) or k == spec.output + 1
        value = np.array(0, np.int8 if k == (spec.weight or -9) + 2 else np.uint8) if zp else None
        if k == spec.bias:
            value = np.zeros(4, np.int32)
        elif value is None and k not in spec.triples:
            value = np.array(0.1, np.float32)
        if value is not None:
            inits.append(numpy_helper.from_array(value, name))
    node = h.make_node(spec.qop, names, ["y"], name="q", domain=spec.domain)
    graph = h.make_graph(
        [node],
        "g",
        [h.make_tensor_value_info(names[t], onnx.TensorProto.UINT8, None) for t in spec.triples],
        [h.make_tensor_value_info("y", 2, None)],
        inits,
    )
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", 13), h.make_opsetid("com.microsoft", 1)]
    )
    out = to_qdq(model)
    ops = [n.op_type for n in out.graph.node]
    n_dq = len(spec.triples) + (1 if spec.bias is not None else 0)
    assert ops.count("DequantizeLinear") == n_dq and ops[-1] == "QuantizeLinear"
    assert spec.float_op in ops and spec.qop not in ops
    float_node = next(n for n in out.graph.node if n.op_type == spec.float_op)
    assert len(float_node.input) == len(spec.triples) + (1 if spec.bias is not None else 0)
    assert list(out.graph.node[-1].input)[1:] == [names[spec.output], names[spec.output + 1]]
