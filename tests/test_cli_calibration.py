"""CLI options of calibration: methods, batching, range tables, images, module references."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN, make_model, run
from onnx import helper as h

from onnxq.cli import main

CNN = DIGITS_CNN
X = np.random.default_rng(3).uniform(0, 1, (24, 1, 28, 28)).astype(np.float32)


@pytest.fixture()
def calib(tmp_path):
    path = tmp_path / "calib.npz"
    np.savez(path, input=X)
    return path


def quantize(*args):
    return main(["quantize", *map(str, args), "--quiet"])


def error_of(capsys, *args):
    rc = quantize(*args)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("onnxq: error: ") and len(err.strip().splitlines()) == 1
    return err


@pytest.mark.parametrize(
    "flags",
    [
        ["--method", "percentile", "--percentile", "99.9"],
        ["--method", "entropy", "--bins", "1024"],
        ["--method", "mse"],
        ["--method", "output-aware"],
        ["--method", "entropy", "--batch-size", "8", "--samples", "16"],
    ],
)
def test_methods_produce_runnable_close_models(tmp_path, calib, flags):
    out = tmp_path / "q.onnx"
    assert quantize(CNN, "-o", out, "--data", calib, *flags) == 0
    f = run(CNN, {"input": X[:4]})[0]
    q = run(out, {"input": X[:4]})[0]
    assert np.abs(f - q).max() < 0.1 * np.abs(f).max()


def test_methods_choose_different_ranges(tmp_path, calib):
    tables = {}
    for m in ("minmax", "entropy", "mse", "output-aware"):
        path = tmp_path / f"{m}.json"
        assert (
            quantize(
                CNN,
                "-o",
                tmp_path / f"{m}.onnx",
                "--data",
                calib,
                "--method",
                m,
                "--save-ranges",
                path,
            )
            == 0
        )
        tables[m] = json.loads(path.read_text())["tensors"]
    assert tables["minmax"].keys() == tables["entropy"].keys()
    for m in ("entropy", "mse", "output-aware"):
        assert tables[m] != tables["minmax"]
        for t, (lo, hi) in tables[m].items():  # never wider than the data
            mm_lo, mm_hi = tables["minmax"][t]
            assert lo >= min(mm_lo, 0.0) - 1e-6 and hi <= mm_hi + 1e-6


def test_save_and_load_ranges_reproduce_the_model_without_data(tmp_path, calib):
    table = tmp_path / "ranges.json"
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    # optimized rounding (layer Hessians) and the sequential bias correction (a run of the int8
    # model) need the data, which a range table does not hold; the fast correction's means it does
    nearest = ("--rounding", "nearest", "--bias-correction", "fast")
    args = ("--data", calib, "--method", "entropy", "--save-ranges", table, *nearest)
    assert quantize(CNN, "-o", a, *args) == 0
    doc = json.loads(table.read_text())
    assert doc["format"] == "onnxq-ranges" and doc["method"] == "entropy"
    assert quantize(CNN, "-o", b, "--load-ranges", table, *nearest) == 0
    assert a.read_bytes() == b.read_bytes()


def test_bad_range_tables(tmp_path, capsys):
    out = tmp_path / "o.onnx"
    assert "does not exist" in error_of(
        capsys, CNN, "-o", out, "--load-ranges", tmp_path / "none.json"
    )
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "onnxq-ranges", "tensors": {"input": [1, 0]}}')
    assert "finite min <= max" in error_of(capsys, CNN, "-o", out, "--load-ranges", bad)
    partial = tmp_path / "partial.json"
    partial.write_text('{"format": "onnxq-ranges", "tensors": {"input": [0, 1]}}')
    assert "no entry for tensor" in error_of(capsys, CNN, "-o", out, "--load-ranges", partial)
    assert not out.exists()


def test_missing_data_and_bad_numbers(tmp_path, calib, capsys):
    out = tmp_path / "o.onnx"
    assert "needs calibration data" in error_of(capsys, CNN, "-o", out)
    assert "--bins" in error_of(
        capsys, CNN, "-o", out, "--data", calib, "--method", "entropy", "--bins", "7"
    )
    assert "--percentile" in error_of(
        capsys, CNN, "-o", out, "--data", calib, "--method", "percentile", "--percentile", "5"
    )


def _images(folder, n=6, size=(40, 32), mode="L"):
    from PIL import Image

    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        arr = rng.integers(0, 255, (size[1], size[0]) + (() if mode == "L" else (3,)))
        Image.fromarray(arr.astype(np.uint8), mode).save(folder / f"{i}.png")
    return folder


def test_image_folder_with_preprocess(tmp_path):
    images = _images(tmp_path / "imgs")
    out = tmp_path / "q.onnx"
    assert (
        quantize(
            CNN,
            "-o",
            out,
            "--data",
            images,
            "--preprocess",
            "resize=28,crop=28,color=gray,mean=0.5,std=0.5,layout=nchw",
        )
        == 0
    )
    assert onnx.load(str(out)).graph.node


def test_image_preprocess_values_and_layouts(tmp_path):
    from onnxq.calibrate.dataset import InputSpec
    from onnxq.calibrate.images import ImageFolderDataset

    images = _images(tmp_path / "rgb", n=1, size=(8, 6), mode="RGB")
    ds = ImageFolderDataset(images, "color=bgr,layout=nhwc,mean=0.5,std=0.25,scale=255")
    ds.bind([InputSpec("x", np.dtype(np.float32), (1, 6, 8, 3))])
    (feed,) = list(ds)
    from PIL import Image

    raw = np.asarray(Image.open(images / "0.png"), np.float32) / 255
    np.testing.assert_allclose(feed["x"][0], (raw[:, :, ::-1] - 0.5) / 0.25, rtol=1e-6)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("resize=abc", "resize='abc' is not valid"),
        ("zoom=2", "key 'zoom' is unknown"),
        ("layout=nchwc", "layout='nchwc' is not valid"),
        ("crop", "is not key=value"),
        ("std=0", "must not be 0"),
    ],
)
def test_bad_preprocess(tmp_path, capsys, spec, message):
    images = _images(tmp_path / "imgs", n=1)
    assert message in error_of(
        capsys, CNN, "-o", tmp_path / "o.onnx", "--data", images, "--preprocess", spec
    )


def test_image_folder_needs_preprocess_and_matching_size(tmp_path, capsys):
    images = _images(tmp_path / "imgs", n=1)
    assert "give --preprocess" in error_of(capsys, CNN, "-o", tmp_path / "o.onnx", "--data", images)
    assert "input 'input' is a batch of shape" in error_of(
        capsys, CNN, "-o", tmp_path / "o.onnx", "--data", images, "--preprocess", "color=gray"
    )


MODULE = """
import numpy as np
import onnxq

def feeds():
    rng = np.random.default_rng(0)
    return [{"input": rng.uniform(0, 1, (1, 1, 28, 28)).astype(np.float32)} for _ in range(5)]

def broken():
    raise RuntimeError("database offline")

class Fixed(onnxq.CalibrationCallback):
    def calibrate_pattern(self, info):
        from onnxq.core.qparams import params_from_range, weight_params
        values = {}
        for qt in info.inputs + info.outputs:
            qp = (weight_params(info.constant(qt.tensor), qt.axis) if qt.role == "weight"
                  else params_from_range(0.0, 20.0, qt.dtype))
            values[qt.scale], values[qt.zero_point] = qp.scale, qp.zero_point
        return values
"""


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "userdata.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_data_module_function_and_callback_class(user_module):
    out = user_module / "q.onnx"
    assert quantize(CNN, "-o", out, "--data", "userdata:feeds") == 0
    table = user_module / "r.json"
    assert (
        quantize(
            CNN,
            "-o",
            out,
            "--data",
            "userdata:feeds",
            "--callback",
            "userdata:Fixed",
            "--save-ranges",
            table,
        )
        == 0
    )
    model = onnx.load(str(out))
    scales = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    assert np.isclose(scales["input_scale"], 20 / 255)


def test_bad_module_references(user_module, capsys):
    out = user_module / "q.onnx"
    assert "cannot import module 'nosuchmodule'" in error_of(
        capsys, CNN, "-o", out, "--data", "nosuchmodule:feeds"
    )
    assert "has no attribute 'nothing'" in error_of(
        capsys, CNN, "-o", out, "--data", "userdata:nothing"
    )
    assert "database offline" in error_of(capsys, CNN, "-o", out, "--data", "userdata:broken")
    assert "is not a CalibrationCallback" in error_of(
        capsys, CNN, "-o", out, "--data", "userdata:feeds", "--callback", "userdata:feeds"
    )
    assert not out.exists()


def test_output_aware_beats_minmax_on_layer_error():
    """Output-aware picks, per layer, an output range whose error is no worse than MinMax's."""
    import onnxq

    w = np.random.default_rng(0).normal(0, 1, (16, 8)).astype(np.float32)
    model = make_model(
        [h.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        [("x", ["N", 16])],
        [("y", None)],
        {"W": w},
    )
    x = np.random.default_rng(1).laplace(0, 1, (64, 16)).astype(np.float32)
    ref = run(model, {"x": x})[0]
    errs = {}
    for m in ("minmax", "output-aware"):
        q, _ = onnxq.quantize(
            model, [{"x": x[i : i + 8]} for i in range(0, 64, 8)], method=m, progress=False
        )
        errs[m] = float(np.mean((run(q, {"x": x})[0] - ref) ** 2))
    assert errs["output-aware"] <= errs["minmax"]


INTERRUPT = """
import numpy as np

def feeds():
    for i in range(100):
        if i == 3:
            raise KeyboardInterrupt
        yield {"input": np.zeros((1, 1, 28, 28), np.float32)}
"""


def test_interrupted_calibration_leaves_no_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "slowdata.py").write_text(INTERRUPT)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(CNN), "-o", str(out), "--data", "slowdata:feeds"]) == 130
    assert "interrupted; no output written" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".q.onnx*"))


def test_progress_bar_on_request(capsys):
    import onnxq

    onnxq.quantize(str(CNN), {"input": X[:6]}, progress=True)
    err = capsys.readouterr().err
    assert "calibrating" in err and "/6" in err and "batch" in err
