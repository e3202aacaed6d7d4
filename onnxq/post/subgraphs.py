"""Quantizing inside If branches: each branch is quantized as a model of its own.

onnxruntime cannot fetch a tensor computed inside a subgraph, and onnxruntime.quantization
leaves If bodies untouched (silero-vad keeps every weight float). onnxq lifts each branch out:

1. the branch becomes a standalone model whose inputs are the outer values it reads (its free
   variables, nested bodies included), typed from the outer graph;
2. the outer graph is run on the calibration data to get, per sample, the If condition and
   those outer values; a branch is calibrated on the samples that take it;
3. the branch model goes through the whole pipeline (``onnxq.quantize``, so an If nested in
   it is handled the same way, one level down);
4. the quantized graph replaces the branch: its free variables become implicit again, names it
   introduced that clash with names elsewhere in the model are renamed, and the opsets the
   branch needs are imported by the model.

A branch that no calibration sample takes, or whose quantization fails, stays float and the
report says why. Loop and Scan bodies carry state between iterations that cannot be fed from
outside; they stay float.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxq.core.errors import OnnxqError
from onnxq.io.graph import graphs_of
from onnxq.io.session import make_session


@dataclass
class BranchResult:
    """What happened to one branch."""

    node: str
    branch: str
    quantized: int = 0
    nodes: int = 0
    samples: int = 0
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
    """The main graph holds an If node."""
    return any(n.op_type == "If" for n in model.graph.node)


def branch_model(
    parent: onnx.ModelProto, body: onnx.GraphProto, sample: dict[str, np.ndarray]
) -> onnx.ModelProto:
    """A standalone model of ``body``: its free variables become graph inputs.

    Their element type and rank come from a calibration ``sample``; every dimension is
    symbolic, since a declared size (silero-vad's state is [2, 0, 128]) would let constant
    folding decide the nested Ifs once for every input.
    """
    graph = copy.deepcopy(body)
    del graph.input[:]
    for name in free_variables(body):
        value = np.asarray(sample[name])
        elem = helper.np_dtype_to_tensor_dtype(value.dtype)
        dims = [f"{name}_dim{i}" for i in range(value.ndim)]
        graph.input.append(helper.make_tensor_value_info(name, elem, dims))
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


def outer_values(
    model: onnx.ModelProto, names: list[str], feeds: Iterable[dict[str, np.ndarray]]
) -> list[dict[str, np.ndarray]]:
    """``names`` computed by the float ``model`` on every feed (graph inputs read from it)."""
    inputs = {i.name for i in model.graph.input}
    wanted = [n for n in names if n not in inputs]
    session = make_session(model, optimize=False, expose=wanted)
    rows = []
    for feed in feeds:
        got = dict(zip(wanted, session.run(wanted, feed), strict=True)) if wanted else {}
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
    quantize: Callable[[onnx.ModelProto, list[dict[str, np.ndarray]]], tuple[onnx.ModelProto, Any]],
) -> tuple[onnx.ModelProto, list[BranchResult]]:
    """``result`` with the branches of its top-level If nodes quantized (see the module doc).

    ``float_model`` is the preprocessed float model whose If nodes ``result`` kept; ``quantize``
    quantizes a branch model with the caller's options.
    """
    ifs = [n for n in float_model.graph.node if n.op_type == "If"]
    out = copy.deepcopy(result)
    by_name = {n.name: n for n in out.graph.node}
    report: list[BranchResult] = []
    needed: list[str] = []
    for node in ifs:
        needed.append(node.input[0])
        for _, body in graphs_of(node):
            needed += [n for n in free_variables(body) if n not in needed]
    values = outer_values(float_model, list(dict.fromkeys(needed)), feeds)
    for node in ifs:
        target = by_name.get(node.name)
        for attr_name, body in graphs_of(node):
            res = BranchResult(node.name, attr_name, nodes=len(body.node))
            report.append(res)
            if target is None:
                res.reason = "the If node is not in the quantized model"
                continue
            taken = attr_name == "then_branch"
            names = free_variables(body)
            samples = [
                {n: row[n] for n in names}
                for row in values
                if bool(np.asarray(row[node.input[0]]).reshape(-1)[0]) == taken
            ]
            res.samples = len(samples)
            if not samples:
                res.reason = "no calibration sample takes this branch, so it stays float"
                continue
            try:
                qbranch, qreport = quantize(branch_model(float_model, body, samples[0]), samples)
            except OnnxqError as exc:
                res.reason = f"stays float: {exc}"
                continue
            res.decisions = list(qreport.decisions)
            res.quantized = len(qreport.quantized_nodes)
            if res.quantized == 0:
                res.reason = "nothing in it is worth quantizing (see its node reasons)"
                continue
            graph = qbranch.graph
            if [o.name for o in graph.output] != [o.name for o in body.output]:
                res.reason = "its outputs changed names while quantizing; it stays float"
                continue
            del graph.input[:]
            outer = all_names(out.graph) - all_names(_branch_of(target, attr_name))
            clashes = {n for n in all_names(graph) - all_names(body) if n in outer}
            if clashes:
                _rename(graph, {n: f"{n}__{node.name}_{attr_name}" for n in sorted(clashes)})
            _replace_branch(target, attr_name, graph)
            _merge_opsets(out, qbranch)
    return out, report


def _branch_of(node: onnx.NodeProto, name: str) -> onnx.GraphProto:
    return dict(graphs_of(node))[name]


def _replace_branch(node: onnx.NodeProto, name: str, graph: onnx.GraphProto) -> None:
    for attr in node.attribute:
        if attr.name == name and attr.type == onnx.AttributeProto.GRAPH:
            attr.g.CopyFrom(graph)
            return
    raise OnnxqError(f"If node '{node.name}' has no branch '{name}'")
