"""SmoothQuant: migrate activation outliers of MatMul/Gemm inputs into their weights.

Needs ``state.float_model`` and ``state.data``; runs before annotation, on the float model, which
stays exactly equivalent in float. For every activation read by MatMul/Gemm nodes with constant
weights, it streams the calibration data once to gather the input's per-channel range and a
sample of its rows, chooses alpha per input (``onnxq.solve.smoothquant``), scales the weight
rows by ``s`` and divides the input by ``s``: folded into the LayerNormalization producing it
when nothing else reads it, otherwise as one constant Mul in front of the readers. Leaves
``state.float_model`` (rewritten), ``state.dataset`` (for calibration to read again) and
``state.smoothing`` (per input: alpha, the readers, the error before and after, where 1/s went),
which the report lists.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from onnxq.io.graph import insert_nodes, tensor_array
from onnxq.passes.defaults import runs
from onnxq.passes.manager import PassResult, State
from onnxq.passes.stream import float_batches
from onnxq.solve.smoothquant import Smoothing, choose

#: rows of each input kept for choosing alpha (a strided sample of every batch)
SAMPLE_ROWS = 2048
#: producers whose output stays float, so a Mul by 1/s after them breaks no int8 chain (a
#: MatMul or a Reshape carrying int8 to the readers would lose it: those inputs are skipped)
FLOAT_PRODUCERS = frozenset(
    {"LayerNormalization", "Gelu", "FastGelu", "Erf", "Mul", "Div", "Add", "Sub", "Tanh",
     "Sigmoid", "Softmax", "Cast"}
)  # fmt: skip


@dataclass
class _Reader:
    """One MatMul/Gemm reading the input: its node and constant weight as [K, N]."""

    node: onnx.NodeProto
    weight: str
    transposed: bool  # Gemm transB: the initializer is [N, K]


@dataclass
class _Stats:
    lo: np.ndarray
    hi: np.ndarray
    rows: list[np.ndarray]
    seen: int = 0

    @property
    def absmax(self) -> np.ndarray:
        """The largest magnitude per channel (from the extremes: no pass of its own)."""
        return np.maximum(np.maximum(-self.lo, self.hi), 0.0)


class SmoothQuant:
    """Smooth every MatMul/Gemm input where the measured int8 error drops."""

    name = "smoothquant"

    def run(self, state: State) -> PassResult:
        """Gather input statistics, choose alpha per input, rewrite the float model."""
        if not runs("smoothquant", state):
            why = state.over_budget.get("smoothquant", f"{state.kind} model")
            return PassResult(f"off ({state.options.smoothquant}, {why})")
        if state.data is None:
            return PassResult("off (no calibration data)")
        model = state.float_model
        readers = _readers(model, state.options.kept_float(model))
        if not readers:
            return PassResult("no MatMul/Gemm with constant weights reads an activation")
        stats = _collect(state, model, sorted(readers))
        inits = {i.name: i for i in model.graph.initializer}
        applied = 0
        for x in sorted(readers):
            st = stats.get(x)
            if st is None or not st.rows:
                continue
            weights = [_as_kn(inits[r.weight], r.transposed) for r in readers[x]]
            rows = np.concatenate(st.rows)
            choice = choose(rows, st.absmax, st.lo, st.hi, weights, state.options.weight_bits)
            where = ""
            if choice.alpha is not None:
                state.float_graph = None  # rewritten: annotation prepares the model again
                where = _apply(model, x, readers[x], choice)
            applied += bool(where)
            if where.startswith("Mul"):
                names = ", ".join(f"'{r.node.name}'" for r in readers[x])
                state.float_nodes[f"{x}_smoothed"] = (
                    f"SmoothQuant: divides '{x}' by s (alpha {choice.alpha}) for {names}, "
                    "whose weights took s; it runs in float before their QuantizeLinear"
                )
            state.smoothing[x] = {
                "alpha": choice.alpha,
                "readers": [r.node.name for r in readers[x]],
                "error_before": round(choice.error_before, 6),
                "error_after": round(choice.error_after, 6),
                "divided_in": where,
            }
        return PassResult(f"{applied} of {len(readers)} MatMul/Gemm inputs smoothed")


def _readers(model: onnx.ModelProto, excluded: set[str]) -> dict[str, list[_Reader]]:
    """Activation tensor -> the MatMul/Gemm nodes reading it with a 2-D constant weight.

    Only tensors that a graph input or a :data:`FLOAT_PRODUCERS` op writes: 1/s goes there.
    """
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producers = {o: n.op_type for n in g.node for o in n.output}
    uses: dict[str, int] = defaultdict(int)
    for n in g.node:
        for t in n.input:
            uses[t] += 1
    out: dict[str, list[_Reader]] = defaultdict(list)
    for n in g.node:
        if n.name in excluded or len(n.input) < 2 or n.input[0] in inits:
            continue
        if producers.get(n.input[0], "Input") not in FLOAT_PRODUCERS | {"Input"}:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "MatMul" or (n.op_type == "Gemm" and not attrs.get("transA", 0)):
            w = inits.get(n.input[1])
            if w is None or len(w.dims) != 2 or uses[w.name] != 1:
                continue  # not constant, not 2-D, or shared with another node
            if w.data_type != onnx.TensorProto.FLOAT:
                continue
            transposed = n.op_type == "Gemm" and bool(attrs.get("transB", 0))
            out[n.input[0]].append(_Reader(n, w.name, transposed))
    return dict(out)


def _as_kn(init: onnx.TensorProto, transposed: bool) -> np.ndarray:
    w = tensor_array(init).astype(np.float64)
    return w.T if transposed else w


def _collect(state: State, model: onnx.ModelProto, tensors: list[str]) -> dict[str, _Stats]:
    """Per-channel min and max (|max| from them) and a row sample of each tensor over the data."""
    stats: dict[str, _Stats] = {}
    for values in float_batches(
        state,
        model,
        tensors,
        "smoothquant",
        "per-channel ranges and rows of MatMul inputs to choose alpha; calibration reads "
        "the smoothed model",
    ):
        for t in tensors:
            v = values[t]
            if v.ndim < 1 or not np.issubdtype(v.dtype, np.floating):
                continue
            # statistics in the tensor's own dtype (exact), float64 only for the kept rows
            rows = v.reshape(-1, v.shape[-1])
            st = stats.get(t)
            if st is None:
                k = rows.shape[1]
                st = stats[t] = _Stats(np.full(k, np.inf), np.full(k, -np.inf), [])
            st.lo = np.minimum(st.lo, rows.min(0))
            st.hi = np.maximum(st.hi, rows.max(0))
            room = SAMPLE_ROWS - st.seen
            if room > 0:
                step = max(1, len(rows) // 64)
                take = rows[::step][:room].astype(np.float64)
                st.rows.append(take)
                st.seen += len(take)
    return stats


def _apply(model: onnx.ModelProto, x: str, readers: list[_Reader], choice: Smoothing) -> str:
    """Scale the readers' weights by s and divide ``x`` by s; returns where 1/s went."""
    s = choice.scales
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    for r in readers:
        w = tensor_array(inits[r.weight]).astype(np.float64)
        w = w * s[None, :] if r.transposed else w * s[:, None]
        inits[r.weight].CopyFrom(numpy_helper.from_array(w.astype(np.float32), r.weight))
    inv = (1.0 / s).astype(np.float32)
    producer = next((n for n in g.node if x in n.output), None)
    reader_names = {r.node.name for r in readers}
    others = [n for n in g.node if x in n.input and n.name not in reader_names]
    graph_output = any(o.name == x for o in g.output)
    if (
        producer is not None
        and producer.op_type == "LayerNormalization"
        and not others
        and not graph_output
        and len(producer.output) == 1
        and all(t in inits for t in producer.input[1:3])
    ):
        for t in producer.input[1:3]:
            v = tensor_array(inits[t]).astype(np.float64) * inv
            inits[t].CopyFrom(numpy_helper.from_array(v.astype(np.float32), t))
        return f"LayerNormalization '{producer.name}'"
    name = f"{x}_smoothed"
    g.initializer.append(numpy_helper.from_array(inv, f"{name}_inverse_scale"))
    mul = onnx.helper.make_node("Mul", [x, f"{name}_inverse_scale"], [name], name=name)
    for r in readers:
        r.node.input[0] = name
    first = min(i for i, n in enumerate(g.node) if n.name in reader_names)
    insert_nodes(g, first, [mul])
    return f"Mul '{name}'"
