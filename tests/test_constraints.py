"""Constraint propagation: shared-scale Concat, fixed grids, Relu folds, carriers, rescales."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import make_model, run

import onnxq
from onnxq.annotate.targets import Target
from onnxq.core.errors import ConfigError

H = onnx.helper


def _concat_model(left: str = "plain"):
    """x → conv1 [→ Sigmoid | Relu] = a; x → conv2 (4× the weights) = b; Concat(a, b) → conv3."""
    gen = np.random.default_rng(11)
    first = "a" if left == "plain" else "c1"
    nodes = [H.make_node("Conv", ["x", "W1"], [first], name="conv1", pads=[1, 1, 1, 1])]
    if left == "sigmoid":
        nodes.append(H.make_node("Sigmoid", ["c1"], ["a"], name="sig"))
    elif left == "relu":
        nodes.append(H.make_node("Relu", ["c1"], ["a"], name="relu"))
    nodes += [
        H.make_node("Conv", ["x", "W2"], ["b"], name="conv2", pads=[1, 1, 1, 1]),
        H.make_node("Concat", ["a", "b"], ["cat"], name="cat", axis=1),
        H.make_node("Conv", ["cat", "W3"], ["y"], name="conv3", pads=[1, 1, 1, 1]),
    ]
    inits = {
        "W1": gen.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
        "W2": gen.normal(0, 1.2, (4, 3, 3, 3)).astype(np.float32),
        "W3": gen.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32),
    }
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
    data = {"x": np.random.default_rng(12).normal(0, 1, (32, 3, 8, 8)).astype(np.float32)}
    return model, data


def _params_around(model: onnx.ModelProto, op: str) -> tuple[list[tuple], list[tuple]]:
    """(scale, zero point) of the DQs feeding the ``op`` node and of the Qs reading it."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.op_type == op)

    def params(n: onnx.NodeProto) -> tuple:
        return float(inits[n.input[1]]), int(inits[n.input[2]])

    ins = [params(producers[i]) for i in node.input if producers[i].op_type == "DequantizeLinear"]
    outs = [params(n) for n in model.graph.node if node.output[0] in n.input]
    return ins, outs


def _close(q, model, data, tol=0.05):
    x = {"x": data["x"][:4]}
    ref, got = run(model, x)[0], run(q, x)[0]
    assert np.abs(got - ref).max() < tol * np.abs(ref).max()


def test_tensorrt_concat_inputs_and_output_share_one_scale():
    model, data = _concat_model()
    q, report = onnxq.quantize(model, data, target="tensorrt", progress=False)
    ins, outs = _params_around(q, "Concat")
    assert len(ins) == 2 and outs
    assert len(set(ins) | set(outs)) == 1, (ins, outs)
    assert report.rescales == []
    assert any("share scale" in c and "'cat'" in c for c in report.constraints)
    _close(q, model, data)
    # the same QDQ conventions without the constraint keep each input's own range
    free = Target("free-qdq", format="qdq", activation_dtype="int8", symmetric_activations=True)
    q2, report2 = onnxq.quantize(model, data, target=free, progress=False)
    ins2, _ = _params_around(q2, "Concat")
    assert len(set(ins2)) == 2 and report2.constraints == []


def test_fixed_grid_conflict_inserts_exactly_one_rescale():
    # a Sigmoid writes the fixed grid [-1, 1] (1/127, zero point 0); the shared range is ±20: the
    # Sigmoid's edge into the Concat is rescaled, nothing else
    model, data = _concat_model("sigmoid")
    q, report = onnxq.quantize(model, data, target="tensorrt", progress=False)
    assert report.rescales == ["a"]
    assert any("fixed grid" in c and "'a'" in c for c in report.constraints)
    cat = next(d for d in report.decisions if d.node == "cat")
    assert "rescaled" in cat.reason and "fixed grid" in cat.reason
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in q.graph.initializer}
    sig_scales = [
        float(inits[n.input[1]])
        for n in q.graph.node
        if n.op_type == "QuantizeLinear" and n.input[0].startswith("a")
    ]
    assert np.float32(1 / 127) in sig_scales  # the Sigmoid still writes its fixed grid (zp 0)
    ins, outs = _params_around(q, "Concat")
    assert len(set(ins) | set(outs)) == 1  # after the rescale the Concat itself is shared
    zps = [inits[n.input[2]] for n in q.graph.node if n.op_type == "QuantizeLinear"]
    assert all(z.dtype == np.int8 and int(z) == 0 for z in zps)  # TensorRT's rule holds
    _close(q, model, data)


def test_relu_fold_conflict_rescales_the_relu_edge():
    # uint8 asymmetric with shared-scale Concat: conv1+Relu needs zero point 0, the Concat's
    # range is negative, so conv1 keeps [0, max] and its edge into the Concat is rescaled
    model, data = _concat_model("relu")
    npu = Target("npu-test", format="qdq", activation_dtype="uint8", shared_scale_ops=("Concat",))
    q, report = onnxq.quantize(model, data, target=npu, progress=False)
    assert len(report.rescales) == 1
    assert any("folds a Relu" in c and "'a'" in c for c in report.constraints)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in q.graph.initializer}
    assert int(inits["a_zero_point"]) == 0
    _close(q, model, data)
    # QOperator with the same constraint: QLinearConcat reads every input at its output scale
    q2, report2 = onnxq.quantize(model, data, target=npu, format="qoperator", progress=False)
    cat = next(n for n in q2.graph.node if n.op_type == "QLinearConcat")
    inits2 = {i.name: onnx.numpy_helper.to_array(i) for i in q2.graph.initializer}
    pairs = {
        (float(inits2[cat.input[i]]), int(inits2[cat.input[i + 1]]))
        for i in range(0, len(cat.input), 3)
    }
    assert len(pairs) == 1
    assert len(report2.rescales) == 1
    _close(q2, model, data)


def test_carrier_output_takes_its_source_parameters():
    # conv1 → MaxPool → conv2: the MaxPool output port takes conv1's output value, so the QDQ
    # model has one scale across the MaxPool and no DQ→Q pair
    gen = np.random.default_rng(3)
    nodes = [
        H.make_node("Conv", ["x", "W1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
        H.make_node("MaxPool", ["a"], ["m"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        H.make_node("Conv", ["m", "W2"], ["y"], name="conv2"),
    ]
    inits = {
        "W1": gen.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
        "W2": gen.normal(0, 0.3, (2, 4, 1, 1)).astype(np.float32),
    }
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
    data = {"x": gen.normal(0, 1, (16, 3, 8, 8)).astype(np.float32)}
    q, report = onnxq.quantize(model, data, format="qdq", progress=False)
    vals = report.values
    assert vals["m_scale"] == vals["a_scale"] and vals["m_zero_point"] == vals["a_zero_point"]
    assert report.rescales == [] and report.requantize.rescaled_pairs == 0
    _close(q, model, data)


def test_solver_is_deterministic():
    model, data = _concat_model("sigmoid")
    a, _ = onnxq.quantize(model, data, target="tensorrt", progress=False)
    b, _ = onnxq.quantize(model, data, target="tensorrt", progress=False)
    assert a.SerializeToString() == b.SerializeToString()


def test_unknown_shared_scale_op_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="shared_scale_ops"):
        Target("bad", format="qdq", shared_scale_ops=("Add",))
    f = tmp_path / "t.toml"
    f.write_text('[target.cat]\nformat = "qdq"\nshared_scale_ops = ["Concat"]\n')
    from onnxq.annotate.targets import load_targets

    (t,) = load_targets(f)
    assert t.shared_scale_ops == ("Concat",)
