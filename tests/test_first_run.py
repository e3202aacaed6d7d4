"""What a new user meets first: wrong data, file modes, input names, misleading paths.

Each case reproduces a finding of a first-run review through the CLI and holds its fix.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN, make_model, run, trained_model
from onnx import helper as h

from onnxq.cli import main

CNN = DIGITS_CNN


def _quantize(tmp_path, data, *extra):
    out = tmp_path / "q.onnx"
    rc = main(["quantize", str(CNN), "-o", str(out), "--data", str(data), "--quiet", *extra])
    return rc, out


def test_uint8_pixels_for_a_float_input_are_refused_with_the_fix(tmp_path, capsys):
    path = tmp_path / "calib.npz"
    pixels = np.random.default_rng(0).integers(0, 256, (8, 1, 28, 28)).astype(np.uint8)
    np.savez(path, input=pixels)
    rc, out = _quantize(tmp_path, path)
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert "input 'input' holds uint8 data, the model expects float32" in err
    assert "scale your pixels as your model expects" in err and "onnxq does not guess" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_float64_data_is_converted_with_one_warning(tmp_path, capsys):
    path = tmp_path / "calib.npz"
    np.savez(path, input=np.random.default_rng(0).uniform(0, 1, (8, 1, 28, 28)))  # float64
    rc, out = _quantize(tmp_path, path)
    err = capsys.readouterr().err
    assert rc == 0 and out.is_file()
    lines = [ln for ln in err.splitlines() if "float64" in ln]
    assert lines == ["onnxq: warning: input 'input': float64 calibration data converted to float32"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_every_output_file_honours_the_umask(tmp_path, umask):
    path = tmp_path / "calib.npz"
    np.savez(path, input=np.random.default_rng(0).uniform(0, 1, (8, 1, 28, 28)).astype("f4"))
    old = os.umask(umask)
    try:
        rc, out = _quantize(tmp_path, path, "--report", str(tmp_path / "r.json"))
        html = tmp_path / "c.html"
        rc2 = main(["compare", str(CNN), str(out), "--data", str(path), "--report", str(html)])
    finally:
        os.umask(old)
    assert rc == 0 and rc2 == 0
    for f in (out, tmp_path / "r.json", html):
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f


def test_inspect_prints_the_inputs_and_an_npz_example(capsys):
    assert main(["inspect", str(CNN)]) == 0
    out = capsys.readouterr().out
    assert "the model's inputs: 'input' float32[N,1,28,28]" in out
    assert "numpy.savez('calib.npz', input=samples_0)" in out


def test_extra_arrays_of_other_lengths_are_named_before_counts(tmp_path, capsys):
    path = tmp_path / "calib.npz"
    x = np.zeros((8, 1, 28, 28), np.float32)
    np.savez(path, input=x, labels=np.zeros(5, np.int64))
    rc, _ = _quantize(tmp_path, path)
    err = capsys.readouterr().err
    assert (
        rc == 2
        and "array(s) ['labels'] that name no input of the model" in err
        and "sample counts" not in err
    )
    assert "the model's inputs: 'input' float32[N,1,28,28]" in err


def _matmul_of_two_fixed_inputs():
    w = np.random.default_rng(2).normal(0, 0.5, (4, 5)).astype(np.float32)
    return make_model(
        [
            h.make_node("MatMul", ["a", "b"], ["ab"], name="mm"),
            h.make_node("MatMul", ["ab", "W"], ["y"], name="dense"),
        ],
        [("a", [2, 3]), ("b", [3, 4])],
        [("y", [2, 5])],
        {"W": w},
    )


@pytest.mark.parametrize("stacked", [False, True])
def test_inputs_of_different_fixed_batch_sizes_fit_one_npz(tmp_path, capsys, stacked):
    model = _matmul_of_two_fixed_inputs()
    src = tmp_path / "mm.onnx"
    onnx.save(model, str(src))
    g = np.random.default_rng(1)
    shape = (5,) if stacked else ()
    a = g.normal(0, 1, (*shape, 2, 3)).astype(np.float32)
    b = g.normal(0, 1, (*shape, 3, 4)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", a=a, b=b)
    out = tmp_path / "q.onnx"
    argv = ["quantize", str(src), "-o", str(out), "--data", str(tmp_path / "calib.npz")]
    rc = main([*argv, "--verbose"])
    assert rc == 0, capsys.readouterr().err
    assert f"in {5 if stacked else 1} batches," in capsys.readouterr().out
    feeds = {"a": a.reshape(-1, 2, 3)[0], "b": b.reshape(-1, 3, 4)[0]}
    ref, got = run(model, feeds)[0], run(onnx.load(str(out)), feeds)[0]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_missing_external_data_says_to_put_it_beside_the_model(tmp_path, capsys):
    model = onnx.load(str(CNN))
    src = tmp_path / "ext.onnx"
    onnx.save_model(
        model, str(src), save_as_external_data=True, location="ext.onnx.data", size_threshold=0
    )
    (tmp_path / "ext.onnx.data").unlink()
    rc = main(["inspect", str(src)])
    err = capsys.readouterr().err
    assert rc == 2 and "'ext.onnx.data'" in err and "put the .data file(s) next to the model" in err


def test_a_folder_given_as_the_model_is_named_a_folder(tmp_path, capsys):
    (tmp_path / "m.onnx").write_bytes(CNN.read_bytes())
    rc = main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "is a folder (it holds m.onnx)" in err and "does not exist" not in err


def test_the_inputs_hint_names_a_symbolic_length():
    """A decoder's [batch, src_len] input was shown as int64[N,N], as if both were samples."""
    from onnx import TensorProto
    from onnx import helper as h

    from onnxq.calibrate.dataset import inputs_hint, model_inputs

    graph = h.make_graph(
        [h.make_node("Identity", ["src"], ["y"])],
        "g",
        [h.make_tensor_value_info("src", TensorProto.INT64, ["batch", "src_len"])],
        [h.make_tensor_value_info("y", TensorProto.INT64, ["batch", "unk__3"])],
    )
    assert "'src' int64[N,src_len]" in inputs_hint(model_inputs(h.make_model(graph)))
    graph.input[0].type.tensor_type.shape.dim[1].dim_param = "unk__3"
    assert "'src' int64[N,N]" in inputs_hint(model_inputs(h.make_model(graph)))


def test_the_npz_example_is_python_for_names_that_are_not_identifiers(tmp_path):
    # 'gpu_0/data_0' (the onnx light models) once gave "**{'gpu_0/data_0': ...}=samples_0"
    import ast

    from onnxq.calibrate.dataset import InputSpec, inputs_hint

    specs = [
        InputSpec("gpu_0/data_0", np.dtype(np.float32), (1, 3, 4, 4)),
        InputSpec("mask", np.dtype(np.float32), (None, 4)),
        InputSpec("2d", np.dtype(np.float32), (None, 2)),
    ]
    hint = inputs_hint(specs)
    call = hint.split("e.g. ", 1)[1].split(" with each array", 1)[0]
    tree = ast.parse(call, mode="eval").body
    assert isinstance(tree, ast.Call)
    named = [k.arg for k in tree.keywords if k.arg] + [
        key.value for k in tree.keywords if k.arg is None for key in k.value.keys
    ]
    assert sorted(named) == sorted(s.name for s in specs)


@pytest.mark.parametrize("name", ["digits_cnn", "digits_mlp"])
def test_inspect_counts_what_quantize_quantizes(tmp_path, capsys, name):
    # inspect said "7 of 10" where quantize quantized 10: the ops requantize carries int8
    # through (MaxPool, Reshape) were counted by quantize only
    import json

    model = trained_model(name)
    spec = onnx.load(str(model)).graph.input[0]
    shape = [d.dim_value or 4 for d in spec.type.tensor_type.shape.dim]
    data = tmp_path / "calib.npz"
    np.savez(data, **{spec.name: np.random.default_rng(0).uniform(0, 1, shape).astype(np.float32)})
    counts = set()
    for target in ("ort-cpu", "tensorrt", "generic"):
        assert main(["inspect", str(model), "--target", target]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        said = out[-1]
        report = tmp_path / "r.json"
        q = tmp_path / "q.onnx"
        args = ["--data", str(data), "--report", str(report), "--quiet", "--no-latency-check"]
        assert main(["quantize", str(model), "-o", str(q), "--target", target, *args]) == 0
        decisions = json.loads(report.read_text())["decisions"]
        done = sum(d["quantized"] for d in decisions)
        left = len(decisions) - done
        assert said == f"{done} of {len(decisions)} nodes would be quantized; {left} stay float"
        listed = sum(line.startswith("  ") for line in out) + sum(
            int(part.split("×")[1])
            for line in out
            if line.startswith("not quantized, no rule")
            for part in line.split(": ", 1)[1].split(" (")[0].split(", ")
        )
        assert listed == left, out  # every float node is listed or counted by op type
        counts.add(done)
    # TensorRT fuses the Relus and carries the pools: as quantized as the default's QOperator
    assert len(counts) == 1


def test_a_model_that_runs_only_at_batch_2_is_told_about_batch_size(tmp_path, capsys):
    # declares x: [N, 3] but reshapes to a fixed (2, 6): batches of 1 fail inside onnxruntime
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        h.make_node("Reshape", ["m", "shape"], ["y"], name="reshape"),
    ]
    w = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)
    model = make_model(
        nodes, [("x", ["N", 3])], [("y", [2, 6])], {"w": w, "shape": np.array([2, 6])}
    )
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    data = tmp_path / "calib.npz"
    np.savez(data, x=np.random.default_rng(1).standard_normal((8, 3)).astype(np.float32))
    out = tmp_path / "q.onnx"
    base = ["quantize", str(path), "-o", str(out), "--data", str(data), "--quiet"]
    assert main([*base, "--batch-size", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--batch-size N" in err and err.count("\n") == 0
    assert main([*base, "--batch-size", "2", "--no-latency-check"]) == 0


def test_compare_with_its_models_swapped_says_so(tmp_path, capsys):
    data = tmp_path / "d.npz"
    np.savez(data, input=np.random.default_rng(0).uniform(0, 1, (4, 1, 28, 28)).astype(np.float32))
    q = tmp_path / "q.onnx"
    assert main(["quantize", str(DIGITS_CNN), "-o", str(q), "--data", str(data), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["compare", str(q), str(DIGITS_CNN), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert "is the quantized model" in err and "give the float model first" in err
    assert main(["compare", str(DIGITS_CNN), str(DIGITS_CNN), "--data", str(data)]) == 2
    assert "holds no quantized op" in capsys.readouterr().err


def test_a_wrong_sample_shape_names_the_array_as_saved(tmp_path, capsys):
    w = np.ones((64, 8), np.float32)
    model = make_model(
        [h.make_node("MatMul", ["x", "w"], ["y"])], [("x", ["N", 64])], [("y", ["N", 8])], {"w": w}
    )
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.ones((200, 256), np.float32))
    argv = ["quantize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx")]
    assert main([*argv, "--data", str(tmp_path / "d.npz")]) == 2
    err = capsys.readouterr().err
    assert "array 'x' has shape [200, 256], 200 samples of [256]; input 'x' takes [N, 64]" in err
    assert "dimension 1 is 256, the model expects 64" in err


def test_the_default_summary_is_a_few_plain_lines(tmp_path, capsys):
    data = tmp_path / "d.npz"
    np.savez(data, input=np.random.default_rng(0).uniform(0, 1, (8, 1, 28, 28)).astype(np.float32))
    out = tmp_path / "q.onnx"
    argv = ["quantize", str(DIGITS_CNN), "-o", str(out), "--data", str(data)]
    assert main([*argv, "--no-latency-check"]) == 0
    text = capsys.readouterr().out
    lines = text.strip().splitlines()
    assert len(lines) <= 4 and max(len(line) for line in lines) < 220, text
    assert lines[0].startswith("int8: 10 of 10 nodes; float: none")
    for jargon in ("DQ→Q", "placeholders", "passes:", "bytes of statistics"):
        assert jargon not in text
    assert main([*argv, "--no-latency-check", "--verbose"]) == 0
    verbose = capsys.readouterr().out
    assert "passes:" in verbose and "calibration:" in verbose
