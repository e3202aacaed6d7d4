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

from onnxq.core.errors import ModelError
from onnxq.io.graph import MS_DOMAIN, constant_value, export_model, import_graph
from onnxq.match.rewrite import DFPatternCallback, rewrite
from onnxq.pattern import DFPattern, is_constant, is_op, wildcard
from onnxq.prepare.opset import default_opset, raise_opset


def _scalar(value: float) -> Callable[[gs.Tensor], bool]:
    def test(t: gs.Tensor) -> bool:
        v = constant_value(t)
        return v is not None and v.size == 1 and abs(float(v.reshape(-1)[0]) - value) <= 1e-4

    return test


class _Fusion(DFPatternCallback):
    """A written-out activation of ``self.x`` (the pattern :meth:`build` returns) → one ``op``."""

    op = ""
    domain = ""
    #: appended to the group's last node name to name the fused node
    suffix = ""

    def __init__(self) -> None:
        super().__init__()
        self.x = wildcard()
        self.pattern: DFPattern = self.build(self.x)
        #: the node names of every fused group
        self.fused: list[list[str]] = []

    def build(self, x: DFPattern) -> DFPattern:
        """The written-out form, reading ``x``."""
        raise NotImplementedError

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        """One ``op`` node reading ``x``, named after the group's last node."""
        m = self.match
        out = self.editor.variable(f"{pre.name}_{self.op.lower()}", np.float32, pre.shape)
        names = [n.name for n in m.nodes]
        self.editor.add_node(
            self.op, [m.tensor(self.x)], [out], names[0] + self.suffix, None, self.domain
        )
        self.fused.append(names)
        return out


def _const(value: float, text: str) -> DFPattern:
    # a fresh pattern per use: one pattern object binds one tensor
    return is_constant().check(_scalar(value), f"not {text}")


class GeluFusion(_Fusion):
    """``Mul(Mul(x, Add(Erf(x / √2), 1)), 0.5)`` in its usual arrangements → ``Gelu(x)``."""

    op = "Gelu"
    domain = MS_DOMAIN
    suffix = "_Gelu"

    def build(self, x: DFPattern) -> DFPattern:
        """The three arrangements of the Muls, with x / √2 or x · (1/√2)."""
        scaled = is_op("Div")(x, _const(math.sqrt(2), "√2")) | is_op("Mul")(
            x, _const(1 / math.sqrt(2), "1/√2")
        )
        one_plus = is_op("Add")(is_op("Erf")(scaled), _const(1.0, "1"))
        return (
            is_op("Mul")(is_op("Mul")(x, one_plus), _const(0.5, "0.5"))
            | is_op("Mul")(is_op("Mul")(x, _const(0.5, "0.5")), one_plus)
            | is_op("Mul")(x, is_op("Mul")(one_plus, _const(0.5, "0.5")))
        )


class HardSwishFusion(_Fusion):
    """``x · Clip(x + 3, 0, 6) / 6`` in its usual arrangements → ``HardSwish(x)``."""

    op = "HardSwish"

    def build(self, x: DFPattern) -> DFPattern:
        """Divided by 6 or multiplied by 1/6, before or after the product with x."""
        relu6 = is_op("Clip")(is_op("Add")(x, _const(3.0, "3")), _const(0.0, "0"), _const(6.0, "6"))
        return (
            is_op("Div")(is_op("Mul")(x, relu6), _const(6.0, "6"))
            | is_op("Mul")(is_op("Mul")(x, relu6), _const(1 / 6, "1/6"))
            | is_op("Mul")(x, is_op("Div")(relu6, _const(6.0, "6")))
            | is_op("Mul")(x, is_op("Mul")(relu6, _const(1 / 6, "1/6")))
        )


HARDSWISH_OPSET = 14


def fuse_hardswish(
    model: onnx.ModelProto, graph: gs.Graph | None = None
) -> tuple[onnx.ModelProto, list[list[str]]]:
    """``model`` with every written-out HardSwish as one ``HardSwish`` node (opset ≥ 14).

    A model below opset 14 is converted first; when the conversion fails it is returned as it
    was. ``model`` is not modified. ``graph``: ``model`` already imported, which the caller
    gives up (preprocessing passes the graph it exported ``model`` from), so it is not
    imported again.
    """
    out, fused, _ = fuse_hardswish_graph(model, graph)
    return out, fused


def fuse_hardswish_graph(
    model: onnx.ModelProto, graph: gs.Graph | None = None
) -> tuple[onnx.ModelProto, list[list[str]], gs.Graph]:
    """:func:`fuse_hardswish`, with the graph the returned model was exported from."""
    fusion = HardSwishFusion()
    graph = graph if graph is not None else import_graph(model)
    if not any(fusion.pattern.match(n.outputs[0]) for n in graph.nodes if n.outputs):
        return model, [], graph
    if default_opset(model) < HARDSWISH_OPSET:
        try:
            model = raise_opset(model, HARDSWISH_OPSET, "HardSwish")
        except ModelError:
            return model, [], graph
        graph = import_graph(model)
    rewrite(fusion, graph)
    return export_model(graph, model), fusion.fused, graph


def fuse_gelu(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[list[str]]]:
    """``model`` with every written-out GELU as one ``com.microsoft.Gelu`` node; the fused groups.

    The float subgraph's values must not escape (an interior tensor read elsewhere keeps the
    subgraph as it is). ``model`` is not modified.
    """
    if not any(n.op_type == "Erf" for n in model.graph.node):  # no GELU to match
        return model, []
    graph = import_graph(model)
    fused = fuse_gelu_graph(graph)
    if not fused:
        return model, []
    out = export_model(graph, model)
    if not any(o.domain == MS_DOMAIN for o in out.opset_import):
        out.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    return out, fused


def fuse_gelu_graph(graph: gs.Graph) -> list[list[str]]:
    """:func:`fuse_gelu` on ``graph``, in place; the fused groups (none: ``graph`` untouched)."""
    if not any(n.op == "Erf" for n in graph.nodes):  # no GELU to match
        return []
    fusion = GeluFusion()
    result = rewrite(fusion, graph)
    return fusion.fused if result.modified else []
