"""Loop and Scan bodies quantized as models of their own, calibrated on every iteration that runs.

Each result is run in onnxruntime against the float model.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import pytest
from helpers import rng, run
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxq
from onnxq.calibrate.iterations import Iterations
from onnxq.io.bodies import body_iterations, steps_together
from onnxq.io.session import make_session
from onnxq.post.subgraphs import branch_model
from onnxq.prepare.preprocess import prepare

D, H = 16, 32
F = TensorProto.FLOAT


def _weights(seed: int, gain: float = 0.8) -> dict[str, np.ndarray]:
    g = rng(seed)
    return {
        "wx": (g.normal(0, 1, (D, H)) / np.sqrt(D)).astype(np.float32),
        "wh": (g.normal(0, 1, (H, H)) * gain / np.sqrt(H)).astype(np.float32),
        "b": g.normal(0, 0.1, H).astype(np.float32),
        "wo": (g.normal(0, 1, (H, 4)) / np.sqrt(H)).astype(np.float32),
    }


def _step(x_t: str, h_in: str, h_out: str) -> list[onnx.NodeProto]:
    """h_out = tanh(x_t·wx + h_in·wh + b): the weights are outer constants the body reads."""
    return [
        h.make_node("MatMul", [x_t, "wx"], ["a"], name="input_mm"),
        h.make_node("MatMul", [h_in, "wh"], ["c"], name="hidden_mm"),
        h.make_node("Add", ["a", "c"], ["s"], name="sum"),
        h.make_node("Add", ["s", "b"], ["s2"], name="bias"),
        h.make_node("Tanh", ["s2"], [h_out], name="tanh"),
    ]


def _zero_state() -> list[onnx.NodeProto]:
    return [
        h.make_node("Shape", ["x"], ["shape"]),
        h.make_node("Gather", ["shape", "first"], ["n"], axis=0),
        h.make_node("Concat", ["n", "hidden"], ["dims"], axis=0),
        h.make_node(
            "ConstantOfShape", ["dims"], ["h0"], value=nh.from_array(np.zeros(1, np.float32))
        ),
    ]


def _model(
    nodes: list[onnx.NodeProto], steps: int, weights: dict[str, np.ndarray], outputs: list
) -> onnx.ModelProto:
    inits = {**weights, "first": np.array([0], np.int64), "hidden": np.array([H], np.int64)}
    inits["steps"] = np.array(steps, np.int64)
    graph = h.make_graph(
        nodes,
        "rnn",
        [h.make_tensor_value_info("x", F, ["N", steps, D])],
        outputs,
        [nh.from_array(v, k) for k, v in inits.items()],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def loop_rnn(steps: int, gain: float = 0.8) -> onnx.ModelProto:
    """A tanh RNN as a Loop (step i gathers x[:, i]), its states as a scan output, then a head."""
    body = h.make_graph(
        [
            h.make_node("Gather", ["x", "i"], ["x_t"], axis=1, name="row"),
            *_step("x_t", "h_in", "h_out"),
            h.make_node("Identity", ["cond_in"], ["cond_out"], name="cond"),
            h.make_node("Identity", ["h_out"], ["h_each"], name="each"),
        ],
        "body",
        [
            h.make_tensor_value_info("i", TensorProto.INT64, []),
            h.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            h.make_tensor_value_info("h_in", F, ["N", H]),
        ],
        [
            h.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            h.make_tensor_value_info("h_out", F, ["N", H]),
            h.make_tensor_value_info("h_each", F, ["T", "N", H]),
        ],
    )
    nodes = [
        *_zero_state(),
        h.make_node("Loop", ["steps", "", "h0"], ["h_last", "states"], body=body, name="rnn"),
        h.make_node("MatMul", ["h_last", "wo"], ["y"], name="head"),
    ]
    outputs = [
        h.make_tensor_value_info("y", F, ["N", 4]),
        h.make_tensor_value_info("states", F, [steps, "N", H]),
    ]
    return _model(nodes, steps, _weights(1, gain), outputs)


def scan_rnn(steps: int, reverse: bool = False) -> onnx.ModelProto:
    """The same RNN as a Scan over axis 1 of x (optionally last step first)."""
    body = h.make_graph(
        _step("x_t", "h_in", "h_out") + [h.make_node("Identity", ["h_out"], ["h_each"])],
        "body",
        [
            h.make_tensor_value_info("h_in", F, ["N", H]),
            h.make_tensor_value_info("x_t", F, ["N", D]),
        ],
        [
            h.make_tensor_value_info("h_out", F, ["N", H]),
            h.make_tensor_value_info("h_each", F, ["N", H]),
        ],
    )
    nodes = [
        *_zero_state(),
        h.make_node(
            "Scan",
            ["h0", "x"],
            ["h_last", "states"],
            body=body,
            num_scan_inputs=1,
            scan_input_axes=[1],
            scan_input_directions=[1 if reverse else 0],
            name="rnn",
        ),
        h.make_node("MatMul", ["h_last", "wo"], ["y"], name="head"),
    ]
    outputs = [
        h.make_tensor_value_info("y", F, ["N", 4]),
        h.make_tensor_value_info("states", F, [steps, "N", H]),
    ]
    return _model(nodes, steps, _weights(2), outputs)


def _counted_io() -> tuple[list, list]:
    """A Loop body's inputs and outputs with no carried value: (i, cond) -> (cond, y_i)."""
    inputs = [
        h.make_tensor_value_info("i", TensorProto.INT64, []),
        h.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
    ]
    outputs = [
        h.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
        h.make_tensor_value_info("y_i", F, ["N", H]),
    ]
    return inputs, outputs


def growing_loop(steps: int) -> onnx.ModelProto:
    """A Loop whose body's range grows with the iteration: y_i = ((i + 1) · x) · wx."""
    body = h.make_graph(
        [
            h.make_node("Add", ["i", "one"], ["i1"]),
            h.make_node("Cast", ["i1"], ["k"], to=TensorProto.FLOAT),
            h.make_node("Mul", ["x2", "k"], ["xk"], name="grow"),
            h.make_node("MatMul", ["xk", "wx"], ["y_i"], name="mm"),
            h.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        *_counted_io(),
    )
    nodes = [
        h.make_node("Relu", ["x"], ["x2"]),
        h.make_node("Loop", ["steps", ""], ["ys"], body=body, name="grow_loop"),
    ]
    weights = {"wx": _weights(3)["wx"], "one": np.array(1, np.int64)}
    graph_in = [h.make_tensor_value_info("x", F, ["N", D])]
    inits = {**weights, "steps": np.array(steps, np.int64)}
    graph = h.make_graph(
        nodes,
        "grow",
        graph_in,
        [h.make_tensor_value_info("ys", F, [steps, "N", H])],
        [nh.from_array(v, k) for k, v in inits.items()],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _feeds(
    steps: int, n: int = 40, shape: tuple[int, ...] | None = None
) -> list[dict[str, np.ndarray]]:
    g = rng(7)
    shape = shape or (1, steps, D)
    return [{"x": g.normal(0, 1, shape).astype(np.float32)} for _ in range(n)]


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - got) ** 2), 1e-30)))


def _body(model: onnx.ModelProto) -> onnx.GraphProto:
    node = next(n for n in model.graph.node if n.op_type in ("Loop", "Scan"))
    return next(a.g for a in node.attribute if a.name == "body")


def _eval_feed(steps: int) -> dict[str, np.ndarray]:
    return {"x": rng(99).normal(0, 1, (8, steps, D)).astype(np.float32)}


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_loop_body_quantized_and_its_state_holds_through_100_iterations(fmt):
    model = loop_rnn(100)
    q, report = onnxq.quantize(model, _feeds(100, 24), format=fmt, progress=False)
    onnx.checker.check_model(q)
    body_ops = [n.op_type for n in _body(q).node]
    # the input projection runs once for every step before the Loop (onnxq.prepare.hoist);
    # the body keeps the hidden state's MatMul
    if fmt == "qoperator":
        assert body_ops.count("MatMulIntegerToFloat") + body_ops.count("QLinearMatMul") == 1
        assert "MatMul" not in body_ops
    else:
        assert body_ops.count("DequantizeLinear") >= 2  # the weight and the activation
        assert body_ops.count("MatMul") == 1
    assert "input_mm" in report.quantized_nodes
    # the body holds its weights (the bias joined the input projection outside)
    assert {"wx", "wh"}.isdisjoint(t.name for t in q.graph.initializer)
    d = next(d for d in report.decisions if d.node == "rnn")
    assert d.quantized and "2,400 iterations" in d.reason, d.reason
    assert any(d.node.startswith("rnn/body/") and d.quantized for d in report.decisions)
    feed = _eval_feed(100)
    (y_ref, s_ref), (y_got, s_got) = run(model, feed), run(q, feed)
    # the carried state after 100 requantized iterations, and every state on the way
    assert _sqnr(s_ref[-1], s_got[-1]) > 25
    assert _sqnr(s_ref, s_got) > 25
    assert _sqnr(y_ref, y_got) > 25


def test_scan_body_quantized_in_either_direction():
    for reverse in (False, True):
        model = scan_rnn(30, reverse)
        q, report = onnxq.quantize(model, _feeds(30, 16), progress=False)
        body_ops = [n.op_type for n in _body(q).node]
        assert body_ops.count("MatMulIntegerToFloat") + body_ops.count("QLinearMatMul") == 1
        assert "MatMul" not in body_ops and "input_mm" in report.quantized_nodes
        prepared = next(p for p in report.passes if p.name == "prepare")
        assert "moved before their loop, computed once: 'input_mm' of 'rnn'" in prepared.changed
        d = next(d for d in report.decisions if d.node == "rnn")
        assert "480 iterations" in d.reason, d.reason
        feed = _eval_feed(30)
        (y_ref, s_ref), (y_got, s_got) = run(model, feed), run(q, feed)
        assert _sqnr(s_ref, s_got) > 25 and _sqnr(y_ref, y_got) > 25


def test_body_calibrated_on_every_iteration_not_the_first():
    # the last iteration's values are 8x the first's: calibrated on the first alone, every
    # later iteration would clip (SQNR near 0 dB on the last one)
    model = growing_loop(8)
    q, _ = onnxq.quantize(model, _feeds(8, 24, (1, D)), progress=False)
    assert "MatMulIntegerToFloat" in [n.op_type for n in _body(q).node] or "QLinearMatMul" in [
        n.op_type for n in _body(q).node
    ]
    feed = {"x": rng(5).normal(0, 1, (8, D)).astype(np.float32)}
    ref, got = run(model, feed)[0], run(q, feed)[0]
    assert _sqnr(ref[7], got[7]) > 25
    assert _sqnr(ref[0], got[0]) > 15  # on a grid 8x its range: about 2 dB less than the last


def test_loop_stops_where_its_condition_says():
    # a Loop with no trip count that ends when its counter reaches 5: the driver gives the
    # body's inputs for iterations 0..4 only, as onnxruntime runs it
    body = h.make_graph(
        [
            h.make_node("Add", ["k_in", "one"], ["k_out"]),
            h.make_node("Less", ["k_out", "five"], ["cond_out"]),
            h.make_node("Mul", ["v_in", "two"], ["v_out"]),
        ],
        "body",
        [
            h.make_tensor_value_info("i", TensorProto.INT64, []),
            h.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            h.make_tensor_value_info("k_in", F, []),
            h.make_tensor_value_info("v_in", F, ["N"]),
        ],
        [
            h.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            h.make_tensor_value_info("k_out", F, []),
            h.make_tensor_value_info("v_out", F, ["N"]),
        ],
        [
            nh.from_array(np.array(1, np.float32), "one"),
            nh.from_array(np.array(5, np.float32), "five"),
            nh.from_array(np.array(2, np.float32), "two"),
        ],
    )
    node = h.make_node("Loop", ["", "go", "k0", "v0"], ["k", "v"], body=body, name="l")
    parent = h.make_model(h.make_graph([node], "g", [], []), opset_imports=[h.make_opsetid("", 17)])
    row = {"go": np.array(True), "k0": np.array(0, np.float32), "v0": np.ones(3, np.float32)}
    feeds = list(
        body_iterations(node, make_session(branch_model(parent, body, _first(node, row))), row, [])
    )
    assert [int(f["i"]) for f in feeds] == [0, 1, 2, 3, 4]
    assert [float(f["v_in"][0]) for f in feeds] == [1, 2, 4, 8, 16]


def _first(node: onnx.NodeProto, row: dict) -> dict:
    return next(body_iterations(node, None, row, []))


def test_iterations_hold_one_iteration_in_memory():
    # the driver's peak allocation does not grow with the number of iterations
    peaks = []
    for steps in (10, 400):
        model = scan_rnn(steps)
        node = model.graph.node[4]
        body = _body(model)
        row = {"h0": np.zeros((64, H), np.float32), "x": np.ones((64, steps, D), np.float32)}
        data = Iterations(node, branch_model(model, body, _first(node, row)), [], [row])
        tracemalloc.start()
        count = sum(1 for _ in data.batches())
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert count == steps
    assert peaks[1] < 1.5 * peaks[0] + (1 << 16), peaks


def _scan_iterations(model: onnx.ModelProto, rows: list[dict], stacked: bool) -> Iterations:
    node = next(n for n in model.graph.node if n.op_type == "Scan")
    body = branch_model(model, _body(model), _first(node, rows[0]))
    sizes = [len(r["x"]) for r in rows] if stacked else None
    return Iterations(node, body, [], rows, sizes)


def _scan_rows(n: int, steps: int) -> list[dict]:
    g = rng(11)
    return [
        {"h0": np.zeros((1, H), np.float32), "x": g.normal(0, 1, (1, steps, D)).astype(np.float32)}
        for _ in range(n)
    ]


def test_rows_stacked_in_one_body_run_give_every_iteration_they_give_alone():
    # 40 samples of 100 steps: 4,000 row-iterations, 15 rows a run (256 feeds kept at least)
    rows = _scan_rows(40, 100)
    model = scan_rnn(100)
    alone, together = _scan_iterations(model, rows, False), _scan_iterations(model, rows, True)
    each = list(alone.batches())
    joined = list(together.batches())
    assert alone.stacked == 1 and together.stacked == 15
    assert alone.count == together.count == 4000
    assert len(each) == 4000 and len(joined) == 300  # 2 runs of 15 rows and one of 10, 100 steps
    for name in ("h_in", "x_t"):
        ref = np.concatenate([f[name] for f in each])
        got = np.concatenate([f[name] for f in joined])
        # the same values, in another order: a step of every stacked row, then the next step
        np.testing.assert_allclose(np.sort(got, axis=0), np.sort(ref, axis=0), atol=1e-5)


def test_a_body_that_mixes_its_rows_runs_each_row_alone():
    # the body adds its batch's mean to the state: stacked rows would see each other's values
    model = scan_rnn(100)
    body = _body(model)
    tanh = next(n for n in body.node if n.op_type == "Tanh")
    tanh.output[0] = "t"
    body.node.extend(
        [
            h.make_node("ReduceMean", ["t"], ["m"], axes=[0], keepdims=1),
            h.make_node("Add", ["t", "m"], ["h_out"]),
        ]
    )
    data = _scan_iterations(model, _scan_rows(40, 100), True)
    assert len(list(data.batches())) == 4000 and data.stacked == 1


def test_a_loop_whose_body_computes_its_condition_is_not_stacked():
    body = _body(loop_rnn(10))
    assert steps_together(next(n for n in loop_rnn(10).graph.node if n.op_type == "Loop"))
    cond = next(n for n in body.node if n.name == "cond")
    cond.op_type, cond.input[:] = "Not", ["cond_in"]  # a condition of its own: the rows may part
    node = h.make_node("Loop", ["steps", "", "h0"], ["h_last", "states"], body=body)
    assert not steps_together(node)


def test_fakequantize_output_leaves_the_body_float_with_its_reason():
    pytest.importorskip("openvino")
    model = loop_rnn(10)
    q, report = onnxq.quantize(model, _feeds(10, 8), format="openvino", progress=False)
    assert not any(n.domain for n in _body(q).node)
    d = next(d for d in report.decisions if d.node == "rnn")
    assert not d.quantized and "FakeQuantize output covers the main graph only" in d.reason


def test_excluding_the_loop_node_keeps_its_body_float():
    # a recurrent step at batch 1 can run slower in int8 than in float: the user's way out
    model = loop_rnn(10)
    q, report = onnxq.quantize(model, _feeds(10, 8), exclude=["rnn"], progress=False)
    body = _body(q)
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in body.node}
    assert not any(n.domain for n in body.node)
    assert [n.op_type for n in body.node].count("MatMul") == 2  # nothing hoisted out of it
    d = next(d for d in report.decisions if d.node == "rnn")
    assert not d.quantized and "excluded" in d.reason, d.reason
    feed = _eval_feed(10)
    np.testing.assert_allclose(run(q, feed)[1], run(model, feed)[1], atol=1e-5)


def test_a_slower_int8_loop_model_is_told_how_to_keep_the_body_float(monkeypatch):
    from onnxq.simulate import checks

    monkeypatch.setattr(checks, "latency", lambda *a, **k: checks.Latency(0.10, 0.16, 9))
    model = loop_rnn(10)
    _, report = onnxq.quantize(model, _feeds(10, 8), latency_check=True, progress=False)
    slower = [w for w in report.warnings if "slower than fp32" in w]
    assert len(slower) == 1, slower
    assert slower[0].endswith("int8 body of 'rnn' runs every step: exclude=['rnn'] keeps it float")


def test_quantizing_a_loop_is_deterministic():
    model = loop_rnn(12)
    a, _ = onnxq.quantize(model, _feeds(12, 8), progress=False)
    b, _ = onnxq.quantize(model, _feeds(12, 8), progress=False)
    assert a.SerializeToString() == b.SerializeToString()


def test_if_nested_in_a_loop_body_is_quantized_on_the_iterations_that_take_each_branch():
    # odd iterations multiply by wx, even ones by -2·wx: each branch calibrated on its own
    # iterations, both int8
    w = _weights(4)["wx"]

    def branch(name: str, scale: float) -> onnx.GraphProto:
        return h.make_graph(
            [h.make_node("MatMul", ["x_t", f"w_{name}"], [f"y_{name}"], name=f"mm_{name}")],
            name,
            [],
            [h.make_tensor_value_info(f"y_{name}", F, ["N", H])],
            [nh.from_array((w * scale).astype(np.float32), f"w_{name}")],
        )

    body = h.make_graph(
        [
            h.make_node("Gather", ["x", "i"], ["x_t"], axis=1),
            h.make_node("Mod", ["i", "two"], ["odd_i"]),
            h.make_node("Cast", ["odd_i"], ["odd"], to=TensorProto.BOOL),
            h.make_node(
                "If",
                ["odd"],
                ["y_i"],
                then_branch=branch("odd", 1.0),
                else_branch=branch("even", -2.0),
                name="pick",
            ),
            h.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        *_counted_io(),
    )
    graph = h.make_graph(
        [h.make_node("Loop", ["steps", ""], ["ys"], body=body, name="alt")],
        "alt",
        [h.make_tensor_value_info("x", F, ["N", 6, D])],
        [h.make_tensor_value_info("ys", F, [6, "N", H])],
        [
            nh.from_array(np.array(6, np.int64), "steps"),
            nh.from_array(np.array(2, np.int64), "two"),
        ],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    q, report = onnxq.quantize(model, _feeds(6, 16), progress=False)
    onnx.checker.check_model(q)
    inner = next(n for n in _body(q).node if n.op_type == "If")
    for a in inner.attribute:
        assert {n.op_type for n in a.g.node} & {"MatMulIntegerToFloat", "QLinearMatMul"}, a.name
    d = next(d for d in report.decisions if d.node == "alt")
    assert d.quantized and "96 iterations" in d.reason, d.reason
    feed = _eval_feed(6)
    assert _sqnr(run(model, feed)[0], run(q, feed)[0]) > 30


def test_inspect_explains_the_nodes_of_a_loop_body(tmp_path, capsys):
    from onnxq.cli import main

    path = tmp_path / "loop.onnx"
    onnx.save(loop_rnn(5), str(path))
    assert main(["inspect", str(path), "--explain"]) == 0
    out = capsys.readouterr().out
    # the body's MatMul is matched (the input's runs before the Loop); its Tanh stays float
    assert "rnn/body/hidden_mm" in out and "input_mm" in out and "rnn/body/input_mm" not in out
    assert "rnn/body/tanh" in out
    assert "calibrated on every iteration" in out


def test_debug_measures_the_groups_inside_a_loop_body(tmp_path):
    from onnxq.tools.debug import debug

    model = loop_rnn(20, gain=1.2)
    page = tmp_path / "debug.html"
    result = debug(model, _feeds(20, 8), budget=5, output=tmp_path / "fix.toml", report=page)
    names = [g.name for g in result.body_groups]
    assert names == ["rnn/body/hidden_mm"], names  # the input's MatMul runs before the Loop
    for g in result.body_groups:  # each measured: a quantization with that MatMul float
        assert g.metric != result.int8
    assert "inside If/Loop/Scan bodies" in result.summary()
    assert {r["node"] for r in result.to_dict()["body_groups"]} == set(names)
    text = page.read_text()
    assert "Groups inside If branches and Loop/Scan bodies" in text and "rnn/body/hidden_mm" in text


def test_sequential_bias_correction_runs_past_a_scan():
    # the correction cuts the model into pieces at each biased layer; a piece holding the
    # Scan declared the body's own names (its step's 'a', 'c', ...) as inputs: onnxruntime
    # refused the piece ("'a' has been used as output names multiple times")
    model = scan_rnn(12)
    head = next(n for n in model.graph.node if n.name == "head")
    head.output[0] = "y_mm"
    model.graph.node.append(h.make_node("Add", ["y_mm", "head_b"], ["y"], name="head_bias"))
    model.graph.initializer.append(nh.from_array(np.full(4, 0.1, np.float32), "head_b"))
    q, report = onnxq.quantize(model, _feeds(12, 16), bias_correction="sequential", progress=False)
    assert "sequential" in report.summary()
    feed = _eval_feed(12)
    assert _sqnr(run(model, feed)[0], run(q, feed)[0]) > 25


def _holder(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type in ("Loop", "Scan"))


def _hoisted(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` prepared, checked, and computing what ``model`` computes."""
    out, _ = prepare(model)
    onnx.checker.check_model(out)
    steps = next(t for t in model.graph.initializer if t.name == "steps")
    feed = _eval_feed(int(nh.to_array(steps)))
    for ref, got in zip(run(model, feed), run(out, feed), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    return out


def test_a_loops_carried_value_keeps_its_shape_without_symbolic_inference(monkeypatch):
    # ONNX types a carried value without its shape; the body declares [N, H] in and out, as
    # its initial value is: the Loop's output is given it, and the MatMul after it its shape
    import onnxq.prepare.preprocess as preprocess

    def refused(model):
        assert not preprocess._unshaped(model), "onnxruntime's symbolic inference was needed"
        return []

    monkeypatch.setattr(preprocess, "_symbolic_value_info", refused)
    out, _ = prepare(loop_rnn(10))
    shapes = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in out.graph.value_info
    }
    assert shapes["h_last"] == ["N", H]
    # a body whose carried value changes shape (declared [N, H] in, [N, 2H] out) gets none
    model = loop_rnn(10)
    body = _body(model)
    body.output[1].type.tensor_type.shape.dim[1].dim_value = 2 * H
    monkeypatch.setattr(preprocess, "_symbolic_value_info", lambda model: [])
    out, _ = prepare(model)
    assert not any(
        v.name == "h_last" and v.type.tensor_type.HasField("shape") for v in out.graph.value_info
    )


@pytest.mark.parametrize("reverse", [False, True])
def test_prepare_hoists_a_scan_bodys_input_projection_into_one_matmul(reverse):
    out = _hoisted(scan_rnn(12, reverse))
    body_ops = [n.op_type for n in _body(out).node]
    # the hidden state's MatMul and the sum with it stay; the input's MatMul and the bias
    # (added after the sum) run for all steps before the Scan, steps first
    assert body_ops.count("MatMul") == 1 and body_ops.count("Add") == 1
    by_name = {n.name: n for n in out.graph.node}
    steps_first, mm, bias = by_name["input_mm_steps_first"], by_name["input_mm"], by_name["bias"]
    assert h.get_attribute_value(steps_first.attribute[0]) == [1, 0, 2]
    assert mm.input[0] == steps_first.output[0] and bias.input[0] == mm.output[0]
    scan = _holder(out)
    assert list(scan.input)[-1] == bias.output[0]
    attrs = {a.name: h.get_attribute_value(a) for a in scan.attribute if a.name != "body"}
    assert attrs["num_scan_inputs"] == 1 and attrs["scan_input_axes"] == [0]
    assert attrs["scan_input_directions"] == [1 if reverse else 0]


def test_a_scan_input_the_body_still_reads_stays_beside_its_projection():
    model = scan_rnn(8)
    body = _body(model)
    body.node.append(h.make_node("Relu", ["x_t"], ["x_pos"], name="x_pos"))
    body.output.append(h.make_tensor_value_info("x_pos", F, ["N", D]))
    model.graph.node[-2].output.append("x_pos_all")
    model.graph.output.append(h.make_tensor_value_info("x_pos_all", F, [8, "N", D]))
    out = _hoisted(model)
    attrs = {a.name: h.get_attribute_value(a) for a in _holder(out).attribute if a.name != "body"}
    assert attrs["num_scan_inputs"] == 2 and attrs["scan_input_axes"] == [1, 0]
    assert [n.op_type for n in _body(out).node].count("MatMul") == 1


def test_a_scan_over_the_axis_the_matmul_sums_stays_as_it_is():
    # x is (N, 16, 16) scanned along its last axis: x_t = x[:, :, t] multiplies wx over axis 1,
    # while MatMul(x, wx) would sum over axis 2; nothing may move
    model = scan_rnn(D)
    scan = _holder(model)
    next(a for a in scan.attribute if a.name == "scan_input_axes").ints[:] = [2]
    out = _hoisted(model)
    assert [n.op_type for n in _body(out).node].count("MatMul") == 2


def test_a_loop_gathering_rows_is_hoisted_only_when_its_trip_count_covers_them():
    out = _hoisted(loop_rnn(6))
    body = _body(out)
    assert [n.op_type for n in body.node].count("MatMul") == 1
    row = next(n for n in body.node if n.op_type == "Gather" and n.input[1] == "i")
    assert row.input[0] == next(n for n in out.graph.node if n.name == "bias").output[0]
    assert h.get_attribute_value(row.attribute[0]) == 0  # the rows of one step lie together
    # a Loop of 3 steps over 6 rows would multiply rows it never reads: left as it is
    model = loop_rnn(6)
    steps = next(t for t in model.graph.initializer if t.name == "steps")
    steps.CopyFrom(nh.from_array(np.array(3, np.int64), "steps"))
    model.graph.output.pop()  # its per-step states are now 3, not the declared 6
    model.graph.output.append(h.make_tensor_value_info("states", F, [3, "N", H]))
    out, _ = prepare(model)
    assert [n.op_type for n in _body(out).node].count("MatMul") == 2


def test_a_bias_added_to_the_projection_itself_moves_with_it():
    model = scan_rnn(8)
    body = _body(model)
    nodes = {n.name: n for n in body.node}
    nodes["sum"].input[:] = ["a", "b"]  # a = x_t·wx; s = a + b; s2 = s + c
    nodes["bias"].input[:] = ["s", "c"]
    out = _hoisted(model)
    body_ops = [n.op_type for n in _body(out).node]
    assert body_ops.count("MatMul") == 1 and body_ops.count("Add") == 1
    by_name = {n.name: n for n in out.graph.node}
    assert by_name["sum"].input[:] == [by_name["input_mm"].output[0], "b"]
    assert list(_holder(out).input)[-1] == by_name["sum"].output[0]


def test_a_gemm_projection_with_transposed_weight_and_bias_is_hoisted():
    # torch writes a Linear layer on a 2-D input as Gemm(x, W, b, transB=1)
    model = scan_rnn(8)
    w = next(t for t in model.graph.initializer if t.name == "wx")
    wt = nh.from_array(np.ascontiguousarray(nh.to_array(w).T) * 2, "wx_t")
    model.graph.initializer.append(wt)
    model.graph.initializer.append(nh.from_array(rng(4).normal(0, 1, H).astype(np.float32), "bx"))
    body = _body(model)
    gemm = h.make_node("Gemm", ["x_t", "wx_t", "bx"], ["a"], transB=1, alpha=0.5, name="input_mm")
    body.node[0].CopyFrom(gemm)
    out = _hoisted(model)
    body_ops = [n.op_type for n in _body(out).node]
    assert "Gemm" not in body_ops and body_ops.count("MatMul") == 1
    assert {"input_mm", "input_mm_bias"} <= {n.name for n in out.graph.node}


def test_two_projections_of_one_scan_input_share_its_transpose():
    # a cell written gate by gate multiplies x_t by one weight per gate
    model = scan_rnn(8)
    model.graph.initializer.append(
        nh.from_array((rng(5).normal(0, 1, (D, H)) / np.sqrt(D)).astype(np.float32), "wx2")
    )
    body = _body(model)
    body.node.insert(1, h.make_node("MatMul", ["x_t", "wx2"], ["a2"], name="gate_mm"))
    body.node.insert(2, h.make_node("Add", ["a", "a2"], ["a12"], name="gates"))
    next(n for n in body.node if n.name == "sum").input[0] = "a12"
    out = _hoisted(model)
    assert [n.op_type for n in _body(out).node].count("MatMul") == 1
    assert [n.op_type for n in out.graph.node].count("Transpose") == 1
    attrs = {a.name: h.get_attribute_value(a) for a in _holder(out).attribute if a.name != "body"}
    assert attrs["num_scan_inputs"] == 2 and attrs["scan_input_axes"] == [0, 0]


def test_a_loop_counting_the_rows_from_their_shape_is_hoisted():
    # `for t in range(x.size(1))`: the trip count is read from x's shape, the steps dynamic
    model = loop_rnn(6)
    g = model.graph
    g.node.insert(0, h.make_node("Shape", ["x"], ["x_shape"], name="x_shape"))
    g.node.insert(1, h.make_node("Gather", ["x_shape", "axis1"], ["rows_n"], axis=0))
    g.initializer.append(nh.from_array(np.array(1, np.int64), "axis1"))
    _holder(model).input[0] = "rows_n"
    g.input[0].type.tensor_type.shape.dim[1].dim_param = "T"
    g.output[1].type.tensor_type.shape.dim[0].dim_param = "T"
    out = _hoisted(model)
    assert [n.op_type for n in _body(out).node].count("MatMul") == 1
    # the same count read along another axis says nothing about the gathered rows
    model.graph.initializer[-1].CopyFrom(nh.from_array(np.array(0, np.int64), "axis1"))
    out, _ = prepare(model)
    assert [n.op_type for n in _body(out).node].count("MatMul") == 2


def _sliced_every_step(ends: int) -> onnx.ModelProto:
    """loop_rnn(6) as TorchScript writes ``x[:, t]``: ``x[:]`` sliced inside the body each step."""
    model = loop_rnn(6)
    body = _body(model)
    consts = {"s0": [0], "s1": [ends], "s_axes": [0], "s_steps": [1]}
    body.initializer.extend(nh.from_array(np.array(v, np.int64), k) for k, v in consts.items())
    body.node.insert(0, h.make_node("Slice", ["x", *consts], ["x_all"], name="x_all"))
    next(n for n in body.node if n.name == "row").input[0] = "x_all"
    return model


def test_a_slice_the_same_every_step_leaves_the_body_and_the_projection_follows():
    out = _hoisted(_sliced_every_step(2**63 - 1))  # x[:]: dropped, the rows gathered from x
    body_ops = [n.op_type for n in _body(out).node]
    assert "Slice" not in body_ops and body_ops.count("MatMul") == 1
    assert "Slice" not in [n.op_type for n in out.graph.node]
    # a slice that keeps what it is given up to 8 rows runs once before the Loop, the
    # projection reading it
    out = _hoisted(_sliced_every_step(8))
    assert "Slice" not in [n.op_type for n in _body(out).node]
    sliced = next(n for n in out.graph.node if n.op_type == "Slice")
    assert sliced.input[0] == "x"
    assert [n.op_type for n in _body(out).node].count("MatMul") == 1


def test_excluding_a_moved_body_node_by_its_inspect_name_keeps_it_float():
    # inspect names the body's projection rnn/body/input_mm; it runs before the loop, as input_mm
    q, report = onnxq.quantize(
        loop_rnn(6), _feeds(6, 4), exclude=["rnn/body/input_mm"], progress=False
    )
    assert next(n for n in q.graph.node if n.name == "input_mm").op_type == "MatMul"
    decision = next(d for d in report.decisions if d.node == "input_mm")
    assert not decision.quantized and "is in exclude" in decision.reason


def test_a_moved_node_takes_another_name_where_the_main_graph_has_its_own():
    model = loop_rnn(6)
    model.graph.node[-1].name = "input_mm"  # the head is named like the body's projection
    out = _hoisted(model)
    names = [n.name for n in out.graph.node]
    assert len(names) == len(set(names)) and "input_mm_1" in names
