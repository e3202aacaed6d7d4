"""Models over 2 GB, with the 2 GB limit lowered: external data in, external data out.

The real run (benchmarks/big_model.py on a 2.13 GiB model) is documented in docs/calibration.md;
here the same code paths run on a 1.6 MB model by lowering ``onnxq.io.graph.TWO_GIB``: the
checker's weights-as-inputs check, the session from external data, the output written with
its weights beside it, loaded back by onnxruntime and compared with the float model.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnxq
import onnxq.io.graph as graph
import onnxq.io.session as session
from benchmarks import big_model


@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(graph, "TWO_GIB", 128 * 1024)  # the int8 output is ~230 KB
    monkeypatch.setattr(session, "FILE_WEIGHTS_BYTES", 128 * 1024)  # sessions from files


@pytest.mark.parametrize("method", ["minmax", "average-max", "percentile", "entropy", "mse"])
def test_a_model_past_the_limit_quantizes_with_external_data(tmp_path, small_limit, method):
    path = big_model.build(tmp_path / "model", hidden=96, blocks=3)
    assert big_model.weight_bytes(path) > graph.TWO_GIB
    tokens = np.random.default_rng(0).standard_normal((6, 8, 96)).astype(np.float32)
    out = tmp_path / "int8.onnx"
    q, report = onnxq.quantize(str(path), {"x": tokens}, method=method, output=out, progress=False)
    assert len(report.quantized_nodes) == 6
    data = tmp_path / "int8.onnx.data"
    assert data.exists() and data.stat().st_size > 0  # the weights beside the model
    assert out.stat().st_size < data.stat().st_size
    assert big_model._agreement(path, out, 96) > 0.99
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": tokens[:1]})[0].shape == (1, 8, 96)


def test_the_checker_still_rejects_a_broken_model_past_the_limit(tmp_path, small_limit):
    import onnx

    path = big_model.build(tmp_path / "model", hidden=96, blocks=3)
    model = onnx.load(str(path))
    model.graph.node[0].input[1] = "no_such_weight"
    with pytest.raises(onnxq.core.errors.ModelError, match="rejected by onnx.checker"):
        graph.check_model(model)
