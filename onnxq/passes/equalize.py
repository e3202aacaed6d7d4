"""Cross-layer equalization (with bias absorption) of Conv → [activation] → Conv chains.

Needs ``state.float_model`` (and ``state.data`` for bias absorption); runs before annotation,
on the float model, which stays equivalent in float. A link is a Conv whose output reaches
one other Conv through nothing but Relu, LeakyRelu, Clip(0 or no minimum, any maximum) and
zero Pad, each read by the next alone; depthwise and grouped convolutions included. The
weights of every link are equalized (``onnxq.solve.equalize``), a Clip with a maximum becomes
Relu → Min with a bound per channel, and where the data allows, the mean of the activation
is absorbed into the next bias. Leaves ``state.float_model`` (rewritten), ``state.dataset``
(when it streamed the data) and ``state.equalization`` (per link: the activation, the spread
of the first weight's channel ranges before and after, the channels absorbed), which the
report lists.

``equalization``: ``on`` equalizes every link, ``off`` none, ``auto`` (the default) the links
of CNNs whose weights share one scale per tensor (``--per-tensor``), where unequal channel
ranges cost the most; with a scale per output channel it changed no zoo model's accuracy
for the better (docs/ablation.md).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from onnxq.io.graph import insert_nodes, tensor_array
from onnxq.passes.defaults import runs
from onnxq.passes.manager import PassResult, State
from onnxq.passes.stream import float_batches
from onnxq.prepare.preprocess import fold_batchnorm
from onnxq.solve.equalize import (
    Layer,
    Link,
    absorb,
    activation_floor,
    equalize,
    output_ranges,
    spread,
)

#: ops a link may pass through (positively homogeneous once Clip's bound is per channel)
THROUGH = frozenset({"Relu", "LeakyRelu", "Clip", "Pad"})


@dataclass
class _Chain:
    """One link as found in the graph."""

    first: onnx.NodeProto
    second: onnx.NodeProto
    path: list[onnx.NodeProto] = field(default_factory=list)
    #: the Clip on the path: (node, lower bound 0 or None, upper bound or None)
    clip: tuple[onnx.NodeProto, float | None, float | None] | None = None

    @property
    def through(self) -> str:
        """The path's ops, for the report."""
        return " → ".join(n.op_type for n in self.path) or "none"

    def activation(self, y: np.ndarray) -> np.ndarray:
        """What the path makes of the first layer's output ``y`` (per channel, monotone)."""
        for n in self.path:
            if n.op_type == "Relu":
                y = np.maximum(y, 0.0)
            elif n.op_type == "LeakyRelu":
                alpha = next((a.f for a in n.attribute if a.name == "alpha"), 0.01)
                y = np.where(y < 0, alpha * y, y)
        if self.clip is not None:
            _, lo, hi = self.clip
            y = np.clip(y, -np.inf if lo is None else lo, np.inf if hi is None else hi)
        return y

    def absorbable(self) -> bool:
        """Whether a constant can leave the activation exactly (see onnxq.solve.equalize)."""
        if any(n.op_type in ("Pad", "LeakyRelu") for n in self.path):
            return False
        if self.clip is not None and self.clip[1] is None:
            return False  # Clip without a minimum: leave it
        return _pads_nothing(self.second)


class Equalize:
    """Equalize the weight ranges of Conv chains and absorb what the data allows."""

    name = "equalization"

    def run(self, state: State) -> PassResult:
        """Find the links, equalize them, rewrite the float model."""
        if not runs("equalization", state):
            why = state.over_budget.get("equalization") or (
                "per-channel weights" if state.options.per_channel else f"{state.kind} model"
            )
            return PassResult(f"off ({state.options.equalization}, {why})")
        if state.data is None and state.dataset is None:
            return PassResult("off (no calibration data)")
        # preprocessing folds BatchNormalization into the Conv before it later on: folded
        # now, a Conv → BatchNormalization → Relu → Conv chain is found as one
        model = state.float_model = fold_batchnorm(state.float_model)
        kept = state.options.kept_float(model)
        chains = _chains(model, kept, kept | state.options.named_nodes())
        if not chains:
            return PassResult("no Conv → Conv chain to equalize")
        inits = {i.name: i for i in model.graph.initializer}
        layers = {n.name: _layer(n, inits) for c in chains for n in (c.first, c.second)}
        before = {c.first.name: spread(output_ranges(layers[c.first.name].weight)) for c in chains}
        ranges = _ranges(state, model, chains)
        links = []
        for c in chains:
            lo, hi = ranges[c.first.output[0]]
            after = np.maximum(np.abs(c.activation(lo)), np.abs(c.activation(hi)))
            before_path = np.maximum(np.abs(lo), np.abs(hi))
            floor = np.maximum(activation_floor(after), activation_floor(before_path))
            links.append(Link(c.first.name, c.second.name, np.ones_like(lo), floor))
        rounds = equalize(layers, links)
        state.float_graph = None  # the model is rewritten below: annotation prepares it again
        absorbed = _absorb(chains, links, layers, ranges)
        for c, link in zip(chains, links, strict=True):
            if c.clip is not None:
                rank = layers[c.first.name].weight.ndim
                for name in _per_channel_clip(
                    model, c, link.scale, absorbed.get(c.first.name), rank
                ):
                    state.derived[name] = c.clip[0].name
        _drop_unread(model, {t for c in chains if c.clip for t in c.clip[0].input[1:]})
        nodes = {n.name: n for n in model.graph.node}
        inits = {i.name: i for i in model.graph.initializer}
        for name, layer in layers.items():
            _write(model, nodes[name], layer, inits)
        for c in chains:
            a = c.first.name
            c_abs = absorbed.get(a)
            state.equalization[f"{a} → {c.second.name}"] = {
                "through": c.through,
                "spread_before": round(before[a], 3),
                "spread_after": round(spread(output_ranges(layers[a].weight)), 3),
                "absorbed_channels": int(np.count_nonzero(c_abs)) if c_abs is not None else 0,
            }
        return PassResult(describe(state.equalization, rounds))


def describe(equalization: dict[str, dict], rounds: int) -> str:
    """One line for the summary."""
    v = list(equalization.values())
    b = float(np.median([e["spread_before"] for e in v]))
    a = float(np.median([e["spread_after"] for e in v]))
    absorbed = sum(e["absorbed_channels"] for e in v)
    clips = sum("Clip" in e["through"] for e in v)
    return (
        f"{len(v)} Conv pairs equalized in {rounds} rounds (channel range spread, largest over "
        f"median, {b:.1f} → {a:.1f} median); {absorbed} channels' bias absorbed; "
        f"{clips} Clip bounds made per channel"
    )


def _consts(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    out = {i.name: tensor_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            out[n.output[0]] = tensor_array(n.attribute[0].t)
    return out


def _pads_nothing(conv: onnx.NodeProto) -> bool:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in conv.attribute}
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    return auto == "VALID" or (auto == "NOTSET" and not any(attrs.get("pads", [])))


def _chains(model: onnx.ModelProto, excluded: set[str], named: set[str]) -> list[_Chain]:
    """Every link, in graph order.

    ``excluded``: Convs that stay as they are (kept float); ``named``: nodes the call keeps or
    names one by one, which a link's Clip must not be (equalizing replaces it).
    """
    g = model.graph
    consts = _consts(model)
    inits = {i.name for i in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for t in n.input:
            readers[t].append(n)
    outputs = {o.name for o in g.output}

    def eligible(n: onnx.NodeProto) -> bool:
        if n.op_type != "Conv" or n.name in excluded or not n.name or len(n.input) < 2:
            return False
        w = n.input[1]
        if w not in inits or len(readers[w]) != 1 or consts[w].dtype != np.float32:
            return False
        return (
            len(n.input) < 3
            or not n.input[2]
            or (n.input[2] in inits and len(readers[n.input[2]]) == 1)
        )

    chains: list[_Chain] = []
    for n in g.node:
        if not eligible(n) or n.input[0] in inits:
            continue
        chain = _Chain(n, n)
        t = n.output[0]
        while t not in outputs and len(readers[t]) == 1:
            r = readers[t][0]
            if r.op_type == "Conv" and r.input[0] == t:
                if eligible(r):
                    chain.second = r
                    chains.append(chain)
                break
            if r.op_type not in THROUGH or r.input[0] != t or not _homogeneous(r, consts, chain):
                break
            if r.op_type == "Clip" and r.name in named:
                break
            chain.path.append(r)
            t = r.output[0]
    return chains


def _homogeneous(n: onnx.NodeProto, consts: dict[str, np.ndarray], chain: _Chain) -> bool:
    """Whether ``n`` commutes with a positive scale per channel (recording a Clip's bounds)."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
    if n.op_type in ("Relu", "LeakyRelu"):
        return True
    if n.op_type == "Pad":
        mode = attrs.get("mode", b"constant")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        value = n.input[2] if len(n.input) > 2 else ""
        zero = not value or (value in consts and not np.any(consts[value]))
        pads_const = len(n.input) > 1 and n.input[1] in consts
        axes_given = len(n.input) > 3 and bool(n.input[3])
        return mode == "constant" and zero and pads_const and not axes_given
    # Clip: both bounds constant (or absent), the minimum 0 or absent, one Clip per link
    if chain.clip is not None or "min" in attrs or "max" in attrs:
        return False  # opset < 11 attributes are raised by loading; be safe regardless
    bounds: list[float | None] = []
    for i in (1, 2):
        name = n.input[i] if len(n.input) > i else ""
        if not name:
            bounds.append(None)
        elif name in consts and consts[name].size == 1:
            bounds.append(float(consts[name].reshape(())))
        else:
            return False
    lo, hi = bounds
    if lo is not None and lo != 0.0:
        return False
    if hi is not None and not (np.isfinite(hi) and hi > 0):
        return False
    chain.clip = (n, lo, hi)
    return True


def _layer(conv: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> Layer:
    w = tensor_array(inits[conv.input[1]]).astype(np.float64)
    if len(conv.input) > 2 and conv.input[2]:
        b = tensor_array(inits[conv.input[2]]).astype(np.float64)
    else:
        b = np.zeros(w.shape[0])
    groups = next((int(a.i) for a in conv.attribute if a.name == "group"), 1)
    return Layer(w, b, groups)


def _ranges(
    state: State, model: onnx.ModelProto, chains: list[_Chain]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """First layer's output -> its per-channel minimum and maximum on the calibration data."""
    names = sorted({c.first.output[0] for c in chains})
    lo: dict[str, np.ndarray] = {}
    hi: dict[str, np.ndarray] = {}
    for values in float_batches(
        state,
        model,
        names,
        "equalization",
        "per-channel ranges before the rewrite; calibration reads the equalized model",
    ):
        for t, v in values.items():
            flat = np.moveaxis(v, 1, 0).reshape(v.shape[1], -1).astype(np.float64)
            flat = np.where(np.isfinite(flat), flat, np.nan)
            lo[t] = np.fmin(lo.get(t, np.inf), np.nanmin(flat, axis=1, initial=np.inf))
            hi[t] = np.fmax(hi.get(t, -np.inf), np.nanmax(flat, axis=1, initial=-np.inf))
    return {t: (lo[t], hi[t]) for t in names}


def _absorb(
    chains: list[_Chain],
    links: list[Link],
    layers: dict[str, Layer],
    ranges: dict[str, tuple[np.ndarray, np.ndarray]],
) -> dict[str, np.ndarray]:
    """First layer -> the constant absorbed per channel, where the link allows it."""
    out: dict[str, np.ndarray] = {}
    for c, link in zip(chains, links, strict=True):
        lo, hi = ranges[c.first.output[0]]
        if not c.absorbable() or not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
            continue
        y_lo, y_hi = lo / link.scale, hi / link.scale  # the equalized layer's output
        if c.path:  # Relu or Clip(0, hi): only a lower bound that never clipped moves
            const = np.maximum(y_lo, 0.0)
        else:  # nothing in between: centre every channel on 0
            const = (y_lo + y_hi) / 2
        absorb(layers[c.first.name], layers[c.second.name], const)
        out[c.first.name] = const
    return out


def _per_channel_clip(
    model: onnx.ModelProto,
    chain: _Chain,
    scale: np.ndarray,
    absorbed: np.ndarray | None,
    rank: int,
) -> list[str]:
    """Replace the link's Clip by Relu (if it had a minimum) → Min(bound per channel).

    Returns the names of the nodes written in its place.
    """
    assert chain.clip is not None
    clip, lo, hi = chain.clip
    if lo is None and hi is None:
        return []  # a Clip without bounds passes every value
    g = model.graph
    shift = np.zeros_like(scale) if absorbed is None else absorbed
    at = list(g.node).index(clip)
    new: list[onnx.NodeProto] = []
    x = clip.input[0]
    if lo is not None:
        new.append(
            onnx.helper.make_node("Relu", [x], [f"{clip.name}_relu"], name=f"{clip.name}_relu")
        )
        x = f"{clip.name}_relu"
    if hi is not None:
        bound = (hi / scale - shift).reshape((-1,) + (1,) * (rank - 2)).astype(np.float32)
        g.initializer.append(numpy_helper.from_array(bound, f"{clip.name}_bound"))
        new.append(
            onnx.helper.make_node(
                "Min", [x, f"{clip.name}_bound"], [clip.output[0]], name=f"{clip.name}_min"
            )
        )
    else:
        new[-1].output[0] = clip.output[0]
    insert_nodes(g, at, new, replace=1)
    return [n.name for n in new]


def _drop_unread(model: onnx.ModelProto, names: set[str]) -> None:
    """Remove the initializers among ``names`` that no node reads any more (Clip bounds)."""
    g = model.graph
    read = {t for n in g.node for t in n.input}
    for init in [i for i in g.initializer if i.name in names and i.name not in read]:
        g.initializer.remove(init)


def _write(
    model: onnx.ModelProto,
    conv: onnx.NodeProto,
    layer: Layer,
    inits: dict[str, onnx.TensorProto],
) -> None:
    """Store the layer's equalized weight and bias (a bias input is added where there was none)."""
    g = model.graph
    w = conv.input[1]
    inits[w].CopyFrom(numpy_helper.from_array(layer.weight.astype(np.float32), w))
    if len(conv.input) > 2 and conv.input[2]:
        b = conv.input[2]
        inits[b].CopyFrom(numpy_helper.from_array(layer.bias.astype(np.float32), b))
    elif np.any(layer.bias):
        b = f"{conv.name}_equalized_bias"
        g.initializer.append(numpy_helper.from_array(layer.bias.astype(np.float32), b))
        while len(conv.input) < 3:
            conv.input.append("")
        conv.input[2] = b
