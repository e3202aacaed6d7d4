"""Solve: the constraints between calibrated values (shared scales, rescales).

Needs ``state.quantizer`` and ``state.values``. Leaves the solved ``state.values`` and
``state.solution`` (the shared groups and the rescales, for the report).
"""

from __future__ import annotations

from onnxq.passes.manager import PassResult, State
from onnxq.solve.constraints import solve


class Solve:
    """Propagate the target's same-scale constraints over the values."""

    name = "solve"

    def run(self, state: State) -> PassResult:
        """Resolve the constraints."""
        shared = set(state.options.target.shared_scale_ops)
        asks = state.calibrator.report.asks if state.calibrator is not None else []
        solution = solve(state.quantizer, state.values, shared, asks)
        state.values, state.solution = solution.values, solution
        parts = []
        if solution.shared:
            parts.append(f"{len(solution.shared)} shared-scale groups")
        if solution.rescales:
            parts.append(f"{len(solution.rescales)} rescales")
        if solution.merged:
            parts.append(f"{len(solution.merged)} conflicts merged")
        return PassResult(", ".join(parts))
