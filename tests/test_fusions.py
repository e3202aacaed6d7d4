"""GELU written out in float ops becomes one com.microsoft.Gelu node in QOperator output."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from helpers import make_model, run

import onnxq
from onnxq.prepare.fusions import fuse_gelu

H = onnx.helper


def _gelu_model(form: str, escape: bool = False):
    """conv1 → GELU (written out in ``form``) → conv2."""
    g = np.random.default_rng(5)
    scale = (
        [H.make_node("Div", ["c", "sqrt2"], ["d"], name="div")]
        if form != "mul-inv-sqrt2"
        else [H.make_node("Mul", ["c", "inv_sqrt2"], ["d"], name="div")]
    )
    head = [
        H.make_node("Conv", ["x", "W1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        *scale,
        H.make_node("Erf", ["d"], ["e"], name="erf"),
        H.make_node("Add", ["one", "e"], ["a"], name="add"),  # commuted on purpose
    ]
    if form == "x-half":
        tail = [
            H.make_node("Mul", ["c", "half"], ["xh"], name="mul1"),
            H.make_node("Mul", ["xh", "a"], ["gelu"], name="mul2"),
        ]
    elif form == "half-last-factor":
        tail = [
            H.make_node("Mul", ["a", "half"], ["ah"], name="mul1"),
            H.make_node("Mul", ["c", "ah"], ["gelu"], name="mul2"),
        ]
    else:  # paddle2onnx and PyTorch: (x · (1 + erf)) · 0.5
        tail = [
            H.make_node("Mul", ["c", "a"], ["xa"], name="mul1"),
            H.make_node("Mul", ["xa", "half"], ["gelu"], name="mul2"),
        ]
    nodes = [*head, *tail, H.make_node("Conv", ["gelu", "W2"], ["y"], name="conv2")]
    inits = {
        "W1": g.normal(0, 0.4, (8, 3, 3, 3)).astype(np.float32),
        "W2": g.normal(0, 0.4, (4, 8, 1, 1)).astype(np.float32),
        "sqrt2": np.array(math.sqrt(2), np.float32),
        "inv_sqrt2": np.array(1 / math.sqrt(2), np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
    }
    outputs = [("y", None)] + ([("e", None)] if escape else [])
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], outputs, inits)
    return model, {"x": g.normal(0, 1, (16, 3, 8, 8)).astype(np.float32)}


@pytest.mark.parametrize("form", ["x-then-half", "x-half", "half-last-factor", "mul-inv-sqrt2"])
def test_gelu_becomes_one_node_in_qoperator_output(form, monkeypatch):
    import onnx_graphsurgeon as gs

    imports: list[int] = []
    real = gs.import_onnx
    monkeypatch.setattr(gs, "import_onnx", lambda *a, **k: imports.append(1) or real(*a, **k))
    model, data = _gelu_model(form)
    q, report = onnxq.quantize(model, data, progress=False)
    assert len(imports) == 1  # fused on the pipeline's graph, not a model imported again
    kinds = [(n.op_type, n.domain) for n in q.graph.node]
    assert ("Gelu", "com.microsoft") in kinds and not {"Erf", "Div", "Mul"} & {k for k, _ in kinds}
    erf = next(d for d in report.decisions if d.node == "erf")
    assert not erf.quantized and erf.pattern == "gelu" and "com.microsoft.Gelu" in erf.reason
    x = {"x": data["x"][:4]}
    ref, got = run(model, x)[0], run(q, x)[0]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    # QDQ output keeps the written-out ops (its runtimes fuse them themselves)
    unfused = onnxq.quantize(model, data, format="qdq", progress=False)[0]
    assert "Erf" in [n.op_type for n in unfused.graph.node]


def test_gelu_whose_interior_escapes_is_left_alone():
    model, _ = _gelu_model("x-then-half", escape=True)
    fused, groups = fuse_gelu(model)
    assert groups == [] and fused is model


def test_other_constants_are_not_gelu():
    model, _ = _gelu_model("x-then-half")
    for init in model.graph.initializer:
        if init.name == "half":
            init.CopyFrom(onnx.numpy_helper.from_array(np.array(0.25, np.float32), "half"))
    assert fuse_gelu(model)[1] == []


def _hardswish_model(form: str, opset: int = 12):
    """conv1 → HardSwish written out (paddle2onnx's x · Clip(x + 3, 0, 6) / 6 and relatives)."""
    g = np.random.default_rng(9)
    relu6 = [
        H.make_node("Add", ["c", "three"], ["c3"], name="add3"),
        H.make_node("Clip", ["c3", "zero", "six"], ["r6"], name="clip"),
    ]
    tail = {
        "div": [
            H.make_node("Mul", ["c", "r6"], ["m"], name="mul"),
            H.make_node("Div", ["m", "six_b"], ["hs"], name="div"),
        ],
        "mul-sixth": [
            H.make_node("Mul", ["c", "r6"], ["m"], name="mul"),
            H.make_node("Mul", ["m", "sixth"], ["hs"], name="div"),
        ],
        "gate": [
            H.make_node("Div", ["r6", "six_b"], ["gate"], name="div"),
            H.make_node("Mul", ["gate", "c"], ["hs"], name="mul"),
        ],
    }[form]
    nodes = [
        H.make_node("Conv", ["x", "W1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        *relu6,
        *tail,
        H.make_node("Conv", ["hs", "W2"], ["y"], name="conv2"),
    ]
    inits = {
        "W1": g.normal(0, 0.8, (8, 3, 3, 3)).astype(np.float32),
        "W2": g.normal(0, 0.4, (4, 8, 1, 1)).astype(np.float32),
        "three": np.array([3.0], np.float32),
        "zero": np.array(0.0, np.float32),
        "six": np.array(6.0, np.float32),
        "six_b": np.array([6.0], np.float32),
        "sixth": np.array(1 / 6, np.float32),
    }
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits, opset=opset)
    return model, {"x": g.normal(0, 1, (16, 3, 8, 8)).astype(np.float32)}


@pytest.mark.parametrize("form", ["div", "mul-sixth", "gate"])
def test_written_out_hardswish_becomes_the_op(form):
    from onnxq.prepare.fusions import fuse_hardswish
    from onnxq.prepare.opset import default_opset

    model, data = _hardswish_model(form)
    fused, groups = fuse_hardswish(model)
    assert len(groups) == 1 and default_opset(fused) == 14  # raised from 12 for HardSwish
    assert [n.op_type for n in fused.graph.node] == ["Conv", "HardSwish", "Conv"]
    x = {"x": data["x"][:4]}
    assert np.allclose(run(fused, x)[0], run(model, x)[0], atol=1e-5)
    # QDQ output quantizes the Conv → HardSwish group as one island
    q, report = onnxq.quantize(model, data, format="qdq", progress=False)
    hs = next(d for d in report.decisions if d.op == "HardSwish")
    assert hs.quantized and hs.pattern == "conv+hard-activation"
    ref, got = run(model, x)[0], run(q, x)[0]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_hardswish_with_other_constants_is_left_alone():
    from onnxq.prepare.fusions import fuse_hardswish

    model, _ = _hardswish_model("div")
    for init in model.graph.initializer:
        if init.name == "three":
            init.CopyFrom(onnx.numpy_helper.from_array(np.array([2.0], np.float32), "three"))
    fused, groups = fuse_hardswish(model)
    assert groups == [] and fused is model
