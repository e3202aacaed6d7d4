"""Materialize: the template with its placeholders set to the solved values.

Needs ``state.quantizer`` and ``state.values`` (and ``state.constants``, the float biases and
weights an algorithm replaced). Leaves ``state.graph``: a QOperator model
(quantized weights and int32 biases derived from the float constants), and ``state.values`` as
the model holds them (weight scales widened where a bias needs the headroom).
"""

from __future__ import annotations

from onnxq.passes.manager import PassResult, State, graph_histogram, op_changes, op_histogram


class Materialize:
    """Write the values into the template."""

    name = "materialize"

    def run(self, state: State) -> PassResult:
        """Materialize the model."""
        q = state.quantizer
        state.graph = q.materialize_graph(state.values, state.constants)
        state.values = dict(q.final_values)  # after bias widening: what the model holds
        return PassResult(op_changes(op_histogram(q.float_model), graph_histogram(state.graph)))
