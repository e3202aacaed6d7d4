"""Preprocessing passes run on the float model before matching.

Contract: requires a model accepted by onnx.checker; ensures a model with the same inputs,
outputs and numerics in which every node has a unique name, constant subgraphs (Constant,
ConstantOfShape, Transpose of a weight, ...) are folded into initializers, BatchNormalization
after a Conv is folded into the Conv, the default opset is at least 10 (QLinear ops exist),
shapes are inferred, and the input projections of Loop/Scan bodies run before their loop
(onnxq.prepare.hoist).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import tempfile
from collections.abc import Collection

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxq.io.graph import (
    GraphEditor,
    as_imported,
    constant_value,
    copy_fields,
    export_model,
    graphs_of,
    import_graph,
    in_file,
    is_absent,
    iter_subgraph_nodes,
    skeleton,
)
from onnxq.prepare.fusions import fuse_hardswish_graph
from onnxq.prepare.hoist import hoist_projections
from onnxq.prepare.opset import default_opset, raise_opset

MIN_OPSET = 10
TARGET_OPSET = 13


def preprocess(model: onnx.ModelProto) -> onnx.ModelProto:
    """Run every preprocessing pass and return a new model (the argument is not modified)."""
    return prepare(model)[0]


def prepare(model: onnx.ModelProto, kept: Collection[str] = ()) -> tuple[onnx.ModelProto, gs.Graph]:
    """:func:`preprocess`, and the model it returns as a graph: the one import of the model.

    The graph the passes edited is handed on, with the shapes inference found written into it
    (onnxq.io.graph.as_imported), instead of importing the returned model again.
    """
    out, graph, _ = prepare_hoisting(model, kept)
    return out, graph


def prepare_hoisting(
    model: onnx.ModelProto, kept: Collection[str] = ()
) -> tuple[onnx.ModelProto, gs.Graph, list[str]]:
    """:func:`prepare`, and the input projections it moved out of Loop and Scan bodies.

    They are hoisted (onnxq.prepare.hoist) once shapes are known, except in the If/Loop/Scan
    nodes named in ``kept``; that costs one more export and import, only where one moved.
    """
    if default_opset(model) < MIN_OPSET:
        model = raise_opset(model, TARGET_OPSET, f"QLinear ops (opset >= {MIN_OPSET})")
    graph = import_graph(model)
    _name_nodes(graph)
    _drop_identities(graph)
    _fold_constants(graph)
    _fold_batchnorm(graph)
    _fold_affine(graph)
    out = export_model(graph, model)
    out, _, graph = fuse_hardswish_graph(out, graph)
    out = _shaped(out, model)
    graph = as_imported(graph, out)
    bodies = any(True for n in out.graph.node for _ in graphs_of(n))
    moved = hoist_projections(graph, kept) if bodies else []
    if moved:
        out = _shaped(export_model(graph, out), model)
        graph = as_imported(graph, out)
    return out, graph, moved


def _shaped(out: onnx.ModelProto, model: onnx.ModelProto) -> onnx.ModelProto:
    """``out`` with ``model``'s producer and the shapes ONNX and symbolic inference find."""
    out.producer_name = model.producer_name
    out.producer_version = model.producer_version
    try:
        out = _with_weights(onnx.shape_inference.infer_shapes(skeleton(out), data_prop=True), out)
        if _carried_shapes(out):  # and what follows from them
            out = _with_weights(
                onnx.shape_inference.infer_shapes(skeleton(out), data_prop=True), out
            )
    except Exception as exc:  # shape inference is best effort: patterns cope with unknown shapes
        logging.getLogger("onnxq").info("shape inference failed: %s", exc)
    out.graph.value_info.extend(_symbolic_value_info(out))
    return out


def _dims(value: onnx.ValueInfoProto | None) -> list[int | str] | None:
    """``value``'s dimensions (a number or a name each), or None where one is unknown."""
    if value is None or not value.type.tensor_type.HasField("shape"):
        return None
    dims: list[int | str] = []
    for d in value.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            return None
    return dims


def _carried_shapes(model: onnx.ModelProto) -> bool:
    """Give each Loop carried value and Scan state leaving the main graph its initial shape.

    ONNX inference types them without a shape (a carried value may change shape between
    iterations). One whose body declares the same shape for it coming in and going out, the
    shape its initial value has, keeps that shape on every iteration: its output is given it.
    onnxruntime's symbolic inference, the other way to these shapes, costs half a second to
    import. True when a shape was added (inference then runs again for what follows).
    """
    g = model.graph
    known = {v.name: v for v in [*g.input, *g.value_info, *g.output]}
    declared = {o.name for o in g.output}  # the model's own outputs stay as it declares them
    added = False
    for node in g.node:
        if node.op_type not in ("Loop", "Scan"):
            continue
        body = dict(graphs_of(node))["body"]
        if node.op_type == "Loop":
            states = len(node.input) - 2
            pairs = [(node.input[2 + k], 2 + k, 1 + k, k) for k in range(states)]
        else:
            scans = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
            states = len(node.input) - scans
            pairs = [(node.input[k], k, k, k) for k in range(states)]
        for initial, body_in, body_out, out_at in pairs:
            if out_at >= len(node.output) or not node.output[out_at]:
                continue
            name = node.output[out_at]
            if name in declared or _dims(known.get(name)) is not None:
                continue
            first = _dims(known.get(initial))
            if first is None or body_in >= len(body.input) or body_out >= len(body.output):
                continue
            if not first == _dims(body.input[body_in]) == _dims(body.output[body_out]):
                continue
            value = known.get(name)
            typed = onnx.ValueInfoProto()
            typed.CopyFrom(known[initial])
            typed.name = name
            if value is not None:
                value.CopyFrom(typed)
            else:
                g.value_info.append(typed)
            added = True
    return added


def _with_weights(inferred: onnx.ModelProto, full: onnx.ModelProto) -> onnx.ModelProto:
    """``full``, changed in place, with everything of ``inferred`` but the initializers.

    ``inferred`` is :func:`~onnxq.io.graph.skeleton` of ``full`` after shape inference.
    Copying the weights back into ``inferred`` instead took 2 s on VGG19.
    """
    for field, _ in full.graph.ListFields():
        if field.name != "initializer":
            full.graph.ClearField(field.name)
    for field, _ in full.ListFields():
        if field.name != "graph":
            full.ClearField(field.name)
    copy_fields(inferred, full, skip="graph")
    copy_fields(inferred.graph, full.graph, skip="initializer")
    return full


def _unshaped(model: onnx.ModelProto) -> list[str]:
    g = model.graph
    known = {
        v.name for v in [*g.value_info, *g.input, *g.output] if v.type.tensor_type.HasField("shape")
    }
    known |= {t.name for t in g.initializer}
    return [o for n in g.node for o in n.output if o and o not in known]


def _symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fill the shapes ONNX inference leaves open with onnxruntime's symbolic shape inference.

    ONNX stops at ops whose output shape depends on values it does not propagate (paddle2onnx
    exports: 122 of the 363 tensors of the PP-OCRv4 recogniser). Only missing entries are
    added; when the symbolic pass (it needs sympy) fails, the model is returned as it was.
    """
    found = _symbolic_value_info(model)
    if not found:
        return model
    out = copy.deepcopy(model)
    out.graph.value_info.extend(found)
    return out


def _symbolic_value_info(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The shapes :func:`_symbolic_shapes` adds (none when the symbolic pass gives up)."""
    missing = set(_unshaped(model))
    if not missing:
        return []
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        # on incomplete inference it saves "sym_shape_infer_temp.onnx" (and external data) in
        # the working directory: run it in a scratch directory so no file lands there
        with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
            inferred = SymbolicShapeInference.infer_shapes(
                skeleton(model), auto_merge=True, guess_output_rank=True
            )
    except Exception as exc:  # sympy missing, or an op it does not know
        logging.getLogger("onnxq").info("symbolic shape inference failed: %s", exc)
        return []
    if inferred is None:
        return []
    return [
        vi
        for vi in inferred.graph.value_info
        if vi.name in missing and vi.type.tensor_type.HasField("shape")
    ]


def _name_nodes(graph: gs.Graph) -> None:
    """Give every node a unique, deterministic name derived from its op and first output."""
    bases = [n.name or f"{n.op}_{n.outputs[0].name if n.outputs else 'node'}" for n in graph.nodes]
    for node, name in zip(graph.nodes, unique_names(bases), strict=True):
        node.name = name


def unique_names(bases: list[str]) -> list[str]:
    """``bases`` made unique in order: a repeated ``mm`` becomes ``mm_1``, ``mm_2`` and so on."""
    seen: set[str] = set()
    out = []
    for base in bases:
        name, k = base, 1
        while name in seen:
            name = f"{base}_{k}"
            k += 1
        out.append(name)
        seen.add(name)
    return out


def _drop_identities(graph: gs.Graph) -> None:
    """Remove Identity nodes: they sit between ops a pattern joins (Conv → Identity → Relu).

    paddle2onnx writes one after most convolutions (58 in the PP-OCRv6 recogniser). An Identity
    that writes a graph output, or whose output a subgraph reads by name, is kept.
    """
    editor = GraphEditor(graph)
    outputs = {id(t) for t in graph.outputs}
    inner = {
        t.name
        for node in graph.nodes
        for body in node.attrs.values()
        if isinstance(body, gs.Graph)
        for n in iter_subgraph_nodes(body)
        for t in n.inputs
    }
    for node in list(graph.nodes):
        if node.op != "Identity" or len(node.inputs) != 1 or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        if id(out) in outputs or out.name in inner:
            continue
        editor.redirect(out, node.inputs[0])
        editor.remove_node(node)
    editor.finish()


def _fold_constants(graph: gs.Graph) -> None:
    """Fold constant subgraphs into initializers (uses onnxruntime through graphsurgeon)."""
    editor = GraphEditor(graph)
    outputs = {id(t) for t in graph.outputs}
    for node in graph.nodes:
        if node.op == "Constant" and "value" in node.attrs and id(node.outputs[0]) not in outputs:
            value = node.attrs["value"]
            arr = value.values if isinstance(value, gs.Constant) else np.asarray(value)
            out = node.outputs[0]
            editor.redirect(out, gs.Constant(out.name + "_value", np.asarray(arr)))
            editor.remove_node(node)
    graph.cleanup(remove_unused_graph_inputs=False)
    _read_folded_weights(graph)
    _quiet()
    try:
        # flatten_subgraphs=False: graphsurgeon 0.6's inlining of an If with a constant
        # condition loses outputs of nested Ifs (silero-vad's decoder: the model no longer loads)
        graph.fold_constants(error_ok=True, fold_shapes=True, flatten_subgraphs=False).cleanup(
            remove_unused_graph_inputs=False
        )
    except Exception as exc:  # graphsurgeon folding is an optimisation, never required
        logging.getLogger("onnxq").info("constant folding skipped: %s", exc)
    graph.toposort()


def _read_folded_weights(graph: gs.Graph) -> None:
    """Read in the file weights a foldable node reads (a Transpose of a weight, a Cast).

    graphsurgeon folds by running onnxruntime on an exported copy of the constant subgraph;
    a weight left in the model's data file would reach it without its folder. Only the
    weights of nodes whose every input is constant are read; the rest stay in the file.
    """
    for node in graph.nodes:
        ins = [t for t in node.inputs if not is_absent(t)]
        if ins and all(isinstance(t, gs.Constant) for t in ins):
            for t in ins:
                if in_file(t):
                    t.values = t.values


def _quiet() -> None:
    """Keep graphsurgeon's and onnxruntime's advice off the user's terminal."""
    import onnxruntime as ort
    from onnx_graphsurgeon.logger import G_LOGGER

    G_LOGGER.severity = G_LOGGER.ERROR
    ort.set_default_logger_severity(3)


def _gemm_weights(gemm: gs.Node) -> tuple[np.ndarray, np.ndarray, bool, int] | None:
    """Gemm as (alpha·B, beta·C per output column, has C, column axis of B), or None."""
    if not isinstance(gemm.inputs[1], gs.Constant):
        return None
    w = np.asarray(gemm.inputs[1].values, np.float64) * float(gemm.attrs.get("alpha", 1.0))
    axis = 0 if int(gemm.attrs.get("transB", 0)) else 1
    n = w.shape[axis]
    has_b = len(gemm.inputs) > 2 and not is_absent(gemm.inputs[2])
    if not has_b:
        return w, np.zeros(n), False, axis
    c = gemm.inputs[2]
    if not isinstance(c, gs.Constant):
        return None
    value = np.asarray(c.values, np.float64) * float(gemm.attrs.get("beta", 1.0))
    if value.size not in (1, n) or (value.ndim == 2 and value.shape[0] != 1) or value.ndim > 2:
        return None  # a C that varies along the batch rows is not a per-channel bias
    return w, np.broadcast_to(value.reshape(-1), (n,)).copy(), True, axis


def _weights(conv: gs.Node) -> tuple[np.ndarray, np.ndarray, bool, int] | None:
    """(W, b, has_b, output-channel axis of W) of a Conv/ConvTranspose/Gemm with constant W, b."""
    if conv.op == "Gemm":
        return _gemm_weights(conv)
    if conv.op not in ("Conv", "ConvTranspose") or not isinstance(conv.inputs[1], gs.Constant):
        return None
    if conv.op == "ConvTranspose" and int(conv.attrs.get("group", 1)) != 1:
        return None
    has_b = len(conv.inputs) > 2 and not is_absent(conv.inputs[2])
    if has_b and not isinstance(conv.inputs[2], gs.Constant):
        return None
    w = np.asarray(conv.inputs[1].values, np.float64)
    axis = 1 if conv.op == "ConvTranspose" else 0
    b = np.asarray(conv.inputs[2].values, np.float64) if has_b else np.zeros(w.shape[axis])
    return w, b, has_b, axis


def _scale_shift(editor: GraphEditor, conv: gs.Node, scale: np.ndarray, shift: np.ndarray) -> None:
    """Make ``conv`` compute ``conv(x) · scale + shift`` (per output channel) by itself."""
    found = _weights(conv)
    assert found is not None
    w, b, has_b, axis = found
    shape = [1] * w.ndim
    shape[axis] = -1
    editor.set_input(
        conv,
        1,
        editor.constant(f"{conv.name}.W_folded", (w * scale.reshape(shape)).astype(np.float32)),
    )
    bias = editor.constant(f"{conv.name}.B_folded", (b * scale + shift).astype(np.float32))
    if conv.op == "Gemm":  # alpha and beta are now inside W and the bias
        conv.attrs["alpha"], conv.attrs["beta"] = 1.0, 1.0
    if has_b:
        editor.set_input(conv, 2, bias)
    else:
        editor.append_input(conv, bias)


def _single_reader(graph: gs.Graph, node: gs.Node) -> gs.Node | None:
    """The one node reading ``node``'s output, when the output is not also a graph output."""
    y = node.outputs[0] if node.outputs else None
    if y is None or len(y.outputs) != 1 or any(o is y for o in graph.outputs):
        return None
    return y.outputs[0]


def fold_batchnorm(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each BatchNormalization after a Conv/ConvTranspose/Gemm folded into it.

    For a float rewrite that must see the layers as preprocessing will leave them (cross-layer
    equalization finds Conv → Relu → Conv chains; a BatchNormalization between hid them). A
    model without such a pair is returned as it is.
    """
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    folds = [
        n
        for n in model.graph.node
        if n.op_type == "BatchNormalization"
        and producers.get(n.input[0]) in ("Conv", "ConvTranspose", "Gemm")
    ]
    if not folds:
        return model
    graph = import_graph(model)
    _fold_batchnorm(graph)
    return export_model(graph, model)


def _fold_batchnorm(graph: gs.Graph) -> None:
    """Conv/ConvTranspose/Gemm → BatchNormalization (inference form) becomes one node."""
    editor = GraphEditor(graph)
    for conv in list(graph.nodes):
        bn = _single_reader(graph, conv)
        if bn is None or bn.op != "BatchNormalization" or len(bn.outputs) != 1:
            continue
        params = [constant_value(t) for t in bn.inputs[1:5]]
        found = _weights(conv)
        if found is None or any(p is None for p in params):
            continue
        gamma, beta, mean, var = (np.asarray(p, np.float64) for p in params)
        scale = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        _scale_shift(editor, conv, scale, beta - mean * scale)
        editor.absorb(conv, bn)
    editor.finish()


def _per_channel(value: np.ndarray, rank: int, channels: int) -> np.ndarray | None:
    """``value`` as one number per channel (axis 1 of a rank-``rank`` tensor), else None."""
    v = np.asarray(value, np.float64)
    if v.ndim > rank:
        return None
    full = v.reshape((1,) * (rank - v.ndim) + v.shape)
    if any(d != 1 for i, d in enumerate(full.shape) if i != 1):
        return None
    if full.shape[1] not in (1, channels):
        return None
    return np.broadcast_to(full.reshape(-1), (channels,)).copy()


def _fold_affine(graph: gs.Graph) -> None:
    """Conv → Mul(constant per channel) / Add(constant per channel) folds into W and b.

    Old exporters write BatchNormalization as such a Mul and Add; folded, the Conv's output
    range is the one that gets quantized and the pair costs nothing at run time.
    """
    editor = GraphEditor(graph)
    changed = True
    while changed:
        changed = False
        for conv in list(graph.nodes):
            nxt = _single_reader(graph, conv)
            found = _weights(conv)
            if nxt is None or found is None or nxt.op not in ("Mul", "Add"):
                continue
            y = conv.outputs[0]
            other = nxt.inputs[1] if nxt.inputs[0] is y else nxt.inputs[0]
            value = constant_value(other)
            w, _, _, axis = found
            if value is None or (y.shape is not None and len(y.shape) != w.ndim):
                continue
            vec = _per_channel(value, w.ndim, w.shape[axis])
            if vec is None:
                continue
            if nxt.op == "Mul":
                _scale_shift(editor, conv, vec, np.zeros_like(vec))
            else:
                _scale_shift(editor, conv, np.ones_like(vec), vec)
            editor.absorb(conv, nxt)
            changed = True
        editor.finish()
