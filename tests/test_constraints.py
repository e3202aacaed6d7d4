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
        Target("bad", format="qdq", shared_scale_ops=("Conv",))
    f = tmp_path / "t.toml"
    f.write_text('[target.cat]\nformat = "qdq"\nshared_scale_ops = ["Concat"]\n')
    from onnxq.annotate.targets import load_targets

    (t,) = load_targets(f)
    assert t.shared_scale_ops == ("Concat",)


# -- one test per conflict kind, each checked in onnxruntime ----------------------------------


def _convs(spec: list[tuple[str, str, str, float]], outputs: list[str], extra=()):
    """Convs (name, input, output, weight gain) on x (3 channels) and ``extra`` nodes."""
    gen = np.random.default_rng(21)
    nodes, inits = [], {}
    for name, src, dst, gain in spec:
        cin = 3 if src == "x" else 4
        inits[f"W_{name}"] = (gen.normal(0, 0.3, (4, cin, 3, 3)) * gain).astype(np.float32)
        nodes.append(H.make_node("Conv", [src, f"W_{name}"], [dst], name=name, pads=[1, 1, 1, 1]))
    nodes[len(spec) : len(spec)] = list(extra)
    order = {n.output[0]: i for i, n in enumerate(nodes)}
    nodes.sort(key=lambda n: max([order.get(i, -1) for i in n.input] + [-1]))
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [(o, None) for o in outputs], inits)
    data = {"x": np.random.default_rng(22).normal(0, 1, (32, 3, 8, 8)).astype(np.float32)}
    return model, data


def _sqnr(model, q, data) -> list[float]:
    x = {"x": data["x"][:8]}
    return [
        float(10 * np.log10(np.sum(r**2) / np.sum((r - g) ** 2)))
        for r, g in zip(run(model, x), run(q, x, exact=True), strict=True)
    ]


def test_two_calibrations_of_one_tensor_keep_the_written_grid_with_its_cost():
    # conv1 writes 'a' with MSE ranges, conv2 reads it configured for MinMax: one grid, the
    # writer's, which conv2's QLinearConv reads as written; the report gives conv2's cost
    model, data = _convs([("conv1", "x", "a", 1.0), ("conv2", "a", "y", 1.0)], ["y"])
    config = {"node": {"conv2": {"method": "minmax"}}}
    q, report = onnxq.quantize(model, data, config=config, recipe="fixed", progress=False)
    line = next(c for c in report.constraints if "calibrated twice" in c)
    assert "'a'" in line and "conv 'conv2'" in line and "dB" in line, line
    assert report.calibration.conflicts == []
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in q.graph.initializer}
    conv2 = next(n for n in q.graph.node if n.name == "conv2_quant")
    assert float(inits[conv2.input[1]]) == report.values["a_scale"]
    _, alone = onnxq.quantize(model, data, recipe="fixed", progress=False)
    assert report.values["a_scale"] == alone.values["a_scale"]  # conv1's MSE grid
    assert min(_sqnr(model, q, data)) > 30


def test_a_tensor_feeding_two_concats_joins_one_and_is_rescaled_into_the_other():
    # t and u (gain 0.1) meet in cat1; t and v (gain 5) meet in cat2. One grid for both Concats
    # would be 34 dB coarser for cat1's reader: t joins cat1, its edge into cat2 is rescaled
    cat1 = H.make_node("Concat", ["t", "u"], ["c1"], name="cat1", axis=1)
    cat2 = H.make_node("Concat", ["t", "v"], ["c2"], name="cat2", axis=1)
    spec = [
        ("conv_t", "x", "t", 0.1),
        ("conv_u", "x", "u", 0.1),
        ("conv_v", "x", "v", 5.0),
        ("head1", "c1", "y1", 1.0),
        ("head2", "c2", "y2", 1.0),
    ]
    gen = np.random.default_rng(23)
    model, data = _convs(spec, ["y1", "y2"], [cat1, cat2])
    for name in ("W_head1", "W_head2"):  # the heads read 8 channels
        t = next(i for i in model.graph.initializer if i.name == name)
        t.CopyFrom(
            onnx.numpy_helper.from_array(gen.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32), name)
        )
    q, report = onnxq.quantize(model, data, target="tensorrt", progress=False)
    assert report.rescales == ["t"], report.rescales
    line = next(c for c in report.constraints if "rescale of 't' into 'cat2'" in c)
    assert "dB coarser" in line and "bound 6.02 dB" in line
    assert any("'t', 'u'" in c and "same-scale Concat 'cat1'" in c for c in report.constraints)
    y1, y2 = _sqnr(model, q, data)
    assert y1 > 30 and y2 > 30  # one grid for both: cat1 34 dB coarser, y1 at 6 dB


def test_tensorrt_add_reads_both_inputs_on_one_grid():
    add = H.make_node("Add", ["a", "b"], ["s"], name="add")
    model, data = _convs(
        [("conv1", "x", "a", 1.0), ("conv2", "x", "b", 3.0), ("conv3", "s", "y", 1.0)], ["y"], [add]
    )
    q, report = onnxq.quantize(model, data, target="tensorrt", progress=False)
    ins, _ = _params_around(q, "Add")
    assert len(ins) == 2 and len(set(ins)) == 1, ins
    assert report.rescales == []
    assert any("same-scale Add 'add'" in c for c in report.constraints)
    assert min(_sqnr(model, q, data)) > 25
    # without TensorRT's rule each input keeps its own grid
    free = Target("free-qdq2", format="qdq", activation_dtype="int8", symmetric_activations=True)
    q2, _ = onnxq.quantize(model, data, target=free, progress=False)
    ins2, _ = _params_around(q2, "Add")
    assert len(set(ins2)) == 2


def test_add_input_read_elsewhere_is_rescaled_not_coarsened():
    # 'a' (gain 0.1) is also read by conv4: one grid with b (gain 8) would be 38 dB coarser for
    # it, so a's edge into the Add is rescaled and conv4 reads a on a's own grid
    add = H.make_node("Add", ["a", "b"], ["s"], name="add")
    model, data = _convs(
        [
            ("conv1", "x", "a", 0.1),
            ("conv2", "x", "b", 8.0),
            ("conv3", "s", "y", 1.0),
            ("conv4", "a", "y2", 1.0),
        ],
        ["y", "y2"],
        [add],
    )
    q, report = onnxq.quantize(model, data, target="tensorrt", progress=False)
    assert report.rescales == ["a"], report.rescales
    ins, _ = _params_around(q, "Add")
    assert len(set(ins)) == 1, ins  # the Add still reads one grid
    y, y2 = _sqnr(model, q, data)
    assert y > 25 and y2 > 30


def test_fixed_grid_input_of_an_add_is_rescaled_onto_the_calibrated_grid():
    # Add(Sigmoid(conv1), conv2) under TensorRT: the Sigmoid writes its fixed grid (1/127); the
    # calibrated input's range (±20) cannot fit it, so the Sigmoid's edge is rescaled and the
    # Add reads both inputs on the wider grid (no value clips)
    sig = H.make_node("Sigmoid", ["c1"], ["a"], name="sig")
    add = H.make_node("Add", ["a", "b"], ["s"], name="add")
    model, data = _convs(
        [("conv1", "x", "c1", 1.0), ("conv2", "x", "b", 4.0), ("conv3", "s", "y", 1.0)],
        ["y"],
        [sig, add],
    )
    q, report = onnxq.quantize(model, data, target="tensorrt", progress=False)
    assert report.rescales == ["a"], report.rescales
    assert any("fixed grid" in c and "'a'" in c for c in report.constraints)
    ins, _ = _params_around(q, "Add")
    assert len(set(ins)) == 1 and ins[0][0] > 1 / 127
    assert min(_sqnr(model, q, data)) > 25
