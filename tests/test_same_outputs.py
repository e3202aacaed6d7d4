"""The refactor guard: this checkout quantizes the committed models exactly as the reference
commit did (scripts/same_outputs.py; values and outputs must match, bytes are reported)."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import needs_debian

from scripts import same_outputs
from scripts.same_outputs import REFERENCE

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "same_outputs.py"


def _has_history() -> bool:
    probe = ["git", "-C", str(ROOT), "cat-file", "-e", f"{REFERENCE}^{{commit}}"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _has_history(), reason="needs the git history (git fetch --unshallow)")
def test_committed_models_give_the_reference_values_and_outputs():
    needs_debian("dataset-fashion-mnist")  # fashion_cnn's calibration and evaluation data
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--strict-bytes"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(("digits", "fashion"))]
    assert len(lines) == 20, done.stdout  # 5 models x 4 settings


def test_the_check_fails_on_a_changed_scale(tmp_path):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    def model(scale: float) -> onnx.ModelProto:
        q = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])
        dq = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])
        g = helper.make_graph(
            [q, dq],
            "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])],
            [
                numpy_helper.from_array(np.array(scale, np.float32), "s"),
                numpy_helper.from_array(np.array(0, np.uint8), "z"),
            ],
        )
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])

    base, head = tmp_path / "base", tmp_path / "head"
    base.mkdir(), head.mkdir()
    feeds = [{"x": np.array([0.013, 0.5, 1.0, 2.0], np.float32)}]
    (base / "m__default.onnx").write_bytes(model(0.01).SerializeToString())
    (head / "m__default.onnx").write_bytes(model(0.01).SerializeToString())
    assert same_outputs.compare("m__default", base, head, feeds) == []
    (head / "m__default.onnx").write_bytes(model(0.02).SerializeToString())
    assert same_outputs.compare("m__default", base, head, feeds) == [
        "bytes differ",
        "VALUES differ",
        "OUTPUTS differ",
    ]
