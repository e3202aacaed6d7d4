"""QDQ export: standard ONNX only, and it agrees with the QOperator model in onnxruntime."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import (
    DIGITS_CNN,
    make_model,
    needs_debian,
    ops,
    rng,
    run,
    trained_model,
    zoo_datasets,
)
from onnx import helper as h
from test_patterns import ACT_CASES, BINARY_CASES, CONV_CASES, DENSE_CASES, POOL_CASES, weights

import onnxq
from onnxq.cli import main
from onnxq.core.errors import ConfigError
from onnxq.io.openvino import openvino_compile

R = rng(5)
ds = zoo_datasets()


def both(model, data, **kw):
    qop, rep = onnxq.quantize(model, data, progress=False, **kw)
    qdq, _ = onnxq.quantize(model, data, progress=False, format="qdq", **kw)
    onnx.checker.check_model(qdq)
    assert {o.domain for o in qdq.opset_import} <= {"", "ai.onnx"}
    assert not {n.op_type for n in qdq.graph.node} & {"QLinearConv", "QGemm", "QLinearAdd"}
    return qop, qdq, rep


def agree(qop, qdq, feeds, scale):
    a, b = run(qop, feeds)[0], run(qdq, feeds)[0]
    assert np.abs(a - b).max() <= float(np.max(scale)) * 1.001 + 1e-7


def model_of(nodes, inits, shape):
    return make_model(nodes, [("x", ["N", *shape[1:]])], [("y", None)], inits)


CASES = {
    **{f"conv:{k}": (*v[:2], [1, 3, 8, 8]) for k, v in CONV_CASES.items()},
    **{f"dense:{k}": (*v[:2], [1, 16]) for k, v in DENSE_CASES.items()},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("per_channel", [True, False])
def test_qdq_matches_qoperator(case, per_channel):
    nodes, inits, shape = CASES[case]
    model = model_of(nodes, inits, shape)
    data = {"x": R.normal(0, 1, (8, *shape[1:])).astype(np.float32)}
    qop, qdq, rep = both(model, data, per_channel=per_channel)
    assert "QuantizeLinear" in ops(qdq) and "DequantizeLinear" in ops(qdq)
    agree(qop, qdq, {"x": data["x"][:2]}, rep.values["y_scale"])


@pytest.mark.parametrize("case", [*BINARY_CASES, *POOL_CASES, *ACT_CASES])
def test_qdq_activation_ops(case):
    if case in BINARY_CASES:
        op, _, relu = BINARY_CASES[case]
        mid = [h.make_node(op, ["a", "b"], ["s" if relu else "t"], name="bin")]
        if relu:
            mid.append(h.make_node("Relu", ["s"], ["t"], name="relu"))
    elif case in ACT_CASES:
        act = ACT_CASES[case][0]
        mid = [
            h.make_node("Add", ["a", "b"], ["ab"], name="add"),
            h.make_node(
                act.op_type,
                ["ab"],
                ["t"],
                name="act",
                **{a.name: h.get_attribute_value(a) for a in act.attribute},
            ),
        ]
    else:
        pool = POOL_CASES[case][0]
        mid = [
            h.make_node("Relu", ["a"], ["ra"], name="ra"),
            h.make_node(
                pool.op_type,
                ["ra"],
                ["t"],
                name="pool",
                **{a.name: h.get_attribute_value(a) for a in pool.attribute},
            ),
        ]
    nodes = [
        h.make_node("Conv", ["x", "W1"], ["a"], pads=[1, 1, 1, 1], name="c1"),
        h.make_node("Conv", ["x", "W2"], ["b"], pads=[1, 1, 1, 1], name="c2"),
        *mid,
        h.make_node("Conv", ["t", "W3"], ["y"], name="c3"),
    ]
    inits = {"W1": weights(4, 3, 3, 3), "W2": weights(4, 3, 3, 3), "W3": weights(2, 4, 1, 1)}
    model = model_of(nodes, inits, [1, 3, 8, 8])
    data = {"x": R.normal(0, 1, (8, 3, 8, 8)).astype(np.float32)}
    qop, qdq, rep = both(model, data)
    agree(qop, qdq, {"x": data["x"][:2]}, rep.values["y_scale"])


def test_qdq_raises_opset_for_per_channel_and_keeps_low_opset_per_tensor():
    # its own generator: the shared one's state depends on which tests ran before
    r = rng(17)
    nodes = [h.make_node("Conv", ["x", "W", "B"], ["y"], name="conv")]
    model = make_model(
        nodes,
        [("x", ["N", 3, 8, 8])],
        [("y", None)],
        {
            "W": r.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
            "B": r.normal(0, 0.3, 4).astype(np.float32),
        },
        opset=11,
    )
    data = {"x": r.normal(0, 1, (4, 3, 8, 8)).astype(np.float32)}
    pc, _ = onnxq.quantize(model, data, format="qdq", progress=False)
    pt, _ = onnxq.quantize(model, data, format="qdq", per_channel=False, progress=False)
    opset = {o.domain: o.version for o in pc.opset_import}[""]
    assert opset >= 13
    assert {o.domain: o.version for o in pt.opset_import}[""] == 11
    axes = [a.i for n in pc.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute]
    assert axes and set(axes) == {0}
    # both within a few output steps of the float model (per-tensor weights are coarser)
    feeds = {"x": data["x"][:1]}
    ref = run(model, feeds)[0]
    for q in (pc, pt):
        np.testing.assert_allclose(run(q, feeds)[0], ref, atol=0.05 * float(np.ptp(ref)))


def _step_of(table: Path, tensor: str) -> float:
    """The uint8 step of ``tensor``'s range in a saved range table (the range covers 0)."""
    lo, hi = json.loads(Path(table).read_text())["tensors"][tensor]
    return (max(hi, 0.0) - min(lo, 0.0)) / 255


def test_cli_format_qdq_on_zoo_model(tmp_path):
    x = R.uniform(0, 1, (16, 1, 28, 28)).astype(np.float32)
    np.savez(tmp_path / "c.npz", input=x)
    for fmt in ("qoperator", "qdq"):
        assert (
            main(
                [
                    "quantize",
                    str(DIGITS_CNN),
                    "-o",
                    str(tmp_path / f"{fmt}.onnx"),
                    "--data",
                    str(tmp_path / "c.npz"),
                    "--format",
                    fmt,
                    "--quiet",
                    "--save-ranges",
                    str(tmp_path / f"{fmt}.json"),
                ]
            )
            == 0
        )
    a = run(tmp_path / "qoperator.onnx", {"input": x[:4]})[0]
    b = run(tmp_path / "qdq.onnx", {"input": x[:4]})[0]
    # the logits are written in float (onnxq.post.float_outputs), so no output scale is left
    # in the model: the step the calibrated range would have had is the unit
    scale = _step_of(tmp_path / "qdq.json", "logits")
    assert np.abs(a - b).max() <= float(scale) + 1e-6


# OpenVINO FakeQuantize ---------------------------------------------------------------------

try:
    import openvino as ov
except ImportError:  # only the tests that run the OpenVINO runtime skip
    ov = None
needs_openvino = pytest.mark.skipif(
    ov is None, reason="needs the OpenVINO runtime: pip install openvino"
)


def run_ov(model, x):
    return openvino_compile(model)(x)[0]


def test_fq_bounds_follow_the_formula():
    from onnxq.lower.fakequantize import fq_bounds

    low, high, levels = fq_bounds(np.float32(0.1), np.uint8(0), "uint8")
    assert levels == 256 and low == 0 and np.isclose(high, 25.5)
    low, high, levels = fq_bounds(np.float32(0.5), np.uint8(128), "uint8")
    assert np.isclose(low, -64.0) and np.isclose(high, 63.5)
    low, high, levels = fq_bounds(
        np.array([0.1, 0.2], np.float32), np.zeros(2, np.int8), "int8", -64, 63
    )
    assert levels == 128 and np.allclose(low, [-6.4, -12.8]) and np.allclose(high, [6.3, 12.6])


def zoo_data(name):
    if name == "fashion_cnn":
        needs_debian("dataset-fashion-mnist")
        xtr, _, xte, _ = ds.fashion()
        return xtr[:200], xte[:500]
    xtr, _, xte, _ = ds.digits()
    if name == "digits_mlp":
        return ds.nhwc(xtr[:200]), ds.nhwc(xte)
    return xtr[:200], xte


@needs_openvino
@pytest.mark.parametrize(
    "name", ["digits_cnn", "digits_mlp", pytest.param("fashion_cnn", marks=pytest.mark.slow)]
)
def test_three_formats_agree_within_one_step(name):
    calib, xte = zoo_data(name)
    path = str(trained_model(name))
    fp32 = onnx.load(path)
    inp = fp32.graph.input[0].name
    models = {
        # 7-bit weights: exact in onnxruntime and OpenVINO on any CPU (see onnxq.io.hostcheck)
        f: onnxq.quantize(path, {inp: calib}, format=f, weight_bits=7, progress=False)[0]
        for f in ("qoperator", "qdq", "openvino")
    }
    fq = models["openvino"]
    assert {n.domain for n in fq.graph.node} <= {"", "org.openvinotoolkit"}
    assert "FakeQuantize" in ops(fq)
    last = fp32.graph.output[0].name
    table = Path(tempfile.mkdtemp()) / "ranges.json"
    onnxq.quantize(path, {inp: calib}, weight_bits=7, progress=False, save_ranges=table)
    # the unit: the step of the last layer's calibrated range (it writes float, so the model
    # keeps no output scale); the MLP's Softmax stays float and moves less than its input's step
    ranges = json.loads(table.read_text())["tensors"]
    scale = _step_of(table, last if last in ranges else "logits")
    outputs = {}
    for f, model in models.items():
        m = onnx.ModelProto()
        m.CopyFrom(model)
        outputs[f] = run_ov(m, xte) if f == "openvino" else run(m, {inp: xte})[0]
    step = float(scale) * 1.001 + 1e-6
    assert np.abs(outputs["qoperator"] - outputs["qdq"]).max() <= step
    # OpenVINO rounds in its own kernels: intermediate ties can move a few outputs by 2 steps
    diff = np.abs(outputs["qoperator"] - outputs["openvino"])
    assert (diff <= step).mean() >= 0.999 and diff.max() <= 2 * step


@needs_openvino
def test_weight_bits_7(tmp_path):
    xtr, _, xte, yte = ds.digits()
    path = str(DIGITS_CNN)
    q, _ = onnxq.quantize(path, {"input": xtr[:100]}, weight_bits=7, progress=False)
    ints = [onnx.numpy_helper.to_array(i) for i in q.graph.initializer if i.data_type == 3]
    assert ints and all(np.abs(w.astype(int)).max() <= 63 for w in ints)
    assert (run(q, {"input": xte})[0].argmax(1) == yte).mean() >= 0.97
    fq, _ = onnxq.quantize(
        path, {"input": xtr[:100]}, weight_bits=7, format="openvino", progress=False
    )
    levels = {a.i for n in fq.graph.node if n.op_type == "FakeQuantize" for a in n.attribute}
    assert levels == {128, 256}
    assert (run_ov(fq, xte).argmax(1) == yte).mean() >= 0.97
    with pytest.raises(SystemExit):
        main(
            [
                "quantize",
                path,
                "-o",
                str(tmp_path / "q.onnx"),
                "--data",
                "x.npz",
                "--weight-bits",
                "9",
            ]
        )


def test_qdq_concat():
    from test_patterns import _concat_model

    model = _concat_model(extra_reader=True)
    data = {"x": R.normal(0, 1, (8, 3, 8, 8)).astype(np.float32)}
    qop, qdq, rep = both(model, data)
    assert "Concat" in ops(qdq)
    agree(qop, qdq, {"x": data["x"][:2]}, rep.values["y_scale"])


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_symmetric_int8_activations(fmt, tmp_path):
    xtr, _, xte, yte = ds.digits()
    path = str(DIGITS_CNN)
    q, _ = onnxq.quantize(
        path,
        {"input": xtr[:100]},
        activation_dtype="int8",
        symmetric_activations=True,
        format=fmt,
        progress=False,
    )
    zps = [
        onnx.numpy_helper.to_array(i) for i in q.graph.initializer if i.name.endswith("zero_point")
    ]
    assert zps and all(not np.any(z) for z in zps)
    assert {z.dtype for z in zps} <= {np.dtype(np.int8), np.dtype(np.int32)}
    fp = (run(path, {"input": xte})[0].argmax(1) == yte).mean()
    assert (run(q, {"input": xte})[0].argmax(1) == yte).mean() >= fp - 0.005
    np.savez(tmp_path / "c.npz", input=xtr[:50])
    out = tmp_path / "s.onnx"
    assert (
        main(
            [
                "quantize",
                path,
                "-o",
                str(out),
                "--data",
                str(tmp_path / "c.npz"),
                "--activation-dtype",
                "int8",
                "--symmetric-activations",
                "--format",
                fmt,
                "--quiet",
            ]
        )
        == 0
    )
    assert all(
        not np.any(onnx.numpy_helper.to_array(i))
        for i in onnx.load(str(out)).graph.initializer
        if i.name.endswith("zero_point")
    )


def test_int16_activations_a16w8_qdq():
    xtr, _, xte, yte = ds.digits()
    path = str(DIGITS_CNN)
    q, _ = onnxq.quantize(
        path, {"input": xtr[:100]}, activation_dtype="int16", format="qdq", progress=False
    )
    assert {o.domain: o.version for o in q.opset_import}[""] >= 21
    acts = [
        onnx.numpy_helper.to_array(i)
        for i in q.graph.initializer
        if i.name.endswith("zero_point") and onnx.numpy_helper.to_array(i).ndim == 0
    ]
    assert acts and {a.dtype for a in acts} >= {np.dtype(np.int16)}
    ref = run(path, {"input": xte})[0]
    out = run(q, {"input": xte})[0]
    q8, _ = onnxq.quantize(path, {"input": xtr[:100]}, format="qdq", progress=False)
    err16 = np.abs(out - ref).mean()
    err8 = np.abs(run(q8, {"input": xte})[0] - ref).mean()
    assert err16 <= err8
    with pytest.raises(ConfigError, match="int16 activations"):
        onnxq.quantize(path, {"input": xtr[:10]}, activation_dtype="int16", progress=False)


def _relu_outputs(path):
    """Tensors produced by a Relu in the model at ``path`` (the unsigned-after-relu ones)."""
    return {n.output[0] for n in onnx.load(path).graph.node if n.op_type == "Relu"}


@needs_openvino
@pytest.mark.parametrize("fmt", ["qdq", "openvino"])
def test_unsigned_after_relu(fmt):
    xtr, _, xte, yte = ds.digits()
    path = str(DIGITS_CNN)
    relu_outputs = _relu_outputs(path)
    kw = dict(activation_dtype="int8", symmetric_activations=True, format=fmt, progress=False)
    kw["rounding"] = "nearest"  # the comparison is of grids: the same rounding on both sides
    q, rep = onnxq.quantize(path, {"input": xtr[:100]}, unsigned_after_relu=True, **kw)
    plain, plain_rep = onnxq.quantize(path, {"input": xtr[:100]}, **kw)
    zps = {
        k[: -len("_zero_point")]: np.asarray(v)
        for k, v in rep.values.items()
        if k.endswith("_zero_point")
    }
    after = {t: z for t, z in zps.items() if t in relu_outputs}
    before = {
        t: z
        for t, z in zps.items()
        if t not in relu_outputs and z.ndim == 0 and not t.endswith("weight")
    }
    assert after and all(z == 0 for z in after.values())
    assert before and all(z == 0 for z in before.values())
    if fmt == "qdq":
        dtypes = {i.name: onnx.numpy_helper.to_array(i).dtype for i in q.graph.initializer}
        assert all(dtypes[f"{t}_zero_point"] == np.uint8 for t in after)
        assert dtypes["input_zero_point"] == np.int8
        outs, ref = run(q, {"input": xte})[0], run(path, {"input": xte})[0]
        plain_outs = run(plain, {"input": xte})[0]
    else:
        outs, ref, plain_outs = run_ov(q, xte), run(path, {"input": xte})[0], run_ov(plain, xte)
    # unsigned Relu outputs get twice the resolution. At the logits that is now within noise
    # of plain symmetric int8 (0.1213 against 0.1211 mean error with 7-bit weights; 0.0783
    # against 0.0762 with the 8-bit weights of a VNNI CPU), whose range the Relu's saturation
    # bound already cut to [-max, max]: assert the grids, and no loss beyond that noise
    for t in after:
        assert rep.values[f"{t}_scale"] < 0.6 * plain_rep.values[f"{t}_scale"]
    assert np.abs(outs - ref).mean() < 1.05 * np.abs(plain_outs - ref).mean()
    assert (outs.argmax(1) == yte).mean() >= (ref.argmax(1) == yte).mean() - 0.005
    scales = {
        k: float(v) for k, v in rep.values.items() if k.endswith("_scale") and k[:-6] in after
    }
    plain_scales = {k: float(v) for k, v in plain_rep.values.items() if k in scales}
    assert all(scales[k] < 0.6 * plain_scales[k] for k in scales)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(activation_dtype="int8", symmetric_activations=True), "use format='qdq'"),
        (
            dict(format="qdq"),
            "unsigned_after_relu applies to symmetric int8 activations: add "
            "activation_dtype='int8' symmetric_activations=True",
        ),
    ],
)
def test_unsigned_after_relu_refused_where_it_cannot_work(kw, message):
    with pytest.raises(ConfigError, match=message):
        onnxq.quantize(
            str(DIGITS_CNN),
            {"input": np.zeros((1, 1, 28, 28), np.float32)},
            unsigned_after_relu=True,
            progress=False,
            **kw,
        )


def test_option_errors_name_cli_flags_from_the_cli(tmp_path, capsys):
    """The same refusal names Python parameters from Python (above) and flags from the CLI."""
    calib = tmp_path / "c.npz"
    np.savez(calib, input=np.zeros((2, 1, 28, 28), np.float32))
    argv = ["quantize", str(DIGITS_CNN), "-o", str(tmp_path / "q.onnx")]
    argv += ["--data", str(calib), "--unsigned-after-relu", "--activation-dtype", "int8"]
    assert main([*argv, "--symmetric-activations"]) == 2
    err = capsys.readouterr().err
    assert "--unsigned-after-relu mixes uint8 and int8" in err and "use --format qdq" in err
    assert main(argv) == 2
    assert "add --activation-dtype int8 --symmetric-activations" in capsys.readouterr().err
    assert not (tmp_path / "q.onnx").exists()


def test_deep_errors_name_python_parameters_from_python(tmp_path, capsys):
    """An error raised deep in calibration names ``bins=`` from Python, ``--bins`` from the CLI."""
    data = {"input": np.zeros((2, 1, 28, 28), np.float32)}
    with pytest.raises(ConfigError, match=r"^bins=63 must be an even number"):
        onnxq.quantize(str(DIGITS_CNN), data, method="entropy", bins=63, progress=False)
    calib = tmp_path / "c.npz"
    np.savez(calib, **data)
    argv = ["quantize", str(DIGITS_CNN), "-o", str(tmp_path / "q.onnx"), "--data", str(calib)]
    assert main([*argv, "--method", "entropy", "--bins", "63"]) == 2
    assert "--bins 63 must be an even number" in capsys.readouterr().err
