"""Depthwise scaling in the graph: which inputs can take a factor per channel, and the rewrite.

The rewrite folds the factor upstream and its inverse into the depthwise filters.

An input qualifies when a depthwise convolution (``group`` = input channels, constant weights)
is its only reader and the walk from the input goes up through Identity, Relu, LeakyRelu and
Add/Sub of a constant (whose constant takes ``s``) to a Mul or Div by a constant, a
BatchNormalization or a Conv with constant weights, which takes ``s`` (each tensor on the way
read by the next node alone). The factors themselves come from
``onnxq.solve.depthwise_scaling``; the pass is ``onnxq.passes.depthwise_scaling``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from onnxq.io.graph import tensor_array

#: ops the walk passes through unchanged (positively homogeneous: f(s·x) = s·f(x) for s > 0)
HOMOGENEOUS = frozenset({"Identity", "Relu", "LeakyRelu"})
#: nodes the walk may take before it must reach a node that absorbs the factor
MAX_WALK = 8


@dataclass
class Edit:
    """One constant the factor reaches: ``how`` is "mul" (times s), "div" (over s) or "rows"."""

    node: onnx.NodeProto
    slot: int
    how: str


@dataclass
class Candidate:
    """A depthwise convolution whose input can take a factor per channel, and where it goes."""

    conv: onnx.NodeProto
    tensor: str
    edits: list[Edit] = field(default_factory=list)
    #: the node that took the factor last (for the report)
    into: str = ""


def constants(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Initializers and Constant nodes' values by name (a value written in place changes both)."""
    out = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value":
            out[n.output[0]] = n.attribute[0].t
    return out


def uses_of(model: onnx.ModelProto) -> dict[str, int]:
    """How many node inputs and graph outputs read each tensor."""
    uses: dict[str, int] = defaultdict(int)
    for n in model.graph.node:
        for t in n.input:
            uses[t] += 1
    for o in model.graph.output:
        uses[o.name] += 1
    return uses


def candidates(model: onnx.ModelProto, excluded: set[str]) -> list[Candidate]:
    """Depthwise convolutions whose input can take a factor per channel upstream."""
    g = model.graph
    inits = constants(model)
    producers = {o: n for n in g.node for o in n.output if n.op_type != "Constant"}
    uses = uses_of(model)
    out = []
    for n in g.node:
        if n.op_type != "Conv" or n.name in excluded or len(n.input) < 2:
            continue
        w = inits.get(n.input[1])
        if w is None or w.data_type != onnx.TensorProto.FLOAT or len(w.dims) < 3:
            continue
        group = next((a.i for a in n.attribute if a.name == "group"), 1)
        if group <= 1 or w.dims[1] != 1 or w.dims[0] % group:
            continue  # not depthwise: each output channel reads one input channel
        c = Candidate(n, n.input[0])
        if _walk(c, group, len(w.dims), inits, producers, uses, excluded):
            out.append(c)
    return out


def _walk(
    c: Candidate,
    channels: int,
    rank: int,
    inits: dict[str, onnx.TensorProto],
    producers: dict[str, onnx.NodeProto],
    uses: dict[str, int],
    excluded: set[str],
) -> bool:
    """Fill ``c.edits`` up to a node that absorbs the factor; False if none is reached."""
    t = c.tensor
    for _ in range(MAX_WALK):
        p = producers.get(t)
        if p is None or uses[t] != 1 or p.name in excluded:
            return False
        const = [i for i, x in enumerate(p.input) if x in inits]
        if p.op_type in HOMOGENEOUS:
            t = p.input[0]
            continue
        if p.op_type == "BatchNormalization" and {1, 2} <= set(const):
            c.edits += [Edit(p, 1, "mul"), Edit(p, 2, "mul")]
            c.into = f"BatchNormalization '{p.name}'"
            return True
        if p.op_type == "Conv" and 1 in const and (len(p.input) < 3 or 2 in const):
            if inits[p.input[1]].dims[0] != channels:
                return False
            c.edits.append(Edit(p, 1, "rows"))
            if len(p.input) > 2 and p.input[2]:
                c.edits.append(Edit(p, 2, "mul"))
            c.into = f"Conv '{p.name}'"
            return True
        if p.op_type not in ("Mul", "Div", "Add", "Sub") or len(const) != 1:
            return False
        k = const[0]
        if not _per_channel(inits[p.input[k]], channels, rank):
            return False
        if p.op_type == "Mul":
            c.edits.append(Edit(p, k, "mul"))
            c.into = f"Mul '{p.name}'"
            return True
        if p.op_type == "Div":
            if k != 1:
                return False  # constant / x is not linear in x
            c.edits.append(Edit(p, k, "div"))
            c.into = f"Div '{p.name}'"
            return True
        c.edits.append(Edit(p, k, "mul"))  # Add/Sub: s·(x ± b) = s·x ± s·b
        t = p.input[1 - k]
    return False


def _per_channel(init: onnx.TensorProto, channels: int, rank: int) -> bool:
    """A float constant that is one value, or one per channel broadcast over NC…."""
    if init.data_type != onnx.TensorProto.FLOAT:
        return False
    dims = list(init.dims)
    if int(np.prod(dims, dtype=np.int64)) == 1:
        return len(dims) <= rank
    tail = [channels] + [1] * (rank - 2)
    return dims == tail or dims == [1, *tail]


def filter_energy(weight: np.ndarray, channels: int) -> np.ndarray:
    """Per input channel, the sum of squares of the filters reading it (multiplier ≥ 1)."""
    per_output = np.sum(weight.reshape(weight.shape[0], -1) ** 2, axis=1)
    return per_output.reshape(channels, -1).sum(axis=1)


def rewrite(
    model: onnx.ModelProto,
    c: Candidate,
    s: np.ndarray,
    inits: dict[str, onnx.TensorProto],
    uses: dict[str, int],
) -> None:
    """Fold ``s`` into the walk's constants and ``1/s`` into the convolution's filters."""
    channels = s.size
    for e in c.edits:
        v = tensor_array(inits[e.node.input[e.slot]]).astype(np.float64)
        if e.how == "rows":  # a producing Conv: its output channel o takes s[o]
            v = v * s.reshape(-1, *[1] * (v.ndim - 1))
        elif v.ndim == 1 and v.size == channels:  # BatchNormalization, Conv bias
            v = v * s if e.how == "mul" else v / s
        else:
            rank = len(inits[c.conv.input[1]].dims)
            shaped = s.reshape(channels, *[1] * (rank - 2))
            v = v * shaped if e.how == "mul" else v / shaped
        _store(model, e.node, e.slot, v, inits, uses)
    w = tensor_array(inits[c.conv.input[1]]).astype(np.float64)
    per_output = np.repeat(s, w.shape[0] // channels)
    _store(model, c.conv, 1, w / per_output.reshape(-1, *[1] * (w.ndim - 1)), inits, uses)


def _store(
    model: onnx.ModelProto,
    node: onnx.NodeProto,
    slot: int,
    value: np.ndarray,
    inits: dict[str, onnx.TensorProto],
    uses: dict[str, int],
) -> None:
    """Write ``value`` as the node's constant input ``slot``: in place when it reads it alone."""
    name = node.input[slot]
    tensor = numpy_helper.from_array(value.astype(np.float32), name)
    if uses[name] == 1:
        tensor.name = inits[name].name  # a Constant node's value keeps its own (empty) name
        inits[name].CopyFrom(tensor)
        return
    fresh = f"{name}_scaled_for_{node.name}"
    tensor.name = fresh
    model.graph.initializer.append(tensor)
    inits[fresh] = model.graph.initializer[-1]
    uses[name] -= 1
    uses[fresh] = 1
    node.input[slot] = fresh
