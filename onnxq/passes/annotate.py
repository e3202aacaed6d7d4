"""Annotate: match the rules and rewrite each group with placeholder parameters.

Needs ``state.float_model``. Leaves ``state.quantizer``: the preprocessed float model, the
template with placeholders, the records of what each rule matched and the decisions.
"""

from __future__ import annotations

import gc

from onnxq.annotate.quantizer import Quantizer
from onnxq.passes.manager import PassResult, State


class Annotate:
    """Run the Quantizer over the float model."""

    name = "annotate"

    def run(self, state: State) -> PassResult:
        """Build the annotated template."""
        o = state.options
        q = Quantizer(state.float_model, o.patterns, o.quantizer_config(), state.float_nodes)
        gc.collect()  # graphsurgeon graphs are reference cycles: free the stages' copies now
        state.quantizer = q
        matched = len({n for rec in q.records for n in rec.nodes})
        return PassResult(
            f"{len(q.records)} groups ({matched} nodes), {len(q.placeholders)} placeholders"
        )
