"""Check: every float output compared with fp32 on a few batches; latency on request.

A MatMul/Gemm of int16 activations that onnxruntime computes with 8-bit activations (its
MatMulNBits fusion) is named in a warning, with the session option that avoids it.

A FakeQuantize model (``--format openvino``) runs in OpenVINO where it is installed, and its
outputs are compared with the fake-quantized model's in onnxruntime as well (a conversion or
kernel fault of OpenVINO's is warned about, not written in silence).

Needs ``state.model``, ``state.session``, ``state.dataset`` and fp32 reference outputs: of
the batches held back for the recipe choice (never fitted on) where there are some, else of
the first calibration batches (the calibrator keeps them). Leaves ``state.check_warnings``
and ``state.latency``.
"""

from __future__ import annotations

from typing import Any

from onnxq.core.errors import DataError
from onnxq.io.openvino import OpenVINOSession
from onnxq.io.openvino import available as openvino_available
from onnxq.passes.manager import CHECK_BATCHES, PassResult, State
from onnxq.prepare.depthwise_scaling import candidates
from onnxq.simulate import checks
from onnxq.simulate.emulate import emulate


class Check:
    """Accuracy (always) and latency (with ``latency_check``) of onnxruntime output.

    OpenVINO output against the fake-quantized model where OpenVINO is installed.
    """

    name = "check"

    def run(self, state: State) -> PassResult:
        """Warn below the SQNR floor (naming the first layer below it) and when int8 is slower."""
        o, dataset = state.options, state.dataset
        runtime = o.output_format.runtime
        if dataset is None or runtime not in ("onnxruntime", "openvino"):
            return PassResult()
        if runtime == "openvino" and not openvino_available():
            return PassResult()  # checked structurally only (verify); pip install openvino
        # the batches held back for the recipe choice where there are some: never fitted on
        reference = state.held_back[:CHECK_BATCHES] or state.calibrator.reference
        feeds = [feed for feed, _ in reference]
        if not reference:
            try:
                dataset.reset()
                for feed in dataset.batches():
                    feeds.append(feed)
                    if len(feeds) >= CHECK_BATCHES:
                        break
            except DataError:  # a one-shot iterator: nothing left to check with
                return PassResult()
        outputs = [out for _, out in reference] if reference else None
        float_model = state.quantizer.float_model
        if runtime == "openvino":
            # the model runs in OpenVINO only: its outputs against the fake-quantized model's
            state.check_warnings = checks.runtime_warnings(
                "OpenVINO",
                float_model,
                emulate(state).fixed(),
                OpenVINOSession(state.model),
                feeds,
                outputs,
            )
            n = len(state.check_warnings)
            return PassResult(f"{n} warnings" if n else "")
        advice = (
            _depthwise_advice(float_model, o.kept_float(float_model))
            # not where the trial of auto (onnxq.passes.depthwise_scaling) measured it already
            if o.depthwise_scaling == "off"
            and o.per_channel
            and "depthwise_scaling" not in state.choice
            else None
        )
        warnings = checks.accuracy_warnings(
            float_model, state.model, feeds, state.session, outputs, advice
        )
        narrowed = checks.narrowed_warning(state.model)
        if narrowed:
            warnings.append(narrowed)
        if o.latency_check and feeds:
            lat = checks.latency(float_model, state.model, feeds[0])
            slower = lat.warning()
            if slower:
                warnings.append(slower + _body_hint(state))
            state.latency = {"fp32_ms": lat.fp32_ms, "int8_ms": lat.int8_ms, "ratio": lat.ratio}
        state.check_warnings = warnings
        return PassResult(f"{len(warnings)} warnings" if warnings else "")


def _depthwise_advice(float_model: Any, kept: set[str]) -> dict[str, str]:
    """Depthwise convolution -> the hint for a warning blaming it.

    Those whose input's channels could take a factor into their filters
    (``--depthwise-scaling``, off by default).
    """
    found = candidates(float_model, kept)
    hint = (
        f"; its input's channels can be rescaled into its filters ({len(found)} such "
        "depthwise input(s) in the model): try --depthwise-scaling on"
    )
    return {c.conv.name: hint for c in found}


def _body_hint(state: State) -> str:
    """For a slower int8 model: the Loop/Scan nodes whose bodies run int8 every step."""
    graph = state.quantizer.float_model.graph
    loops = {n.name for n in graph.node if n.op_type in ("Loop", "Scan")}
    named = sorted({b.node for b in state.branches if b.quantized and b.node in loops})
    if not named:
        return ""
    one = len(named) == 1
    return (
        f"; the int8 {'body' if one else 'bodies'} of {', '.join(repr(n) for n in named)} "
        f"{'runs' if one else 'run'} every step: --exclude {' '.join(named)} keeps "
        f"{'it' if one else 'them'} float"
    )
