"""Check: every float output compared with fp32 on a few batches; latency on request.

Needs ``state.model``, ``state.session``, ``state.dataset`` and the calibrator's fp32
reference outputs. Leaves ``state.check_warnings`` and ``state.latency``.
"""

from __future__ import annotations

from onnxq.errors import DataError
from onnxq.passes.calibrate import CHECK_BATCHES
from onnxq.passes.manager import PassResult, State
from onnxq.tools import checks


class Check:
    """Accuracy (always) and latency (with ``latency_check``) of onnxruntime output."""

    name = "check"

    def run(self, state: State) -> PassResult:
        """Warn below the SQNR floor (naming the first layer below it) and when int8 is slower."""
        o, dataset = state.options, state.dataset
        if o.output_format.runtime != "onnxruntime" or dataset is None:
            return PassResult()
        reference = state.calibrator.reference
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
        warnings = checks.accuracy_warnings(float_model, state.model, feeds, state.session, outputs)
        if o.latency_check and feeds:
            lat = checks.latency(float_model, state.model, feeds[0])
            slower = lat.warning()
            if slower:
                warnings.append(slower)
            state.latency = {"fp32_ms": lat.fp32_ms, "int8_ms": lat.int8_ms, "ratio": lat.ratio}
        state.check_warnings = warnings
        return PassResult(f"{len(warnings)} warnings" if warnings else "")
