"""Running a model in pieces, in graph order, so that each correction sees the ones before it.

A correction measured on one run of the int8 model sees every earlier layer uncorrected: the
corrections of a chain, made together, compound (on MobileNetV2 the bias shifts of all 1×1
convolutions measured in one run left 63% top-1 agreement with fp32, made one after another
93%). Measuring each on a fresh run of the corrected model is right but costs one run per
layer. :func:`run_in_order` cuts the model at the layers to correct (the *targets*) and runs
the pieces in order over the same batches, keeping the tensors later pieces read: piece i runs
from target i−1, now shifted, to target i, whose unshifted output it measures; the caller turns
the measurement into a shift of target i's output (a change of its bias), which piece i+1
applies when it runs target i again. One run of the model in all, each target twice.

A target's output ``y`` becomes ``y/unshifted`` plus an Add of the constant ``y/shift``.

Tensors kept between pieces are held for every batch at once (a target's shift needs every
batch before the next piece runs). A DequantizeLinear's output is held as its integer input, a
quarter of the memory: the DequantizeLinear runs again in each piece that reads it. When the
held tensors pass ``limit`` bytes, the later batches are dropped for the rest of the run (the
caller is told how many batches each measurement covers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxq.calibrate.streaming import run_ahead
from onnxq.io.graph import copy_fields, in_memory_names, names_read, set_nodes
from onnxq.io.session import inferred_types, make_session, output_types, trim_heap_if_grown
from onnxq.solve.bias_correction import channel_means

#: bytes of held tensors above which later batches are dropped
HELD_LIMIT = 1 << 30

#: corrects target k from (its unshifted output's channel sums over the batches used, the number
#: of values each sum holds, the number of batches used); returns the shift to add, or None
Correct = Callable[[int, np.ndarray, int, int], "np.ndarray | None"]


def run_in_order(
    model: onnx.ModelProto,
    targets: Sequence[tuple[str, int]],
    batches: Sequence[Mapping[str, Any]],
    correct: Correct,
    limit: int = HELD_LIMIT,
    weights: dict[str, np.ndarray] | None = None,
    let_go: bool = False,
) -> int:
    """Run ``model`` piece by piece over ``batches``, calling ``correct`` at every target.

    ``targets``: (output tensor of a node, its channel axis), in any order; they are measured
    in graph order. Returns the number of batches the last measurement covered.

    ``weights``: the values of the initializers ``model`` holds as in-memory stubs
    (onnxq.io.graph.values_apart). Each is let go of (removed from the dict) once the last
    piece that reads it holds it: VGG19's first dense layer is then held once at a time.

    ``let_go``: ``batches`` (a list) is emptied once read, so the model's inputs go when the
    last piece that reads them is done, as every other tensor does (OriNet's 32 inputs of
    320 × 320 held 39 MB to the end).
    """
    weights = weights if weights is not None else {}
    types = {**inferred_types(model), **output_types(model)}
    inits = {i.name: i for i in model.graph.initializer}
    model, shifts = _with_shifts(model, [name for name, _ in targets])
    inits.update({t.name: t for t in shifts.values()})
    nodes = list(model.graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    reads = [names_read([n]) for n in nodes]
    lazy = {
        i
        for i, n in enumerate(nodes)
        if n.op_type == "DequantizeLinear" and n.input[0] not in inits
    }
    order = sorted(range(len(targets)), key=lambda k: producer[f"{targets[k][0]}/unshifted"])
    pieces = _pieces(
        nodes, producer, reads, lazy, [producer[f"{targets[k][0]}/unshifted"] for k in order]
    )
    external = [_external(piece, nodes, reads, inits) for piece in pieces]
    # the constants each piece's successors read (a weight is let go of after its last piece)
    later_reads: list[set[str]] = [set() for _ in pieces]
    for p in range(len(pieces) - 2, -1, -1):
        later_reads[p] = later_reads[p + 1] | {
            x for i in pieces[p + 1] for x in reads[i] if x in weights
        }
    live: dict[str, list[np.ndarray]] = {
        name: [np.asarray(b[name]) for b in batches] for name in {i.name for i in model.graph.input}
    }
    used = len(batches)
    if let_go and isinstance(batches, list):
        batches.clear()
    resident = trim_heap_if_grown(None)
    for p, (piece, k) in enumerate(zip(pieces, order, strict=True)):
        name, axis = targets[k]
        later = set().union(*external[p + 1 :]) if p + 1 < len(pieces) else set()
        produced = [o for i in piece if i not in lazy for o in nodes[i].output if o]
        keep = [o for o in produced if o in later]
        measured = f"{name}/unshifted"
        fetch = [*keep, measured]
        sub = _submodel(model, [nodes[i] for i in piece], external[p], fetch, inits, types, live)
        stubs = set(in_memory_names(sub))
        session = make_session(
            sub, as_written=True, weights={n: weights[n] for n in stubs} if stubs else None
        )
        del sub  # the session holds its own copy of the piece's weights
        for done in stubs - later_reads[p]:
            del weights[done]
        feeds = ({x: live[x][b] for x in external[p]} for b in range(used))
        stored: dict[str, list[np.ndarray]] = {o: [] for o in keep}
        total: np.ndarray | None = None
        count = rank = 0
        for _, outs in run_ahead(session, fetch, feeds):
            for o, arr in zip(keep, outs[:-1], strict=True):
                stored[o].append(arr)
            rank = np.ndim(outs[-1])
            sums, n = channel_means(np.asarray(outs[-1]), axis)
            total = sums if total is None else total + sums
            count += n
        del session
        for x in [x for x in live if x not in later]:
            del live[x]
        live.update(stored)
        resident = trim_heap_if_grown(resident)  # the piece's session and tensors are gone
        shift = correct(k, total if total is not None else np.zeros(0), count, used)
        if shift is not None:
            shape = [1] * rank
            shape[axis % rank] = -1
            shifts[name].CopyFrom(
                numpy_helper.from_array(
                    np.asarray(shift, np.float32).reshape(shape), shifts[name].name
                )
            )
        held = sum(a.nbytes for arrays in live.values() for a in arrays)
        if held > limit and used > 1:
            used = max(1, int(used * limit / held))
            for x in live:
                live[x] = live[x][:used]
    return used


def _with_shifts(
    model: onnx.ModelProto, outputs: list[str]
) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """``model``'s graph with every target output ``y`` written as ``y/unshifted + y/shift``.

    A copy without the initializers: the caller keeps reading those of ``model``, and the
    shifts (zero for now, by target) returned beside it.
    """
    copy = onnx.ModelProto()
    copy_fields(model, copy, skip="graph")
    copy_fields(model.graph, copy.graph, skip="initializer")
    wanted = set(outputs)
    shifts: dict[str, onnx.TensorProto] = {}
    nodes: list[onnx.NodeProto] = []
    for node in copy.graph.node:
        nodes.append(node)
        if node.output and node.output[0] in wanted:
            y = node.output[0]
            node.output[0] = f"{y}/unshifted"
            shifts[y] = numpy_helper.from_array(np.zeros((), np.float32), f"{y}/shift")
            nodes.append(helper.make_node("Add", [node.output[0], f"{y}/shift"], [y], f"{y}/Shift"))
    missing = wanted - set(shifts)
    if missing:
        raise ValueError(f"no node writes {sorted(missing)[0]}")
    set_nodes(copy.graph, nodes)
    return copy, shifts


def _pieces(
    nodes: list[onnx.NodeProto],
    producer: dict[str, int],
    reads: list[set[str]],
    lazy: set[int],
    ends: list[int],
) -> list[list[int]]:
    """The node indices of each piece, in graph order.

    A piece holds the previous target and its shift, the nodes its target needs that no earlier
    piece ran, that target, and the DequantizeLinears these read. A node runs in the piece of
    the first target that needs it, not in the piece its place in the graph falls in: the
    branches of a multi-head model then do not hand each other their half-computed tensors
    (LEADER's three heads held three GELUs' intermediates at 128×128 between pieces). The values
    are the same: a node runs once, after every shift it depends on is set.
    """
    done: set[int] = set()
    pieces = []
    for p, end in enumerate(ends):
        members = set() if p == 0 else {ends[p - 1], ends[p - 1] + 1}  # the target, its shift
        members.add(end)
        stack = list(members)
        while stack:  # what these need that no earlier piece ran (DequantizeLinears: again)
            i = stack.pop()
            for x in reads[i]:
                j = producer.get(x)
                if j is None or j in done or j in members:
                    continue
                members.add(j)
                stack.append(j)
        done |= {i for i in members if i not in lazy}
        pieces.append(sorted(members))
    return pieces


def _external(
    piece: list[int], nodes: list[onnx.NodeProto], reads: list[set[str]], inits: Mapping[str, Any]
) -> set[str]:
    """The tensors ``piece`` reads that it does not write and that are not constants."""
    written = {o for i in piece for o in nodes[i].output}
    return {x for i in piece for x in reads[i] if x not in written and x not in inits}


def _submodel(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    inputs: set[str],
    outputs: list[str],
    inits: Mapping[str, onnx.TensorProto],
    types: Mapping[str, int],
    live: Mapping[str, list[np.ndarray]],
) -> onnx.ModelProto:
    """The model of one piece: its nodes, the constants they read, typed inputs and outputs."""
    read = names_read(nodes)

    def typed(name: str) -> onnx.ValueInfoProto:
        if name in live and live[name]:
            elem: int = int(helper.np_dtype_to_tensor_dtype(live[name][0].dtype))
        else:
            elem = types.get(name, onnx.TensorProto.FLOAT)
        return helper.make_tensor_value_info(name, elem, None)

    graph = helper.make_graph(
        nodes,
        "piece",
        [typed(x) for x in sorted(inputs)],
        [typed(o) for o in outputs],
        [inits[x] for x in sorted(read) if x in inits],
    )
    sub = helper.make_model(graph, opset_imports=list(model.opset_import))
    sub.ir_version = model.ir_version
    return sub
