"""Placement: graph facts that keep nodes float before any rule matches.

**Attention masks.**

An attention mask puts a large negative number (-10000, -1e9, float-min or -inf) on the
attention scores of padding just before Softmax: added to them (an additive mask, 0 where a
token is attended), or written over them (PyTorch's ``masked_fill``, exported as
``Where(padding, -1e9, scores)``). Quantized, the huge negative values would set the scale of
every tensor they reach, and the scores would be rounded to a handful of levels (a 6-layer
encoder fell from a cosine of 0.999 to 0.74 on padded batches; a GRU transliterator's attention
went uniform and 98% of its outputs changed). A mask never sets a scale here:

* the mask path (every float node computing the mask from the graph inputs and constants, with no
  weighted op such as MatMul or Conv upstream) stays float,
* the Add or Where that applies it, the shape-only ops after it and the Softmax stay float too,
  since their inputs hold the mask values. Softmax's output (0 to 1) is quantized by its reader.

A calibration set without padding cannot hide the problem: the decision is made from the graph,
not from the values seen.

**Expectations over a distribution.** A 1×1 Conv with one output channel reading a Softmax
(through shape-only ops) takes the expectation of the distribution: YOLOv8's distribution
focal loss head turns 16 bin probabilities into one box edge with weights 0, 1, ..., 15, and
integral (soft-argmax) regression heads do the same for keypoints. Its result is a coordinate
that only float box arithmetic reads; int8 would round it to 1/255 of its range (on a
YOLOv8n detector, box IoU with fp32 96.90% with it rounded, 97.69% float). It stays float,
and with it the Softmax (no quantized op reads it then): one multiply-add per bin and
position, and onnxruntime's float Softmax over the bins' axis (0.6 ms more than its int8 one
on that detector, 10.5 ms in all at batch 1 on one thread).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.io.graph import constant_value, producer

#: ops that only move or reshape values between the masked Add and the Softmax
_SHAPE_ONLY = {"Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Cast"}
#: ops whose output is a learned function of activations: attention scores come from one
_WEIGHTED = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "MatMulInteger", "Attention"}
#: a constant added to the scores is a mask when it holds values this negative (Swin: -100)
MASK_FLOOR = -100.0


def attention_masks(graph: gs.Graph) -> dict[str, str]:
    """Node name -> why it stays float, for every additive attention mask of ``graph``."""
    kept: dict[str, str] = {}
    for softmax in graph.nodes:
        if softmax.op != "Softmax":
            continue
        path: list[gs.Node] = [softmax]
        for applier in _appliers_before(softmax.inputs[0], path):
            for operand in _values(applier):
                mask = _mask_nodes(operand)
                if mask is None:
                    continue
                how = (
                    "an additive attention mask added"
                    if applier.op == "Add"
                    else "an attention mask written over the scores"
                )
                why = (
                    f"transformer placement: '{operand.name}' is {how} by "
                    f"'{applier.name}' before Softmax '{softmax.name}'; the mask path and "
                    "the masked scores stay float (mask values such as float-min or -10000 "
                    "would set the scale)"
                )
                for node in [*mask, applier, *path]:
                    kept.setdefault(node.name, why)
    return kept


def expectations(graph: gs.Graph) -> dict[str, str]:
    """Node name -> why it stays float, for every expectation over a Softmax of ``graph``."""
    kept: dict[str, str] = {}
    for conv in graph.nodes:
        if conv.op != "Conv" or len(conv.inputs) < 2 or conv.attrs.get("group", 1) != 1:
            continue
        w = constant_value(conv.inputs[1])
        if w is None or w.ndim < 3 or w.shape[0] != 1 or any(k != 1 for k in w.shape[2:]):
            continue
        node = producer(conv.inputs[0])
        while node is not None and node.op in _SHAPE_ONLY and node.inputs:
            node = producer(node.inputs[0])
        if node is None or node.op != "Softmax":
            continue
        kept[conv.name] = (
            f"placement: '{conv.name}' takes the expectation of Softmax '{node.name}' over "
            f"{w.shape[1]} bins (a 1x1 Conv with one output channel, as in YOLOv8's box head): "
            "int8 would round the coordinate it computes to 1/255 of its range; float costs "
            "one multiply-add per bin"
        )
    return kept


def _values(node: gs.Node) -> list[gs.Tensor]:
    """The operands of an Add or Where that may be the scores or the mask (not a condition)."""
    return list(node.inputs[1:] if node.op == "Where" else node.inputs)


def _appliers_before(tensor: gs.Tensor, path: list[gs.Node]) -> list[gs.Node]:
    """The Add and Where nodes applying a mask to ``tensor`` through shape-only ops.

    The shape-only ops join ``path``. An Add or Where counts when one of its operands is a
    mask (:func:`_mask_nodes`): scores + bias + mask is a chain of Adds, a ``masked_fill``
    may follow an additive mask.
    """
    node = producer(tensor)
    while node is not None and node.op in _SHAPE_ONLY and node.inputs:
        path.append(node)
        node = producer(node.inputs[0])
    if node is None or node.op not in ("Add", "Where"):
        return []
    found = [node]
    for operand in _values(node):
        if _mask_nodes(operand) is None:
            found += _appliers_before(operand, path)
    return found


def _mask_nodes(tensor: gs.Tensor) -> list[gs.Node] | None:
    """The float nodes computing ``tensor`` if it is a mask, else None."""
    value = constant_value(tensor)
    if value is not None:
        floating = np.issubdtype(value.dtype, np.floating) and value.size > 0
        return [] if floating and float(np.min(value)) <= MASK_FLOOR else None
    nodes: list[gs.Node] = []
    seen: set[int] = set()
    stack = [tensor]
    while stack:
        t = stack.pop()
        node = producer(t)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op in _WEIGHTED or node.op == "Softmax":
            return None  # computed from activations: scores, not a mask
        if any(_maybe_float(o) for o in node.outputs):
            nodes.append(node)
        stack.extend(i for i in node.inputs if isinstance(i, gs.Variable))
    return nodes


def _maybe_float(tensor: gs.Tensor) -> bool:
    """False only for a tensor known to hold integers or booleans."""
    dtype = getattr(tensor, "dtype", None)
    return dtype is None or np.issubdtype(np.dtype(dtype), np.floating)
