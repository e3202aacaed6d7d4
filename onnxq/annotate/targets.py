"""Targets as data: what a runtime runs well, separate from what the user asks for.

A :class:`Target` names the output format, the activation and weight conventions and the
patterns worth quantizing for one runtime. ``--target NAME`` picks one; explicit options
(``--format``, ``--activation-dtype``, …) still win. Users add targets from Python
(:func:`register_target`) or from a TOML file (``--target-file``)::

    [target.my-npu]
    format = "qdq"
    activation_dtype = "int8"
    symmetric_activations = true
    weight_bits = 8                 # or "auto" (the default): 7 where onnxruntime would clip
    patterns = ["conv", "conv+bias", "gemm", "gemm+bias"]
    shared_scale_ops = ["Concat", "Add"]  # ports that share one scale (onnxq.core.constraints)
    int16_activations = true        # runs int16 activations with int8 weights (a16w8)

A target with ``int16_activations`` (QDQ format only) is one whose runtime runs a layer with
int16 activations and int8 weights as integer code, as many NPUs do: the accuracy-driven
fallback and ``onnxq debug`` then return a group to int16 activations rather than to float
(onnxq.fallback). onnxruntime's CPU kernels are 8-bit, so no built-in target declares it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from onnxq.annotate.config import load_toml
from onnxq.core.constraints import SHAREABLE
from onnxq.core.errors import ConfigError
from onnxq.io.text import shown
from onnxq.lower.formats import FORMATS

#: ops whose scale sharing onnxq.solve.constraints can enforce (onnxq.core.constraints)
SHAREABLE_OPS = SHAREABLE
RUNTIMES = ("onnxruntime", "tensorrt", "openvino", "other")


@dataclass(frozen=True)
class Target:
    """A runtime's conventions. ``patterns`` None means every pattern of the library."""

    name: str
    description: str = ""
    format: str = "qoperator"
    activation_dtype: str = "uint8"
    symmetric_activations: bool = False
    per_channel: bool = True
    #: 8 or 7; None ("auto") is 7 only where this machine's onnxruntime clips U8S8 products
    weight_bits: int | None = None
    patterns: tuple[str, ...] | None = None
    unsigned_after_relu: bool = False
    #: QDQ output: a Q/DQ pair per consumer (TensorRT fuses each pair into its layer)
    dedicated_qdq_pairs: bool = False
    #: ops whose inputs and output share one scale and zero point (onnxq.solve.constraints)
    shared_scale_ops: tuple[str, ...] = ()
    #: what runs the model: "onnxruntime" (weight_bits auto then measures its CPU kernels),
    #: "tensorrt", "openvino" or "other"
    runtime: str = "onnxruntime"
    #: the runtime runs int16 activations with int8 weights as integer code (QDQ format): the
    #: fallback returns groups to int16 activations, not to float
    int16_activations: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(
                f"target {self.name!r}: format {self.format!r} is not one of {', '.join(FORMATS)}"
            )
        if self.activation_dtype not in ("uint8", "int8"):
            raise ConfigError(f"target {self.name!r}: activation_dtype must be uint8 or int8")
        if self.weight_bits not in (None, 7, 8):
            raise ConfigError(f'target {self.name!r}: weight_bits must be 8, 7 or "auto"')
        if self.runtime not in RUNTIMES:
            raise ConfigError(
                f"target {self.name!r}: runtime {self.runtime!r} is not one of "
                f"{', '.join(RUNTIMES)}"
            )
        if self.int16_activations and not FORMATS[self.format].int16:
            raise ConfigError(
                f'target {self.name!r}: int16_activations needs format = "qdq" (int16 '
                f"activations are standard Q/DQ, opset 21); {self.format} has no int16 kernels"
            )
        unknown = set(self.shared_scale_ops) - SHAREABLE_OPS
        if unknown:
            raise ConfigError(
                f"target {self.name!r}: shared_scale_ops {sorted(unknown)} are not supported; "
                f"onnxq can share scales across {', '.join(sorted(SHAREABLE_OPS))}"
            )


BUILTIN = (
    Target(
        "ort-cpu",
        "onnxruntime CPU: uint8 activations (U8S8 kernels), int8 per-channel weights (7-bit on "
        "CPUs without VNNI, where those kernels clip), QLinear ops",
        "qoperator",
        "uint8",
    ),
    Target(
        "tensorrt",
        "TensorRT: int8 symmetric activations and weights, standard Q/DQ that TensorRT fuses, "
        "a Q/DQ pair per consumer",
        "qdq",
        "int8",
        symmetric_activations=True,
        dedicated_qdq_pairs=True,
        shared_scale_ops=("Concat", "Add", "MaxPool", "Resize", "Pad", "Slice", "Split", "Gather"),
        runtime="tensorrt",
        weight_bits=8,
    ),
    Target(
        "openvino",
        "OpenVINO: FakeQuantize on the float graph, uint8 activations (7-bit weights on CPUs "
        "without VNNI, where its kernels clip)",
        "openvino",
        "uint8",
        runtime="openvino",
    ),
    Target(
        "generic",
        "any runtime that reads standard ONNX Q/DQ (weights 7-bit where onnxruntime would clip)",
        "qdq",
        "uint8",
    ),
)
_REGISTRY: dict[str, Target] = {t.name: t for t in BUILTIN}


def register_target(target: Target) -> None:
    """Add (or replace) a target by name."""
    _REGISTRY[target.name] = target


def get_target(name: str) -> Target:
    """The target called ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"target {name!r} is unknown; known targets: {', '.join(sorted(_REGISTRY))}"
        ) from None


def targets() -> list[Target]:
    """Every registered target."""
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def load_targets(
    path: str | os.PathLike[str], warn: Callable[[str], None] | None = None
) -> list[Target]:
    """Register the ``[target.NAME]`` tables of a TOML file and return them.

    Every value is checked against the type of its :class:`Target` field; a table that
    redefines a built-in target is ``warn``-ed about (it replaces it for this process).
    """
    where = f"--target-file '{shown(str(path))}'"
    doc = load_toml(path, "--target-file")
    tables = doc.get("target", {})
    if not isinstance(tables, dict):
        raise ConfigError(
            f"{where}: target = {_value(tables)} must be tables instead, e.g. [target.my-npu] "
            'with format = "qdq" on the next line'
        )
    loaded = []
    for name, table in tables.items():
        label = f"[target.{shown(name)}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {label} must be a table")
        unknown = set(table) - set(_KINDS)
        if unknown:
            raise ConfigError(
                f"{where}: {label} has unknown key(s) {shown(str(sorted(unknown)))}; the keys "
                f"are {', '.join(sorted(_KINDS))}"
            )
        values = {key: _typed(where, label, key, value) for key, value in table.items()}
        target = Target(name=name, **values)
        if name in _BUILTIN_NAMES and warn is not None:
            warn(f"{where}: {label} replaces the built-in target {name!r} for this run")
        register_target(target)
        loaded.append(target)
    if not loaded:
        raise ConfigError(f"{where} defines no [target.NAME] table")
    return loaded


#: what each key of a [target.NAME] table takes: a type, or "names" (an array of strings),
#: or "bits" (8, 7 or "auto")
_KINDS: dict[str, Any] = {
    "description": str,
    "format": str,
    "activation_dtype": str,
    "symmetric_activations": bool,
    "per_channel": bool,
    "weight_bits": "bits",
    "patterns": "names",
    "unsigned_after_relu": bool,
    "dedicated_qdq_pairs": bool,
    "shared_scale_ops": "names",
    "runtime": str,
    "int16_activations": bool,
}
_BUILTIN_NAMES = frozenset(t.name for t in BUILTIN)


def _typed(where: str, label: str, key: str, value: Any) -> Any:
    """A table value as its Target field takes it, or a ConfigError naming it."""
    kind = _KINDS[key]
    if kind == "names":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        expected = 'an array of names, e.g. ["conv", "gemm"]'
    elif kind == "bits":
        if value == "auto":
            return None
        if type(value) is int:
            return value
        expected = '8, 7 or "auto"'
    elif type(value) is kind:
        return value
    else:
        expected = "true or false" if kind is bool else "a string"
    raise ConfigError(f"{where}: {key} = {_value(value)} in {label} must be {expected}")


def _value(value: Any) -> str:
    return shown(repr(value), 80)
