"""Save: the output model (atomically) and the range table, where asked.

Needs ``state.model`` and, for ``save_ranges``, the calibrator's ranges. Lets go of
``state.session`` (the verification session: nothing after the checks runs it).
"""

from __future__ import annotations

from onnxq.calibrate.ranges import write_ranges
from onnxq.io.graph import save_model
from onnxq.passes.manager import PassResult, State, release


class Save:
    """Write what the options ask to be written."""

    name = "save"

    def run(self, state: State) -> PassResult:
        """Write the model and the ranges."""
        o = state.options
        wrote = []
        # nothing after the checks runs the verification session: let its copy of the
        # model go before the writer serializes one (a 2 GB model's peak was here)
        state.session = None
        release(state)
        if o.output is not None:
            save_model(state.model, o.output)
            wrote.append(str(o.output))
        if o.save_ranges is not None:
            method = o.method if o.callback is None else "callback"
            cal = state.calibrator
            means = {t: cal.channel_mean(t) for t in sorted(cal.channel_sums)}
            smoothed = any(v["alpha"] is not None for v in state.smoothing.values())
            scaled = any(v["folded_into"] for v in state.depthwise_scaling.values())
            rewrites = (
                ["equalization"] * bool(state.equalization)
                + ["smoothquant"] * smoothed
                + ["depthwise-scaling"] * scaled
            )
            write_ranges(o.save_ranges, cal.ranges, method, means, rewrites)
            wrote.append(str(o.save_ranges))
        return PassResult(f"wrote {', '.join(wrote)}" if wrote else "")
