"""The command line: quantize, inspect, demo, and clear errors with exit code 2."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN, make_model
from onnx import helper as h

from onnxq.cli import main

CNN = DIGITS_CNN


@pytest.fixture()
def calib(tmp_path):
    x = np.random.default_rng(0).uniform(0, 1, (8, 1, 28, 28)).astype(np.float32)
    path = tmp_path / "calib.npz"
    np.savez(path, input=x)
    return path


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_quantize_writes_model_and_report(tmp_path, calib, capsys):
    out = tmp_path / "int8.onnx"
    before = sha(CNN)
    rc = main(
        [
            "quantize",
            str(CNN),
            "-o",
            str(out),
            "--data",
            str(calib),
            "--quiet",
            "--report",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 0 and out.is_file()
    onnx.checker.check_model(onnx.load(str(out)))
    assert sha(CNN) == before  # the input model is never modified
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ops_after"]["QLinearConv"] == 3


@pytest.mark.parametrize(
    "flags",
    [
        ["--method", "average-max"],
        ["--per-tensor"],
        ["--activation-dtype", "int8"],
        ["--exclude", "conv2"],
        ["--samples", "3"],
        ["--batch-size", "4"],
    ],
)
def test_quantize_options(tmp_path, calib, flags):
    out = tmp_path / "int8.onnx"
    assert (
        main(["quantize", str(CNN), "-o", str(out), "--data", str(calib), "--quiet", *flags]) == 0
    )
    model = onnx.load(str(out))
    convs = [n for n in model.graph.node if n.op_type == "QLinearConv"]
    assert len(convs) == (2 if "--exclude" in flags else 3)


def test_output_is_byte_identical_across_runs(tmp_path, calib):
    outs = [tmp_path / "a.onnx", tmp_path / "b.onnx"]
    for out in outs:
        assert main(["quantize", str(CNN), "-o", str(out), "--data", str(calib), "--quiet"]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()


def _expect_error(capsys, argv, message, out=None):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("onnxq: error: ") and message in err
    assert len(err.strip().splitlines()) == 1
    if out is not None:
        assert not out.exists()
        assert not list(out.parent.glob(f".{out.name}*"))  # no temp files left behind


def test_error_not_onnx(tmp_path, calib, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf \x00\x01\x02")
    out = tmp_path / "o.onnx"
    _expect_error(
        capsys,
        ["quantize", str(bad), "-o", str(out), "--data", str(calib)],
        "not a readable ONNX model",
        out,
    )


def test_error_missing_model(tmp_path, calib, capsys):
    out = tmp_path / "o.onnx"
    _expect_error(
        capsys,
        ["quantize", str(tmp_path / "nope.onnx"), "-o", str(out), "--data", str(calib)],
        "does not exist",
        out,
    )


def test_error_missing_and_empty_data(tmp_path, capsys):
    out = tmp_path / "o.onnx"
    _expect_error(
        capsys,
        ["quantize", str(CNN), "-o", str(out), "--data", str(tmp_path / "none.npz")],
        "does not exist",
        out,
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_error(
        capsys,
        ["quantize", str(CNN), "-o", str(out), "--data", str(empty)],
        "holds no .npy or .npz files",
        out,
    )
    np.savez(tmp_path / "zero.npz", input=np.zeros((0, 1, 28, 28), np.float32))
    _expect_error(
        capsys,
        ["quantize", str(CNN), "-o", str(out), "--data", str(tmp_path / "zero.npz")],
        "no samples",
        out,
    )


def test_error_wrong_input_name_and_shape(tmp_path, capsys):
    out = tmp_path / "o.onnx"
    np.savez(tmp_path / "name.npz", image=np.zeros((2, 1, 28, 28), np.float32))
    _expect_error(
        capsys,
        ["quantize", str(CNN), "-o", str(out), "--data", str(tmp_path / "name.npz")],
        "array(s) ['image'] that name no input of the model",
        out,
    )
    np.savez(tmp_path / "shape.npz", input=np.zeros((2, 1, 32, 32), np.float32))
    _expect_error(
        capsys,
        ["quantize", str(CNN), "-o", str(out), "--data", str(tmp_path / "shape.npz")],
        "array 'input' has shape [2, 1, 32, 32], 2 samples of [1, 32, 32]; input 'input' "
        "takes [N, 1, 28, 28]: dimension 2 is 32",
        out,
    )


def test_error_checker_rejects(tmp_path, calib, capsys):
    model = onnx.load(str(CNN))
    model.graph.node[0].input[1] = "missing_weight"
    bad = tmp_path / "invalid.onnx"
    onnx.save(model, str(bad))
    out = tmp_path / "o.onnx"
    _expect_error(
        capsys,
        ["quantize", str(bad), "-o", str(out), "--data", str(calib)],
        "rejected by onnx.checker",
        out,
    )


def test_error_output_is_input(tmp_path, calib, capsys):
    copy = tmp_path / "m.onnx"
    copy.write_bytes(CNN.read_bytes())
    before = sha(copy)
    _expect_error(
        capsys,
        ["quantize", str(copy), "-o", str(copy), "--data", str(calib)],
        "never overwrites what it reads",
    )
    assert sha(copy) == before


def test_error_unknown_exclude(tmp_path, calib, capsys):
    out = tmp_path / "o.onnx"
    _expect_error(
        capsys,
        ["quantize", str(CNN), "-o", str(out), "--data", str(calib), "--exclude", "nope"],
        "not in the model",
        out,
    )


def test_error_already_quantized(tmp_path, calib, capsys):
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(CNN), "-o", str(out), "--data", str(calib), "--quiet"]) == 0
    capsys.readouterr()  # the first run's warnings
    _expect_error(
        capsys,
        ["quantize", str(out), "-o", str(tmp_path / "qq.onnx"), "--data", str(calib)],
        "already quantized",
    )


def test_inspect_lists_matches_and_reasons(tmp_path, capsys):
    w = np.ones((2, 3, 1, 1), np.float32)
    model = make_model(
        [
            h.make_node("Conv", ["x", "W"], ["c"], name="conv"),
            h.make_node("Tanh", ["c"], ["y"], name="sig"),
        ],
        [("x", ["N", 3, 4, 4])],
        [("y", None)],
        {"W": w},
    )
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert main(["inspect", str(path), "--explain"]) == 0
    text = capsys.readouterr().out
    assert "ops: Conv 1, Tanh 1" in text and "conv: conv" in text
    assert "sig" in text and "no int8 kernel in onnxruntime CPU; runs in float" in text
    assert main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {d["node"]: d["quantized"] for d in data["nodes"]} == {"conv": True, "sig": False}


def test_console_script_demo_and_exit_codes(tmp_path):
    exe = [sys.executable, "-m", "onnxq.cli"]
    res = subprocess.run(
        [*exe, "demo", "--runs", "20", "-o", str(tmp_path / "demo.onnx")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "int8 vs fp32" in res.stdout and (tmp_path / "demo.onnx").is_file()
    res = subprocess.run(
        [*exe, "quantize", str(tmp_path / "x.onnx"), "-o", "y.onnx", "--data", "d.npz"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_large_models_are_saved_with_external_data(tmp_path, calib, monkeypatch):
    """Over the 2 GB protobuf limit the output goes to external data (limit lowered here)."""
    import onnxq
    import onnxq.io.graph

    monkeypatch.setattr(onnxq.io.graph, "TWO_GIB", 10_000)  # sessions load from files too
    out = tmp_path / "big.int8.onnx"
    model, _ = onnxq.quantize(str(CNN), str(calib), output=str(out), progress=False)
    assert (tmp_path / "big.int8.onnx.data").is_file()
    assert out.stat().st_size < 10_000
    reloaded = onnx.load(str(out))  # loads the external data
    x = np.random.default_rng(1).uniform(0, 1, (2, 1, 28, 28)).astype(np.float32)
    from helpers import run

    np.testing.assert_array_equal(run(reloaded, {"input": x})[0], run(model, {"input": x})[0])


def test_explain_says_how_if_branches_are_handled(tmp_path, capsys):
    branch = onnx.helper.make_graph(
        [h.make_node("Conv", ["x", "W"], ["yb"], name="inner_conv")],
        "then",
        [],
        [onnx.helper.make_tensor_value_info("yb", onnx.TensorProto.FLOAT, [1, 2, 4, 4])],
    )
    nodes = [
        h.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch, name="branch")
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 4, 4]),
            onnx.helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []),
        ],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 4, 4])],
        [onnx.numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "W")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / "if.onnx"
    onnx.save(model, str(path))
    assert main(["inspect", str(path), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "holds 2 branches with 2 node(s)" in out and "graph of its own" in out
