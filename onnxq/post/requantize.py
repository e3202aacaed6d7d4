"""The requantize pass: keep int8 data int8 between quantized ops.

Contract: requires a materialized model (constant scales and zero points) in QOperator or QDQ
form (onnxq.lower.qoperator, onnxq.lower.qdq); ensures a model computing the same function up
to rounding in which

* DQ(x, s, z) → Q(·, s, z) pairs are removed (identity);
* DQ(x, s1, z1) → Q(·, s2, z2) feeding only quantized ops is replaced by those ops reading
  ``x`` with ``s1, z1`` directly (they take their input's scale as an argument, so nothing is
  lost; an int32 bias scaled by the input's scale is re-expressed for ``s1``). A quantized op
  is a QLinear op, or in QDQ form a DequantizeLinear feeding the float op the template wrote
  for a group of the op table (:func:`quantized_op`); a QDQ island's is not one;
* a DequantizeLinear moves past ops that commute with the affine map (MaxPool, Reshape,
  Flatten, Transpose, Squeeze, Unsqueeze, Slice, Gather, Depth/SpaceToDepth, Expand, Tile,
  nearest Resize, Split, and Pad with 0 — which becomes Pad with the zero point), so the pair
  it forms with a later Q can fold. Where no such Q (or Relu) lies ahead through those ops it
  still moves (int8 data is cheaper to move, and a Slice or MaxPool leaves less to
  dequantize), except past a Split, where it would become one dequantizer per part, and after
  a MatMul/Gemm, which then writes float instead (a recurrent cell's gates: 1.4× slower a
  step at batch 1 when the gates were rounded to int8 and dequantized part by part);
* a Relu after a DQ whose zero point is the type's minimum is dropped (provably a no-op).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxq.core.optable import BY_QOP, BYTE_ONLY, CARRIERS, FLOAT_OUTPUT_QOPS, PASS_THROUGH, QOp
from onnxq.core.qparams import INT32_MAX, accumulation_bound, qrange
from onnxq.io.graph import (
    GraphEditor,
    constant_value,
    export_model,
    import_graph,
    producer,
)
from onnxq.prepare.opset import default_opset


def qlinear_positions(node: gs.Node) -> tuple[int, ...]:
    """Input positions of the (tensor, scale, zero point) triples a QLinear op reads."""
    return BY_QOP[node.op].triple_positions(len(node.inputs))


def quantized_op(
    node: gs.Node, qdq_ops: Mapping[str, str]
) -> tuple[QOp, list[tuple[gs.Node, int]]] | None:
    """``node`` as a quantized op: its table entry and where each operand triple is held.

    A QLinear op holds its (tensor, scale, zero point) triples itself. In QDQ form a group's
    float op (named in ``qdq_ops``, :attr:`onnxq.lower.qoperator.Template.ops`) reads each
    operand through a DequantizeLinear, which holds the triple at 0. None: neither.
    """
    if node.op in BY_QOP:
        return BY_QOP[node.op], [(node, p) for p in qlinear_positions(node)]
    qop = qdq_ops.get(node.name)
    if qop is None:
        return None
    spec = BY_QOP[qop]
    holders = []
    for x in node.inputs[: len(node.inputs) if spec.variadic else len(spec.triples)]:
        dq = producer(x)
        if dq is None or dq.op != "DequantizeLinear":
            return None
        holders.append((dq, 0))
    return spec, holders


def output_grid(node: gs.Node, spec: QOp) -> tuple[gs.Tensor, gs.Tensor] | None:
    """The (scale, zero point) a quantized op writes with (QDQ form: its QuantizeLinear's)."""
    if node.op in BY_QOP:
        ins = node.inputs
        return (ins[spec.output], ins[spec.output + 1]) if len(ins) > spec.output + 1 else None
    q = output_quantizer(node)
    return (q.inputs[1], q.inputs[2]) if q is not None and len(q.inputs) > 2 else None


def output_quantizer(node: gs.Node) -> gs.Node | None:
    """The QuantizeLinear that alone reads ``node``'s output (a QDQ-form op's), else None."""
    users = node.outputs[0].outputs if len(node.outputs) == 1 else []
    return users[0] if len(users) == 1 and users[0].op == "QuantizeLinear" else None


def commutes(node: gs.Node, opset: int) -> bool:
    """True when ``node`` may carry int8 data: a PASS_THROUGH op (Resize: nearest only)."""
    if node.op not in PASS_THROUGH or opset < PASS_THROUGH[node.op] or len(node.outputs) != 1:
        return False
    if node.op == "Resize":
        mode = node.attrs.get("mode", "nearest")
        return (mode.decode() if isinstance(mode, bytes) else mode) == "nearest"
    if node.op == "MaxPool":
        return len(node.outputs) == 1  # no Indices output
    return True


def carried_source(t: gs.Tensor) -> gs.Tensor | None:
    """The tensor ``t`` carries through a chain of CARRIERS (None: no carrier produces ``t``)."""
    node = producer(t)
    source = None
    while node is not None and node.op in CARRIERS and node.inputs:
        source = node.inputs[0]
        node = producer(source)
    return source


@dataclass
class RequantizeStats:
    """What the pass changed."""

    folded_pairs: int = 0
    rescaled_pairs: int = 0
    crossed_ops: list[str] = field(default_factory=list)
    relus_removed: list[str] = field(default_factory=list)
    iterations: int = 0


class Requantizer:
    """Fold DQ→Q pairs and move DQ past commuting ops until nothing changes."""

    def __init__(self, max_iterations: int = 16, qdq_ops: Mapping[str, str] | None = None):
        """Run at most ``max_iterations`` rounds.

        ``qdq_ops``: in QDQ form, the float ops written for groups, by name (the template's
        ``ops``; :func:`quantized_op`).
        """
        self.max_iterations = max_iterations
        self.qdq_ops = qdq_ops or {}
        self.stats = RequantizeStats()

    def requantize(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """Return the requantized model (``model`` is not modified)."""
        graph = import_graph(model)
        self.requantize_graph(graph, default_opset(model))
        return export_model(graph, model)

    def requantize_graph(self, graph: gs.Graph, opset: int) -> None:
        """Requantize ``graph`` in place (``opset``: its ai.onnx opset); leave it tidied."""
        editor = GraphEditor(graph)
        for _ in range(self.max_iterations):
            self.stats.iterations += 1
            changed = self._cross(graph, editor, opset)
            changed |= self._drop_relus(graph, editor)
            changed |= self._fold(graph, editor)
            editor.finish()  # tidied: as an export writes it
            if not changed:
                break

    # ----------------------------------------------------------------------------------------
    def _cross(self, graph: gs.Graph, editor: GraphEditor, opset: int) -> bool:
        changed = False
        outputs = {id(t) for t in graph.outputs}
        for dq in list(graph.nodes):
            if dq.op != "DequantizeLinear" or not _per_tensor(dq):
                continue
            d = dq.outputs[0]
            if id(d) in outputs or len(d.outputs) != 1:
                continue
            op = d.outputs[0]
            if op.inputs[0] is not d or any(t is d for t in op.inputs[1:]):
                continue
            if _dtype(dq) not in (np.dtype(np.uint8), np.dtype(np.int8)) and op.op in BYTE_ONLY:
                continue  # onnxruntime has these kernels for 8-bit integers only
            if (op.op == "Split" or self._could_write_float(dq)) and not _fold_ahead(op, opset):
                continue  # the move would cost more than it saves, and nothing folds ahead
            if op.op == "Split":
                editor.move_after_split(dq, op)
            elif op.op == "Pad" and _copying_pad(op, opset):
                editor.move_after(dq, op)  # reflect/edge padding only copies values
            elif op.op == "Pad" and _zero_padding(op, opset):
                # padding with 0.0 in float is padding with the zero point in int8
                zp = _zero_point(dq)
                assert zp is not None
                value = editor.constant(f"{op.name}.pad_value", zp.reshape(()))
                editor.move_after(dq, op)
                if len(op.inputs) > 2:
                    editor.set_input(op, 2, value)
                else:
                    editor.append_input(op, value)
            elif commutes(op, opset):
                editor.move_after(dq, op)
            else:
                continue
            self.stats.crossed_ops.append(op.name)
            changed = True
        return changed

    def _could_write_float(self, dq: gs.Node) -> bool:
        """Whether ``dq`` dequantizes the result of an op that can write float instead."""
        node = producer(dq.inputs[0])
        if node is not None and node.op == "QuantizeLinear":
            node = producer(node.inputs[0])  # QDQ form: the op's quantizer
        found = quantized_op(node, self.qdq_ops) if node is not None else None
        return found is not None and found[0].qop in FLOAT_OUTPUT_QOPS

    def _drop_relus(self, graph: gs.Graph, editor: GraphEditor) -> bool:
        changed = False
        outputs = {id(t) for t in graph.outputs}
        for relu in list(graph.nodes):
            if relu.op != "Relu" or not relu.inputs:
                continue
            dq = producer(relu.inputs[0])
            if dq is None or dq.op != "DequantizeLinear" or not _per_tensor(dq):
                continue
            zp = _zero_point(dq)
            if zp is None or int(zp.reshape(-1)[0]) != qrange(zp.dtype.name)[0]:
                continue
            r = relu.outputs[0]
            d = relu.inputs[0]
            if id(r) in outputs:
                if len(d.outputs) != 1 or id(d) in outputs:
                    continue
                editor.remove_node(relu)
                editor.replace_producer(r, d)
            else:
                editor.redirect(r, d)
                editor.remove_node(relu)
            self.stats.relus_removed.append(relu.name)
            changed = True
        return changed

    def _fold(self, graph: gs.Graph, editor: GraphEditor) -> bool:
        changed = False
        for q in list(graph.nodes):
            if q.op != "QuantizeLinear" or not q.outputs:
                continue
            dq = producer(q.inputs[0])
            if dq is None or dq.op != "DequantizeLinear":
                continue
            src = dq.inputs[0]
            q_out = q.outputs[0]
            if _same_params(dq, q):
                editor.redirect(q_out, src)
                editor.remove_node(q)
                self.stats.folded_pairs += 1
                changed = True
            elif (
                _per_tensor(dq)
                and _per_tensor(q)
                and _dtype(dq) == _dtype(q)
                and (readers := _readers(q_out, self.qdq_ops)) is not None
                and all(r.bias_fits(q_out, q, dq) for r in readers)
            ):
                for r in readers:
                    for pos in r.positions:
                        if r.node.inputs[pos] is q_out:
                            if r.scales_bias(pos):
                                r.rescale_bias(editor, q, dq)
                            editor.set_input(r.node, pos, src)
                            editor.set_input(r.node, pos + 1, dq.inputs[1])
                            editor.set_input(r.node, pos + 2, dq.inputs[2])
                editor.remove_node(q)
                self.stats.rescaled_pairs += 1
                changed = True
        return changed


@dataclass
class _Reader:
    """A quantized op reading an integer tensor as (tensor, scale, zero point) triples.

    In QOperator form the QLinear op itself; in QDQ form one operand's DequantizeLinear
    (``node``, its triple at 0) and the float op ``op`` of the table it feeds at ``operand``.
    """

    node: gs.Node
    spec: QOp
    positions: tuple[int, ...]
    #: QDQ form: the float op and which of its inputs the DequantizeLinear gives
    op: gs.Node | None = None
    operand: int = 0

    def scales_bias(self, pos: int) -> bool:
        """Whether the triple at ``pos`` is the op's first operand, whose scale its bias has."""
        return (pos if self.op is None else self.operand) == 0

    def bias(self) -> gs.Tensor | None:
        """The int32 bias tensor (None: the op has none)."""
        if self.op is None:
            index = self.spec.bias
            ins = self.node.inputs
            return (
                ins[index] if index is not None and len(ins) > index and ins[index].name else None
            )
        dq = self._bias_dq()
        return dq.inputs[0] if dq is not None else None

    def weight(self) -> np.ndarray | None:
        """The op's integer weight."""
        if self.op is None:
            return constant_value(self.node.inputs[3])  # QLinearConv and QGemm
        dq = self._weight_dq()
        return constant_value(dq.inputs[0]) if dq is not None else None

    def _weight_dq(self) -> gs.Node | None:
        assert self.op is not None and self.spec.weight is not None
        return producer(self.op.inputs[self.spec.triples.index(self.spec.weight)])

    def _bias_dq(self) -> gs.Node | None:
        assert self.op is not None
        n = len(self.spec.triples)
        if self.spec.bias is None or len(self.op.inputs) <= n:
            return None
        dq = producer(self.op.inputs[n])
        return dq if dq is not None and dq.op == "DequantizeLinear" else None

    def new_bias(self, q: gs.Node, dq: gs.Node) -> np.ndarray | None:
        """The bias re-expressed for input scale dq's instead of q's (None: no int32 bias)."""
        t = self.bias()
        bias = constant_value(t) if t is not None else None
        if bias is None or bias.dtype != np.int32:
            return None
        old, new = constant_value(q.inputs[1]), constant_value(dq.inputs[1])
        assert old is not None and new is not None
        ratio = np.float64(old.reshape(-1)[0]) / np.float64(new.reshape(-1)[0])
        return np.round(bias.astype(np.float64) * ratio)

    def bias_fits(self, q_out: gs.Tensor, q: gs.Node, dq: gs.Node) -> bool:
        """Reading the producer's scale keeps the bias plus its accumulation inside int32.

        The worst-case sum of products over its weight counts too (qparams.accumulation_bound).
        """
        if not any(self.node.inputs[p] is q_out and self.scales_bias(p) for p in self.positions):
            return True
        bias = self.new_bias(q, dq)
        if bias is None:
            return True
        weight = self.weight()
        zero_point = constant_value(dq.inputs[2]) if len(dq.inputs) > 2 else None
        if weight is None:
            return False
        x_dtype = zero_point.dtype if zero_point is not None else np.dtype(np.uint8)
        bound = accumulation_bound(
            weight.size // max(bias.size, 1),
            int(np.abs(weight.astype(np.int64)).max(initial=0)),
            x_dtype,
            zero_point if zero_point is not None else np.zeros(1, np.uint8),
        )
        return bool(np.all(np.abs(bias) + bound <= INT32_MAX))

    def rescale_bias(self, editor: GraphEditor, q: gs.Node, dq: gs.Node) -> None:
        """A new input scale needs the int32 bias (and in QDQ form its grid) rescaled."""
        bias = self.new_bias(q, dq)
        if bias is None:
            return
        t = self.bias()
        assert t is not None
        rescaled = editor.constant(f"{t.name}_rescaled", bias.astype(np.int32))
        if self.op is None:
            assert self.spec.bias is not None
            editor.set_input(self.node, self.spec.bias, rescaled)
            return
        bias_dq, w_dq = self._bias_dq(), self._weight_dq()
        assert bias_dq is not None and w_dq is not None
        x_scale, w_scale = constant_value(dq.inputs[1]), constant_value(w_dq.inputs[1])
        assert x_scale is not None and w_scale is not None
        grid = (x_scale.astype(np.float64) * w_scale).astype(np.float32)
        editor.set_input(bias_dq, 0, rescaled)
        editor.set_input(bias_dq, 1, editor.constant(f"{bias_dq.inputs[1].name}_rescaled", grid))


def _readers(t: gs.Tensor, qdq_ops: Mapping[str, str]) -> list[_Reader] | None:
    """Every reader of ``t`` as a quantized op (None: some reader is not one, or none reads it)."""
    readers = [_reader(u, qdq_ops) for u in t.outputs]
    if not readers or any(r is None for r in readers):
        return None
    return [r for r in readers if r is not None]


def _reader(node: gs.Node, qdq_ops: Mapping[str, str]) -> _Reader | None:
    """``node`` as a quantized op reading triples, if it is one (see the module docstring)."""
    if node.op in BY_QOP:
        return _Reader(node, BY_QOP[node.op], qlinear_positions(node))
    users = node.outputs[0].outputs if node.op == "DequantizeLinear" else []
    found = quantized_op(users[0], qdq_ops) if len(users) == 1 else None
    if found is None:
        return None
    spec, holders = found
    operand = next((k for k, (dq, _) in enumerate(holders) if dq is node), None)
    return _Reader(node, spec, (0,), users[0], operand) if operand is not None else None


def _pad_mode(pad: gs.Node) -> str:
    mode = pad.attrs.get("mode", "constant")
    return mode.decode() if isinstance(mode, bytes) else str(mode)


def _fold_ahead(op: gs.Node, opset: int) -> bool:
    """Whether int8 data carried through ``op`` can meet a QuantizeLinear (or a Relu) to fold.

    Its readers are followed through the ops a DequantizeLinear may cross.
    """
    seen, todo = {id(op)}, [op]
    while todo:
        for out in todo.pop().outputs:
            for reader in out.outputs:
                if reader.op in ("QuantizeLinear", "Relu"):
                    return True
                carries = reader.op in ("Split", "Pad") or commutes(reader, opset)
                if carries and reader.inputs[0] is out and id(reader) not in seen:
                    seen.add(id(reader))
                    todo.append(reader)
    return False


def _copying_pad(pad: gs.Node, opset: int) -> bool:
    """A Pad that only copies existing values (reflect, edge)."""
    return opset >= 11 and _pad_mode(pad) in ("reflect", "edge")


def _zero_padding(pad: gs.Node, opset: int) -> bool:
    """A constant-mode Pad (opset ≥ 11 form) whose pad value is 0.0 or absent."""
    if opset < 11 or _pad_mode(pad) != "constant":
        return False
    if len(pad.inputs) < 3 or pad.inputs[2].name == "":
        return True
    value = constant_value(pad.inputs[2])
    return value is not None and value.size == 1 and float(value.reshape(-1)[0]) == 0.0


def _zero_point(node: gs.Node) -> np.ndarray | None:
    if len(node.inputs) < 3:
        return None
    return constant_value(node.inputs[2])


def _per_tensor(node: gs.Node) -> bool:
    scale = constant_value(node.inputs[1])
    return scale is not None and scale.size == 1


def _dtype(node: gs.Node) -> np.dtype | None:
    zp = _zero_point(node)
    return None if zp is None else zp.dtype


def _same_params(dq: gs.Node, q: gs.Node) -> bool:
    s1, s2 = constant_value(dq.inputs[1]), constant_value(q.inputs[1])
    z1, z2 = _zero_point(dq), _zero_point(q)
    if s1 is None or s2 is None or z1 is None or z2 is None:
        return False
    if z1.dtype != z2.dtype or s1.shape != s2.shape or z1.shape != z2.shape:
        return False
    if dq.attrs.get("axis", 1) != q.attrs.get("axis", 1) and s1.size > 1:
        return False
    return bool(np.array_equal(s1, s2) and np.array_equal(z1, z2))


def requantize(model: onnx.ModelProto) -> tuple[onnx.ModelProto, RequantizeStats]:
    """Run the :class:`Requantizer` and return the model with its statistics."""
    r = Requantizer()
    return r.requantize(model), r.stats


def rescales(model: onnx.ModelProto) -> list[str]:
    """Tensors read through a DequantizeLinear → QuantizeLinear pair that remains in ``model``.

    Each costs one requantize the pass cannot fold: a boundary between regions quantized in
    different activation dtypes (``--config activation_dtype``), an input rescaled to a
    Concat's shared scale (onnxq.solve.constraints), or a pair whose fold would overflow a bias.
    """
    producers = {o: n for n in model.graph.node for o in n.output}
    out = []
    for q in model.graph.node:
        dq = producers.get(q.input[0]) if q.op_type == "QuantizeLinear" else None
        if dq is not None and dq.op_type == "DequantizeLinear":
            out.append(q.input[0])
    return out
