"""Targets as data: each built-in target's conventions hold in its output; users add targets."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN, ops, run, zoo_datasets

import onnxq
from onnxq.annotate.targets import Target, get_target, register_target
from onnxq.cli import main
from onnxq.core.errors import ConfigError
from onnxq.io.openvino import openvino_compile

ds = zoo_datasets()
CNN = str(DIGITS_CNN)


@pytest.fixture(scope="module")
def digits():
    xtr, _, xte, yte = ds.digits()
    return xtr[:100], xte, yte


def zero_points(model):
    return [
        onnx.numpy_helper.to_array(i)
        for i in model.graph.initializer
        if i.name.endswith("zero_point")
    ]


def accurate(model, digits):
    _, xte, yte = digits
    fp = (run(CNN, {"input": xte})[0].argmax(1) == yte).mean()
    return (run(model, {"input": xte})[0].argmax(1) == yte).mean() >= fp - 0.005


def test_ort_cpu(digits):
    q, _ = onnxq.quantize(CNN, {"input": digits[0]}, target="ort-cpu", progress=False)
    assert "QLinearConv" in ops(q)
    assert {z.dtype for z in zero_points(q)} <= {np.dtype(np.uint8), np.dtype(np.int8)}
    assert accurate(q, digits)


def test_tensorrt_every_zero_point_is_int8_zero(digits):
    q, _ = onnxq.quantize(CNN, {"input": digits[0]}, target="tensorrt", progress=False)
    assert {o.domain for o in q.opset_import} <= {"", "ai.onnx"}
    zps = zero_points(q)
    assert zps and all(not np.any(z) for z in zps)
    assert {z.dtype for z in zps} <= {np.dtype(np.int8), np.dtype(np.int32)}
    assert accurate(q, digits)


def test_generic_is_standard_qdq(digits):
    q, _ = onnxq.quantize(CNN, {"input": digits[0]}, target="generic", progress=False)
    assert {o.domain for o in q.opset_import} <= {"", "ai.onnx"}
    assert "DequantizeLinear" in ops(q) and "QLinearConv" not in ops(q)
    assert accurate(q, digits)


def test_openvino_runs_in_openvino(digits):
    pytest.importorskip("openvino")
    q, _ = onnxq.quantize(CNN, {"input": digits[0]}, target="openvino", progress=False)
    assert "FakeQuantize" in ops(q)
    out = openvino_compile(q)(digits[1])[0]
    assert (out.argmax(1) == digits[2]).mean() > 0.97


def test_explicit_options_win_over_the_target(digits):
    q, _ = onnxq.quantize(
        CNN, {"input": digits[0]}, target="tensorrt", format="qoperator", progress=False
    )
    assert "QLinearConv" in ops(q)
    assert all(z.dtype in (np.dtype(np.int8), np.dtype(np.int32)) for z in zero_points(q))


def test_target_from_toml_with_a_pattern_subset(tmp_path, digits):
    toml = tmp_path / "t.toml"
    toml.write_text('[target.convs-only]\nformat = "qdq"\npatterns = ["conv+bias"]\n')
    np.savez(tmp_path / "c.npz", input=digits[0])
    out = tmp_path / "q.onnx"
    assert (
        main(
            [
                "quantize",
                CNN,
                "-o",
                str(out),
                "--data",
                str(tmp_path / "c.npz"),
                "--target-file",
                str(toml),
                "--target",
                "convs-only",
                "--quiet",
            ]
        )
        == 0
    )
    model = onnx.load(str(out))
    assert "Gemm" in ops(model) and ops(model).count("Conv") == 3


def test_register_target_from_python(digits):
    register_target(Target("unit-test-int8", format="qoperator", activation_dtype="int8"))
    q, _ = onnxq.quantize(CNN, {"input": digits[0]}, target="unit-test-int8", progress=False)
    acts = [z for z in zero_points(q) if z.ndim == 0]
    assert acts and all(z.dtype == np.int8 for z in acts)


def test_bad_targets(tmp_path, capsys):
    with pytest.raises(ConfigError, match="unknown"):
        get_target("tpu-9000")
    with pytest.raises(ConfigError, match="weight_bits"):
        Target("x", weight_bits=4)
    toml = tmp_path / "t.toml"
    toml.write_text('[target.bad]\nformat = "qdq"\ncolour = "red"\n')
    rc = main(
        [
            "quantize",
            CNN,
            "-o",
            str(tmp_path / "o.onnx"),
            "--data",
            "x.npz",
            "--target-file",
            str(toml),
        ]
    )
    assert rc == 2 and "unknown key(s) ['colour']" in capsys.readouterr().err
    toml.write_text('[target.nopat]\npatterns = ["warp-drive"]\n')
    np.savez(tmp_path / "c.npz", input=np.zeros((2, 1, 28, 28), np.float32))
    rc = main(
        [
            "quantize",
            CNN,
            "-o",
            str(tmp_path / "o.onnx"),
            "--data",
            str(tmp_path / "c.npz"),
            "--target-file",
            str(toml),
            "--target",
            "nopat",
        ]
    )
    assert rc == 2 and "warp-drive" in capsys.readouterr().err
    for table, message in (
        (
            'int16_activations = "yes"',
            "int16_activations = 'yes' in [target.t] must be true or false",
        ),
        ("int16_activations = true", 'int16_activations needs format = "qdq"'),
    ):
        toml.write_text(f"[target.t]\n{table}\n")
        rc = main(["targets", "--target-file", str(toml)])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_targets_command_lists_builtins(capsys):
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    for name in ("ort-cpu", "tensorrt", "openvino", "generic"):
        assert name in out


def test_tensorrt_gives_each_consumer_its_own_qdq_pair():
    # x feeds two convs: tensorrt gets a Q/DQ pair per consumer, generic one shared Q
    from helpers import make_model

    gen = np.random.default_rng(8)
    nodes = [
        onnx.helper.make_node("Conv", ["x", "W1"], ["a"], name="c1"),
        onnx.helper.make_node("Conv", ["x", "W2"], ["b"], name="c2"),
        onnx.helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        onnx.helper.make_node("Conv", ["s", "W3"], ["y"], name="c3"),
    ]
    inits = {
        k: gen.normal(0, 0.3, (4, c, 3, 3)).astype(np.float32)
        for k, c in (("W1", 3), ("W2", 3), ("W3", 4))
    }
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
    data = {"x": gen.normal(0, 1, (8, 3, 8, 8)).astype(np.float32)}
    trt, _ = onnxq.quantize(model, data, target="tensorrt", progress=False)
    register_target(
        Target(
            "trt-shared",
            "tensorrt without dedicated pairs",
            "qdq",
            "int8",
            symmetric_activations=True,
            shared_scale_ops=("Concat", "Add"),
            runtime="tensorrt",
            weight_bits=8,
        )
    )
    shared, _ = onnxq.quantize(model, data, target="trt-shared", progress=False)
    generic, _ = onnxq.quantize(model, data, target="generic", progress=False)

    def q_of_x(m):
        return [n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x"]

    readers = {}
    for n in trt.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.op_type)
    assert len(q_of_x(trt)) == 2 and all(
        readers[q.output[0]] == ["DequantizeLinear"] for q in q_of_x(trt)
    )
    assert len(q_of_x(generic)) == 1
    assert len(q_of_x(shared)) == 1
    f = {"x": data["x"][:2]}
    # TensorRT's integer math is exact: check in onnxruntime's exact U8S8 mode
    np.testing.assert_array_equal(run(trt, f, exact=True)[0], run(shared, f, exact=True)[0])
    ref = run(model, f)[0]
    assert np.abs(run(trt, f, exact=True)[0] - ref).max() < 0.05 * np.abs(ref).max()
