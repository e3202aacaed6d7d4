"""Fusions of written-out activations into the single ops runtimes run as one kernel.

HardSwish written out as ``x · Clip(x + 3, 0, 6) / 6`` (paddle2onnx: 28 times in the PP-OCRv4
recogniser) is four element-wise kernels in onnxruntime, float or int8, and hides the
Conv → HardSwish group the QDQ islands fuse. :func:`fuse_hardswish` (run by preprocessing)
writes it as the ONNX ``HardSwish`` op, raising the opset to 14 where needed.

GELU: onnxruntime fuses it in a float graph but not behind a DequantizeLinear.

GELU written out as ``x · 0.5 · (1 + erf(x / √2))`` (paddle2onnx, older PyTorch exports) is one
``Gelu`` kernel in a float onnxruntime session. In a quantized model ``x`` comes from a
DequantizeLinear, and onnxruntime first gives each of the DequantizeLinear's consumers (the Div
and the Mul) its own copy; the two then read different tensors and the GELU fusion no longer
applies: five element-wise kernels run instead of one (PP-OCRv6 tiny: Erf, Div, Mul and Add
took 1.1 ms of its 3.7 ms). :func:`fuse_gelu` writes each such subgraph as one
``com.microsoft.Gelu`` node, the op onnxruntime's own fusion produces, in QOperator output.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxq._rewrite import DFPatternCallback, rewrite
from onnxq.graph import MS_DOMAIN, constant_value, export_model, import_graph
from onnxq.pattern import DFPattern, is_constant, is_op, wildcard


def _scalar(value: float) -> Callable[[gs.Tensor], bool]:
    def test(t: gs.Tensor) -> bool:
        v = constant_value(t)
        return v is not None and v.size == 1 and abs(float(v.reshape(-1)[0]) - value) <= 1e-4

    return test


class GeluFusion(DFPatternCallback):
    """``Mul(Mul(x, Add(Erf(x / √2), 1)), 0.5)`` in its usual arrangements → ``Gelu(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.x = wildcard()
        scaled = is_op("Div")(self.x, is_constant().check(_scalar(math.sqrt(2)), "not √2")) | (
            is_op("Mul")(self.x, is_constant().check(_scalar(1 / math.sqrt(2)), "not 1/√2"))
        )
        one = is_constant().check(_scalar(1.0), "not 1")
        half = is_constant().check(_scalar(0.5), "not 0.5")
        one_plus = is_op("Add")(is_op("Erf")(scaled), one)
        self.pattern: DFPattern = (
            is_op("Mul")(is_op("Mul")(self.x, one_plus), half)
            | is_op("Mul")(is_op("Mul")(self.x, half), one_plus)
            | is_op("Mul")(self.x, is_op("Mul")(one_plus, half))
        )
        #: the node names of every fused GELU
        self.fused: list[list[str]] = []

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        """One Gelu node reading ``x``."""
        m = self.match
        out = self.editor.variable(f"{pre.name}_gelu", np.float32, pre.shape)
        names = [n.name for n in m.nodes]
        self.editor.add_node("Gelu", [m.tensor(self.x)], [out], f"{names[0]}_Gelu", None, MS_DOMAIN)
        self.fused.append(names)
        return out


class HardSwishFusion(DFPatternCallback):
    """``x · Clip(x + 3, 0, 6) / 6`` in its usual arrangements → ``HardSwish(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.x = wildcard()

        def const(value: float, text: str) -> DFPattern:
            # a fresh pattern per use: one pattern object binds one tensor
            return is_constant().check(_scalar(value), f"not {text}")

        relu6 = is_op("Clip")(
            is_op("Add")(self.x, const(3.0, "3")), const(0.0, "0"), const(6.0, "6")
        )
        self.pattern: DFPattern = (
            is_op("Div")(is_op("Mul")(self.x, relu6), const(6.0, "6"))
            | is_op("Mul")(is_op("Mul")(self.x, relu6), const(1 / 6, "1/6"))
            | is_op("Mul")(self.x, is_op("Div")(relu6, const(6.0, "6")))
            | is_op("Mul")(self.x, is_op("Mul")(relu6, const(1 / 6, "1/6")))
        )
        self.fused: list[list[str]] = []

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        """One HardSwish node reading ``x``, named after the group's last node."""
        m = self.match
        out = self.editor.variable(f"{pre.name}_hardswish", np.float32, pre.shape)
        names = [n.name for n in m.nodes]
        self.editor.add_node("HardSwish", [m.tensor(self.x)], [out], names[0])
        self.fused.append(names)
        return out


HARDSWISH_OPSET = 14


def fuse_hardswish(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[list[str]]]:
    """``model`` with every written-out HardSwish as one ``HardSwish`` node (opset ≥ 14).

    A model below opset 14 is converted first; when the conversion fails it is returned as it
    was. ``model`` is not modified.
    """
    from onnxq.errors import ModelError
    from onnxq.preprocess import default_opset, raise_opset

    fusion = HardSwishFusion()
    graph = import_graph(model)
    if not any(fusion.pattern.match(n.outputs[0]) for n in graph.nodes if n.outputs):
        return model, []
    if default_opset(model) < HARDSWISH_OPSET:
        try:
            model = raise_opset(model, HARDSWISH_OPSET, "HardSwish")
        except ModelError:
            return model, []
        graph = import_graph(model)
    rewrite(fusion, graph)
    return export_model(graph, model), fusion.fused


def fuse_gelu(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[list[str]]]:
    """``model`` with every written-out GELU as one ``com.microsoft.Gelu`` node; the fused groups.

    The float subgraph's values must not escape (an interior tensor read elsewhere keeps the
    subgraph as it is). ``model`` is not modified.
    """
    graph = import_graph(model)
    fusion = GeluFusion()
    result = rewrite(fusion, graph)
    if not result.modified:
        return model, []
    out = export_model(graph, model)
    if not any(o.domain == MS_DOMAIN for o in out.opset_import):
        out.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    return out, fusion.fused
