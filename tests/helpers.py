"""Shared test helpers: tiny models built with onnx.helper, onnxruntime runs, graph checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
#: the demo model, which the zoo lists too (one committed copy, inside the package)
DIGITS_CNN = ROOT / "onnxq" / "demo" / "digits_cnn.onnx"


def trained_model(name: str) -> Path:
    """The committed model trained by models/train.py called ``name`` (digits_cnn is the demo's)."""
    return DIGITS_CNN if name == "digits_cnn" else MODELS / f"{name}.onnx"


QUANTIZED_OPS = {"QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul"}


def make_model(nodes, inputs, outputs, inits=None, opset=13) -> onnx.ModelProto:
    """inputs/outputs: [(name, shape)] float32; inits: {name: array}."""
    graph = h.make_graph(
        nodes,
        "test",
        [h.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [h.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [nh.from_array(np.asarray(v), k) for k, v in (inits or {}).items()],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 8
    if any(s is None for _, s in outputs):  # fill unknown output shapes by shape inference
        inferred = onnx.shape_inference.infer_shapes(model)
        types = {vi.name: vi.type for vi in [*inferred.graph.value_info, *inferred.graph.output]}
        for out in model.graph.output:
            if not out.type.tensor_type.HasField("shape") and out.name in types:
                out.type.CopyFrom(types[out.name])
    onnx.checker.check_model(model)
    return model


def run(model: onnx.ModelProto | str | Path, feeds: dict, exact: bool = False) -> list[np.ndarray]:
    """Run in onnxruntime; ``exact`` asks for its exact U8S8 path (for models meant for another
    runtime, e.g. TensorRT, whose integer math does not clip like x86 CPUs without VNNI)."""
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if exact:
        opts.add_session_config_entry("session.x64quantprecision", "1")
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def dq_q_pairs_between_quantized(model: onnx.ModelProto) -> list[str]:
    """DequantizeLinear → QuantizeLinear pairs whose ends are both quantized ops."""
    producers = {o: n for n in model.graph.node for o in n.output}
    bad = []
    for q in model.graph.node:
        if q.op_type != "QuantizeLinear":
            continue
        dq = producers.get(q.input[0])
        if dq is not None and dq.op_type == "DequantizeLinear":
            src = producers.get(dq.input[0])
            if src is not None and src.op_type in QUANTIZED_OPS:
                bad.append(f"{dq.name} -> {q.name}")
    return bad


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def zoo_datasets():
    """The models/datasets.py module (digits and Fashion-MNIST loaders)."""
    from models import datasets

    return datasets


def examples(fast: int, slow: int) -> int:
    """A property test's example count: ``fast`` in the fast tier, ``slow`` under --slow."""
    import os

    return slow if os.environ.get("ONNXQ_TEST_TIER") == "slow" else fast


#: what tells that a Debian package is installed: a file, or a command on PATH
DEBIAN_PROBES = {
    "dataset-fashion-mnist": "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz",
    "espeak-ng": "espeak-ng",
    "fonts-dejavu-core": "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "chromium": "chromium",
}


def needs_debian(*packages: str) -> None:
    """Skip the calling test when a Debian package it needs is missing, naming the command.

    Under ``CI=true`` the test runs (and fails) instead: ``.ci/run`` installs every package.
    Every test that needs a Debian package calls this (tests/test_tiers.py checks it).
    """
    import os
    import shutil

    import pytest

    def present(probe: str) -> bool:
        return Path(probe).is_file() if probe.startswith("/") else shutil.which(probe) is not None

    missing = [p for p in packages if not present(DEBIAN_PROBES[p])]
    if missing and not os.environ.get("CI"):
        pytest.skip(
            f"needs the Debian package(s) {', '.join(missing)}: apt-get install {' '.join(missing)}"
        )


class DyingObserver:
    """An observer whose process ends on its first batch (a worker killed, e.g. out of memory)."""

    def observe(self, x) -> None:
        import os

        os._exit(7)
