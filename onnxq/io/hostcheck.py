"""What the runtimes on this machine do with int8 arithmetic, measured once per process.

x86-64 CPUs without VNNI (AVX2, AVX-512 before Cascade Lake) multiply uint8 activations by int8
weights with ``vpmaddubsw``, which adds each pair of products into a *saturating* int16. With
8-bit weights a pair reaches 2·255·127 = 64,770 > 32,767, so onnxruntime's default U8S8 kernels
(QLinearConv, QGemm, QLinearMatMul, MatMulInteger, and QDQ models fused into them) return
clipped sums: the quantized model is silently wrong on such a machine. 7-bit weights keep every
pair within 2·255·63 = 32,130. onnxruntime's session option ``session.x64quantprecision=1``
selects a slower exact path instead, but that is the user's session, not the model.

OpenVINO's CPU plugin does the same with FakeQuantize models on such CPUs (7-bit weights are
the remedy its tools use). Rather than guess from CPU flags, :func:`saturates` runs one tiny
product in the runtime whose exact result needs the full int32 sum, and compares.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

#: the onnxruntime session option that selects the exact (slower) U8S8 path on such CPUs
PRECISE_OPTION = "session.x64quantprecision"

_K = 64  # reduced length of the probes; any even length shows the clipping
_EXACT = 255 * 127 * _K


@functools.cache
def u8s8_saturates() -> bool:
    """True when onnxruntime's default CPU session clips uint8 × int8 pair sums to int16."""
    import onnxruntime as ort

    a = np.full((4, _K), 255, np.uint8)
    b = np.full((_K, 16), 127, np.int8)
    graph = h.make_graph(
        [h.make_node("MatMulInteger", ["a", "b"], ["y"])],
        "u8s8_probe",
        [h.make_tensor_value_info("a", TensorProto.UINT8, list(a.shape))],
        [h.make_tensor_value_info("y", TensorProto.INT32, [4, 16])],
        [nh.from_array(b, "b")],
    )
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(
        _model(graph).SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    return bool(np.any(session.run(None, {"a": a})[0] != _EXACT))


@functools.cache
def openvino_saturates() -> bool | None:
    """The same for OpenVINO's CPU plugin on a FakeQuantize model; None without OpenVINO."""
    from onnxq.io.openvino import available, openvino_compile

    if not available():
        return None
    ranges = {"lo_x": 0.0, "hi_x": 255.0, "lo_w": -127.0, "hi_w": 127.0}
    graph = h.make_graph(
        [
            _fake_quantize("xq", "x", 256),
            _fake_quantize("wq", "w", 255),
            h.make_node("MatMul", ["xq", "wq"], ["y"]),
        ],
        "fq_probe",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [4, _K])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
        [nh.from_array(np.full((_K, 16), 127, np.float32), "w")]
        + [nh.from_array(np.array(v, np.float32), k) for k, v in ranges.items()],
    )
    model = _model(graph, ("org.openvinotoolkit", 1))
    compiled = openvino_compile(model)
    got = compiled(np.full((4, _K), 255, np.float32))[0]
    return bool(np.any(np.abs(got - _EXACT) > 0.5))


def saturates(runtime: str) -> bool | None:
    """Whether ``runtime`` ("onnxruntime" or "openvino") clips 8-bit products here."""
    if runtime == "onnxruntime":
        return u8s8_saturates()
    if runtime == "openvino":
        return openvino_saturates()
    return False


def _fake_quantize(out: str, src: str, levels: int) -> onnx.NodeProto:
    lo, hi = f"lo_{src}", f"hi_{src}"
    return h.make_node(
        "FakeQuantize", [src, lo, hi, lo, hi], [out], domain="org.openvinotoolkit", levels=levels
    )


def _model(graph: onnx.GraphProto, *domains: tuple[str, int]) -> onnx.ModelProto:
    opsets = [h.make_opsetid("", 13), *(h.make_opsetid(d, v) for d, v in domains)]
    model = h.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


_WHY = {
    "onnxruntime": "onnxruntime's U8S8 kernels",
    "openvino": "OpenVINO's CPU kernels",
}
_ELSEWHERE = {
    "onnxruntime": "on a CPU with VNNI or with session.x64quantprecision=1",
    "openvino": "on a CPU with VNNI",
}


def auto_weight_bits(runtime: str, clipping_path: bool) -> tuple[int, str]:
    """Weight bits for ``weight_bits = auto`` and the sentence that explains the choice.

    7 only where it matters: the model runs in ``runtime`` on a path that multiplies uint8 by
    int8 (``clipping_path``), and that runtime clips such products on this machine; 8 everywhere
    else ('' needs no explanation).
    """
    if not clipping_path:
        return 8, ""
    clips = saturates(runtime)
    if clips:
        return 7, (
            f"weights are 7-bit ([-63, 63]): {_WHY[runtime]} clip 8-bit products to int16 on "
            f"this CPU (no VNNI); pass --weight-bits 8 for a model to run {_ELSEWHERE[runtime]}"
        )
    if clips is None:
        return 8, (
            f"weights are 8-bit; {runtime} is not installed here, so onnxq could not measure "
            "whether its CPU kernels clip 8-bit products on this machine (they do on x86 CPUs "
            "without VNNI: pass --weight-bits 7 for those)"
        )
    return 8, ""


def saturation_warning(runtime: str, clipping_path: bool, bits: int) -> str:
    """A warning for explicit 8-bit weights that this machine's runtime would clip."""
    if bits == 8 and clipping_path and saturates(runtime):
        return (
            f"8-bit weights: this CPU has no VNNI and {_WHY[runtime]} clip such products to "
            f"int16, so the model is inaccurate here; run it {_ELSEWHERE[runtime]}, or quantize "
            "with --weight-bits 7"
        )
    return ""
