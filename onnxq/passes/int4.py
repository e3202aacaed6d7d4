"""Int4: block-wise int4 weights, for the nodes ``--config`` asks for or for the whole model.

Needs ``state.model`` and ``state.quantizer.int4_nodes``. Leaves ``state.model`` with those
weights as int4 DequantizeLinear (opset 21, block_size).
"""

from __future__ import annotations

from onnxq.passes.manager import PassResult, State
from onnxq.post.weight_only import quantize_weights_int4


class Int4Weights:
    """Quantize the chosen weights to int4 (nothing when none was chosen)."""

    name = "int4-weights"

    def run(self, state: State) -> PassResult:
        """Rewrite the chosen weights."""
        nodes = set(state.quantizer.int4_nodes)
        if not nodes:
            return PassResult()
        state.model, wo = quantize_weights_int4(
            state.model, state.options.block_size, nodes=nodes, prepare=False
        )
        return PassResult(f"{len(wo.quantized)} weights int4")


class WeightOnlyInt4:
    """Every MatMul/Gemm weight block-wise int4, no calibration (``weight_dtype="int4"``)."""

    name = "int4-weight-only"

    def run(self, state: State) -> PassResult:
        """Quantize every eligible weight."""
        state.model, state.weight_only = quantize_weights_int4(
            state.float_model, state.options.block_size
        )
        wo = state.weight_only
        return PassResult(f"{len(wo.quantized)} weights int4, {len(wo.skipped)} kept float")
