"""Annotate: match the rules and rewrite each group with placeholder parameters.

Needs ``state.float_model`` (and ``state.float_graph``, its graph, unless a float rewrite
changed the model after preprocessing). Leaves ``state.quantizer``: the preprocessed float
model, the template with placeholders, the records of what each rule matched and the
decisions.
"""

from __future__ import annotations

import onnx

from onnxq.annotate.quantizer import Quantizer
from onnxq.io.graph import skeleton
from onnxq.passes.manager import PassResult, State, release


def _hand_over(state: State) -> onnx.ModelProto:
    """The float model for the Quantizer, which keeps its own preprocessed copy of it.

    The state keeps only the weightless skeleton (later passes read its ops: the report's
    histogram), so no second copy of the weights outlives the hand-over.
    """
    model = state.float_model
    state.float_model = skeleton(model)
    return model


class Annotate:
    """Run the Quantizer over the float model."""

    name = "annotate"

    def run(self, state: State) -> PassResult:
        """Build the annotated template."""
        o = state.options
        graph, state.float_graph = state.float_graph, None
        q = Quantizer(
            _hand_over(state),
            o.patterns,
            o.quantizer_config(),
            state.float_nodes,
            copy=False,
            prepared=graph,  # None: a float rewrite changed the model, preprocessed again
        )
        # graphsurgeon graphs are reference cycles: free the stages' copies now, and hand the
        # pages back (the 2 GB transformer held 1.2x its weights in freed heap otherwise)
        release(state)
        state.quantizer = q
        matched = len({n for rec in q.records for n in rec.nodes})
        return PassResult(
            f"{len(q.records)} groups ({matched} nodes), {len(q.placeholders)} placeholders"
        )
