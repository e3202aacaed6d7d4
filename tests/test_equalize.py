"""Cross-layer equalization: exact in float, balanced weight ranges, a better per-tensor model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import make_model, rng, run
from onnx import helper as h

import onnxq
from onnxq.calibrate.calibration import clamped_by_reader
from onnxq.core.errors import ConfigError
from onnxq.io.openvino import openvino_compile
from onnxq.options import resolve
from onnxq.passes.equalize import Equalize
from onnxq.passes.load import Load
from onnxq.passes.manager import State
from onnxq.solve.equalize import (
    Layer,
    Link,
    absorb,
    equalize,
    equalizing_scales,
    input_ranges,
    output_ranges,
)


def _chain_model(seed: int = 0, relu_link: bool = True) -> onnx.ModelProto:
    """Conv → Clip(0, 6) → Pad → depthwise Conv → Conv 1x1 [→ Relu → Conv 1x1].

    Output channels of the first Conv span three decades of weight range, the way folded
    BatchNormalizations leave them.
    """
    r = rng(seed)
    w1 = r.normal(size=(8, 3, 3, 3)) * np.logspace(-1.5, 1, 8)[:, None, None, None]
    inits = {
        "w1": w1.astype(np.float32),
        "b1": r.normal(size=8).astype(np.float32),
        "lo": np.array(0.0, np.float32),
        "hi": np.array(6.0, np.float32),
        "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64),
        "w2": (r.normal(size=(8, 1, 3, 3)) * np.logspace(1, -1, 8)[:, None, None, None]).astype(
            np.float32
        ),
        "b2": r.normal(size=8).astype(np.float32),
        "w3": r.normal(size=(6, 8, 1, 1)).astype(np.float32),
        # three channels a Relu never clips: their offset can leave the activation
        "b3": (r.normal(size=6) + [200, 200, 200, 0, 0, 0]).astype(np.float32),
    }
    nodes = [
        h.make_node("Conv", ["x", "w1", "b1"], ["y1"], name="c1", pads=[1, 1, 1, 1]),
        h.make_node("Clip", ["y1", "lo", "hi"], ["a1"], name="clip1"),
        h.make_node("Pad", ["a1", "pads"], ["p1"], name="pad1"),
        h.make_node("Conv", ["p1", "w2", "b2"], ["y2"], name="dw", group=8),
        h.make_node("Conv", ["y2", "w3", "b3"], ["y3"], name="c3"),
    ]
    out = "y3"
    if relu_link:
        inits["w4"] = (r.normal(size=(4, 6, 1, 1)) * 0.5).astype(np.float32)
        nodes += [
            h.make_node("Relu", ["y3"], ["a3"], name="relu3"),
            h.make_node("Conv", ["a3", "w4"], ["y4"], name="c4"),  # no bias: one is added
        ]
        out = "y4"
    return make_model(nodes, [("x", [None, 3, 12, 12])], [(out, None)], inits)


def _data(n: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": rng(seed).normal(size=(n, 3, 12, 12)).astype(np.float32)}


def _equalized(model: onnx.ModelProto, data, **options) -> State:
    state = State(options=resolve(equalization="on", **options), source=model, data=data)
    Load().run(state)
    state.records = []
    state.equalization = {}
    Equalize().run(state)
    return state


def _close(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(a).max())))


def test_the_scales_balance_each_pair_of_ranges():
    r = rng(1)
    a = Layer(
        r.normal(size=(6, 4, 3, 3)) * np.arange(1, 7)[:, None, None, None], r.normal(size=6), 1
    )
    b = Layer(r.normal(size=(4, 3, 3, 3)), r.normal(size=4), 2)  # grouped: 2 groups of 3
    r1, r2 = output_ranges(a.weight), input_ranges(b.weight, 2)
    assert r2.shape == (6,)
    np.testing.assert_allclose(equalizing_scales(r1, r2), np.sqrt(r1 / r2))
    link = Link("a", "b", np.ones(6), np.zeros(6))
    equalize({"a": a, "b": b}, [link])
    np.testing.assert_allclose(output_ranges(a.weight), input_ranges(b.weight, 2), rtol=1e-9)
    np.testing.assert_allclose(output_ranges(a.weight), np.sqrt(r1 * r2), rtol=1e-9)


def test_the_floor_keeps_a_channel_from_outgrowing_the_activation():
    a = Layer(np.array([[1.0], [1e-6]]), np.array([0.5, 3.0]), 1)
    b = Layer(np.ones((1, 2)), np.zeros(1), 1)
    link = Link("a", "b", np.ones(2), np.array([1.0, 1.0]))
    equalize({"a": a, "b": b}, [link])
    assert np.all(link.scale >= 1.0 - 1e-12)
    assert abs(a.bias[1]) <= 3.0  # the near-constant channel was not divided by ~1e-3


def test_absorbing_a_constant_keeps_the_second_layer_output():
    r = rng(2)
    a = Layer(r.normal(size=(4, 2)), r.normal(size=4), 1)
    b = Layer(r.normal(size=(3, 4)), r.normal(size=3), 1)
    x = r.normal(size=(10, 2))
    before = (a.weight @ x.T + a.bias[:, None]).T @ b.weight.T + b.bias
    absorb(a, b, np.array([0.3, -1.0, 2.0, 0.0]))
    after = (a.weight @ x.T + a.bias[:, None]).T @ b.weight.T + b.bias
    np.testing.assert_allclose(before, after, rtol=1e-12, atol=1e-12)


def test_equalization_leaves_the_float_outputs_unchanged():
    model = _chain_model()
    calib = _data(32, 3)
    state = _equalized(model, calib)
    assert set(state.equalization) == {"c1 → dw", "dw → c3", "c3 → c4"}
    assert state.equalization["c1 → dw"]["through"] == "Clip → Pad"
    assert state.equalization["c3 → c4"]["absorbed_channels"] > 0
    eq = state.float_model
    assert "Clip" not in [n.op_type for n in eq.graph.node]  # Relu → Min, bound per channel
    for feed in (calib, _data(8, 4)):
        if feed is not calib:  # the Relu link's absorbed offsets hold on the calibration data
            state = _equalized(_chain_model(relu_link=False), calib)
            model, eq = _chain_model(relu_link=False), state.float_model
        assert _close(run(model, feed)[0], run(eq, feed)[0]) < 1e-5


def test_the_first_weight_ranges_become_even():
    state = _equalized(_chain_model(), _data(32, 3))
    first = state.equalization["c1 → dw"]
    assert first["spread_before"] > 5 * first["spread_after"]


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2)))


def _both(option: str, values: tuple[str, str], **common) -> tuple:
    """The chain model quantized per tensor twice (``option`` at each of ``values``): fp32's
    outputs on evaluation data, the data, and each (model, report)."""
    model = _chain_model(relu_link=False)
    calib, evaluation = _data(64, 5), _data(32, 6)
    runs = [
        onnxq.quantize(model, calib, per_channel=False, rounding="nearest", **{option: v}, **common)
        for v in values
    ]
    return run(model, evaluation)[0], evaluation, runs


def test_equalization_raises_the_accuracy_of_per_tensor_weights():
    ref, evaluation, [(off, _), (on, report)] = _both(
        "equalization", ("off", "on"), bias_correction="none"
    )
    gain = _sqnr(ref, run(on, evaluation)[0]) - _sqnr(ref, run(off, evaluation)[0])
    assert gain > 3.0, gain
    assert report.algorithms["equalization"].startswith("2 Conv pairs equalized")
    assert report.to_dict()["equalization"]["c1 → dw"]["spread_after"] < 2.5


def test_auto_equalizes_per_tensor_cnns_only():
    model, calib = _chain_model(relu_link=False), _data(16, 7)
    _, per_channel = onnxq.quantize(model, calib, rounding="nearest")
    assert per_channel.algorithms["equalization"].startswith("off (auto, per-channel weights)")
    _, per_tensor = onnxq.quantize(model, calib, rounding="nearest", per_channel=False)
    assert "Conv pairs equalized" in per_tensor.algorithms["equalization"]


def test_an_unknown_equalization_is_refused():
    with pytest.raises(ConfigError, match="equalization='sometimes' is unknown"):
        onnxq.quantize(_chain_model(), _data(4, 0), equalization="sometimes")


def test_calibration_sees_a_tensor_as_its_per_channel_min_reads_it():
    state = _equalized(_chain_model(relu_link=False), _data(16, 3))
    clamps = clamped_by_reader(state.float_model)
    op, bound = clamps["clip1_relu"]
    assert op == "Min" and bound.shape == (8, 1, 1)


def test_equalization_output_is_byte_identical_across_runs():
    model, calib = _chain_model(), _data(16, 8)
    a, _ = onnxq.quantize(model, calib, equalization="on", rounding="nearest")
    b, _ = onnxq.quantize(model, calib, equalization="on", rounding="nearest")
    assert a.SerializeToString() == b.SerializeToString()


def test_keep_float_in_a_config_is_exclude_for_equalization_too():
    from onnxq.annotate.config import UserConfig

    model, calib = _chain_model(), _data(16, 8)
    kw = dict(equalization="on", rounding="nearest", progress=False)
    excluded, rx = onnxq.quantize(model, calib, exclude=["dw"], **kw)
    config = UserConfig.from_dict({"node": {"dw": {"keep_float": True}}})
    configured, rc = onnxq.quantize(model, calib, config=config, **kw)
    assert not any("dw" in pair for pair in rx.equalization)  # neither side of a pair
    assert rc.equalization == rx.equalization
    assert configured.SerializeToString() == excluded.SerializeToString()


def test_the_openvino_form_of_an_equalized_model_runs_there():
    pytest.importorskip("openvino", reason="needs the OpenVINO runtime: pip install openvino")
    ref, evaluation, [(fq, _), (qdq, _)] = _both("format", ("openvino", "qdq"), equalization="on")
    got = openvino_compile(fq)(evaluation["x"])[0]
    assert "Min" in [n.op_type for n in fq.graph.node]
    assert abs(_sqnr(ref, got) - _sqnr(ref, run(qdq, evaluation)[0])) < 1.5
    assert _sqnr(ref, got) > 20


def test_a_range_table_of_an_equalized_model_is_refused_not_misapplied(tmp_path):
    model, calib = _chain_model(relu_link=False), _data(16, 9)
    table = tmp_path / "ranges.json"
    onnxq.quantize(model, calib, per_channel=False, save_ranges=table)  # auto: equalized
    with pytest.raises(ConfigError, match="as equalization rewrote it") as info:
        onnxq.quantize(model, None, per_channel=False, load_ranges=table)
    assert "equalization='off'" in str(info.value) or "--equalization off" in str(info.value)
    plain = tmp_path / "plain.json"
    onnxq.quantize(model, calib, per_channel=False, equalization="off", save_ranges=plain)
    b, _ = onnxq.quantize(model, None, per_channel=False, load_ranges=plain, rounding="nearest")
    assert _sqnr(run(model, _data(8, 1))[0], run(b, _data(8, 1))[0]) > 20


def test_a_clip_the_config_names_is_not_replaced_and_the_name_still_applies():
    """Equalizing a link replaces its Clip by Relu → Min; a Clip a [node] entry names stays."""
    from onnxq.annotate.config import UserConfig

    model, calib = _chain_model(relu_link=False), _data(16, 8)
    kw = dict(equalization="on", per_channel=False, rounding="nearest", progress=False)
    plain, rp = onnxq.quantize(model, calib, **kw)
    assert "c1 → dw" in rp.equalization
    asks = [{"config": UserConfig.from_dict({"node": {"clip1": entry}})} for entry in (
        {"keep_float": True}, {"method": "minmax"}
    )] + [{"exclude": ["clip1"]}]  # fmt: skip
    for ask in asks:
        q, report = onnxq.quantize(model, calib, **ask, **kw)
        assert "c1 → dw" not in report.equalization  # the link through it is left alone
        if "exclude" in ask or ask["config"].node["clip1"].get("keep_float"):
            assert "clip1" in {n.name for n in q.graph.node}
        x = _data(8, 9)
        want = run(model, x)[0]
        assert _close(want, run(q, x)[0]) < 0.1


def test_the_groups_a_tool_returns_to_float_are_named_as_in_the_callers_model():
    """onnxq debug and --max-drop write keep_float / --exclude for a group's nodes: a Relu or
    Min that equalization wrote for a Clip is named by that Clip, and the config applies."""
    from onnxq.annotate.config import UserConfig
    from onnxq.api import quantize_state
    from onnxq.simulate.emulate import emulate

    model, calib = _chain_model(relu_link=False), _data(16, 8)
    kw = dict(equalization="on", per_channel=False, rounding="nearest", progress=False)
    state = quantize_state(model, calib, **kw)
    assert state.derived == {"clip1_relu": "clip1", "clip1_min": "clip1"}
    names = {n.name for n in model.graph.node}
    groups = emulate(state).groups
    assert all(set(g.nodes) <= names for g in groups), [g.nodes for g in groups]
    first = next(g for g in groups if g.node == "c1")
    assert "clip1" in first.nodes
    config = UserConfig.from_dict({"node": {n: {"keep_float": True} for n in first.nodes}})
    q, report = onnxq.quantize(model, calib, config=config, **kw)
    kept = {d.node for d in report.decisions if not d.quantized}
    assert set(first.nodes) <= kept
    x = _data(8, 9)
    assert _close(run(model, x)[0], run(q, x)[0]) < 0.1


def test_a_batchnormalization_between_the_layers_does_not_hide_the_chain():
    # exporters that keep BatchNormalization write Conv → BatchNormalization → Relu → Conv;
    # preprocessing folds it later, so equalization folds it first and finds the chain
    r = rng(5)
    c = 8
    inits = {
        "w1": (r.normal(size=(c, 3, 3, 3)) * np.logspace(-1.5, 1, c)[:, None, None, None]),
        "b1": r.normal(size=c),
        "gamma": r.uniform(0.5, 2.0, c),
        "beta": r.normal(size=c),
        "mean": r.normal(size=c) * 0.1,
        "var": r.uniform(0.5, 2.0, c),
        "w2": r.normal(size=(4, c, 1, 1)),
    }
    inits = {k: v.astype(np.float32) for k, v in inits.items()}
    nodes = [
        h.make_node("Conv", ["x", "w1", "b1"], ["y1"], name="c1", pads=[1, 1, 1, 1]),
        h.make_node("BatchNormalization", ["y1", "gamma", "beta", "mean", "var"], ["n1"], "bn"),
        h.make_node("Relu", ["n1"], ["a1"], name="relu"),
        h.make_node("Conv", ["a1", "w2"], ["y2"], name="c2"),
    ]
    model = make_model(nodes, [("x", [None, 3, 12, 12])], [("y2", None)], inits)
    calib = _data(16, 6)
    state = _equalized(model, calib)
    assert set(state.equalization) == {"c1 → c2"}
    assert "BatchNormalization" not in [n.op_type for n in state.float_model.graph.node]
    assert _close(run(model, calib)[0], run(state.float_model, calib)[0]) < 1e-5
    assert model.graph.node[1].op_type == "BatchNormalization"  # the caller's model as it was
    q, report = onnxq.quantize(model, calib, equalization="on", per_channel=False, progress=False)
    assert report.algorithms["equalization"].startswith("1 Conv pairs equalized")
    assert list(report.equalization) == ["c1 → c2"]
