"""OpenVINO output: the float graph with FakeQuantize on every quantized edge and weight.

FakeQuantize is in domain org.openvinotoolkit, the form NNCF and OpenVINO's own tools produce.

For a tensor quantized with scale ``s`` and zero point ``z`` to ``[qmin, qmax]``
(``seeds/003``, design.md §3)::

    level_range = qmax − qmin              levels = level_range + 1
    input_high  = (qmax − z) · s           input_low = input_high − s · level_range
    output_low, output_high = input_low, input_high

Weights get per-channel bounds shaped to broadcast along their channel axis. A tensor produced
by a quantized op is read quantized, on the grid that op writes, by all its consumers (as the
QOperator model's DequantizeLinear output is); an input tensor only by the quantized ops. A
group that reads a tensor in another activation dtype (``--config activation_dtype``) rounds it
again onto its own grid, as the DequantizeLinear → QuantizeLinear rescale of the QDQ model
does. Biases stay float: OpenVINO keeps them in its accumulators. Run the model with the
OpenVINO runtime (``pip install openvino``); onnxruntime does not implement FakeQuantize.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper

from onnxq.core.errors import ModelError
from onnxq.core.optable import CARRIERS, FLOAT_OUTPUT_QOPS
from onnxq.core.qparams import qrange
from onnxq.core.specs import QTensor
from onnxq.io.graph import (
    GraphEditor,
    constant_value,
    copy_graph,
    export_model,
    import_graph,
    producer,
)
from onnxq.post.float_outputs import starts_at_zero
from onnxq.post.requantize import carried_source

OV_DOMAIN = "org.openvinotoolkit"

#: how a FakeQuantize's bounds follow from the solved values: scale and zero-point names,
#: dtype, integer range (None: the dtype's), and the shape per-channel bounds take
Bounds = tuple[str, str, str, int | None, int | None, tuple[int, ...] | None]


def holds_fakequantize(model: onnx.ModelProto) -> bool:
    """Whether ``model`` holds OpenVINO FakeQuantize nodes (only the OpenVINO runtime runs it)."""
    return any(n.domain == OV_DOMAIN for n in model.graph.node)


def fq_bounds(
    scale: np.ndarray,
    zero_point: np.ndarray,
    dtype: str,
    qmin: int | None = None,
    qmax: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """(input_low, input_high, levels) of FakeQuantize for an affine quantizer."""
    lo, hi = qrange(dtype)
    lo = lo if qmin is None else qmin
    hi = hi if qmax is None else qmax
    s = np.asarray(scale, np.float64)
    z = np.asarray(zero_point, np.float64)
    level_range = hi - lo
    high = (hi - z) * s
    low = high - s * level_range
    return low.astype(np.float32), high.astype(np.float32), level_range + 1


def to_fakequantize(
    quantizer: Any,
    values: dict[str, np.ndarray],
    weight_qrange: tuple[int, int] | None = None,
    constants: dict[str, np.ndarray] | None = None,
    cache: FakeQuantizeCache | None = None,
) -> onnx.ModelProto:
    """The FakeQuantize model of ``quantizer``'s annotation with ``values``.

    ``quantizer``: the onnxq.annotate.quantizer.Quantizer that annotated the float model;
    ``values``: the scales and zero points as the materialized model holds them; ``constants``:
    float biases and weights an algorithm replaced (bias correction, optimized rounding), by
    name. ``cache``: one kept across calls on the same annotation (:class:`FakeQuantizeCache`):
    the same model, its graph built once.
    """
    if cache is not None:
        return cache.model(quantizer, values, weight_qrange, constants or {})
    return _build(quantizer, values, weight_qrange, constants or {}, _Trace()).model


class _Trace:
    """What a build of the FakeQuantize graph did that depends on the solved values.

    Everything else in the graph follows from the annotation alone, so two builds with the
    same :meth:`decisions` differ only in initializer values: each FakeQuantize's bounds
    (``bounds``: its node name → how they are computed) and the replaced constants
    (``targets``: a constant's name → the initializers it is written to).
    """

    def __init__(self) -> None:
        self.bounds: dict[str, Bounds] = {}
        #: the MatMul/Gemm results no quantized op reads (left float unless their grid starts
        #: at 0), and each second-grid read: (its grid, the grid the other readers see, whether
        #: that is a rounded value)
        self.float_outputs: list[QTensor] = []
        self.reads: list[tuple[QTensor, QTensor, bool]] = []
        self.targets: dict[str, list[str]] = {}
        self.model = onnx.ModelProto()

    def decisions(self, values: dict[str, np.ndarray]) -> tuple[Any, ...]:
        """The value-dependent choices a build with ``values`` makes, given this one's reads."""
        second = [
            rounded and _same_grid(_bounds_of(_read(qt), values), _bounds_of(_read(first), values))
            for qt, first, rounded in self.reads
        ]
        return _float_written(self.float_outputs, values), tuple(second)


def _float_written(outputs: list[QTensor], values: dict[str, np.ndarray]) -> tuple[str, ...]:
    """The MatMul/Gemm results of ``outputs`` written float (their grid does not start at 0)."""
    return tuple(q.tensor for q in outputs if not starts_at_zero(values[q.zero_point]))


class FakeQuantizeCache:
    """The FakeQuantize model of one annotation under many values, its graph built once.

    The recipe choice emulates each candidate from its FakeQuantize model; the candidates
    differ in values only (ranges, rounded weights, corrected biases), and building the graph
    (a copy of the float graph, the FakeQuantize nodes, the export) was most of the time of
    each emulation. A model from the cache is the one :func:`to_fakequantize` builds, byte for
    byte: its graph is rebuilt when the values change a decision of the build (a MatMul result
    left float, a second rounding that is exact), else copied and its bounds and constants
    written. Holds one copy of the float model while it lives.
    """

    def __init__(self) -> None:
        self._key: tuple[Any, tuple[int, int] | None] | None = None
        self._trace: _Trace | None = None
        self._decided: tuple[Any, ...] = ()

    def model(
        self,
        quantizer: Any,
        values: dict[str, np.ndarray],
        weight_qrange: tuple[int, int] | None,
        constants: dict[str, np.ndarray],
    ) -> onnx.ModelProto:
        """:func:`to_fakequantize`'s model for these arguments."""
        trace = self._trace
        if (
            trace is None
            or self._key is None
            or self._key[0] is not quantizer
            or self._key[1] != weight_qrange
            or trace.decisions(values) != self._decided
        ):
            trace = _build(quantizer, values, weight_qrange, {}, _Trace())
            self._trace, self._key = trace, (quantizer, weight_qrange)
            self._decided = trace.decisions(values)
        assert trace is not None
        return _filled(trace, values, constants)


def _filled(
    trace: _Trace, values: dict[str, np.ndarray], constants: dict[str, np.ndarray]
) -> onnx.ModelProto:
    """A copy of ``trace``'s model with the bounds of ``values`` and ``constants`` written."""
    model = onnx.ModelProto()
    model.CopyFrom(trace.model)
    inits = {i.name: i for i in model.graph.initializer}
    written: dict[str, np.ndarray] = {}
    for node in model.graph.node:
        params = trace.bounds.get(node.name)
        if params is None:
            continue
        written[node.input[1]], written[node.input[2]], _ = _bounds_of(params, values)
    for name, targets in trace.targets.items():
        if name in constants:
            for target in (t for t in targets if t in inits):  # else unread: not exported
                dims = tuple(inits[target].dims)
                written[target] = np.asarray(constants[name], np.float32).reshape(dims)
    for name, value in written.items():
        inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value), name))
    return model


def _read(qt: QTensor) -> Bounds:
    """How an activation's FakeQuantize bounds follow from the values: its own grid."""
    return (qt.scale, qt.zero_point, qt.dtype, None, None, None)


def _bounds_of(bounds: Bounds, values: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    """(input_low, input_high, levels) of a FakeQuantize whose ``bounds`` are these."""
    scale, zero_point, dtype, qmin, qmax, shape = bounds
    low, high, levels = fq_bounds(values[scale], values[zero_point], dtype, qmin, qmax)
    if shape is not None:
        low, high = low.reshape(shape), high.reshape(shape)
    return low, high, levels


def _build(
    quantizer: Any,
    values: dict[str, np.ndarray],
    weight_qrange: tuple[int, int] | None,
    constants: dict[str, np.ndarray],
    trace: _Trace,
) -> _Trace:
    """Build the FakeQuantize model into ``trace.model``, recording what depends on values."""
    graph = copy_graph(quantizer.float_graph)
    tensors = graph.tensors()
    trace.targets = _replace_constants(graph, quantizer, constants)
    editor = GraphEditor(graph)
    group_nodes = {n for rec in quantizer.records for n in rec.nodes}
    produced = {q.tensor for rec in quantizer.records for q in rec.outputs}
    by_tensor = {q.tensor: q for rec in quantizer.records for q in rec.outputs}
    read = {q.tensor for rec in quantizer.records for q in rec.inputs}
    # a MatMul/Gemm result no quantized op reads stays float (onnxq.post.float_outputs)
    trace.float_outputs = [
        rec.outputs[0]
        for rec in quantizer.records
        if rec.lowering.op in FLOAT_OUTPUT_QOPS
        and rec.outputs
        and rec.outputs[0].tensor not in read
    ]
    done = set(_float_written(trace.float_outputs, values))
    #: per activation: the grid every quantized reader sees, and whether that is a rounded
    #: value (an int8 op's output, or one carried from it) rather than the float tensor
    seen: dict[str, tuple[QTensor, bool]] = {}
    for rec in quantizer.records:
        for k, qt in enumerate([*rec.inputs, *rec.outputs]):
            if qt.tensor not in done:
                done.add(qt.tensor)
                t = tensors[qt.tensor]
                if qt.role == "weight":
                    _fq_weight(editor, t, qt, values, group_nodes, weight_qrange, trace)
                    continue
                # every reader sees the grid the writing group wrote; like the requantize pass,
                # data that reached this op through MaxPool, Split… from a quantized op keeps
                # that op's parameters
                carried = carried_source(t)
                source = (
                    by_tensor.get(qt.tensor)
                    or (by_tensor.get(carried.name) if carried is not None else None)
                    or qt
                )
                _fq_activation(editor, t, source, values, group_nodes, qt.tensor in produced, trace)
                seen[qt.tensor] = (source, qt.tensor in produced or source is not qt)
            if k < len(rec.inputs) and qt.tensor in seen:
                first, rounded = seen[qt.tensor]
                if qt.dtype != first.dtype:
                    nodes = set(rec.nodes)
                    _read_as(editor, tensors[qt.tensor], qt, first, values, nodes, rounded, trace)
    trace.model = export_model(graph, quantizer.float_model)  # tidied there, as the editor would
    return trace


def _replace_constants(
    graph: gs.Graph, quantizer: Any, constants: dict[str, np.ndarray]
) -> dict[str, list[str]]:
    """Write the constants an algorithm replaced into the float graph; where each one goes.

    Weights and float layers' biases by tensor name; the biases of quantized layers by derived
    name (``<node>.bias``), written to the tensors of their group that hold their original
    value. Returns, for every constant that may be replaced, the tensors it is written to
    (found before any is written).
    """
    tensors = graph.tensors()
    derived = {quantizer.biases[rec.bias].bias for rec in quantizer.records if rec.bias}
    targets = {
        name: [name]
        for name, t in tensors.items()
        if name not in derived and isinstance(t, gs.Constant)
    }
    nodes = {n.name: n for n in graph.nodes}
    for rec in quantizer.records:
        if rec.bias is None:
            continue
        name = quantizer.biases[rec.bias].bias
        original = np.asarray(quantizer.float_value(name), np.float32).reshape(-1)
        targets[name] = [
            t.name
            for node in (nodes[n] for n in rec.nodes if n in nodes)
            for t in node.inputs
            if isinstance(t, gs.Constant) and _holds(t, original)
        ]
    for name, new in constants.items():
        for target in targets.get(name, ()):
            t = tensors[target]
            t.values = np.asarray(new, np.float32).reshape(t.shape)
    return targets


def _holds(t: gs.Constant, original: np.ndarray) -> bool:
    """Whether constant ``t`` holds the values of ``original`` (flat float32)."""
    value = constant_value(t)
    return (
        value is not None
        and value.size == original.size
        and np.array_equal(np.asarray(value, np.float32).reshape(-1), original)
    )


def _fq_node(
    editor: GraphEditor,
    x: gs.Tensor,
    low: np.ndarray,
    high: np.ndarray,
    levels: int,
    name: str,
    out: gs.Variable | None = None,
    trace: _Trace | None = None,
    bounds: Bounds | None = None,
) -> gs.Variable:
    """A FakeQuantize of ``x``; ``bounds``: how its bounds follow from the values (``trace``)."""
    lo = editor.constant(f"{name}/input_low", low)
    hi = editor.constant(f"{name}/input_high", high)
    out = out if out is not None else editor.variable(f"{name}/fq", np.float32, x.shape)
    node = editor.add_node(
        "FakeQuantize",
        [x, lo, hi, lo, hi],
        [out],
        f"{name}/FakeQuantize",
        {"levels": int(levels)},
        OV_DOMAIN,
    )
    if trace is not None and bounds is not None:
        trace.bounds[node.name] = bounds
    return out


def _fq_activation(
    editor: GraphEditor,
    t: gs.Tensor,
    qt: QTensor,
    values: dict[str, np.ndarray],
    group_nodes: set[str],
    all_readers: bool,
    trace: _Trace,
) -> None:
    bounds = _read(qt)
    low, high, levels = _bounds_of(bounds, values)
    if all_readers and producer(t) is not None:
        # every reader (and a graph output, which keeps its name) sees the quantized value:
        # the producer now writes t/float and FakeQuantize writes t
        pre = editor.variable(f"{t.name}/float", np.float32, t.shape)
        editor.replace_producer(pre, t)
        _fq_node(editor, pre, low, high, levels, t.name, t, trace, bounds)
        return
    out = _fq_node(editor, t, low, high, levels, t.name, None, trace, bounds)
    for node in [n for n in t.outputs if n.name in group_nodes]:
        for i, inp in enumerate(node.inputs):
            if inp is t:
                editor.set_input(node, i, out)


def _read_as(
    editor: GraphEditor,
    t: gs.Tensor,
    qt: QTensor,
    first: QTensor,
    values: dict[str, np.ndarray],
    nodes: set[str],
    rounded: bool,
    trace: _Trace,
) -> None:
    """Let the group of ``nodes`` read activation ``t`` on its own grid ``qt``.

    The group reads ``t`` in another dtype than the grid its other readers see, as the written
    model does through the DequantizeLinear → QuantizeLinear rescale it keeps at that boundary:
    a value an int8 op wrote (``rounded``) is rounded again, onto ``qt``'s grid; a float
    tensor (a graph input, a float op's output) is rounded once, onto ``qt``'s grid alone.
    ``first``: the grid the other readers see.
    """
    # what the group reads now: t itself, or t's FakeQuantize output
    views = [t] + [o.outputs[0] for o in t.outputs if o.op == "FakeQuantize"]
    uses = [
        (node, i)
        for view in views
        for node in list(view.outputs)
        if node.name in nodes
        for i, inp in enumerate(node.inputs)
        if inp is view
    ]
    if not uses:
        return
    read = uses[0][0].inputs[uses[0][1]]
    trace.reads.append((qt, first, rounded))
    bounds = _read(qt)
    low, high, levels = _bounds_of(bounds, values)
    if rounded and _same_grid((low, high, levels), _bounds_of(_read(first), values)):
        return  # uint8 and int8 with one range: the same grid, the second rounding is exact
    name = f"{t.name}/{qt.dtype}"
    out = _fq_node(editor, read if rounded else t, low, high, levels, name, None, trace, bounds)
    for node, i in uses:
        editor.set_input(node, i, out)


def _same_grid(
    a: tuple[np.ndarray, np.ndarray, int], b: tuple[np.ndarray, np.ndarray, int]
) -> bool:
    """Two FakeQuantize grids (low, high, levels) that hold the same values."""
    return a[2] == b[2] and np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def _fq_weight(
    editor: GraphEditor,
    t: gs.Tensor,
    qt: QTensor,
    values: dict[str, np.ndarray],
    group_nodes: set[str],
    weight_qrange: tuple[int, int] | None,
    trace: _Trace,
) -> None:
    lo_q, hi_q = weight_qrange or qrange(qt.dtype, narrow=False)
    ndim = len(t.shape) if isinstance(t, gs.Constant) else 0  # not read: the model holds it
    shape: tuple[int, ...] | None = None
    grid = np.broadcast_shapes(np.shape(values[qt.scale]), np.shape(values[qt.zero_point]))
    if qt.axis is not None and len(grid) == 1:  # per channel: along the weight's axis
        along = [1] * ndim
        along[qt.axis] = -1
        shape = tuple(along)
    bounds = (qt.scale, qt.zero_point, qt.dtype, lo_q, hi_q, shape)
    low, high, levels = _bounds_of(bounds, values)
    out = _fq_node(editor, t, low, high, levels, t.name, None, trace, bounds)
    for node in list(t.outputs):
        if node.name in group_nodes:
            for i, inp in enumerate(node.inputs):
                if inp is t:
                    editor.set_input(node, i, out)


def qdq_to_fakequantize(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A QDQ model (a QAT export, another tool's, onnxq's) as FakeQuantize on the float graph.

    Each activation ``QuantizeLinear → DequantizeLinear`` pair becomes one FakeQuantize with the
    pair's bounds; an int8 weight feeding ``DequantizeLinear`` becomes its float value behind a
    (per-channel) FakeQuantize; an int32 bias becomes its float value. Returns the model and the
    names of the converted DequantizeLinear nodes. Anything else holding integers (a
    DequantizeLinear of a graph input, an integer graph output) is a clear error.
    """
    graph = import_graph(model)
    editor = GraphEditor(graph)
    converted = []
    fq_inputs: dict[str, gs.Variable] = {}
    chain_params: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for dq in [n for n in graph.nodes if n.op == "DequantizeLinear"]:
        x, scale_t = dq.inputs[0], dq.inputs[1]
        scale = constant_value(scale_t)
        zp_t = dq.inputs[2] if len(dq.inputs) > 2 and dq.inputs[2].name else None
        values = constant_value(x)
        zp = constant_value(zp_t) if zp_t is not None else None
        if scale is None or (zp_t is not None and zp is None):
            raise ModelError(f"DequantizeLinear '{dq.name}' has a non-constant scale or zero point")
        zp = (
            np.zeros(scale.shape, values.dtype if values is not None else np.uint8)
            if zp is None
            else zp
        )
        out = dq.outputs[0]
        axis = int(dq.attrs.get("axis", 1))
        if values is not None:  # a weight or a bias
            shape = [1] * values.ndim
            if scale.size > 1:
                shape[axis % values.ndim] = scale.size
            s, z = scale.reshape(shape), zp.reshape(shape).astype(np.float64)
            real = ((values.astype(np.float64) - z) * s).astype(np.float32)
            dq.outputs.clear()
            if values.dtype == np.int32:
                editor.redirect(out, editor.constant(f"{x.name}_float", real))
            else:
                low, high, levels = fq_bounds(s, zp.reshape(shape), np.dtype(values.dtype).name)
                src = editor.constant(f"{x.name}_float", real)
                _fq_node(editor, src, low, high, levels, x.name, out=out)
        else:
            chain, q = _carried_from_quantize(x)
            if q is None:
                raise ModelError(
                    f"DequantizeLinear '{dq.name}' reads '{x.name}', which no QuantizeLinear "
                    "produces (an integer graph input?); FakeQuantize needs the float value"
                )
            if chain:  # int8 carried through MaxPool, Reshape, Pad…: carry the float instead
                _float_chain(editor, chain, q, fq_inputs, chain_params)  # x is now float
            elif q.op == "FakeQuantize":
                pass  # x is already float
            else:
                x = q.inputs[0]
            low, high, levels = fq_bounds(scale, zp, np.dtype(zp.dtype).name)
            dq.outputs.clear()
            _fq_node(editor, x, low, high, levels, out.name, out=out)
        converted.append(dq.name)
        editor.remove_node(dq)
    for q in [n for n in graph.nodes if n.op == "QuantizeLinear"]:
        if any(o in graph.outputs for o in q.outputs):
            raise ModelError(
                f"QuantizeLinear '{q.name}' writes graph output '{q.outputs[0].name}' as "
                "integers; FakeQuantize models return float"
            )
    return export_model(graph, model), converted  # tidied there, as the editor would


def _carried_from_quantize(x: gs.Tensor) -> tuple[list[gs.Node], gs.Node | None]:
    """The carrier nodes (first to last) between a QuantizeLinear and ``x``, and that Q."""
    chain: list[gs.Node] = []
    node = producer(x)
    while node is not None and node.op in CARRIERS and node.inputs:
        chain.insert(0, node)
        node = producer(node.inputs[0])
    # a FakeQuantize here: another DequantizeLinear already made this chain carry floats
    found = node is not None and node.op in ("QuantizeLinear", "FakeQuantize")
    return (chain, node) if found else ([], None)


def _float_chain(
    editor: GraphEditor,
    chain: list[gs.Node],
    q: gs.Node,
    fq_inputs: dict[str, gs.Variable],
    params: dict[str, tuple[np.ndarray, np.ndarray]],
) -> None:
    """Make ``chain`` (carriers reading Q's integers) read FakeQuantize(Q's float input).

    ``q`` may be a FakeQuantize an earlier chain through the same carriers created (SPPF's
    cascaded MaxPools): the carriers past that chain still declare integers and hold
    zero-point padding, and are converted here.
    """
    if q.op == "FakeQuantize":
        scale, zp = params[q.outputs[0].name]
    else:
        scale = np.asarray(constant_value(q.inputs[1]), np.float64)
        zp = np.asarray(constant_value(q.inputs[2]))
        key = q.outputs[0].name
        if key not in fq_inputs:
            low, high, levels = fq_bounds(scale, zp, np.dtype(zp.dtype).name)
            fq_inputs[key] = _fq_node(editor, q.inputs[0], low, high, levels, f"{key}_float")
            params[fq_inputs[key].name] = (scale, zp)
        editor.set_input(chain[0], 0, fq_inputs[key])
    for node in chain:
        if node.op == "Pad" and len(node.inputs) > 2 and node.inputs[2].name:
            value = constant_value(node.inputs[2])  # zero point padding → the real value
            if value is not None and value.dtype != np.float32:
                real = ((value.astype(np.float64) - zp.astype(np.float64)) * scale).astype(
                    np.float32
                )
                editor.set_input(node, 2, editor.constant(f"{node.name}_pad_value", real))
        for out in node.outputs:
            out.dtype = np.float32
