"""Verify: the output passes onnx.checker and loads in the runtime it is meant for.

Needs ``state.model``. Leaves ``state.session``: the onnxruntime session it built (None for
OpenVINO output), which the accuracy check reuses.
"""

from __future__ import annotations

from typing import Any

import onnx

from onnxq.core.errors import ModelError
from onnxq.io.graph import check_model
from onnxq.io.openvino import available as openvino_available
from onnxq.io.openvino import openvino_compile
from onnxq.io.session import make_session
from onnxq.passes.manager import PassResult, State


def verify(
    model: onnx.ModelProto,
    runtime: str = "onnxruntime",
    float_model: onnx.ModelProto | None = None,
    exact: bool = False,
) -> Any:
    """The output must pass onnx.checker and load in its runtime (OpenVINO when installed).

    Returns the onnxruntime session it built (None for OpenVINO), for checks that run the model;
    ``exact``: onnxruntime's exact U8S8 path, for a model meant for another runtime (TensorRT),
    so that the checks do not report this CPU's int16 clipping as the model's error.
    When OpenVINO refuses the output, ``float_model`` (if given) tells whether it refuses the
    float model too, which the error then says.
    """
    check_model(model, "the quantized model")
    if runtime == "onnxruntime":
        return make_session(model, exact=exact, arena=False)
    if not openvino_available():
        return None  # checked structurally only; `pip install openvino` to run it
    try:
        openvino_compile(model)
    except Exception as exc:  # OpenVINO raises RuntimeError and others
        reason = _openvino_reason(exc)
        float_reason = _float_loads_in_openvino(float_model)
        either = ""
        if float_reason:
            same = "for the same reason" if float_reason == reason else f"({float_reason})"
            either = f"; it cannot load the float model either, {same}"
        raise ModelError(
            f"the OpenVINO runtime cannot load the model: {reason}{either}; use --format qdq "
            "or qoperator for onnxruntime"
        ) from None
    return None


def _openvino_reason(exc: BaseException) -> str:
    """The informative line of an OpenVINO exception (its first lines are source locations)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for marker in ("While validating", "-- "):
        for ln in lines:
            if ln.startswith(marker) or marker in ln:
                return ln.lstrip("- ").split(" failed at ")[0][:300]
    useful = [ln for ln in lines if not ln.startswith(("Exception from", "Check '"))]
    return (useful or lines or [type(exc).__name__])[0][:300]


def _float_loads_in_openvino(float_model: onnx.ModelProto | None) -> str:
    """'' when OpenVINO loads ``float_model`` (or none is given), else its reason."""
    if float_model is None:
        return ""
    try:
        openvino_compile(float_model)
    except Exception as exc:  # OpenVINO raises RuntimeError and others
        return _openvino_reason(exc)
    return ""


class Verify:
    """Check the output and load it in its runtime."""

    name = "verify"

    def run(self, state: State) -> PassResult:
        """onnx.checker, then a session."""
        runtime = state.options.output_format.runtime
        float_model = state.quantizer.float_model if state.quantizer else state.float_model
        # a model meant for another runtime (TensorRT) is checked in onnxruntime's exact mode:
        # its accuracy there is what that runtime computes, not this CPU's U8S8 clipping
        exact = state.options.target.runtime != "onnxruntime"
        state.session = verify(state.model, runtime, float_model, exact)
        return PassResult()
