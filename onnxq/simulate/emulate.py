"""The quantized model emulated in float, with a switch on every quantizer.

``onnxq debug`` and the accuracy-driven fallback ask one question many times: how far from fp32
are the outputs when only these groups are quantized? Quantizing once per question would take
minutes per question; this module answers each with one onnxruntime run instead. It starts from
the FakeQuantize form of the quantization (onnxq.lower.fakequantize: the float graph with a
FakeQuantize on every quantized edge and weight, with the scales, zero points, rounded weights
and corrected biases the pipeline chose) and puts each quantizer behind a switch, an If on
``flags[k]`` (only the branch taken runs):

* activation: QuantizeLinear → DequantizeLinear on its 8-bit grid (uint8 with zero point
  −low/step), else the same grid in arithmetic; off: the tensor as it is;
* weight: the op that reads it, once on its quantized weight (and its bias rounded to the
  int32 grid s_x·s_w, as QDQ and integer kernels hold it) and once on the float weight and
  bias; the switch picks which one runs;
* a replaced constant of a float op: the new or the original value.

A float op reads a quantized activation as the written model gives it: dequantized where the
int8 producer writes it quantized, but as it is where the written model holds it in float (a
graph input, a float op's output, a MatMul writing float: onnxq.post.float_outputs) and only
the int8 readers get a QuantizeLinear of it (a Paddle swish's float ``x · 1.0`` read the
rounded and clipped value, and the cross-runtime check blamed onnxruntime for the difference).

``flags`` is one boolean input of the emulation model; each group of the annotation (a Conv with
its folded Relu, a MatMul, an Add, ...) needs the switches of its weights and biases and of the
activations it writes or reads int8; a switch is on while any group that needs it is int8 (as
onnxq writes a model with some groups float: a tensor an int8 group writes stays int8 for a
float reader). All switches on is the fake-quantized model (QDQ semantics, computed in float
by onnxruntime); all off is the float model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxq.core.qparams import row_slices
from onnxq.core.specs import user_nodes
from onnxq.io.graph import (
    add_initializer,
    copy_fields,
    names_read,
    set_nodes,
    tensor_array,
    unfilled,
    values_apart,
)
from onnxq.lower.fakequantize import OV_DOMAIN, FakeQuantizeCache, to_fakequantize

#: the emulation model's input that holds the switches
FLAGS = "onnxq_debug_flags"


@dataclass(frozen=True)
class Switch:
    """One quantizer of the emulation."""

    #: the float tensor it quantizes (a weight, a bias or an activation)
    tensor: str
    kind: str  # "weight" | "bias" | "activation"
    #: the groups that need it: it is quantized while any of them is int8 (an activation: the
    #: group that writes it and those that read it; a weight or bias: the groups that read it)
    groups: tuple[int, ...]
    #: an activation's grid step (per tensor), else None
    step: float | None = None
    #: with ``step``: the grid's lowest value and its number of levels
    low: float = 0.0
    levels: int = 256


@dataclass
class Group:
    """One quantized group of the annotation and its switches."""

    #: the float node the group is named by (the name --config and --exclude take)
    node: str
    op: str
    #: its nodes as the caller's model names them (onnxq.core.specs.user_nodes)
    nodes: tuple[str, ...]
    weights: list[int] = field(default_factory=list)
    activations: list[int] = field(default_factory=list)

    @property
    def switches(self) -> list[int]:
        """All of the group's switches."""
        return self.weights + self.activations


@dataclass
class Emulation:
    """The emulation model, its switches and the groups that own them."""

    model: onnx.ModelProto
    switches: list[Switch]
    groups: list[Group]
    #: weights the model holds as in-memory stubs, by name (built without float branches:
    #: only :meth:`resolved_apart` reads them)
    held: dict[str, np.ndarray] = field(default_factory=dict)

    def steps(self) -> dict[str, float]:
        """Every quantized activation tensor and the step of its grid."""
        return {s.tensor: s.step for s in self.switches if s.step is not None}

    def on_grid(self, tensor: str, value: np.ndarray) -> np.ndarray:
        """``value`` of activation ``tensor`` put on its grid as the emulation's quantizer does.

        An 8-bit grid as QuantizeLinear → DequantizeLinear with zero point −low/step, any
        other in arithmetic (see :func:`_activation`).
        """
        s = next(s for s in self.switches if s.tensor == tensor and s.step is not None)
        assert s.step is not None
        step = np.float32(s.step)
        zero = float(np.round(-np.float32(s.low) / step))
        if s.levels == 256 and 0 <= zero <= 255:
            q = np.clip(np.round(np.asarray(value, np.float32) / step) + zero, 0, 255)
            return ((q - zero) * step).astype(np.float32)
        top = s.low + (s.levels - 1) * s.step
        lo, hi = np.array(s.low, np.float32), np.array(top, np.float32)
        return _fq(np.asarray(value, np.float32), lo, hi, s.levels)

    def without(self, groups: Any, int16: bool = False) -> list[int]:
        """The switches on when ``groups`` (indices) are float and every other group is int8.

        As onnxq writes such a model: a float group's weights are float, and so is a tensor
        no int8 group writes or reads. ``int16``: the groups run int16 activations instead;
        their weights and biases stay quantized and the tensors no int8 group writes or reads
        are taken as exact (an int16 grid is 256 times finer than an 8-bit one).
        """
        floating = set(groups)
        return [
            k
            for k, s in enumerate(self.switches)
            if set(s.groups) - floating or (int16 and s.kind != "activation" and s.groups)
        ]

    def flags(self, on: Any = None) -> np.ndarray:
        """The flags input with the switches ``on`` (indices; None: all) set."""
        flags = np.zeros(len(self.switches), np.bool_)
        if on is None:
            flags[:] = True
        else:
            flags[list(on)] = True
        return flags

    def fixed(self, on: Any = None) -> onnx.ModelProto:
        """The model with the switches ``on`` (None: all) as the flags' default value.

        The flags stay an input backed by an initializer, so onnxruntime neither needs them fed
        nor folds them (folded, its Q/DQ fusion would run integer kernels instead of the
        float emulation).
        """
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        model.graph.initializer.append(numpy_helper.from_array(self.flags(on), FLAGS))
        return model

    def resolved(self, on: Any = None) -> onnx.ModelProto:
        """The model with the switches ``on`` (None: all) taken: no flags, no If, no Where.

        Each switch's If is replaced by the nodes of the branch it takes (their outputs named
        as the If's), each switched constant by an Identity of the one it picks. The same
        arithmetic as :meth:`fixed`, as a flat graph that can be cut into pieces
        (onnxq.calibrate.sequential runs it piece by piece). Run it with
        ``make_session(model, as_written=True)``: onnxruntime's QDQ transformers would
        otherwise put the float weights of a Conv that reads a DequantizeLinear on a grid of
        their own (in :meth:`fixed` the If branches keep them apart).
        """
        return self._resolved(on, apart=False)

    def _resolved(self, on: Any, apart: bool) -> Any:
        """:meth:`resolved`; with ``apart``, as :meth:`resolved_apart` gives it."""
        flags = self.flags(on)
        graph = self.model.graph
        inits = {i.name: i for i in graph.initializer}
        gates = {
            n.output[0]: bool(flags[int(tensor_array(inits[n.input[1]]))])
            for n in graph.node
            if n.op_type == "Gather" and n.input[0] == FLAGS
        }
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            if node.output[0] in gates:
                continue
            taken = gates.get(node.input[0]) if node.input else None
            if taken is None:
                nodes.append(node)
            elif node.op_type == "Where":
                picked = node.input[1] if taken else node.input[2]
                nodes.append(helper.make_node("Identity", [picked], [node.output[0]], node.name))
            else:  # If
                branch = next(
                    a.g
                    for a in node.attribute
                    if a.name == ("then_branch" if taken else "else_branch")
                )
                rename = {o.name: out for o, out in zip(branch.output, node.output, strict=True)}
                for inner in branch.node:
                    copy = onnx.NodeProto()
                    copy.CopyFrom(inner)
                    for j, name in enumerate(copy.output):
                        copy.output[j] = rename.get(name, name)
                    for j, name in enumerate(copy.input):
                        copy.input[j] = rename.get(name, name)
                    nodes.append(copy)
        model = onnx.ModelProto()  # the fields copied one by one: no second copy of weights
        copy_fields(self.model, model, skip="graph")
        copy_fields(graph, model.graph, skip="initializer")
        read = names_read(nodes)
        set_nodes(model.graph, nodes)
        inputs = [i for i in model.graph.input if i.name != FLAGS]
        del model.graph.input[:]
        model.graph.input.extend(inputs)
        used = [i for i in graph.initializer if i.name in read]
        if not apart:
            if self.held:
                raise ValueError("an emulation without float branches resolves apart only")
            model.graph.initializer.extend(used)
            return model
        stubs, values = values_apart(i for i in used if i.name not in self.held)
        model.graph.initializer.extend(stubs)
        model.graph.initializer.extend(i for i in used if i.name in self.held)
        values.update((i.name, self.held[i.name]) for i in used if i.name in self.held)
        return model, values

    def resolved_apart(self) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        """:meth:`resolved` with every switch on and its weights apart.

        The model holds in-memory stubs and the weights are arrays of their own
        (onnxq.io.graph.values_apart): once the emulation is let go of, each weight is held
        once, and the caller can drop each when done with it (a weight inside a protobuf
        message is freed only with the whole message).
        """
        return self._resolved(None, apart=True)


#: bytes above which a weight of an emulation without float branches is held as an array
APART_BYTES = 4096

#: elements of a weight FakeQuantized at once (the rest in further slices of its first axis):
#: numpy's temporaries of VGG19's first dense layer were 1.6 GB at once
FQ_SLICE = 1 << 22


def _fq(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, levels: int) -> np.ndarray:
    """FakeQuantize in numpy, as the emulation computes it.

    Elementwise, so a large ``x`` is done in slices of its first axis (the same values).
    """
    step = _step(lo, hi, levels)
    x = np.asarray(x)
    if x.ndim == 0 or x.size <= FQ_SLICE:
        return (np.round((np.clip(x, lo, hi) - lo) / step) * step + lo).astype(np.float32)
    lo, hi, step = (np.asarray(v) for v in (lo, hi, step))
    out = np.empty(np.broadcast_shapes(x.shape, lo.shape, hi.shape), np.float32)
    for part, (lo_p, hi_p, step_p) in row_slices(x, FQ_SLICE, lo, hi, step):
        out[part] = np.round((np.clip(x[part], lo_p, hi_p) - lo_p) / step_p) * step_p + lo_p
    return out


def _step(lo: np.ndarray, hi: np.ndarray, levels: int) -> np.ndarray:
    width = np.asarray(hi, np.float32) - np.asarray(lo, np.float32)
    return np.where(width > 0, width / np.float32(levels - 1), np.float32(1.0)).astype(np.float32)


def emulate(
    state: Any,
    int32_biases: bool = True,
    float_branches: bool = True,
    fq_cache: FakeQuantizeCache | None = None,
) -> Emulation:
    """The emulation of a finished quantization (a :class:`~onnxq.passes.manager.State`).

    ``int32_biases``: round each Conv/Gemm bias to its int32 grid s_x·s_w, as the int8 model
    holds it. The sequential bias correction, which runs before materialize, leaves them
    float: materialize may still widen a channel's weight scale (a bias the int32 accumulator
    cannot hold, a dead channel's bias on a too coarse grid), and the grid at that point would
    be the wrong one (a pruned channel's bias of 0.62 on a 0.79 grid was "corrected" to 0.36).
    ``float_branches=False`` leaves out the float weights and replaced constants a switch
    turned off would read: the emulation is then only good for :meth:`Emulation.resolved`
    with every switch on (the sequential bias correction's model), at a third of the memory.
    ``fq_cache``: emulations of one annotation under many values share the FakeQuantize
    graph's build (the recipe choice's candidates).
    """
    quantizer = state.quantizer
    raw = held_float(state.model)
    qrange = (-64, 63) if state.options.weight_bits == 7 else None
    fq_model = to_fakequantize(quantizer, state.values, qrange, state.constants, fq_cache)
    records = list(quantizer.records)
    group_of_node = {n: i for i, rec in enumerate(records) for n in rec.nodes}
    produced_by = {q.tensor: i for i, rec in enumerate(records) for q in rec.outputs}
    readers: dict[str, list[int]] = {}
    for i, rec in enumerate(records):
        for q in rec.inputs:
            readers.setdefault(q.tensor, []).append(i)
    float_nodes = {n.name: n for n in quantizer.float_model.graph.node}
    groups = [
        Group(
            rec.node,
            float_nodes[rec.node].op_type if rec.node in float_nodes else "",
            user_nodes(rec.nodes, state.derived),
        )
        for rec in records
    ]
    originals = {i.name: i for i in quantizer.float_model.graph.initializer}
    graph = fq_model.graph
    inits = {i.name: i for i in graph.initializer}
    switches: list[Switch] = []
    gates: dict[int, str] = {}
    nodes: list[onnx.NodeProto] = []

    def switch(
        tensor: str, kind: str, owners: list[int], grid: tuple[float, float, int] | None = None
    ) -> int:
        """A new switch; ``grid``: an activation's (step, lowest value, levels) per tensor."""
        k = len(switches)
        owners = sorted(set(owners))
        switches.append(Switch(tensor, kind, tuple(owners), *(grid or (None,))))
        for g in owners:
            (groups[g].weights if kind != "activation" else groups[g].activations).append(k)
        return k

    def gate(k: int) -> str:
        """The boolean scalar of switch ``k`` (its Gather node emitted on first use)."""
        if k not in gates:
            index = f"{FLAGS}/{k}"
            constant(index, np.array(k), np.int64)
            nodes.append(helper.make_node("Gather", [FLAGS, index], [f"{index}/on"], index))
            gates[k] = f"{index}/on"
        return gates[k]

    held: dict[str, np.ndarray] = {}

    def constant(name: str, value: np.ndarray, dtype: Any = np.float32, apart: bool = False) -> str:
        # straight into the graph: a list of new tensors extended in at the end was a second
        # copy of every quantized weight while the first was alive
        value = np.asarray(value, dtype)
        if apart and value.nbytes > APART_BYTES:  # a stub, the value beside the model
            held[name] = value
            graph.initializer.append(unfilled(name, value.dtype, value.shape))
        else:
            add_initializer(graph, name, value)
        return name

    # weights: FakeQuantize of a constant -> (switch, rounded and quantized, float)
    weights: dict[str, tuple[int, str, str]] = {}
    # constants an algorithm replaced that no FakeQuantize reads (corrected biases): on, off
    replaced: dict[str, tuple[str, str]] = {}
    fq_inputs = set()
    # the grid step of every FakeQuantize output (activations per tensor, weights per channel)
    steps: dict[str, np.ndarray] = {}
    for node in graph.node:
        if node.op_type != "FakeQuantize" or node.domain != OV_DOMAIN:
            continue
        x, y = node.input[0], node.output[0]
        fq_inputs.add(x)
        levels = next(a.i for a in node.attribute if a.name == "levels")
        lo = tensor_array(inits[node.input[1]])
        hi = tensor_array(inits[node.input[2]])
        steps[y] = _step(lo, hi, levels)
        if x not in inits:
            continue
        k = switch(x, "weight", readers.get(x, []))
        on = constant(
            f"{y}/on", _fq(tensor_array(inits[x]), lo, hi, levels), apart=not float_branches
        )
        off = f"{y}/off"
        if float_branches:
            constant(off, tensor_array(originals[x]) if x in originals else tensor_array(inits[x]))
        weights[y] = (k, on, off)
    for name, init in inits.items():
        original = originals.get(name)
        if name in fq_inputs or original is None:
            continue
        if original.SerializeToString() != init.SerializeToString():
            off = f"{name}/off"
            if float_branches:
                constant(off, tensor_array(original))
            replaced[name] = (constant(f"{name}/on", tensor_array(init)), off)

    # activations a float op reads as the written model holds them: the FakeQuantize's input
    as_held = {
        n.output[0]: n.input[0]
        for n in graph.node
        if n.op_type == "FakeQuantize" and n.domain == OV_DOMAIN and n.input[0] in raw
    }
    for node in graph.node:
        if node.op_type == "FakeQuantize" and node.domain == OV_DOMAIN:
            if node.output[0] not in weights:
                _activation(node, inits, switch, gate, constant, nodes, produced_by, readers)
            continue
        if node.name not in group_of_node:
            node.input[:] = [as_held.get(x, x) for x in node.input]
        weighted = [weights[i] for i in node.input if i in weights]
        if weighted:  # the op on quantized or on float constants, chosen by an If
            k = weighted[0][0]
            branches = []
            for which, tag in ((1, "q"), (2, "f")):
                copy = onnx.NodeProto()
                copy.CopyFrom(node)
                copy.name = f"{node.name}/{tag}"
                for j, inp in enumerate(copy.input):
                    if inp in weights:
                        copy.input[j] = weights[inp][which]
                    elif inp in replaced:
                        copy.input[j] = replaced[inp][which - 1]
                if which == 1 and int32_biases:  # on its int32 grid, as int8 kernels hold it
                    _int32_bias(copy, node, steps, inits, constant)
                outs = [f"{o}/{tag}" for o in node.output]
                del copy.output[:]
                copy.output.extend(outs)
                branches.append(_branch(f"{node.name}/{tag}", [copy], outs))
            nodes.append(_if(gate(k), list(node.output), branches[0], branches[1], node.name))
            continue
        for j, inp in enumerate(node.input):
            if inp in replaced:  # a replaced constant of a float op
                owners = [group_of_node[node.name]] if node.name in group_of_node else []
                k = switch(inp, "bias", owners)
                out = f"{inp}/{node.name}/switched"
                on_name, off_name = replaced[inp]
                nodes.append(helper.make_node("Where", [gate(k), on_name, off_name], [out], out))
                node.input[j] = out
        nodes.append(node)
    read = names_read(nodes)
    set_nodes(graph, nodes)
    # a constant a later step replaced (a bias its int32 rounding took over) is not kept:
    # onnxruntime failed to load EfficientNet-Lite1's emulation over such unread initializers
    # ("ReplaceInitializedTensorImpl Failed to find existing initializer ….bias/on")
    for i in reversed(range(len(graph.initializer))):  # in place: no copy of what is kept
        if graph.initializer[i].name not in read:
            del graph.initializer[i]
    graph.input.append(helper.make_tensor_value_info(FLAGS, onnx.TensorProto.BOOL, [len(switches)]))
    opsets = [d for d in fq_model.opset_import if d.domain != OV_DOMAIN]
    del fq_model.opset_import[:]
    fq_model.opset_import.extend(opsets)
    return Emulation(fq_model, switches, groups, held)


def held_float(model: onnx.ModelProto) -> set[str]:
    """Tensors a written model quantizes for its int8 readers and holds in float for others.

    Read by a QuantizeLinear (so float) and by some other node, and not a DequantizeLinear's
    output: a graph input or the output of a float op or of a MatMul writing float. Empty
    before materialize (``state.model`` has no graph yet): the sequential bias correction's
    emulation reads every quantized activation as quantized.
    """
    graph = model.graph
    quantized = {n.input[0] for n in graph.node if n.op_type == "QuantizeLinear" and n.input}
    dequantized = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    read = {x for n in graph.node if n.op_type != "QuantizeLinear" for x in n.input}
    return (quantized & read) - dequantized


def _int32_bias(
    copy: onnx.NodeProto,
    node: onnx.NodeProto,
    steps: dict[str, np.ndarray],
    inits: dict[str, onnx.TensorProto],
    constant: Any,
) -> None:
    """Round a Conv/Gemm bias (corrected, if it was) to the step s_x·s_w of the int32 bias."""
    if node.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(node.input) < 3:
        return
    x, w, b = node.input[0], node.input[1], node.input[2]
    if x not in steps or w not in steps or steps[x].size != 1 or b not in inits:
        return
    value = tensor_array(inits[b])
    step = (steps[x].reshape(()) * steps[w].reshape(-1)).astype(np.float64)
    if step.size not in (1, value.size):
        return
    value = np.asarray(value, np.float64).reshape(-1)
    rounded = np.round(value / step) * step
    copy.input[2] = constant(f"{node.name}/bias/int32", rounded.reshape(-1).astype(np.float32))


def _branch(name: str, nodes: list[onnx.NodeProto], outputs: list[str]) -> onnx.GraphProto:
    return helper.make_graph(
        nodes,
        name,
        [],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs],
    )


def _if(
    flag: str, outputs: list[str], then: onnx.GraphProto, other: onnx.GraphProto, name: str
) -> onnx.NodeProto:
    return helper.make_node(
        "If", [flag], outputs, f"{name}/If", then_branch=then, else_branch=other
    )


def _activation(
    node: onnx.NodeProto,
    inits: dict[str, onnx.TensorProto],
    switch: Any,
    gate: Any,
    constant: Any,
    nodes: list[onnx.NodeProto],
    produced_by: dict[str, int],
    readers: dict[str, list[int]],
) -> None:
    """An activation's FakeQuantize as ONNX ops behind its switch."""
    x, lo, hi = node.input[0], node.input[1], node.input[2]
    levels = next(a.i for a in node.attribute if a.name == "levels")
    tensor = node.name[: -len("/FakeQuantize")]
    y = node.output[0]
    # quantized while any group that writes it int8 or reads it int8 is int8
    needers = [produced_by[tensor]] if tensor in produced_by else []
    lo_v, hi_v = tensor_array(inits[lo]), tensor_array(inits[hi])
    step_v = _step(lo_v, hi_v, levels)
    grid = (
        (float(step_v.reshape(())), float(lo_v.reshape(())), levels) if step_v.size == 1 else None
    )
    k = switch(tensor, "activation", needers + readers.get(tensor, []), grid)
    p = f"{y}/fq"
    zero = np.round(-lo_v / step_v)
    flag = gate(k)
    if levels == 256 and lo_v.size == 1 and 0 <= float(zero.reshape(())) <= 255:
        # an 8-bit grid is uint8 with zero point −lo/s, whatever the dtype that wrote it
        sc = constant(f"{p}/scale", step_v.reshape(()))
        zp = constant(f"{p}/zero_point", zero.reshape(()), np.uint8)
        on = [
            helper.make_node("QuantizeLinear", [x, sc, zp], [f"{p}/q"], f"{p}/Q"),
            helper.make_node("DequantizeLinear", [f"{p}/q", sc, zp], [p], f"{p}/DQ"),
        ]
        off = [helper.make_node("Identity", [x], [f"{p}/id"], f"{p}/Identity")]
        nodes.append(
            _if(flag, [y], _branch(f"{p}/on", on, [p]), _branch(f"{p}/off", off, [f"{p}/id"]), p)
        )
        return
    step_name = constant(f"{p}/step", step_v)
    nodes += [
        helper.make_node("Max", [x, lo], [f"{p}/max"], f"{p}/Max"),
        helper.make_node("Min", [f"{p}/max", hi], [f"{p}/clip"], f"{p}/Min"),
        helper.make_node("Sub", [f"{p}/clip", lo], [f"{p}/shift"], f"{p}/Sub"),
        helper.make_node("Div", [f"{p}/shift", step_name], [f"{p}/steps"], f"{p}/Div"),
        helper.make_node("Round", [f"{p}/steps"], [f"{p}/q"], f"{p}/Round"),
        helper.make_node("Mul", [f"{p}/q", step_name], [f"{p}/scaled"], f"{p}/Mul"),
        helper.make_node("Add", [f"{p}/scaled", lo], [p], f"{p}/Add"),
        helper.make_node("Where", [flag, p, x], [y], f"{y}/Where"),
    ]
