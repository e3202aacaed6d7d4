"""Weight bits ``auto``: 7-bit only where this machine's runtime clips U8S8 products."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_model, rng, run
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxq
from onnxq.io import hostcheck


def _conv():
    g = rng(3)
    model = make_model(
        [h.make_node("Conv", ["x", "W"], ["y"], name="conv")],
        [("x", ["N", 16, 6, 6])],
        [("y", None)],
        {"W": g.normal(0, 0.3, (8, 16, 3, 3)).astype(np.float32)},
    )
    # all-positive inputs push the uint8 activations towards 255: the worst case for clipping
    return model, {"x": g.uniform(0, 4, (8, 16, 6, 6)).astype(np.float32)}


@pytest.fixture
def clipping(monkeypatch):
    def force(value):
        monkeypatch.setattr(hostcheck, "u8s8_saturates", lambda: value)
        monkeypatch.setattr(hostcheck, "openvino_saturates", lambda: value)

    return force


def _weights(model):
    return [
        np.abs(nh.to_array(i).astype(int)).max()
        for i in model.graph.initializer
        if i.data_type == 3  # int8
    ]


@pytest.mark.parametrize("clips", [True, False])
def test_auto_weight_bits_follow_the_runtime(clipping, clips):
    clipping(clips)
    model, data = _conv()
    q, report = onnxq.quantize(model, data, progress=False)
    assert max(_weights(q)) == (63 if clips else 127)
    assert any("7-bit" in n for n in report.notes) == clips
    assert ("note: weights are 7-bit" in report.summary()) == clips
    # the TensorRT target runs elsewhere: its weights stay 8-bit and nothing is said
    trt, rep = onnxq.quantize(model, data, target="tensorrt", progress=False)
    assert max(_weights(trt)) == 127 and not rep.notes and not rep.warnings


def test_explicit_8_bit_weights_are_kept_with_a_warning_where_they_clip(clipping):
    clipping(True)
    model, data = _conv()
    q, report = onnxq.quantize(model, data, weight_bits=8, progress=False)
    assert max(_weights(q)) == 127
    assert any("session.x64quantprecision=1" in w for w in report.warnings)
    clipping(False)
    _, report = onnxq.quantize(model, data, weight_bits=8, progress=False)
    assert not report.warnings


def test_probe_matches_what_the_runtime_computes():
    # the probe's verdict must predict the error of a real 8-bit model in the default session
    model, data = _conv()
    q8, _ = onnxq.quantize(model, data, weight_bits=8, progress=False)
    x = {"x": data["x"][:2]}
    ref = run(model, x)[0]
    default, exact = run(q8, x)[0], run(q8, x, exact=True)[0]
    clipped = np.abs(default - exact).max() > 0.05 * np.abs(ref).max()
    assert clipped == hostcheck.u8s8_saturates()
    # and the automatic choice is accurate in the default session on this machine
    qa, _ = onnxq.quantize(model, data, progress=False)
    assert np.abs(run(qa, x)[0] - ref).max() < 0.05 * np.abs(ref).max()


def test_a_model_the_exact_path_cannot_load_is_loaded_without_its_error_shown(monkeypatch, capfd):
    # two layers sharing one int8 weight, QDQ with the TensorRT target's dedicated pairs: on a
    # CPU without VNNI onnxruntime's exact U8S8 path fails to build it ("Attempt to replace
    # the existing tensor"); the default path loads it, and nothing of the first try is shown
    from onnxq.io import session

    monkeypatch.setattr(session, "u8s8_saturates", lambda: True)
    g = rng(0)
    w = g.normal(0, 0.3, (16, 16)).astype(np.float32)
    nodes = [
        h.make_node("MatMul", ["x", "W"], ["a"], "mm1"),
        h.make_node("Tanh", ["a"], ["b"], "t1"),
        h.make_node("MatMul", ["b", "W"], ["c"], "mm2"),
        h.make_node("Tanh", ["c"], ["y"], "t2"),
    ]
    model = make_model(nodes, [("x", ["N", 16])], [("y", ["N", 16])], {"W": w})
    data = {"x": g.normal(0, 1, (64, 16)).astype(np.float32)}
    q, _ = onnxq.quantize(model, data, target="tensorrt", progress=False)
    capfd.readouterr()
    sess = session.make_session(q, exact=True)
    assert sess.run(None, data)[0].shape == (64, 16)
    assert "onnxruntime" not in capfd.readouterr().err
