"""Depthwise scaling: exact in float, folded upstream, a finer grid for every depthwise input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import make_model, rng, run
from onnx import helper as h
from onnx import numpy_helper

import onnxq
from onnxq.core.errors import ConfigError
from onnxq.options import resolve
from onnxq.passes.depthwise_scaling import DepthwiseScaling
from onnxq.passes.load import Load
from onnxq.passes.manager import State
from onnxq.solve.depthwise_scaling import MAX_SCALE, channel_scales, choose

C = 8
#: channel c of the depthwise input spans about SPANS[c]: three decades, as PP-LCNet's do
SPANS = np.logspace(1.5, -1.5, C)


def _model(producer: str = "affine", shared: bool = False) -> onnx.ModelProto:
    """Conv 1x1 → [producer] → depthwise Conv 3x3 → Conv 1x1.

    ``affine``: HardSwish → Mul(scalar) → Add(scalar), PP-LCNet's learnable affine block;
    ``batchnorm``: BatchNormalization; ``conv``: the 1x1 Conv itself (→ Relu); ``constant``:
    the affine block with its constants as Constant nodes. ``shared``: the Mul's scalar is also
    read by a Mul on the output path, which must keep it.
    """
    r = rng(11)
    w1 = r.normal(size=(C, 3, 1, 1)) * SPANS[:, None, None, None] / 2
    inits = {
        "w1": w1.astype(np.float32),
        "b1": (r.normal(size=C) * SPANS / 4).astype(np.float32),
        # the filters bring every channel back to one span: only the input is uneven
        "wd": (r.normal(size=(C, 1, 3, 3)) / SPANS[:, None, None, None]).astype(np.float32),
        "bd": r.normal(size=C).astype(np.float32),
        "w3": r.normal(size=(4, C, 1, 1)).astype(np.float32),
    }
    nodes = [h.make_node("Conv", ["x", "w1", "b1"], ["y1"], name="c1")]
    if producer in ("affine", "constant"):
        scale, shift = np.array(1.7, np.float32), np.array(0.2, np.float32)
        if producer == "constant":
            nodes += [
                h.make_node("Constant", [], ["a"], value=numpy_helper.from_array(scale, "a")),
                h.make_node("Constant", [], ["b"], value=numpy_helper.from_array(shift, "b")),
            ]
        else:
            inits["a"], inits["b"] = scale, shift
        nodes += [
            h.make_node("HardSwish", ["y1"], ["hs"], name="hs"),
            h.make_node("Mul", ["a", "hs"], ["m"], name="mul"),
            h.make_node("Add", ["m", "b"], ["dw_in"], name="add"),
        ]
    elif producer == "batchnorm":
        inits.update(
            gamma=(r.uniform(0.5, 1.5, C)).astype(np.float32),
            beta=r.normal(size=C).astype(np.float32),
            mean=r.normal(size=C).astype(np.float32),
            var=r.uniform(0.5, 2.0, C).astype(np.float32),
        )
        nodes.append(
            h.make_node(
                "BatchNormalization", ["y1", "gamma", "beta", "mean", "var"], ["dw_in"], name="bn"
            )
        )
    elif producer == "conv":
        nodes.append(h.make_node("Relu", ["y1"], ["dw_in"], name="relu"))
    nodes += [
        h.make_node("Conv", ["dw_in", "wd", "bd"], ["y2"], name="dw", group=C, pads=[1] * 4),
        h.make_node("Conv", ["y2", "w3"], ["y"], name="c3"),
    ]
    out = "y"
    if shared:
        nodes.append(h.make_node("Mul", ["y", "a"], ["y_scaled"], name="out_mul"))
        out = "y_scaled"
    return make_model(nodes, [("x", [None, 3, 10, 10])], [(out, None)], inits, opset=14)


def _data(n: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": rng(seed).normal(size=(n, 3, 10, 10)).astype(np.float32)}


def _scaled(model: onnx.ModelProto, **options) -> State:
    state = State(
        options=resolve(depthwise_scaling="on", **options), source=model, data=_data(32, 1)
    )
    Load().run(state)
    state.records = []
    state.depthwise_scaling = {}
    state.changed = DepthwiseScaling().run(state).changed  # type: ignore[attr-defined]
    return state


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2)))


def test_the_factors_fill_the_range_without_widening_it():
    lo, hi = np.array([0.0, 0.0, -1.0]), np.array([10.0, 0.5, 2.0])
    s = channel_scales(lo, hi, top=10.0, bottom=-1.0)
    np.testing.assert_allclose(s, [1.0, 20.0, 1.0])  # channel 2 already touches the bottom
    assert np.max(s * hi) <= 10.0 and np.min(s * lo) >= -1.0
    tiny = channel_scales(np.zeros(2), np.array([1.0, 1e-9]), top=1.0, bottom=0.0)
    assert tiny[1] == MAX_SCALE


def test_a_wider_negative_side_is_chosen_when_it_lowers_the_noise():
    # every small channel reaches the tensor's small negative side: only a wider one frees them
    lo = np.array([-0.1, -0.1, -0.1, -0.1])
    hi = np.array([100.0, 1.0, 1.0, 1.0])
    choice = choose(lo, hi, np.ones(4))
    assert choice.scales[1] > 10 and choice.gain_db > 3  # without the wider side: none at all
    assert choose(np.zeros(4), hi, np.ones(4)).gain_db > choice.gain_db
    assert choice.spread_after < choice.spread_before / 10


def test_balanced_channels_gain_nothing():
    choice = choose(-np.ones(4), np.ones(4), np.ones(4))
    np.testing.assert_allclose(choice.scales, 1.0)
    assert choice.gain_db == 0.0


@pytest.mark.parametrize("producer", ["affine", "batchnorm", "conv", "constant"])
def test_scaling_leaves_the_float_outputs_unchanged(producer):
    model = _model(producer)
    state = _scaled(model)
    entry = state.depthwise_scaling["dw"]
    assert entry["folded_into"], state.depthwise_scaling
    assert entry["spread_after"] < entry["spread_before"] / 5
    assert len(state.float_model.graph.node) == len(model.graph.node)  # nothing added
    feeds = _data(8, 2)
    ref, got = run(model, feeds)[0], run(state.float_model, feeds)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_a_constant_read_elsewhere_is_copied_not_changed():
    model = _model("affine", shared=True)
    state = _scaled(model)
    assert state.depthwise_scaling["dw"]["folded_into"] == "Mul 'mul'"
    inits = {i.name: numpy_helper.to_array(i) for i in state.float_model.graph.initializer}
    assert float(inits["a"]) == pytest.approx(1.7)  # the output Mul still reads the scalar
    mul = next(n for n in state.float_model.graph.node if n.name == "mul")
    assert inits[mul.input[0]].shape == (C, 1, 1)
    feeds = _data(4, 3)
    np.testing.assert_allclose(
        run(state.float_model, feeds)[0], run(model, feeds)[0], rtol=1e-5, atol=1e-4
    )


def test_scaling_raises_the_int8_accuracy_in_onnxruntime():
    model, calib, evaluation = _model("affine"), _data(64, 4), _data(32, 5)
    ref = run(model, evaluation)[0]
    common = dict(rounding="nearest", bias_correction="none")
    off, _ = onnxq.quantize(model, calib, depthwise_scaling="off", **common)
    on, report = onnxq.quantize(model, calib, depthwise_scaling="on", **common)
    gain = _sqnr(ref, run(on, evaluation)[0]) - _sqnr(ref, run(off, evaluation)[0])
    assert gain > 3.0, gain
    assert report.algorithms["depthwise-scaling"].startswith("1 of 1 depthwise inputs rescaled")
    assert report.to_dict()["depthwise_scaling"]["dw"]["gain_db"] > 3.0
    assert "QLinearConv" in [n.op_type for n in on.graph.node]


def test_without_held_back_batches_auto_is_off_and_the_same_bytes_as_off():
    model, calib = _model("affine"), _data(16, 6)  # 16 batches: too few to hold any back
    default, report = onnxq.quantize(model, calib, rounding="nearest")
    off, _ = onnxq.quantize(model, calib, rounding="nearest", depthwise_scaling="off")
    assert default.SerializeToString() == off.SerializeToString()
    assert report.algorithms["depthwise-scaling"].startswith("off (auto: the recipe is not")
    assert "depthwise_scaling" not in report.choice
    a, _ = onnxq.quantize(model, calib, rounding="nearest", depthwise_scaling="on")
    b, _ = onnxq.quantize(model, calib, rounding="nearest", depthwise_scaling="on")
    assert a.SerializeToString() == b.SerializeToString()


def test_an_excluded_depthwise_conv_and_per_tensor_weights_are_left_alone():
    state = _scaled(_model("affine"), exclude=["dw"])
    assert state.depthwise_scaling == {}
    assert "no depthwise input" in state.changed
    state = _scaled(_model("affine"), per_channel=False)
    assert state.depthwise_scaling == {} and "weights per tensor" in state.changed


def test_a_table_saved_after_scaling_is_refused_on_load(tmp_path):
    model, calib = _model("affine"), _data(16, 7)
    table = tmp_path / "ranges.json"
    onnxq.quantize(model, calib, depthwise_scaling="on", save_ranges=table, rounding="nearest")
    with pytest.raises(ConfigError, match="depthwise_scaling='off'"):
        onnxq.quantize(model, None, load_ranges=table)


def test_an_unknown_setting_is_refused():
    with pytest.raises(ConfigError, match="depthwise_scaling='always' is unknown"):
        onnxq.quantize(_model(), _data(4, 0), depthwise_scaling="always")


def test_auto_keeps_the_rescaled_model_where_the_held_back_batches_score_it_higher():
    model, calib, evaluation = _model("affine"), _data(64, 4), _data(32, 5)
    ref = run(model, evaluation)[0]
    auto, report = onnxq.quantize(model, calib, rounding="nearest")
    off, _ = onnxq.quantize(model, calib, rounding="nearest", depthwise_scaling="off")
    trial = report.choice["depthwise_scaling"]
    assert trial["kept"] and trial["rescaled_inputs"] == 1
    assert trial["vs_unscaled_db"] > trial["noise_db"] > 0
    assert report.algorithms["depthwise-scaling"].startswith("on (auto: 1 inputs rescaled")
    assert report.to_dict()["depthwise_scaling"]["dw"]["folded_into"]
    # the int8 model onnxruntime runs is the better one on samples nobody fitted on
    gain = _sqnr(ref, run(auto, evaluation)[0]) - _sqnr(ref, run(off, evaluation)[0])
    assert gain > 3.0, gain
    # the trial's own passes and data reads are listed as such
    assert any(r["pass"].endswith("(depthwise scaling trial)") for r in report.data_reads)
    again, _ = onnxq.quantize(model, calib, rounding="nearest")
    assert again.SerializeToString() == auto.SerializeToString()


def test_a_rescaled_model_that_scores_no_higher_leaves_no_trace(monkeypatch):
    import onnxq.passes.depthwise_scaling as trial_pass

    model, calib = _model("affine"), _data(64, 4)
    off, _ = onnxq.quantize(model, calib, rounding="nearest", depthwise_scaling="off")
    monkeypatch.setattr(trial_pass, "beats", lambda scored, kept: False)
    auto, report = onnxq.quantize(model, calib, rounding="nearest")
    assert auto.SerializeToString() == off.SerializeToString()
    assert not report.choice["depthwise_scaling"]["kept"]
    assert report.algorithms["depthwise-scaling"].startswith("off (auto: rescaling 1 inputs")
    assert report.to_dict()["depthwise_scaling"] == {}
    # measured already: no warning sends the user to try it
    assert not any("can be rescaled" in w for w in report.warnings)


def test_a_warning_that_blames_a_scalable_depthwise_conv_names_the_switch():
    model, calib = _model("affine"), _data(32, 8)
    _, off = onnxq.quantize(model, calib, rounding="nearest", depthwise_scaling="off")
    assert any("first jumps at node 'dw'" in w and "can be rescaled" in w for w in off.warnings)
    assert any("depthwise_scaling='on'" in w for w in off.warnings)  # Python spelling
    _, on = onnxq.quantize(model, calib, rounding="nearest", depthwise_scaling="on")
    assert not any("can be rescaled" in w for w in on.warnings)
    _, excluded = onnxq.quantize(model, calib, rounding="nearest", exclude=["dw"])
    assert not any("can be rescaled" in w for w in excluded.warnings)


def test_the_fallbacks_trials_follow_the_first_runs_decision(monkeypatch):
    import onnxq.fallback as fallback

    seen = []
    real = fallback.build

    def spy(options, *args, **kwargs):
        seen.append(options.depthwise_scaling)
        return real(options, *args, **kwargs)

    monkeypatch.setattr(fallback, "build", spy)
    # a bar no int8 model meets: the fallback tries groups in float after its first run
    onnxq.quantize(_model("affine"), _data(96, 4), rounding="nearest", max_drop=0.0)
    assert seen[0] == "auto" and len(seen) > 1
    assert set(seen[1:]) == {"on"}  # rescaled in the first run: every trial rescales too


def test_a_model_already_above_the_sqnr_floor_is_not_tried(monkeypatch):
    import onnxq.passes.depthwise_scaling as trial_pass

    monkeypatch.setattr(trial_pass, "SQNR_FLOOR_DB", -1000.0)  # every model is above it
    model, calib = _model("affine"), _data(64, 4)
    auto, report = onnxq.quantize(model, calib, rounding="nearest")
    off, _ = onnxq.quantize(model, calib, rounding="nearest", depthwise_scaling="off")
    assert auto.SerializeToString() == off.SerializeToString()
    assert report.algorithms["depthwise-scaling"].endswith("above the -1000 dB floor: not tried)")
    assert "depthwise_scaling" not in report.choice
    assert not any("depthwise scaling trial" in r["pass"] for r in report.data_reads)
