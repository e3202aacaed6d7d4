"""Requantize: fold DQ→Q pairs so int8 stays int8 between ops.

Needs ``state.graph`` (materialized). Leaves it folded, and
``state.requantize_stats`` (which ops now carry int8, for the decisions).
"""

from __future__ import annotations

from onnxq.passes.manager import PassResult, State, release
from onnxq.post.requantize import Requantizer
from onnxq.prepare.opset import default_opset
from onnxq.solve.constraints import share_scales_graph


class Requantize:
    """Run the Requantizer to its fixed point."""

    name = "requantize"

    def run(self, state: State) -> PassResult:
        """Fold and carry."""
        requantizer = Requantizer(qdq_ops=state.quantizer.template_of().ops)
        requantizer.requantize_graph(state.graph, default_opset(state.quantizer.template))
        state.requantize_stats = s = requantizer.stats
        release(state)
        return PassResult(
            f"{s.folded_pairs} DQ→Q pairs folded, {s.rescaled_pairs} rescaled, "
            f"{len(s.crossed_ops)} ops carried, {len(s.relus_removed)} Relus removed"
        )


class ShareScales:
    """Every QLinear op under a same-scale rule reads its tied inputs on one grid.

    For targets that ask for it.
    """

    name = "share-scales"

    def run(self, state: State) -> PassResult:
        """Requantize the inputs that solving rescaled."""
        shared = set(state.options.target.shared_scale_ops)
        ops = state.quantizer.template_of().ops
        changed = share_scales_graph(state.graph, shared, state.solution.rescales, ops)
        return PassResult(f"{len(changed)} inputs requantized" if changed else "")
