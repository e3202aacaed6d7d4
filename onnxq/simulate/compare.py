"""Compare a float model with its quantized form, output by output and layer by layer.

Layers are matched by tensor name. A tensor of the float model is found in the quantized model
either as the output of the QuantizeLinear that reads it (QDQ models: the value the next op
sees), under its own name (a DequantizeLinear output, or a float op left in place) or as the
integer output of a quantized op whose output scale is the initializer ``<name>_scale`` (the
naming of onnxq and of onnxruntime.quantization), dequantized here with its scale and zero
point. Statistics stream over the samples (four sums per tensor):

    SQNR = 10·log10(Σ f² / Σ (f − q)²)        cosine = Σ f·q / √(Σ f² · Σ q²)

Layers are listed by the SQNR they lose themselves (their inputs' SQNR minus their own), largest
first: errors accumulate along the graph, so the layer with the largest drop, not the deepest one,
is where to look (``--exclude`` it, or try another calibration method).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx

from onnxq.calibrate.dataset import DatasetManager, feed_samples, shared_batch
from onnxq.calibrate.streaming import outputs_bytes, run_ahead, run_checked
from onnxq.core.optable import BY_QOP
from onnxq.io.graph import tensor_array
from onnxq.io.progress import progress
from onnxq.io.session import make_session, output_types, release_shared_arena

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}
CLEAN_DB = 60.0


def output_params(op: str) -> tuple[int, int] | None:
    """Where a quantized op takes its output scale and zero point (the op table's entry)."""
    if op == "QuantizeLinear":
        return 1, 2
    qop = BY_QOP.get(op)
    return (qop.output, qop.output + 1) if qop is not None else None


def short(name: str, width: int = 40) -> str:
    """A tensor name cut to ``width`` characters, keeping its end (the distinctive part)."""
    return name if len(name) <= width else "…" + name[-(width - 1) :]


#: values summed in float32 before their sum joins the float64 total (relative error of a
#: partial sum about 1e-7 · sqrt(ROW), far below what an SQNR in dB or a cosine shows)
ROW = 4096


#: a tensor as float32 rows of :data:`ROW` values: the whole rows (a view of it) and the rest
#: as one zero-padded row (none when the size is a multiple of ROW)
Rows = tuple[np.ndarray, np.ndarray]


def _rows(x: np.ndarray) -> Rows:
    """``x`` as float32 rows of :data:`ROW` values, with no float64 copy.

    Only the last row is copied (zero-padded): a padded copy of the whole tensor took a third
    of ``compare``'s statistics.
    """
    flat = np.asarray(x, np.float32).ravel()
    whole = flat.size - flat.size % ROW
    last = np.zeros((1 if whole < flat.size else 0, ROW), np.float32)
    last[:, : flat.size - whole] = flat[whole:]
    return flat[:whole].reshape(-1, ROW), last


def _minus(a: Rows, b: Rows) -> Rows:
    """``a − b``, row by row."""
    return a[0] - b[0], a[1] - b[1]


def _dot(a: Rows, b: Rows) -> float:
    """Σ a·b: each row summed in float32, the rows in float64."""
    rows = np.concatenate([np.einsum("ij,ij->i", a[0], b[0]), np.einsum("ij,ij->i", a[1], b[1])])
    return float(rows.sum(dtype=np.float64))


@dataclass
class TensorStats:
    """Streaming agreement statistics of one tensor."""

    name: str
    is_output: bool
    order: int
    #: the float node that computes the tensor: the name --exclude and --config take
    node: str = ""
    op: str = ""
    ff: float = 0.0
    ee: float = 0.0
    fq: float = 0.0
    qq: float = 0.0
    count: int = 0
    #: values the float model itself computed as NaN or ±Inf (left out of the sums)
    float_nonfinite: int = 0
    #: SQNR of the nearest compared tensors this one is computed from (inf: graph inputs)
    input_sqnr_db: float = math.inf

    def add(self, f: np.ndarray, q: np.ndarray) -> None:
        """Fold one batch in: the sums of f·f, q·q, f·q and (f−q)·(f−q).

        Values where the float model itself holds NaN or ±Inf are left out (there is nothing
        to compare with; :attr:`float_nonfinite` counts them); a NaN or ±Inf of the quantized
        model where the float value is finite makes the error infinite.
        """
        f32, q32 = _rows(f), _rows(q)
        sums = _dot(f32, f32), _dot(q32, q32), _dot(f32, q32)
        d = _minus(f32, q32)
        err = _dot(d, d)
        if not all(math.isfinite(x) for x in (*sums, err)):  # the rare case: sort it out
            f_flat = np.asarray(f, np.float64).ravel()
            q_flat = np.broadcast_to(np.asarray(q, np.float64), np.shape(f)).ravel()
            known = np.isfinite(f_flat)
            self.float_nonfinite += int(known.size - np.count_nonzero(known))
            f_flat, q_flat = f_flat[known], q_flat[known]
            broken = not np.all(np.isfinite(q_flat))
            q_flat = np.where(np.isfinite(q_flat), q_flat, 0.0)
            sums = (float(f_flat @ f_flat), float(q_flat @ q_flat), float(f_flat @ q_flat))
            err = math.inf if broken else float(np.sum((f_flat - q_flat) ** 2))
        self.ff += sums[0]
        self.qq += sums[1]
        self.fq += sums[2]
        self.ee += err
        self.count += f.size

    @property
    def sqnr_db(self) -> float:
        """Signal-to-quantization-noise ratio in dB (inf when identical)."""
        if self.ee == 0.0:
            return math.inf
        if self.ff == 0.0 or math.isinf(self.ee):
            return -math.inf
        return 10.0 * math.log10(self.ff / self.ee)

    @property
    def cosine(self) -> float:
        """Cosine similarity of the float and quantized values."""
        denom = math.sqrt(self.ff * self.qq)
        return self.fq / denom if denom else (1.0 if self.ee == 0 else 0.0)

    @property
    def drop_db(self) -> float:
        """SQNR lost in this layer: its inputs' SQNR minus its own.

        Both are capped at 60 dB, about the best 8-bit data reaches, so that an exactly
        represented input does not exaggerate the drop.
        """
        own = min(self.sqnr_db, CLEAN_DB)
        return min(self.input_sqnr_db, CLEAN_DB) - own

    def row(self) -> dict[str, Any]:
        """JSON-ready summary."""
        d = asdict(self)
        d.update(sqnr_db=self.sqnr_db, cosine=self.cosine, drop_db=self.drop_db)
        return d


@dataclass
class Comparison:
    """The comparison: graph outputs, then layers worst first."""

    outputs: list[TensorStats]
    layers: list[TensorStats]
    samples: int

    def table(self, limit: int = 20) -> str:
        """A terminal table."""
        lines = [
            f"compared on {self.samples} samples; SQNR in dB (higher is better); drop: SQNR "
            "lost in the layer itself",
            f"{'node (for --exclude / --config)':<40} {'op':<12} {'SQNR':>8} {'drop':>7} "
            f"{'cosine':>9}  output tensor",
        ]
        for title, rows in (("outputs", self.outputs), ("layers, largest drop first", self.layers)):
            lines.append(f"-- {title}")
            for s in rows[:limit]:
                lines.append(
                    f"{short(s.node or s.name):<40} {s.op:<12} {s.sqnr_db:>8.2f} "
                    f"{s.drop_db:>7.2f} {s.cosine:>9.5f}  {short(s.name, 30)}"
                )
            if len(rows) > limit:
                lines.append(f"... {len(rows) - limit} more (see --json or --report)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "samples": self.samples,
            "outputs": [s.row() for s in self.outputs],
            "layers": [s.row() for s in self.layers],
        }


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: tensor_array(i) for i in model.graph.initializer}


def compare(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    dataset: DatasetManager,
    names: Sequence[str] | None = None,
) -> Comparison:
    """Stream ``dataset`` through both models and compare every matched float tensor.

    ``names``: compare only these tensors (their statistics are those of a comparison of
    every tensor; the drops of the first ones lack the inputs left out). When one sample's
    tensors of both models would pass :data:`GROUP_BYTES` (sized by shape inference on the
    first batch), they are compared in graph-order groups of that size, the data streamed
    once per group: onnxruntime holds every exposed tensor of a run, fetched or not (a source
    that can be read once only is compared at once).
    """
    try:
        float_model = onnx.shape_inference.infer_shapes(float_model)
    except Exception:  # shape inference is best effort; unknown tensors are skipped
        pass
    f_types = output_types(float_model)
    graph_inputs = float_inputs(float_model)
    only = set(names) if names is not None else None
    f_names = [
        o
        for o in graph_inputs + [o for n in float_model.graph.node for o in n.output]
        if o and f_types.get(o) in FLOAT_TYPES and (only is None or o in only)
    ]
    groups = [f_names]
    if dataset.replayable:
        first = next(iter(dataset.batches()), None)
        dataset.reset()
        if first is not None:
            groups = tensor_groups(float_model, f_names, first, GROUP_BYTES)
    stats: dict[str, TensorStats] = {}
    samples = 0
    q_inits = _initializers(quant_model)
    streamed = False
    for group in groups:
        plan = tensor_plan(group, quant_model, q_inits)
        if not plan:  # nothing of it in the quantized model (an empty fetch list fetches all)
            continue
        if streamed:
            dataset.reset()
        samples = _stream(float_model, (quant_model, q_inits), dataset, plan, stats)
        release_shared_arena()  # the group's sessions are gone: the next starts from nothing
        streamed = True
    link_inputs(float_model, stats)
    producers = {o: n for n in float_model.graph.node for o in n.output}
    for name, st in stats.items():
        node = producers.get(name)
        if node is not None:
            st.node, st.op = node.name or name, node.op_type
    outs = [s for s in stats.values() if s.is_output]
    # graph inputs are compared (the layers they feed start from them) but are no layer
    layers = sorted(
        (s for s in stats.values() if not s.is_output and s.name not in graph_inputs),
        key=lambda s: (-s.drop_db, s.order),
    )
    return Comparison(outs, layers, samples)


def _stream(
    float_model: onnx.ModelProto,
    quantized: tuple[onnx.ModelProto, dict[str, np.ndarray]],
    dataset: DatasetManager,
    plan: dict[str, tuple[str, str | None, str]],
    stats: dict[str, TensorStats],
) -> int:
    """Fold the data's statistics of ``plan``'s tensors into ``stats``; the samples streamed.

    ``quantized``: the quantized model and its initializers as arrays.
    """
    quant_model, q_inits = quantized
    outputs = {o.name for o in float_model.graph.output}
    for n in plan:  # numbered in graph order across groups
        stats[n] = TensorStats(n, n in outputs, len(stats))
    f_sess = make_session(float_model, expose=list(plan))
    q_fetch = sorted({v[0] for v in plan.values()})
    q_sess = make_session(quant_model, expose=q_fetch)
    both = _Both(f_sess, list(plan), q_sess, q_fetch)
    samples = 0
    batches = progress(dataset.batches(), dataset.num_batches(), "comparing")
    parts = _Parts(batches, both)
    # both models run the next part on a thread of their own while this one is folded
    for feeds, values in run_ahead(both, [], parts, number=parts.batch):
        f_vals = dict(zip(plan, values[: len(plan)], strict=True))
        q_vals = dict(zip(q_fetch, values[len(plan) :], strict=True))
        samples += feed_samples(feeds) if feeds else 0
        for name, q in dequantized(plan, q_inits, q_vals).items():
            stats[name].add(np.asarray(f_vals[name]), q)
    return samples


#: one sample's tensors of both models past this are compared in groups (:func:`compare`)
GROUP_BYTES = 512 << 20


def tensor_groups(
    model: onnx.ModelProto, names: list[str], feeds: Mapping[str, Any], bound: int
) -> list[list[str]]:
    """``names`` in their order, cut where one sample's tensors of both models pass ``bound``.

    Sizes come from :func:`tensor_bytes` on ``feeds`` (per sample where the feeds share a
    batch axis); each tensor counts twice (the float model's and the quantized model's), one
    whose size shape inference cannot tell as the median of those it can. One group when
    they fit.
    """
    per = feed_samples(feeds) if shared_batch(feeds) else 1
    sizes = {n: b // max(per, 1) for n, b in tensor_bytes(model, feeds).items()}
    known = sorted(sizes.values())
    typical = known[len(known) // 2] if known else 0
    groups: list[list[str]] = [[]]
    held = 0
    for name in names:
        size = 2 * sizes.get(name, typical)
        if groups[-1] and held + size > bound:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size
    return groups


def float_inputs(model: onnx.ModelProto) -> list[str]:
    """The graph inputs that are not initializers."""
    inits = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def tensor_bytes(model: onnx.ModelProto, feeds: Mapping[str, Any]) -> dict[str, int]:
    """Bytes of every node output of ``model`` run on ``feeds``, where shapes tell them.

    Shapes are inferred with the inputs fixed to the feeds' shapes and constants propagated
    (a Reshape's target computed from a Shape is then known); tensors whose size stays
    unknown are left out.
    """
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    del fixed.graph.value_info[:]
    for vi in fixed.graph.input:
        if vi.name in feeds and vi.type.tensor_type.HasField("shape"):
            dims = vi.type.tensor_type.shape.dim
            for dim, size in zip(dims, np.shape(feeds[vi.name]), strict=False):
                dim.Clear()
                dim.dim_value = int(size)
    try:
        fixed = onnx.shape_inference.infer_shapes(fixed, data_prop=True)
    except Exception:  # best effort: nothing known
        return {}
    out = {}
    for vi in [*fixed.graph.value_info, *fixed.graph.output]:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        if not t.HasField("shape") or any(d < 0 for d in dims):
            continue
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
        except (KeyError, TypeError, ValueError):
            continue
        out[vi.name] = int(np.prod(dims, dtype=np.int64)) * itemsize
    return out


#: bytes of exposed tensors (both models) one run may hand out: a batch above it is compared in
#: parts (every tensor of magika for 128 files was 3 GB at once); two parts are alive at once,
#: the one folded and the one running
RUN_BYTES = 128 << 20


class _Both:
    """The float and the quantized model's sessions as one: a run of each on the same feeds."""

    def __init__(self, f_sess: Any, f_names: list[str], q_sess: Any, q_names: list[str]):
        self.f_sess, self.f_names, self.q_sess, self.q_names = f_sess, f_names, q_sess, q_names

    def run(self, names: list[str], feeds: dict[str, Any]) -> list[Any]:
        """The float model's exposed tensors, then the quantized model's."""
        return [*self.f_sess.run(self.f_names, feeds), *self.q_sess.run(self.q_names, feeds)]

    def get_inputs(self) -> Any:
        """The float model's inputs (for the error's batch hint)."""
        return self.f_sess.get_inputs()


class _Parts:
    """The feeds of each run, with the batch each comes from (:meth:`batch`, for errors).

    A batch whose exposed tensors would pass :data:`RUN_BYTES` runs in parts along its batch
    axis: its first sample alone, then parts of as many samples as fit, measured on that
    sample (run once more here, as the parts run ahead of the measurement).
    """

    def __init__(self, batches: Any, both: _Both):
        self.batches, self.both = batches, both
        self.per_run: int | None = None
        self.sources: list[int] = []

    def batch(self, part: int) -> int:
        """The batch part ``part`` comes from."""
        return self.sources[part]

    def __iter__(self) -> Any:
        for index, batch in enumerate(self.batches):
            whole = not shared_batch(batch) or feed_samples(batch) <= 1
            n = 1 if whole else feed_samples(batch)
            start = 0
            while start < n:
                step = n if whole else (self.per_run or 1)
                feeds = batch if whole else {k: v[start : start + step] for k, v in batch.items()}
                if self.per_run is None and not whole:
                    made = outputs_bytes(run_checked(self.both, [], feeds, index))
                    self.per_run = max(1, RUN_BYTES // max(made // step, 1))
                self.sources.append(index)
                yield feeds
                start += step


def tensor_plan(
    names: list[str], quant_model: onnx.ModelProto, q_inits: dict[str, np.ndarray]
) -> dict[str, tuple[str, str | None, str]]:
    """Where a quantized model holds each float tensor of ``names`` (graph order kept).

    float tensor -> (tensor to fetch, scale initializer or None, zero-point initializer or "").
    """
    q_types = output_types(quant_model)
    q_produced = {o for n in quant_model.graph.node for o in n.output}
    plan: dict[str, tuple[str, str | None, str]] = {}
    # a float tensor a QuantizeLinear reads (a QDQ model) is compared as that Q's output: the
    # value the next op sees. onnxruntime's QDQ drops a Relu after a Conv and lets the Q's zero
    # point clip; the tensor the Conv writes under the Relu's name is the pre-Relu value
    quantized_by = {
        n.input[0]: n
        for n in quant_model.graph.node
        if n.op_type == "QuantizeLinear" and len(n.input) > 1 and n.input[1] in q_inits
    }
    for name in names:
        q_node = quantized_by.get(name)
        if q_node is not None:
            zp = q_node.input[2] if len(q_node.input) > 2 else ""
            plan[name] = (q_node.output[0], q_node.input[1], zp)
        elif name in q_produced and q_types.get(name, onnx.TensorProto.FLOAT) in FLOAT_TYPES:
            plan[name] = (name, None, "")
    wanted = set(names)
    for node in quant_model.graph.node:
        pos = output_params(node.op_type)
        if pos is None or len(node.input) <= pos[0]:
            continue
        scale = node.input[pos[0]]
        base = scale[: -len("_scale")] if scale.endswith("_scale") else ""
        if base in wanted and base not in plan and scale in q_inits:
            zp = node.input[pos[1]] if len(node.input) > pos[1] else ""
            plan[base] = (node.output[0], scale, zp)
    return {n: plan[n] for n in names if n in plan}


def dequantized(
    plan: dict[str, tuple[str, str | None, str]],
    q_inits: dict[str, np.ndarray],
    fetched: dict[str, Any],
) -> dict[str, np.ndarray]:
    """The fetched values of a :func:`tensor_plan` as float (integer ones dequantized).

    In float32, as DequantizeLinear computes: q − z is exact there (8- and 16-bit integers)
    and the product with the float32 scale is rounded once, the value float64 arithmetic
    rounded to float32 would give, at a quarter of the temporaries.
    """
    out = {}
    for name, (q_name, scale_name, zp_name) in plan.items():
        q = np.asarray(fetched[q_name])
        if scale_name is not None:
            scale = q_inits[scale_name].astype(np.float32)
            zp = q_inits[zp_name].astype(np.float32) if zp_name in q_inits else np.float32(0)
            if np.broadcast_shapes(q.shape, np.shape(zp), scale.shape) == q.shape:
                q = q.astype(np.float32)  # a fresh array: the rest in place, no temporaries
                q -= zp
                q *= scale
            else:
                q = (q.astype(np.float32) - zp) * scale
        out[name] = q
    return out


def link_inputs(model: onnx.ModelProto, stats: dict[str, TensorStats]) -> None:
    """Give each compared tensor the worst SQNR of the nearest compared tensors it reads."""
    producers = {o: n for n in model.graph.node for o in n.output}

    def sources(name: str, seen: set[str]) -> list[str]:
        node = producers.get(name)
        if node is None:
            return []
        found: list[str] = []
        for inp in node.input:
            if not inp or inp in seen:
                continue
            seen.add(inp)
            found.extend([inp] if inp in stats else sources(inp, seen))
        return found

    for name, st in stats.items():
        ups = [stats[u].sqnr_db for u in sources(name, set())]
        st.input_sqnr_db = min(ups) if ups else math.inf
