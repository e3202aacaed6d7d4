"""The output formats as data: what each can hold, which runtime runs it, how it is lowered.

Every question the rest of onnxq asks about an output format ("does it have int16 kernels?",
"which runtime checks it?") is a field here, so no other module branches on a format's name.
Each format writes the annotation in its own form from the records (:attr:`Format.writer`:
the QOperator or the QDQ template, siblings); :meth:`Format.lower` finishes the materialized,
requantized model into what is written (FakeQuantize is written from the records and solved
values instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnx

from onnxq.core.errors import ConfigError
from onnxq.lower.fakequantize import to_fakequantize
from onnxq.lower.qdq import PER_CHANNEL_OPSET, QDQWriter, lower_qdq
from onnxq.lower.qoperator import TemplateWriter
from onnxq.prepare.fusions import fuse_gelu

#: a lowering: (requantized model in the format's form, or None for a format written from the
#: records; quantizer, values, options, replaced constants) -> the output model
Lowering = Callable[
    [onnx.ModelProto | None, Any, dict[str, Any], Any, dict[str, Any]], onnx.ModelProto
]


def _qoperator(
    model: onnx.ModelProto | None,
    quantizer: Any,
    values: dict[str, Any],
    options: Any,
    constants: dict[str, Any],
) -> onnx.ModelProto:
    """QLinear ops as they are; GELUs left whole become one com.microsoft.Gelu kernel."""
    assert model is not None
    out, _ = fuse_gelu(model)
    return out


def _qdq(
    model: onnx.ModelProto | None,
    quantizer: Any,
    values: dict[str, Any],
    options: Any,
    constants: dict[str, Any],
) -> onnx.ModelProto:
    """Written as it is (a Q/DQ pair per consumer for the targets that ask for one)."""
    assert model is not None
    return lower_qdq(model, options.target.dedicated_qdq_pairs)


def _openvino(
    model: onnx.ModelProto | None,
    quantizer: Any,
    values: dict[str, Any],
    options: Any,
    constants: dict[str, Any],
) -> onnx.ModelProto:
    """The float graph with FakeQuantize on every quantized edge (from the annotation)."""
    qrange = (-64, 63) if options.weight_bits == 7 else None
    return to_fakequantize(quantizer, values, qrange, constants)


@dataclass(frozen=True)
class Format:
    """One output format."""

    name: str
    #: what runs it: "onnxruntime" or "openvino" (the checks after quantizing need onnxruntime)
    runtime: str
    lower: Lowering
    #: writes the annotation in this format's form (the template materialize fills)
    writer: type[TemplateWriter] = TemplateWriter
    #: int16 activations (standard Q/DQ from opset 21)
    int16: bool = False
    #: uint8 and int8 activations meeting in one op (--unsigned-after-relu)
    mixed_activation_dtypes: bool = True
    #: its int8-activation kernels are exact where U8S8 products clip (onnxq.io.hostcheck)
    exact_int8_activations: bool = False
    #: per-node block-wise int4 weights
    int4: bool = True
    #: QDQ islands (Q/DQ around ops with no QLinear form)
    islands: bool = True
    #: a written-out GELU is kept whole (and fused into one kernel by the lowering)
    whole_gelu: bool = False
    #: If branches are quantized as graphs of their own
    branches: bool = True
    #: the lowering finishes the requantized model (False: rebuilt from the float model)
    from_requantized: bool = True
    #: opset its per-channel weights need
    per_channel_opset: int = 0


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "qoperator",
            "onnxruntime",
            _qoperator,
            mixed_activation_dtypes=False,
            exact_int8_activations=True,
            islands=False,
            whole_gelu=True,
        ),
        Format(
            "qdq",
            "onnxruntime",
            _qdq,
            QDQWriter,
            int16=True,
            per_channel_opset=PER_CHANNEL_OPSET,
        ),
        Format(
            "openvino",
            "openvino",
            _openvino,
            int4=False,
            branches=False,
            from_requantized=False,
        ),
    )
}


#: the template writers by the form they write (Quantizer.template_of)
WRITERS: dict[str, type[TemplateWriter]] = {w.form: w for w in (TemplateWriter, QDQWriter)}


def get_format(name: str, flag: str = "--format") -> Format:
    """The format called ``name``; an unknown name is a ConfigError naming ``flag``.

    ``flag``: the option as the caller wrote it (``--format`` or ``format``).
    """
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(
            f"{flag} {name!r} is unknown; choose one of {', '.join(FORMATS)}"
        ) from None
