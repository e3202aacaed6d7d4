"""The OpenVINO runtime, compiled one way everywhere (CPU, float parts in f32)."""

from __future__ import annotations

from typing import Any

import onnx

from onnxq.io.graph import serialize

#: OpenVINO's CPU plugin runs float parts in bf16 by default where the CPU has bf16 (AVX-512
#: BF16, AMX); onnxq runs them in f32, as onnxruntime does, so that its checks, the zoo and the
#: cross-runtime check measure the quantization, not a second precision change
OPENVINO_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}


def available() -> bool:
    """Whether the OpenVINO runtime is installed (``pip install openvino``)."""
    import importlib.util

    return importlib.util.find_spec("openvino") is not None


def openvino_compile(model: Any, threads: int | None = None) -> Any:
    """``model`` (an onnx.ModelProto or an openvino.Model) compiled for the CPU.

    Float parts in f32 (:data:`OPENVINO_CONFIG`); ``threads``: inference threads (None: the
    plugin's default).
    """
    import openvino as ov

    core = ov.Core()
    if isinstance(model, onnx.ModelProto):
        model = core.read_model(serialize(model))
    config: dict[str, Any] = dict(OPENVINO_CONFIG)
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    return core.compile_model(model, "CPU", config)


class OpenVINOSession:
    """A compiled FakeQuantize model behind onnxruntime's ``run(names, feed)`` call."""

    def __init__(self, model: Any, threads: int | None = None) -> None:
        self.compiled = openvino_compile(model, threads)
        self.ports = {n: port for port in self.compiled.outputs for n in port.get_names()}

    def run(self, names: list[str] | None, feed: dict[str, Any]) -> list[Any]:
        """The outputs ``names`` (None: all) on ``feed``, as numpy arrays."""
        import numpy as np

        result = self.compiled(feed)
        ports = list(self.compiled.outputs) if names is None else [self.ports[n] for n in names]
        return [np.asarray(result[p]) for p in ports]
