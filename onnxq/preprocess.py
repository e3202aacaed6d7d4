"""Preprocessing passes run on the float model before matching.

Contract: requires a model accepted by onnx.checker; ensures a model with the same inputs,
outputs and numerics in which every node has a unique name, constant subgraphs (Constant,
ConstantOfShape, Transpose of a weight, ...) are folded into initializers, BatchNormalization
after a Conv is folded into the Conv, the default opset is at least 10 (QLinear ops exist), and
shapes are inferred.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxq.errors import ModelError
from onnxq.graph import GraphEditor, constant_value, export_model, import_graph, producer

MIN_OPSET = 10
TARGET_OPSET = 13


def default_opset(model: onnx.ModelProto) -> int:
    """The model's ai.onnx opset version."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 1


def raise_opset(model: onnx.ModelProto, opset: int, why: str) -> onnx.ModelProto:
    """``model`` converted to at least ``opset`` with onnx's version converter (or unchanged)."""
    have = default_opset(model)
    if have >= opset:
        return model
    try:
        return onnx.version_converter.convert_version(model, opset)
    except Exception as exc:  # the converter raises RuntimeError and others
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(
            f"{why} needs opset {opset}; the model has opset {have} and converting "
            f"it failed ({first}); re-export with opset >= {opset} or use "
            "--per-tensor"
        ) from None


def preprocess(model: onnx.ModelProto) -> onnx.ModelProto:
    """Run every preprocessing pass and return a new model (the argument is not modified)."""
    if default_opset(model) < MIN_OPSET:
        model = raise_opset(model, TARGET_OPSET, f"QLinear ops (opset >= {MIN_OPSET})")
    graph = import_graph(model)
    _name_nodes(graph)
    _fold_constants(graph)
    _fold_batchnorm(graph)
    _fold_affine(graph)
    out = export_model(graph, model)
    out.producer_name = model.producer_name
    out.producer_version = model.producer_version
    try:
        out = onnx.shape_inference.infer_shapes(out, data_prop=True)
    except Exception as exc:  # shape inference is best effort: patterns cope with unknown shapes
        logging.getLogger("onnxq").info("shape inference failed: %s", exc)
    return out


def _name_nodes(graph: gs.Graph) -> None:
    """Give every node a unique, deterministic name derived from its op and first output."""
    seen: set[str] = set()
    for node in graph.nodes:
        base = node.name or f"{node.op}_{node.outputs[0].name if node.outputs else 'node'}"
        name, k = base, 1
        while name in seen:
            name = f"{base}_{k}"
            k += 1
        node.name = name
        seen.add(name)


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
    _quiet()
    try:
        graph.fold_constants(error_ok=True, fold_shapes=True).cleanup(
            remove_unused_graph_inputs=False
        )
    except Exception as exc:  # graphsurgeon folding is an optimisation, never required
        logging.getLogger("onnxq").info("constant folding skipped: %s", exc)
    graph.toposort()


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
            if conv.op != "Conv" or not conv.outputs or not isinstance(conv.inputs[1], gs.Constant):
                continue
            y = conv.outputs[0]
            if len(y.outputs) != 1 or any(o is y for o in graph.outputs):
                continue
            nxt = y.outputs[0]
            if nxt.op not in ("Mul", "Add") or len(nxt.inputs) != 2:
                continue
            other = nxt.inputs[1] if nxt.inputs[0] is y else nxt.inputs[0]
            value = constant_value(other)
            w = np.asarray(conv.inputs[1].values, np.float64)
            if value is None or (y.shape is not None and len(y.shape) != w.ndim):
                continue
            vec = _per_channel(value, w.ndim, w.shape[0])
            if vec is None:
                continue
            has_b = len(conv.inputs) > 2 and isinstance(conv.inputs[2], gs.Constant)
            if len(conv.inputs) > 2 and not has_b:
                continue
            b = np.asarray(conv.inputs[2].values, np.float64) if has_b else np.zeros(w.shape[0])
            if nxt.op == "Mul":
                w = w * vec.reshape(-1, *([1] * (w.ndim - 1)))
                b = b * vec
            else:
                b = b + vec
            conv.inputs[1] = editor.constant(f"{conv.name}.W_folded", w.astype(np.float32))
            bias = editor.constant(f"{conv.name}.B_folded", b.astype(np.float32))
            if has_b:
                conv.inputs[2] = bias
            else:
                conv.inputs.append(bias)
            out = nxt.outputs[0]
            nxt.outputs.clear()
            conv.outputs[0] = out
            changed = True
        graph.cleanup(remove_unused_graph_inputs=False).toposort()


def _quiet() -> None:
    """Keep graphsurgeon's and onnxruntime's advice off the user's terminal."""
    import onnxruntime as ort
    from onnx_graphsurgeon.logger import G_LOGGER

    G_LOGGER.severity = G_LOGGER.ERROR
    ort.set_default_logger_severity(3)


def _fold_batchnorm(graph: gs.Graph) -> None:
    """Conv → BatchNormalization (inference form) becomes one Conv with adjusted W and b."""
    editor = GraphEditor(graph)
    for bn in list(graph.nodes):
        if bn.op != "BatchNormalization" or len(bn.outputs) != 1:
            continue
        x = bn.inputs[0]
        conv = producer(x)
        if conv is None or conv.op != "Conv" or len(x.outputs) != 1 or x in graph.outputs:
            continue
        params = [t for t in bn.inputs[1:5]]
        if not all(isinstance(t, gs.Constant) for t in params):
            continue
        if not isinstance(conv.inputs[1], gs.Constant):
            continue
        if len(conv.inputs) > 2 and not isinstance(conv.inputs[2], gs.Constant):
            continue
        gamma, beta, mean, var = (np.asarray(t.values, np.float64) for t in params)
        eps = float(bn.attrs.get("epsilon", 1e-5))
        w = np.asarray(conv.inputs[1].values, np.float64)
        b = (
            np.asarray(conv.inputs[2].values, np.float64)
            if len(conv.inputs) > 2
            else np.zeros(w.shape[0])
        )
        factor = gamma / np.sqrt(var + eps)
        new_w = (w * factor.reshape(-1, *([1] * (w.ndim - 1)))).astype(np.float32)
        new_b = ((b - mean) * factor + beta).astype(np.float32)
        w_const = editor.constant(f"{conv.name}.W_bnfolded", new_w)
        b_const = editor.constant(f"{conv.name}.B_bnfolded", new_b)
        conv.inputs[1] = w_const
        if len(conv.inputs) > 2:
            conv.inputs[2] = b_const
        else:
            conv.inputs.append(b_const)
        y = bn.outputs[0]
        bn.outputs.clear()
        conv.outputs[0] = y
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
