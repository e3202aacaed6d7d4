"""Lower: the requantized QOperator model written in the chosen output format.

Needs ``state.graph`` (exported here; or ``state.model``; a format written from the records,
FakeQuantize, lets it go unexported), ``state.quantizer`` and
``state.constants`` (corrected biases and rounded weights, which the OpenVINO form, rebuilt
from the float model, writes in place of the originals). Leaves ``state.model`` in the output
format (onnxq.lower.formats: QOperator, QDQ or OpenVINO FakeQuantize). For onnxruntime, float
Conv/ConvTranspose/Gemm layers behind a DequantizeLinear read their input through
Cast/Sub/Mul instead, or onnxruntime would quantize their weights per tensor on its own
(onnxq.post.float_guard).
"""

from __future__ import annotations

from onnxq.passes.manager import (
    PassResult,
    State,
    graph_histogram,
    op_changes,
    op_histogram,
    release,
)
from onnxq.post.float_guard import guard_float_layers
from onnxq.prepare.fusions import fuse_gelu_graph


class Lower:
    """Apply the output format's lowering."""

    name = "lower"

    def run(self, state: State) -> PassResult:
        """Lower to ``state.options.format``."""
        fmt = state.options.output_format
        graph = state.graph
        before = graph_histogram(graph) if graph is not None else op_histogram(state.model)
        if fmt.whole_gelu and graph is not None:  # on the pipeline's graph, not imported again
            fuse_gelu_graph(graph)
        if fmt.from_requantized:
            model = state.proto()
        else:  # written from the records and values: the requantized graph is not exported
            state.graph, model = None, None
        state.model = fmt.lower(
            model, state.quantizer, state.values, state.options, state.constants
        )
        guarded: list[str] = []
        if fmt.runtime == "onnxruntime":
            state.model, guarded = guard_float_layers(state.model)
        release(state)
        changed = op_changes(before, op_histogram(state.model))
        note = (
            f"; {len(guarded)} float layer(s) guarded from runtime quantization" if guarded else ""
        )
        return PassResult((f"{fmt.name}: {changed}" if changed else fmt.name) + note)
