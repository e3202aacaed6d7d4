"""Quantizing inside If, Loop and Scan: each body is quantized as a model of its own.

onnxruntime cannot fetch a tensor computed inside a subgraph, and onnxruntime.quantization and
NNCF leave these bodies float (silero-vad keeps every weight float; an RNN exported as a Loop
or Scan keeps all its MatMuls float). onnxq lifts each body out and calibrates it on the values
it sees when it runs (define-by-run):

1. the body becomes a standalone model whose inputs are its own (a Loop's iteration number,
   condition and carried values; a Scan's states and slices; none for an If branch) and the
   outer values it reads (its free variables, nested bodies included), typed from the
   calibration samples; the outer constants a Loop or Scan body reads become its own;
2. the outer graph is run on the calibration data to get, per sample, the node's inputs and
   those outer values. An If branch is calibrated on the samples that take it. A Loop or Scan
   body is calibrated on every iteration that runs: onnxq runs the float body iteration by
   iteration as onnxruntime would (carried values fed back, the trip count and condition
   obeyed, Scan inputs sliced along their axis and direction), and each iteration's inputs are
   one calibration feed, computed again whenever calibration reads the data, so memory does not
   grow with the number of iterations;
3. the body model goes through the whole pipeline (``onnxq.quantize``, so an If nested in it is
   handled the same way, one level down);
4. the quantized graph replaces the body: its own inputs are restored, its free variables
   become implicit again, names it introduced that clash with names elsewhere in the model are
   renamed, outer constants no node reads any more are dropped, and the opsets the body needs
   are imported by the model.

A carried value is quantized at the start of each iteration and dequantized at its end, on
one set of parameters for every iteration: one requantization per iteration at most. A body
that no calibration sample runs, whose quantization fails, or whose If/Loop/Scan node the call
excludes, stays float and the report says why.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxq.core.errors import OnnxqError
from onnxq.io.bodies import first_iteration
from onnxq.io.graph import graphs_of, names_read, tensor_array
from onnxq.io.session import make_session

#: the nodes whose bodies are quantized as models of their own
BODY_OPS = ("If", "Loop", "Scan")


@dataclass
class BranchResult:
    """What happened to one branch."""

    node: str
    branch: str
    quantized: int = 0
    nodes: int = 0
    samples: int = 0
    #: a Loop or Scan body: the iterations those samples ran (one calibration feed each)
    iterations: int = 0
    reason: str = ""
    decisions: list[Any] = field(default_factory=list)


def defined_names(graph: onnx.GraphProto) -> set[str]:
    """Names a graph defines itself: inputs, initializers, node outputs (not nested bodies)."""
    out = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    out |= {t.name for t in graph.sparse_initializer}
    for node in graph.node:
        out.update(o for o in node.output if o)
    return out


def all_names(graph: onnx.GraphProto) -> set[str]:
    """Every name defined anywhere in ``graph``, nested bodies included."""
    out = defined_names(graph)
    for node in graph.node:
        for _, body in graphs_of(node):
            out |= all_names(body)
    return out


def free_variables(graph: onnx.GraphProto) -> list[str]:
    """Names ``graph`` (or a body nested in it) reads from enclosing scopes, first use first."""
    defined = defined_names(graph)
    out: list[str] = []
    for node in graph.node:
        reads = list(node.input)
        for _, body in graphs_of(node):
            reads += free_variables(body)
        for name in reads:
            if name and name not in defined and name not in out:
                out.append(name)
    return out


def has_branches(model: onnx.ModelProto) -> bool:
    """The main graph holds an If, Loop or Scan node."""
    return any(n.op_type in BODY_OPS for n in model.graph.node)


def _constants(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def dynamic_free_variables(model: onnx.ModelProto, body: onnx.GraphProto) -> list[str]:
    """The free variables of a Loop or Scan ``body`` that are not constants of ``model``."""
    consts = _constants(model)
    return [n for n in free_variables(body) if n not in consts]


def branch_model(
    parent: onnx.ModelProto, body: onnx.GraphProto, sample: dict[str, np.ndarray]
) -> onnx.ModelProto:
    """A standalone model of ``body``: its own inputs and free variables become graph inputs.

    Their element type and rank come from a calibration ``sample``; every dimension is
    symbolic, since a declared size (silero-vad's state is [2, 0, 128]) would let constant
    folding decide the nested Ifs once for every input. A body with inputs of its own (Loop,
    Scan) holds the outer constants it reads as initializers, so its weights are constants
    the pipeline can quantize.
    """
    graph = copy.deepcopy(body)
    own = [i.name for i in body.input]
    del graph.input[:]
    consts = _constants(parent) if own else {}
    for name in own + free_variables(body):
        if name in consts:
            graph.initializer.append(copy.deepcopy(consts[name]))
            continue
        value = np.asarray(sample[name])
        elem = helper.np_dtype_to_tensor_dtype(value.dtype)
        dims = [f"{name}_dim{i}" for i in range(value.ndim)]
        graph.input.append(helper.make_tensor_value_info(name, elem, dims))
    _typed_by_inputs(graph)
    model = helper.make_model(graph, opset_imports=list(parent.opset_import))
    model.ir_version = parent.ir_version
    untyped = [o for o in model.graph.output if not o.type.tensor_type.HasField("shape")]
    if untyped:  # onnx.checker wants a shape on graph outputs: take the rank from one run
        values = make_session(model, optimize=False).run([o.name for o in untyped], sample)
        for out, value in zip(untyped, values, strict=True):
            value = np.asarray(value)
            out.type.CopyFrom(
                helper.make_tensor_type_proto(
                    helper.np_dtype_to_tensor_dtype(value.dtype),
                    [f"{out.name}_dim{i}" for i in range(value.ndim)],
                )
            )
    return model


def _typed_by_inputs(graph: onnx.GraphProto) -> None:
    """Drop ``graph``'s value_info entries of its inputs.

    A body's entry for an outer value it reads (exported with no shape) would override the
    input's type where an import reads it.
    """
    inputs = {i.name for i in graph.input}
    kept = [v for v in graph.value_info if v.name not in inputs]
    if len(kept) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(kept)


def declared_bodies(
    model: onnx.ModelProto,
) -> Iterator[tuple[onnx.NodeProto, str, onnx.ModelProto]]:
    """Each body of the top-level If, Loop and Scan nodes as a model, typed without data.

    Its own inputs as it declares them, its free variables as the outer graph's shape inference
    types them (float of unknown shape where it cannot). For ``inspect``, which explains what
    ``quantize`` would do inside each body.
    """
    holders = [n for n in model.graph.node if n.op_type in BODY_OPS]
    if not holders:
        return
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # an untypeable outer graph: its values stay of unknown shape
        inferred = model.graph
    known = {v.name: v for v in [*inferred.input, *inferred.value_info, *inferred.output]}
    for node in holders:
        for attr_name, body in graphs_of(node):
            graph = copy.deepcopy(body)
            consts = _constants(model) if node.op_type != "If" else {}
            for name in free_variables(body):
                if name in consts:
                    graph.initializer.append(copy.deepcopy(consts[name]))
                elif name in known:
                    graph.input.append(copy.deepcopy(known[name]))
                else:
                    graph.input.append(
                        helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                    )
            _typed_by_inputs(graph)
            body_model = helper.make_model(graph, opset_imports=list(model.opset_import))
            body_model.ir_version = model.ir_version
            yield node, attr_name, body_model


def outer_values(
    model: onnx.ModelProto, names: list[str], feeds: Iterable[dict[str, np.ndarray]]
) -> list[dict[str, np.ndarray]]:
    """``names`` computed by the float ``model`` on every feed (graph inputs read from it).

    Constants of ``model`` are read from it.
    """
    inputs = {i.name for i in model.graph.input}
    consts = {n: tensor_array(t) for n, t in _constants(model).items() if n in names}
    wanted = [n for n in names if n not in inputs and n not in consts]
    session = make_session(model, optimize=False, expose=wanted)
    rows = []
    for feed in feeds:
        got = dict(zip(wanted, session.run(wanted, feed), strict=True)) if wanted else {}
        got.update(consts)
        rows.append({n: (np.asarray(feed[n]) if n in inputs else got[n]) for n in names})
    return rows


def _rename(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    for seq in (graph.input, graph.output, graph.value_info):
        for v in seq:
            v.name = mapping.get(v.name, v.name)
    for t in graph.initializer:
        t.name = mapping.get(t.name, t.name)
    for node in graph.node:
        node.input[:] = [mapping.get(x, x) for x in node.input]
        node.output[:] = [mapping.get(x, x) for x in node.output]
        for _, body in graphs_of(node):
            _rename(body, {k: v for k, v in mapping.items() if k not in defined_names(body)})


def _merge_opsets(model: onnx.ModelProto, other: onnx.ModelProto) -> None:
    have = {o.domain: o for o in model.opset_import}
    for imp in other.opset_import:
        if imp.domain not in have:
            model.opset_import.append(copy.deepcopy(imp))
        elif have[imp.domain].version < imp.version:
            have[imp.domain].version = imp.version


def quantize_branches(
    float_model: onnx.ModelProto,
    result: onnx.ModelProto,
    feeds: list[dict[str, np.ndarray]],
    quantize: Callable[[onnx.ModelProto, Any], tuple[onnx.ModelProto, Any]],
    iterations: Callable[[onnx.NodeProto, onnx.ModelProto, list[str], list[Any]], Any],
    kept: set[str] | frozenset[str] = frozenset(),
) -> tuple[onnx.ModelProto, list[BranchResult]]:
    """``result`` with the bodies of its top-level If, Loop and Scan nodes quantized.

    ``float_model`` is the preprocessed float model whose nodes ``result`` kept; ``quantize``
    quantizes a body model with the caller's options, on a list of feeds or a DatasetManager;
    ``iterations(node, body model, dynamic free variables, rows)`` gives a Loop or Scan body's
    feeds, one per iteration (onnxq.calibrate.iterations), with the count of the last read as
    ``count`` (see the module doc). The bodies of the nodes named in ``kept`` (the call's
    ``exclude`` and ``keep_float``) stay float.
    """
    holders = [n for n in float_model.graph.node if n.op_type in BODY_OPS]
    out = copy.deepcopy(result)
    by_name = {n.name: n for n in out.graph.node}
    report: list[BranchResult] = []
    needed: list[str] = []
    for node in holders:
        needed += [n for n in node.input if n]
        for _, body in graphs_of(node):
            needed += free_variables(body)
    values = outer_values(float_model, list(dict.fromkeys(needed)), feeds)
    inlined: set[str] = set()
    for node in holders:
        target = by_name.get(node.name)
        for attr_name, body in graphs_of(node):
            res = BranchResult(node.name, attr_name, nodes=len(body.node))
            report.append(res)
            if target is None:
                res.reason = f"the {node.op_type} node is not in the quantized model"
                continue
            if node.name in kept:
                res.reason = "excluded: the call keeps this node and its bodies float"
                continue
            data: Any  # an If branch's feeds, or a Loop/Scan body's Iterations
            if node.op_type == "If":
                taken = attr_name == "then_branch"
                names = free_variables(body)
                rows = [
                    {n: row[n] for n in names}
                    for row in values
                    if bool(np.asarray(row[node.input[0]]).reshape(-1)[0]) == taken
                ]
                res.samples = len(rows)
                if not rows:
                    res.reason = "no calibration sample takes this branch, so it stays float"
                    continue
                model, data = branch_model(float_model, body, rows[0]), rows
            else:  # preprocessing raised the opset past Scan-8's batched form
                free = dynamic_free_variables(float_model, body)
                rows = [{n: row[n] for n in [*node.input, *free] if n} for row in values]
                first = first_iteration(node, rows, free)
                if first is None:
                    res.reason = "no calibration sample runs an iteration, so it stays float"
                    continue
                model = branch_model(float_model, body, first)
                data = iterations(node, model, free, rows)
                res.samples = len(rows)
            try:
                qbranch, qreport = quantize(model, data)
            except OnnxqError as exc:
                res.reason = f"stays float: {exc}"
                continue
            res.decisions = list(qreport.decisions)
            res.quantized = len(qreport.quantized_nodes)
            res.iterations = 0 if node.op_type == "If" else int(data.count)
            if res.quantized == 0:
                res.reason = "nothing in it is worth quantizing (see its node reasons)"
                continue
            graph = qbranch.graph
            if [o.name for o in graph.output] != [o.name for o in body.output]:
                res.reason = "its outputs changed names while quantizing; it stays float"
                continue
            del graph.input[:]
            graph.input.extend(copy.deepcopy(list(body.input)))
            if node.op_type != "If":
                inlined |= set(free_variables(body)) - set(free_variables(graph))
            outer = all_names(out.graph) - all_names(_branch_of(target, attr_name))
            clashes = {n for n in all_names(graph) - all_names(body) if n in outer}
            if clashes:
                _rename(graph, {n: f"{n}__{node.name}_{attr_name}" for n in sorted(clashes)})
            _replace_branch(target, attr_name, graph)
            _merge_opsets(out, qbranch)
    _drop_unread(out.graph, inlined)
    return out, report


def _drop_unread(graph: onnx.GraphProto, names: set[str]) -> None:
    """Remove the initializers among ``names`` that no node of ``graph`` reads any more."""
    if not names:
        return
    read = names_read(graph.node) | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name not in names or t.name in read]
    if len(keep) < len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)


def _branch_of(node: onnx.NodeProto, name: str) -> onnx.GraphProto:
    return dict(graphs_of(node))[name]


def _replace_branch(node: onnx.NodeProto, name: str, graph: onnx.GraphProto) -> None:
    for attr in node.attribute:
        if attr.name == name and attr.type == onnx.AttributeProto.GRAPH:
            attr.g.CopyFrom(graph)
            return
    raise OnnxqError(f"If node '{node.name}' has no branch '{name}'")
