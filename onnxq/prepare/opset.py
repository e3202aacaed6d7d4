"""The model's opset, and raising it with onnx's version converter."""

from __future__ import annotations

import onnx

from onnxq.core.errors import ModelError


def default_opset(model: onnx.ModelProto) -> int:
    """The model's ai.onnx opset version."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 1


def raise_opset(model: onnx.ModelProto, opset: int, why: str) -> onnx.ModelProto:
    """``model`` converted to at least ``opset`` with onnx's version converter (or unchanged)."""
    have = default_opset(model)
    if have >= opset:
        return model
    try:
        out = onnx.version_converter.convert_version(model, opset)
    except Exception as exc:  # the converter raises RuntimeError and others
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(
            f"{why} needs opset {opset}; the model has opset {have} and converting "
            f"it failed ({first}); re-export with opset >= {opset} or use "
            "--per-tensor"
        ) from None
    # the converter keeps the IR version: an IR 3 export (initializers listed as graph inputs)
    # raised to opset 13 without them is invalid until it declares the IR that opset needs
    needed = onnx.helper.find_min_ir_version_for(list(out.opset_import), ignore_unknown=True)
    out.ir_version = max(out.ir_version, needed)
    return out
