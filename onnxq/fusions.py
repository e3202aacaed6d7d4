"""Fusions onnxruntime makes in a float graph but not behind a DequantizeLinear.

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
