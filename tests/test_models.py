"""Real models on real data, through the CLI: accuracy within 0.5 points of fp32."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import (
    QUANTIZED_OPS,
    dq_q_pairs_between_quantized,
    needs_debian,
    run,
    trained_model,
    zoo_datasets,
)

from onnxq.cli import main

ds = zoo_datasets()


def _digits(layout):
    xtr, _, xte, yte = ds.digits()
    if layout == "nhwc":
        xtr, xte = ds.nhwc(xtr), ds.nhwc(xte)
    return xtr[:300], xte, yte


def _fashion():
    needs_debian("dataset-fashion-mnist")
    xtr, _, xte, yte = ds.fashion()
    return xtr[:500], xte, yte


CASES = {
    "digits_mlp": lambda: _digits("nhwc"),
    "digits_cnn": lambda: _digits("nchw"),
    "fashion_cnn": _fashion,
}
#: the real-data model runs in the slow tier
NAMES = ["digits_mlp", "digits_cnn", pytest.param("fashion_cnn", marks=pytest.mark.slow)]


def accuracy(model, x, y):
    name = model.graph.input[0].name
    out = np.concatenate([run(model, {name: x[i : i + 500]})[0] for i in range(0, len(x), 500)])
    return float((out.argmax(1) == y).mean())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "method", ["minmax", "average-max", "percentile", "entropy", "mse", "output-aware"]
)
def test_model_accuracy_through_cli(name, method, tmp_path):
    calib, xte, yte = CASES[name]()
    path = trained_model(name)
    fp32 = onnx.load(str(path))
    data = tmp_path / "calib.npz"
    np.savez(data, **{fp32.graph.input[0].name: calib})
    out = tmp_path / "int8.onnx"
    assert (
        main(
            [
                "quantize",
                str(path),
                "-o",
                str(out),
                "--data",
                str(data),
                "--method",
                method,
                "--quiet",
            ]
        )
        == 0
    )
    int8 = onnx.load(str(out))
    onnx.checker.check_model(int8)
    kinds = {n.op_type for n in int8.graph.node}
    assert kinds & QUANTIZED_OPS
    assert not kinds & {"Conv", "MatMul", "Gemm"}  # every weighted op runs in int8
    assert dq_q_pairs_between_quantized(int8) == []
    a32, a8 = accuracy(fp32, xte, yte), accuracy(int8, xte, yte)
    assert a8 >= a32 - 0.005, f"fp32 {a32:.4f} int8 {a8:.4f}"
