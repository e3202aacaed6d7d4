"""Load: the float model, refused when already quantized, at the opset its output needs.

Needs ``state.source``. Leaves ``state.float_model`` (a new model; the caller's is untouched)
and ``state.kind`` (CNN, transformer, recurrent: onnxq.prepare.kind), which sets the defaults.
"""

from __future__ import annotations

import onnx

from onnxq.core.errors import ModelError
from onnxq.core.optable import INTEGER_OPS, qops
from onnxq.io.graph import all_graphs, load_model
from onnxq.options import QuantizeOptions
from onnxq.passes.manager import PassResult, State
from onnxq.post.weight_only import INT4_OPSET
from onnxq.prepare.kind import detect
from onnxq.prepare.opset import default_opset, raise_opset

#: ops that mark a model as already quantized
QUANTIZED_OPS = (
    frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
    | qops()
    | INTEGER_OPS
)

#: the opset of int16 Q/DQ
INT16_OPSET = 21


def describe(source: object) -> str:
    """How messages name the model the caller gave."""
    return "the given model" if isinstance(source, onnx.ModelProto) else f"'{source}'"


def quantized_ops(model: onnx.ModelProto) -> list[str]:
    """The quantized op types ``model`` holds (QOperator, Q/DQ, integer ops, FakeQuantize).

    Its If/Loop/Scan bodies included: a model onnxq quantized may hold them there alone
    (silero-vad).
    """
    return sorted(
        {
            n.op_type
            for g in all_graphs(model.graph)
            for n in g.node
            if n.op_type in QUANTIZED_OPS or n.op_type == "FakeQuantize"
        }
    )


def refuse_quantized(model: onnx.ModelProto, where: str, command: str = "quantize") -> None:
    """Raise when ``model`` already holds quantized ops (in its bodies too)."""
    found = [op for op in quantized_ops(model) if op != "FakeQuantize"]
    if found and not any(n.op_type in QUANTIZED_OPS for n in model.graph.node):
        raise ModelError(
            f"{where} is already quantized inside its If/Loop/Scan bodies (they hold "
            f"{', '.join(found)}); {command} the float model instead"
        )
    if found:
        raise ModelError(
            f"{where} is already quantized (it holds {', '.join(found)}); {command} the float "
            "model instead, or retarget this one with `onnxq convert`"
        )


class Load:
    """Read the model and raise its opset where the chosen output needs it."""

    name = "load"

    def __init__(self, raise_opsets: bool = True):
        #: False for passes that set the opset themselves (whole-model int4)
        self.raise_opsets = raise_opsets

    def run(self, state: State) -> PassResult:
        """Load, refuse quantized models, raise the opset (int16, int4, per-channel QDQ)."""
        o = state.options
        model = load_model(state.source)
        refuse_quantized(model, describe(state.source))
        before = default_opset(model)
        if self.raise_opsets:
            model = raise_for_output(model, o)
        state.float_model = model
        after = default_opset(model)
        detected, why = detect(model)
        if o.model_kind == "auto":
            state.kind, state.kind_reason = detected, why
        else:
            state.kind = o.model_kind
            state.kind_reason = f"as asked (the graph says {detected}: {why})"
        opset = f"opset {before} → {after}; " if after != before else ""
        return PassResult(f"{opset}{state.kind} model ({state.kind_reason})")


def raise_for_output(model: onnx.ModelProto, o: QuantizeOptions) -> onnx.ModelProto:
    """``model`` at the opset the output format needs for what ``o`` asks."""
    fmt = o.output_format
    if fmt.int16 and o.asks("activation_dtype", "int16"):
        model = raise_opset(model, INT16_OPSET, "int16 activations")
    if fmt.int4 and o.user is not None and o.user.asks("weight_dtype", "int4"):
        model = raise_opset(model, INT4_OPSET, "int4 weights")
    if fmt.per_channel_opset and o.asks("per_channel", True):
        model = raise_opset(model, fmt.per_channel_opset, "per-channel QDQ")
    return model
