"""The pieces of ``onnxq debug``: the switchable emulation of a quantization, the sensitivity
ranking built on it (also the fallback's), and the cross-runtime check."""

import numpy as np
import onnx
import pytest
from helpers import make_model, rng, run
from onnx import helper as h
from onnx import numpy_helper
from test_fallback import _fragile_mlp

from onnxq.api import quantize_state
from onnxq.io.session import make_session
from onnxq.tools.crosscheck import PART_DB, cross_check
from onnxq.tools.emulate import FLAGS, emulate
from onnxq.tools.sensitivity import db, rank


def _sqnr(ref, got):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return db(float(np.sum((ref - got) ** 2) / np.sum(ref**2)))


def _digits():
    import os

    import onnxq.demo

    folder = os.path.dirname(onnxq.demo.__file__)
    model = onnx.load(f"{folder}/digits_cnn.onnx")
    data = np.load(f"{folder}/digits.npz")
    name = model.graph.input[0].name
    calib = {name: data["calib"][:128].astype(np.float32)}
    test = data["test"].astype(np.float32)
    return model, calib, [{name: test[i : i + 32]} for i in range(0, 128, 32)]


def _weight_outlier_mlp():
    """x → A → Relu → B → Relu → C with per-tensor weights; one weight of B is 400× the rest:
    B's grid is too coarse for its other weights. Activations are benign."""
    r = rng(5)
    wb = r.normal(0, 0.3, (32, 32))
    wb[3, 7] = 120.0
    inits = {
        "WA": r.normal(0, 0.3, (16, 32)), "BA": r.normal(0, 0.1, 32), "WB": wb,
        "BB": r.normal(0, 0.1, 32), "WC": r.normal(0, 0.3, (32, 8)), "BC": r.normal(0, 0.1, 8),
    }  # fmt: skip
    nodes = [
        h.make_node("Gemm", ["x", "WA", "BA"], ["a"], name="A"),
        h.make_node("Relu", ["a"], ["a1"], name="reluA"),
        h.make_node("Gemm", ["a1", "WB", "BB"], ["b"], name="B"),
        h.make_node("Relu", ["b"], ["b1"], name="reluB"),
        h.make_node("Gemm", ["b1", "WC", "BC"], ["y"], name="C"),
    ]
    inits = {k: v.astype(np.float32) for k, v in inits.items()}
    model = make_model(nodes, [("x", ["N", 16])], [("y", ["N", 8])], inits)
    x = r.normal(0, 1, (256, 16)).astype(np.float32)
    return model, {"x": x}


KW = dict(progress=False, batch_size=16, rounding="nearest")


def test_switches_off_is_the_float_model_and_on_is_the_quantized_one():
    model, calib, feeds = _digits()
    state = quantize_state(model, calib, progress=False)
    emu = emulate(state)
    session = make_session(emu.model)
    q = make_session(state.model)
    for feed in feeds:
        off = session.run(None, {**feed, FLAGS: emu.flags([])})[0]
        on = session.run(None, {**feed, FLAGS: emu.flags()})[0]
        ref = run(model, feed)[0]
        np.testing.assert_allclose(off, ref, rtol=1e-4, atol=1e-3)
        assert _sqnr(q.run(None, feed)[0], on) > 40  # the int8 model, but for rounding ties
        assert _sqnr(ref, on) < 60  # and the switches did quantize
    # every group owns its weight and its output; every switch has an owner
    assert all(g.weights and g.activations for g in emu.groups if g.op == "Conv")
    assert all(s.groups for s in emu.switches)
    # fixed(): the same model, its flags set by default
    fixed = emu.fixed()
    on = session.run(None, {**feeds[0], FLAGS: emu.flags()})[0]
    np.testing.assert_array_equal(run(fixed, feeds[0])[0], on)


def test_ranking_names_the_fragile_activation_first():
    model, data = _fragile_mlp()
    state = quantize_state(model, data, **KW)
    feeds = [{"x": data["x"][i : i + 16]} for i in range(0, 64, 16)]
    ranking = rank(emulate(state), feeds)
    first = ranking.groups[0]
    assert first.node == "A" and first.dominant == "activations"
    assert first.float_share > 0.9 and ranking.groups[1].score < 0.1
    assert ranking.samples == 64 and ranking.split == 3
    assert "A" in ranking.table()


def test_ranking_names_the_fragile_weight_first():
    model, data = _weight_outlier_mlp()
    state = quantize_state(model, data, per_channel=False, **KW)
    ranking = rank(emulate(state), [data])
    first = ranking.groups[0]
    assert first.node == "B" and first.dominant == "weights", ranking.table()
    assert first.weights > 5 * first.activations


def test_ranking_keeps_to_its_budget():
    model, calib, feeds = _digits()
    state = quantize_state(model, calib, progress=False)
    ranking = rank(emulate(state), feeds * 8, budget=0.0)
    assert ranking.samples == 32  # one batch left
    assert ranking.split == 1  # the split only for the best-ranked group
    assert any("budget" in n for n in ranking.notes)


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_cross_check_agrees_on_a_sound_onnxruntime_model(fmt):
    model, calib, feeds = _digits()
    state = quantize_state(model, calib, progress=False, format=fmt)
    check = cross_check(state.quantizer.float_model, emulate(state).fixed(), state.model, feeds)
    assert check.agrees and check.runtime == "onnxruntime", check.summary()
    assert len(check.layers) >= 3 and all(v >= PART_DB for _, _, v in check.layers)


def test_cross_check_finds_a_broken_fakequantize_conversion():
    pytest.importorskip("openvino", reason="pip install openvino")
    model, calib, feeds = _digits()
    state = quantize_state(model, calib, progress=False, format="openvino")
    reference = emulate(state).fixed()
    float_model = state.quantizer.float_model
    sound = cross_check(float_model, reference, state.model, feeds)
    assert sound.agrees and sound.runtime == "openvino", sound.summary()
    # a conversion that writes the wrong output range for relu2's output (r2): the dequantized
    # values come out 1.5× too large
    broken = onnx.ModelProto()
    broken.CopyFrom(state.model)
    fq = next(n for n in broken.graph.node if n.name == "r2/FakeQuantize")
    high = next(i for i in broken.graph.initializer if i.name == fq.input[4])
    broken.graph.initializer.append(
        numpy_helper.from_array(numpy_helper.to_array(high) * 1.5, "r2/output_high")
    )
    fq.input[4] = "r2/output_high"
    check = cross_check(float_model, reference, broken, feeds)
    assert not check.agrees
    node, tensor, value = check.first_part
    assert node == "relu2" and tensor == "r2" and value < PART_DB
    assert "relu2" in check.summary()
