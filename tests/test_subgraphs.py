"""If branches quantized as models of their own, checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import rng, run
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxq
from onnxq.core.errors import ConfigError, ModelError
from onnxq.io.graph import hoist_nested_initializers, share_body_constants
from onnxq.post.subgraphs import free_variables

R = rng(3)


def _conv_branch(name: str, scale: float, nested: onnx.GraphProto | None = None) -> onnx.GraphProto:
    """x → Conv(W, b) → Relu → Conv(W2) → y, weights as Constant nodes (silero-vad style)."""
    w1 = (R.normal(0, 0.3, (8, 3, 3, 3)) * scale).astype(np.float32)
    w2 = R.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32)
    b1 = R.normal(0, 0.1, 8).astype(np.float32)
    nodes = [
        h.make_node("Constant", [], [f"{name}_w1"], value=nh.from_array(w1)),
        h.make_node("Constant", [], [f"{name}_b1"], value=nh.from_array(b1)),
        h.make_node("Constant", [], [f"{name}_w2"], value=nh.from_array(w2)),
        h.make_node("Conv", ["x", f"{name}_w1", f"{name}_b1"], [f"{name}_c1"], pads=[1] * 4),
        h.make_node("Relu", [f"{name}_c1"], [f"{name}_r1"]),
        h.make_node("Conv", [f"{name}_r1", f"{name}_w2"], [f"{name}_y"], pads=[1] * 4),
    ]
    out = f"{name}_y"
    if nested is not None:  # a nested If choosing between the conv result and its negation
        nodes += [
            h.make_node("Neg", [f"{name}_y"], [f"{name}_neg"]),
            h.make_node(
                "If",
                ["flag"],
                [f"{name}_out"],
                then_branch=nested,
                else_branch=_identity(f"{name}_neg", f"{name}_e"),
            ),
        ]
        out = f"{name}_out"
    return h.make_graph(
        nodes, name, [], [h.make_tensor_value_info(out, TensorProto.FLOAT, ["N", 4, 8, 8])]
    )


def _identity(src: str, name: str) -> onnx.GraphProto:
    return h.make_graph(
        [h.make_node("Identity", [src], [f"{name}_id"])],
        name,
        [],
        [h.make_tensor_value_info(f"{name}_id", TensorProto.FLOAT, ["N", 4, 8, 8])],
    )


def if_model(nested: bool = False) -> onnx.ModelProto:
    """y = then(x) if mode == 1 else else(x); mode is an int64 input, like silero-vad's sr."""
    inner = _identity("then_y", "inner") if nested else None
    graph = h.make_graph(
        [
            h.make_node("Constant", [], ["one"], value=nh.from_array(np.array(1, np.int64))),
            h.make_node("Equal", ["mode", "one"], ["cond"]),
            h.make_node(
                "If",
                ["cond"],
                ["y"],
                name="branch",
                then_branch=_conv_branch("then", 1.0, inner),
                else_branch=_conv_branch("else", 2.0),
            ),
        ],
        "if_model",
        [
            h.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8]),
            h.make_tensor_value_info("mode", TensorProto.INT64, []),
            h.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def feeds(mode: int, n: int = 8, flag: bool = True) -> list[dict[str, np.ndarray]]:
    gen = rng(10 + mode)
    return [
        {
            "x": gen.normal(0, 1, (2, 3, 8, 8)).astype(np.float32),
            "mode": np.array(mode, np.int64),
            "flag": np.array(flag),
        }
        for _ in range(n)
    ]


def _branch_ops(model: onnx.ModelProto, branch: str) -> list[str]:
    node = next(n for n in model.graph.node if n.op_type == "If")
    body = next(a.g for a in node.attribute if a.name == branch)
    return [n.op_type for n in body.node]


def test_both_branches_quantized_and_close_to_float():
    model = if_model()
    q, report = onnxq.quantize(model, feeds(1) + feeds(2), progress=False)
    for branch in ("then_branch", "else_branch"):
        assert _branch_ops(q, branch).count("QLinearConv") == 2, branch
    d = next(d for d in report.decisions if d.node == "branch")
    assert d.quantized and "then_branch: 3 of 3 nodes int8 (8 batches)" in d.reason
    inner = [d for d in report.decisions if d.node.startswith("branch/then_branch/")]
    assert inner and any(d.quantized for d in inner)
    for mode in (1, 2):
        f = feeds(mode, 1)[0]
        ref, got = run(model, f)[0], run(q, f)[0]
        assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_the_summary_says_what_each_body_got_when_the_main_graph_has_nothing():
    # 32 batches: enough for a recipe choice, which has nothing to choose in the main graph
    q, report = onnxq.quantize(if_model(), feeds(1, 16) + feeds(2, 16), progress=False)
    text = report.summary()
    assert "the main graph has nothing to calibrate" in text and "calibrated on 0" not in text
    bodies = next(line for line in text.splitlines() if line.startswith("bodies: "))
    assert "branch/then_branch 3 of 3 nodes int8 (" in bodies
    assert "branch/else_branch 3 of 3 nodes int8 (" in bodies
    assert report.choice == {"skipped": "the main graph has nothing to quantize"}
    assert "recipe:" not in text
    # nothing was judged on the held-back batches: each branch calibrated on all its samples
    assert {b["samples"] for b in report.bodies} == {16}  # batches of each mode, none held
    assert {b["branch"] for b in report.to_dict()["bodies"]} == {"then_branch", "else_branch"}


def test_branch_no_sample_takes_stays_float_with_reason():
    model = if_model()
    q, report = onnxq.quantize(model, feeds(1), progress=False)
    assert "QLinearConv" in _branch_ops(q, "then_branch")
    assert "QLinearConv" not in _branch_ops(q, "else_branch")
    d = next(d for d in report.decisions if d.node == "branch")
    assert "else_branch: no calibration sample takes this branch" in d.reason
    f = feeds(2, 1)[0]  # the float branch still computes the float result exactly
    np.testing.assert_allclose(run(q, f)[0], run(model, f)[0], rtol=1e-5, atol=1e-5)


def test_nested_if_reads_outer_values():
    model = if_model(nested=True)
    assert "flag" in free_variables(
        next(a.g for a in model.graph.node[2].attribute if a.name == "then_branch")
    )
    q, _ = onnxq.quantize(model, feeds(1) + feeds(2), progress=False)
    onnx.checker.check_model(q)
    assert _branch_ops(q, "then_branch").count("QLinearConv") == 2
    for mode, flag in ((1, True), (1, False), (2, True)):
        f = feeds(mode, 1, flag)[0]
        ref, got = run(model, f)[0], run(q, f)[0]
        assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_quantizing_branches_is_deterministic():
    model = if_model()
    a, _ = onnxq.quantize(model, feeds(1) + feeds(2), progress=False)
    b, _ = onnxq.quantize(model, feeds(1) + feeds(2), progress=False)
    assert a.SerializeToString() == b.SerializeToString()


def test_nested_copies_of_an_outer_constant_are_hoisted():
    # two nested bodies each holding a copy of one tensor (what graphsurgeon's export does)
    w = nh.from_array(np.ones((64, 64), np.float32), "w")
    inner = [
        h.make_graph(
            [h.make_node("MatMul", ["x", "w"], [f"y{i}"])],
            f"inner{i}",
            [],
            [h.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, 64])],
            [w],
        )
        for i in range(2)
    ]
    body = h.make_graph(
        [h.make_node("If", ["c"], ["z"], then_branch=inner[0], else_branch=inner[1])],
        "body",
        [],
        [h.make_tensor_value_info("z", TensorProto.FLOAT, [1, 64])],
    )
    graph = h.make_graph(
        [h.make_node("If", ["c"], ["out"], then_branch=body, else_branch=_identity("x", "e"))],
        "g",
        [
            h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
            h.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [h.make_tensor_value_info("out", TensorProto.FLOAT, [1, 64])],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    before = model.ByteSize()
    hoist_nested_initializers(model.graph)
    assert model.ByteSize() < before - 60 * 64 * 4
    f = {"x": np.ones((1, 64), np.float32), "c": np.array(True)}
    np.testing.assert_array_equal(run(model, f)[0], np.full((1, 64), 64, np.float32))


def test_exclude_and_config_take_a_body_node_as_inspect_names_it():
    model, data = if_model(), feeds(1) + feeds(2)
    # `inspect --explain` and the report name it branch/then_branch/Conv_then_y
    q, report = onnxq.quantize(
        model, data, exclude=["branch/then_branch/Conv_then_y"], progress=False
    )
    assert _branch_ops(q, "then_branch").count("QLinearConv") == 1
    assert _branch_ops(q, "else_branch").count("QLinearConv") == 2
    plain, _ = onnxq.quantize(model, data, exclude=["Conv_then_y"], progress=False)
    assert q.SerializeToString() == plain.SerializeToString()
    with pytest.raises(ConfigError, match="'branch/then_branch/no_such_node'] are not in the"):
        onnxq.quantize(model, data, exclude=["branch/then_branch/no_such_node"], progress=False)
    # a [node."…"] entry takes the same name
    config = {"node": {"branch/then_branch/Conv_then_y": {"keep_float": True}}}
    configured, _ = onnxq.quantize(model, data, config=config, progress=False)
    assert configured.SerializeToString() == plain.SerializeToString()


def _all_initializers(model: onnx.ModelProto) -> list[tuple[str, onnx.TensorProto]]:
    out = []
    todo = [("main", model.graph)]
    while todo:
        where, g = todo.pop(0)
        out += [(where, t) for t in g.initializer]
        todo += [
            (f"{where}/{n.name}.{a.name}", a.g) for n in g.node for a in n.attribute if a.g.name
        ]
    return out


def _folded_twice_model() -> onnx.ModelProto:
    """A branch whose nested If reads one weight of it through a Transpose in each branch."""
    w = R.normal(0, 1, (64, 64)).astype(np.float32)
    w2 = R.normal(0, 1, (64, 64)).astype(np.float32)
    nested = [
        h.make_graph(
            [
                h.make_node("Transpose", ["w"], [f"wt{i}"]),
                h.make_node(op, ["m", f"wt{i}"], [f"z{i}"]),
            ],
            f"nested{i}",
            [],
            [h.make_tensor_value_info(f"z{i}", TensorProto.FLOAT, [64, 64])],
        )
        for i, op in enumerate(("Max", "Min"))
    ]
    body = h.make_graph(
        [
            h.make_node("Constant", [], ["w"], value=nh.from_array(w)),
            h.make_node("Constant", [], ["w2"], value=nh.from_array(w2)),
            h.make_node("MatMul", ["x", "w2"], ["m"]),
            h.make_node("If", ["flag"], ["z"], then_branch=nested[0], else_branch=nested[1]),
        ],
        "then",
        [],
        [h.make_tensor_value_info("z", TensorProto.FLOAT, [64, 64])],
    )
    other = h.make_graph(
        [h.make_node("Tile", ["x", "reps"], ["tiled"])],
        "else",
        [],
        [h.make_tensor_value_info("tiled", TensorProto.FLOAT, [64, 64])],
    )
    graph = h.make_graph(
        [
            h.make_node("Constant", [], ["one"], value=nh.from_array(np.array(1, np.int64))),
            h.make_node("Constant", [], ["reps"], value=nh.from_array(np.array([64, 1]))),
            h.make_node("Equal", ["mode", "one"], ["cond"]),
            h.make_node("If", ["cond"], ["y"], name="branch", then_branch=body, else_branch=other),
        ],
        "g",
        [
            h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
            h.make_tensor_value_info("mode", TensorProto.INT64, []),
            h.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_a_constant_folded_in_two_branches_is_written_once():
    # silero-vad's decoder: each inner branch slices the same LSTM weights, and folding wrote
    # the result into both (its int8 file 2.7 MB against the float model's 2.3 MB)
    model = _folded_twice_model()
    data = [
        {
            "x": rng(i).normal(0, 1, (1, 64)).astype(np.float32),
            "mode": np.array(1),
            "flag": np.array(i % 2 == 0),
        }
        for i in range(16)
    ]
    q, _ = onnxq.quantize(model, data, progress=False)
    onnx.checker.check_model(q)
    transposed = [
        (where, t)
        for where, t in _all_initializers(q)
        if list(t.dims) == [64, 64] and t.data_type == TensorProto.FLOAT
    ]
    assert len(transposed) == 1, [(w, t.name) for w, t in transposed]
    assert transposed[0][0] == "main/branch.then_branch"  # the graph enclosing both readers
    for flag in (True, False):
        f = {**data[0], "flag": np.array(flag)}
        ref, got = run(model, f)[0], run(q, f)[0]
        assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def _branch(node: onnx.NodeProto, name: str) -> onnx.GraphProto:
    return next(a.g for a in node.attribute if a.name == name)


def test_sharing_body_constants_keeps_the_outputs_and_small_constants():
    model = _folded_twice_model()
    body = _branch(model.graph.node[3], "then_branch")
    w = nh.to_array(body.node[0].attribute[0].t)
    for i, name in enumerate(("then_branch", "else_branch")):
        # each inner branch holds its own copy of the transposed weight, and a small constant
        inner = _branch(body.node[3], name)
        del inner.node[0]
        inner.initializer.append(nh.from_array(w.T.copy(), f"wt{i}"))
        inner.initializer.append(nh.from_array(np.ones(4, np.float32), f"small{i}"))
    # the first copy met (the inner else branch's: attributes are sorted by name) has a name
    # another graph defines too: the shared copy takes a fresh one
    _branch(model.graph.node[3], "else_branch").node.append(h.make_node("Identity", ["x"], ["wt1"]))
    f = {"x": np.ones((1, 64), np.float32), "mode": np.array(1)}
    ref = [run(model, {**f, "flag": np.array(b)})[0] for b in (True, False)]
    assert share_body_constants(model) == 64 * 64 * 4
    onnx.checker.check_model(model)
    names = {t.name for t in body.initializer}
    assert "wt1_shared0" in names and not names & {"wt0", "wt1"}
    kept = [
        sorted(t.name for t in _branch(body.node[3], b).initializer)
        for b in ("then_branch", "else_branch")
    ]
    assert kept == [["small0"], ["small1"]]
    got = [run(model, {**f, "flag": np.array(b)})[0] for b in (True, False)]
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_array_equal(g, r)
    assert share_body_constants(model) == 0


def test_config_reaches_a_branch_node_and_a_main_node_entry_leaves_branches_alone():
    # before, any [node] entry made every branch's own quantization fail ("names nodes that
    # are not in the model") and the branches stayed float
    # the branch's nodes by the names `inspect` gives them
    model, data = if_model(), feeds(1) + feeds(2)
    config = {"node": {"Conv_then_y": {"keep_float": True}}}
    q, _ = onnxq.quantize(model, data, config=config, progress=False)
    assert _branch_ops(q, "then_branch").count("QLinearConv") == 1
    assert _branch_ops(q, "else_branch").count("QLinearConv") == 2
    q2, _ = onnxq.quantize(model, data, config={"node": {"Equal_cond": {}}}, progress=False)
    assert _branch_ops(q2, "then_branch").count("QLinearConv") == 2


def test_debug_says_its_emulation_leaves_the_bodies_out_and_advises_above_the_noise():
    from dataclasses import replace

    from onnxq.tools.debug import debug

    result = debug(if_model(), feeds(1, 16) + feeds(2, 16), budget=5)
    text = result.summary()
    # the emulation behind the loss parts, the ranking and the cross-check has float bodies
    assert "not measured: the emulation covers the main graph only" in text
    assert "the same int8 in float arithmetic -" in text
    assert "sensitivity: the main graph holds no int8 group to rank" in text
    assert "the fake-quantized model keeps the If/Loop/Scan bodies float" in text
    best = result.body_groups[0]
    gain = best.metric - result.int8
    assert gain > 0
    # a gain within the noise is not advice; above it, the name --exclude takes
    assert result.body_advice() is None if gain <= result.noise else result.body_advice()
    louder = replace(result, noise=gain / 2)
    assert louder.body_advice() is not None
    assert f"--exclude {best.name} wins back" in louder.summary()
    quiet = replace(result, noise=gain * 2)
    assert quiet.body_advice() is None and "advice:" not in quiet.summary()


def test_a_model_quantized_in_its_bodies_is_known_as_quantized(tmp_path, capsys):
    from onnxq.cli import _check_compare_order, main

    # silero-vad: onnxq's int8 model holds its quantized ops inside the If branches alone
    data = feeds(1) + feeds(2)
    q, _ = onnxq.quantize(if_model(), data, progress=False)
    assert not any(n.op_type.startswith("QLinear") for n in q.graph.node)
    fp, qp = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(if_model(), str(fp))
    onnx.save(q, str(qp))
    with pytest.raises(ModelError, match="already quantized inside its If/Loop/Scan"):
        onnxq.quantize(q, data, progress=False)
    capsys.readouterr()
    assert main(["inspect", str(qp)]) == 2
    assert "already quantized inside its If/Loop/Scan bodies" in capsys.readouterr().err
    assert main(["convert", str(qp), "--format", "qdq", "-o", str(tmp_path / "c.onnx")]) == 2
    assert "sit in its If/Loop/Scan bodies" in capsys.readouterr().err
    assert not (tmp_path / "c.onnx").exists()
    # compare takes it as the quantized one, and refuses it as the float one
    _check_compare_order(str(fp), if_model(), str(qp), q)
    with pytest.raises(ConfigError, match="is the quantized model"):
        _check_compare_order(str(qp), q, str(fp), if_model())
