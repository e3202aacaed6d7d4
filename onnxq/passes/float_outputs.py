"""Float outputs: int8 MatMul/Gemm results that only float ops read are written in float.

Needs the requantized ``state.graph`` (runs before the lowering). Leaves ``state.graph`` with
those nodes as ``MatMulIntegerToFloat`` or float-output ``QGemm`` (in QDQ form: without the
QuantizeLinear after them; onnxq.post.float_outputs), and ``state.float_outputs`` (their
names), which the report lists.
"""

from __future__ import annotations

from onnxq.passes.manager import PassResult, State
from onnxq.post.float_outputs import float_outputs


class FloatOutputs:
    """Drop the output rounding of MatMul/Gemm nodes whose readers all dequantize at once."""

    name = "float-outputs"

    def run(self, state: State) -> PassResult:
        """Rewrite the nodes; say how many."""
        state.float_outputs = float_outputs(state.graph, state.quantizer.template_of().ops)
        n = len(state.float_outputs)
        return PassResult(f"{n} MatMul/Gemm write float (only float ops read them)" if n else "")
