"""onnxruntime sessions, built one way everywhere (CPU, all optimisations, quiet logs)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import onnx

from onnxq import graph
from onnxq.errors import ModelError
from onnxq.graph import serialize


def make_session(
    model: onnx.ModelProto, threads: int = 0, optimize: bool = True, exact: bool = False
) -> Any:
    """An onnxruntime CPU InferenceSession for ``model`` (``threads`` 0 = onnxruntime's choice).

    ``exact`` selects onnxruntime's exact U8S8 path on CPUs without VNNI (see onnxq.hostcheck):
    for onnxq's own layer-by-layer measurements, which must see the quantization error, not the
    host's int16 clipping. What users run (verify, compare, the zoo) uses the default session.
    """
    import onnxruntime as ort

    from onnxq.hostcheck import PRECISE_OPTION, u8s8_saturates

    def options(precise: bool) -> Any:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if precise:
            opts.add_session_config_entry(PRECISE_OPTION, "1")
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        if not optimize:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return opts

    precise = exact and u8s8_saturates()
    try:
        return _session(ort, model, options(precise))
    except Exception as exc:  # onnxruntime raises its own exception types
        if precise:  # the exact path has no int8-activation QLinearConv; those kernels are exact
            try:
                return _session(ort, model, options(False))
            except Exception:  # report the first failure below
                pass
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"onnxruntime cannot load the model: {first}") from None


def _session(ort: Any, model: onnx.ModelProto, opts: Any) -> Any:
    if model.ByteSize() < graph.TWO_GIB:
        return ort.InferenceSession(serialize(model), opts, providers=["CPUExecutionProvider"])
    # protobuf cannot serialize 2 GB: hand onnxruntime a file with external data
    with tempfile.TemporaryDirectory(prefix="onnxq-session-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        graph.save_model(model, path)
        return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def output_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor whose type the model records."""
    g = model.graph
    types: dict[str, int] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in g.initializer:
        types[init.name] = init.data_type
    return types
