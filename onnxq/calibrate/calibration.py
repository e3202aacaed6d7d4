"""Calibration: choose values for the Quantizer's placeholders from data.

* :class:`CalibrationCallback` — ``calibrate_pattern(info) -> {placeholder: value}``.
* :class:`ObserverCallback` — a callback backed by streaming observers: the Calibrator makes one
  pass over the data with one onnxruntime session on the float model, feeding every tensor a
  pattern quantizes to its observer (memory O(tensors), independent of the number of samples),
  then asks each pattern for its values.
* :class:`CalibrationInfo` — what a callback sees of one pattern: placeholder names, observers,
  and ``get_(un)quantized_layer_inputs/outputs(feeds)`` backed by onnxruntime sessions.
* :class:`Calibrator` — runs the pass and the callbacks in topological order; one set of
  parameters per tensor: the first pattern to set a shared placeholder wins; a later different
  scale is handed to constraint solving (onnxq.solve.constraints), which reports its cost.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from onnxq.annotate.config import most_specific
from onnxq.annotate.quantizer import Quantizer
from onnxq.calibrate.dataset import DatasetManager, Feed, feed_samples
from onnxq.calibrate.statistics import OUTLIER_RATIO, Statistics, outlier_batches
from onnxq.calibrate.streaming import (
    AHEAD_BYTES,
    available_cores,
    batch_bytes,
    one_blas_thread,
    outputs_bytes,
    run_ahead,
    run_checked,
)
from onnxq.calibrators import MinMaxCallback
from onnxq.core.callbacks import CalibrationCallback, CalibrationInfo, Observer
from onnxq.core.errors import CalibrationError
from onnxq.core.specs import PatternRecord
from onnxq.io.graph import graphs_of, tensor_array
from onnxq.io.progress import progress
from onnxq.io.session import make_session, trim_heap_if_grown
from onnxq.io.text import shown
from onnxq.solve.rounding import products_beside

#: batches in flight in the one-process pass, each run on its own thread sharing the session's
#: threads: with one run, onnxruntime (exposing the tensors on the cores but one) was the
#: critical path and the core folding the statistics waited most of the pass; two keep both
#: busy (see docs/calibration.md, "Where the time goes"). Where folding the first batch took
#: longer than running it, the pass keeps one: a second run would only wait, holding one more
#: batch's outputs (nudenet_320n, default quantize: peak RSS 677-811 -> 572-623 MB, the same
#: calibrate time). An explicit ``threads`` of 1 keeps one: the process then runs onnxruntime
#: on one thread, as asked (:func:`stream_depth`)
STREAM_DEPTH = 2


#: growth of the resident memory while folding past which the freed heap is handed back:
#: the peak of the whole default quantize fell from 471-541 to 411-421 MB on OriNet and from
#: 627-637 to 612-613 MB on nudenet_320n (same bytes, same time within the machine's noise);
#: 32 MB trimmed so often that OriNet took 6% longer
FOLD_TRIM_GROWTH = 128 << 20


def stream_depth(threads: int | None) -> int:
    """Runs in flight at once in one calibration process given ``--threads``.

    None (the default) lets the process use the cores: :data:`STREAM_DEPTH` runs. An explicit
    count bounds the runs too, each taking at least one thread: ``--threads 1`` is one run of
    one onnxruntime thread at a time (the statistics still folded beside it), the size of one
    worker of ``--workers N --threads 1``.
    """
    return STREAM_DEPTH if threads is None else max(1, min(STREAM_DEPTH, threads))


#: output steps the saturation bounds assume: Sigmoid's fixed 1/255 grid, Tanh's [-1, 1] on
#: 255 steps; a clipped input lands within 1/8 step of the asymptote, so on the same code
_SIGMOID_EDGE = 1.0 / 255 / 8
_TANH_EDGE = 2.0 / 255 / 8


def _scalar(name: str, consts: dict[str, onnx.TensorProto]) -> float | None:
    """The value of a constant scalar input (''= absent: None)."""
    t = consts.get(name) if name else None
    if t is None:
        return None
    value = tensor_array(t)
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def _saturates(
    node: onnx.NodeProto, consts: dict[str, onnx.TensorProto]
) -> tuple[float, float] | None:
    """Inputs beyond which ``node``'s output no longer moves on its grid (None: no such op)."""
    if node.domain not in ("", "ai.onnx"):
        return None
    op = node.op_type
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if op == "Sigmoid":
        t = float(np.log(1.0 / _SIGMOID_EDGE - 1.0))
        return -t, t
    if op == "Tanh":
        t = float(np.arctanh(1.0 - _TANH_EDGE))
        return -t, t
    # HardSigmoid and HardSwish are left out: cutting a Conv's range at their knees (-3) was
    # measured on PP-OCRv4's recogniser, 28 HardSwish: CER 1.48% -> 2.59% (HardSigmoid 1.73%);
    # per layer the HardSwish outputs gained 0.1-0.5 dB early and lost up to 0.9 dB later
    if op == "Relu":
        return 0.0, np.inf
    if op == "Clip":
        if "min" in attrs or "max" in attrs:  # opset < 11
            lo, hi = attrs.get("min"), attrs.get("max")
        else:
            ins = list(node.input) + ["", ""]
            lo, hi = _scalar(ins[1], consts), _scalar(ins[2], consts)
            if (ins[1] and lo is None) or (ins[2] and hi is None):
                return None  # a bound that is not a constant
        lo = -np.inf if lo is None else float(lo)
        hi = np.inf if hi is None else float(hi)
        return (lo, hi) if lo < hi else None
    return None


def _read_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """Names read by nodes of If/Loop/Scan bodies (outer-scope tensors among them)."""
    names: set[str] = set()
    for node in graph.node:
        for _, sub in graphs_of(node):
            names.update(i for n in sub.node for i in n.input)
            names.update(o.name for o in sub.output)
            names |= _read_in_subgraphs(sub)
    return names


def saturation_bounds(model: onnx.ModelProto) -> dict[str, tuple[float, float]]:
    """{tensor: interval} for tensors whose every reader is constant outside the interval.

    Sigmoid, Tanh (both sides), Clip with constant bounds (its bounds), Relu (below 0). Graph
    outputs and tensors with any other reader get none (Min/Max against a constant: see
    :func:`clamped_by_reader`, which clips the data itself, channel by channel).
    """
    consts = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            consts[node.output[0]] = node.attribute[0].t
    bounds: dict[str, tuple[float, float]] = {}
    other: set[str] = {o.name for o in model.graph.output} | _read_in_subgraphs(model.graph)
    for node in model.graph.node:
        interval = _saturates(node, consts)
        for pos, name in enumerate(node.input):
            if pos > 0 and interval is not None:
                continue  # Clip's own bounds
            if interval is None or name in other:
                other.add(name)
                bounds.pop(name, None)
                continue
            lo, hi = bounds.get(name, interval)
            bounds[name] = (min(lo, interval[0]), max(hi, interval[1]))
    return {k: v for k, v in bounds.items() if np.isfinite(v[0]) or np.isfinite(v[1])}


def clamped_by_reader(model: onnx.ModelProto) -> dict[str, tuple[str, np.ndarray]]:
    """{tensor: (op, constant)} for tensors whose one reader is Min or Max against a constant.

    The reader sees ``op(tensor, constant)`` only: values beyond the constant, channel by
    channel (a Clip whose bound became per channel in cross-layer equalization), need no
    grid. Calibration observes the tensor as its reader sees it.
    """
    consts = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in model.graph.output} | _read_in_subgraphs(model.graph)
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, nodes in readers.items():
        n = nodes[0]
        if len(nodes) != 1 or name in outputs or n.op_type not in ("Min", "Max"):
            continue
        if n.domain not in ("", "ai.onnx") or len(n.input) != 2 or n.input[0] != name:
            continue
        if n.input[1] in consts and n.input[0] != n.input[1]:
            c = tensor_array(consts[n.input[1]])
            if c.size > 0 and np.issubdtype(c.dtype, np.floating):
                out[name] = (n.op_type, c)
    return out


def outlier_warnings(stats: Statistics, names: list[str]) -> list[str]:
    """One warning for the first tensor (graph order) with outlier batches, if any."""
    for name in names:
        batches, median = outlier_batches(stats.extremes.get(name, {}))
        if not batches:
            continue
        top = max(stats.extremes[name][b] for b in batches)
        listed = ", ".join(str(b) for b in batches[:5]) + (" …" if len(batches) > 5 else "")
        return [
            f"calibration batch(es) {listed} reach {top:.3g} in tensor '{shown(name)}', over "
            f"{OUTLIER_RATIO:g}× the largest value of the median batch ({median:.3g}): such "
            "an outlier sets the range of every tensor it reaches, and the int8 model rounds "
            "the other samples to almost nothing; fix or drop those samples"
        ]
    return []


@dataclass
class CalibrationReport:
    """What calibration saw: samples, batches, timing, conflicts and data problems."""

    batches: int = 0
    samples: int = 0
    seconds: float = 0.0
    tensors_observed: int = 0
    observer_bytes: int = 0
    nonfinite: dict[str, int] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    #: (scale placeholder, who asked, value) for each calibration of a port after the first:
    #: constraint solving keeps one grid and reports the cost (onnxq.solve.constraints)
    asks: list[tuple[str, str, Any]] = field(default_factory=list)
    #: batches whose values dwarf the rest's (onnxq.calibrate.statistics.outlier_batches)
    outliers: list[str] = field(default_factory=list)


class Calibrator:
    """Calibrate ``quantizer``'s placeholders on ``dataset_manager``.

    ``callback`` is the default CalibrationCallback for patterns created without one.
    """

    def __init__(
        self,
        quantizer: Quantizer,
        dataset_manager: DatasetManager | None = None,
        callback: CalibrationCallback | None = None,
        progress: bool | None = None,
        node_callbacks: Mapping[str, CalibrationCallback] | None = None,
    ):
        self.quantizer = quantizer
        self.dataset_manager = dataset_manager
        self.default_callback = callback or MinMaxCallback()
        self.node_callbacks = dict(node_callbacks or {})
        self.progress = progress  # None: a bar on a terminal once the pass runs 2 s
        self.values: dict[str, np.ndarray] = {}
        #: batches whose feeds and float graph outputs the calibration pass keeps (set before
        #: calibrate) for the accuracy check, which then needs no float session of its own
        self.reference_batches = 0
        self.reference: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
        #: placeholders holding a pattern's fixed output grid
        self._fixed: set[str] = set()
        #: the activation range chosen per tensor, first writer wins like the values (what
        #: --save-ranges writes)
        self.ranges: dict[str, tuple[float, float]] = {}
        self.observers: dict[tuple[str, str], Observer] = {}
        #: tensors whose per-channel means to collect (tensor -> channel axis), set before
        #: calibrate; the sums and value counts land in ``channel_sums``
        self.channel_axes: dict[str, int] = {}
        #: per-channel means read from a range table (--load-ranges) instead of the data
        self.loaded_means: dict[str, np.ndarray] = {}
        self.channel_sums: dict[str, tuple[np.ndarray, int]] = {}
        #: each weight's parameters by (tensor, axis, dtype, bits), computed once
        #: (CalibrationInfo.weight_params)
        self.weight_qparams: dict[tuple[str, int | None, str, int], Any] = {}
        #: observers a later pass streams over the same batches (tensor -> observers with an
        #: ``observe(array)``), set before calibrate: optimized rounding's layer Hessians
        self.taps: dict[str, list[Any]] = {}
        #: the first batches, kept for callbacks that search on real layer outputs
        self.sample_feeds: list[dict[str, np.ndarray]] = []
        #: resident memory after the last trim while folding (onnxq.io.session)
        self._resident: int | None = None
        #: local processes the pass runs on (``--workers``): each takes every N-th batch and
        #: the statistics are merged (see onnxq.calibrate.statistics for what is exact)
        self.workers = 1
        #: onnxruntime threads of each calibration process (None: onnxruntime's choice in one
        #: process, the cores shared out among workers)
        self.threads: int | None = None
        #: the data as Ray tasks open it (``--ray``) and the cluster's address (None: a local
        #: one for the call); see onnxq.calibrate.cluster
        self.ray_data: Any = None
        self.ray_address: str | None = None
        self.report = CalibrationReport()
        self._float_session: Any = None
        self._float_names: list[str] = []
        self._quant_session: Any = None
        self._quant_version = -1
        self._version = 0
        self._saturation: dict[str, tuple[float, float]] | None = None

    def saturation_bound(self, tensor: str) -> tuple[float, float] | None:
        """The interval outside which every consumer of ``tensor`` saturates, or None.

        A tensor read only by ops that are constant beyond some input (not a graph output)
        needs no grid there: Sigmoid ±7.6 and Tanh ±3.8 (outputs within 1/8 of an output step
        of the asymptote), a Clip's bounds, Relu below 0 (see :func:`saturation_bounds`). A
        clipped value gives the same output, while the rest of the range gets a finer grid. A
        Conv → Clip(0, 6) whose Clip is not folded (symmetric TensorRT activations) had its
        int8 grid spread over ±1000; a Conv → Sigmoid gate with outputs of ±30 gains 1.5-2 dB.
        """
        if self._saturation is None:
            self._saturation = saturation_bounds(self.quantizer.float_model)
        return self._saturation.get(tensor)

    def callback_for(self, record: PatternRecord) -> CalibrationCallback:
        """A per-node callback (``--config``) first, then the pattern's, then the default.

        Among the nodes of one group (a Conv and its folded Relu, say) the most specific
        setting wins: a method named for the Conv beats a global one reaching the Relu.
        """
        levels = self.quantizer.node_method_levels
        chosen = most_specific(list(record.nodes), self.node_callbacks, levels)
        if chosen is not None:
            return chosen
        return record.pattern.calibration_callback or self.default_callback

    def calibrate(self) -> dict[str, np.ndarray]:
        """Collect statistics (one pass), run every pattern's calibrate_pattern, return values."""
        start = time.perf_counter()
        records = self.quantizer.records_in_order()
        self._observe(records)
        self._choose(records)
        self.report.seconds = time.perf_counter() - start
        return dict(self.values)

    def recalibrate(self, callback: CalibrationCallback) -> dict[str, np.ndarray]:
        """The values with ``callback`` as the default, from the statistics already gathered.

        No data is read: ``callback`` shares the observers of the default's (its
        ``observer_key``). The ranges and conflicts become the new values' (what
        ``--save-ranges`` and the report show); calling it again with the first callback
        gives the first values back.
        """
        self.default_callback = callback
        self.values, self.ranges, self._fixed = {}, {}, set()
        self.report.conflicts, self.report.asks = [], []
        self._choose(self.quantizer.records_in_order())
        return dict(self.values)

    def _choose(self, records: list[PatternRecord]) -> None:
        """Every pattern's calibrate_pattern, in order, over the statistics gathered."""
        for rec in records:
            info = CalibrationInfo(self, rec)
            chosen = rec.pattern.calibrate_pattern(info)
            self.merge(rec, chosen)
        missing = [
            name
            for name, ph in self.quantizer.placeholders.items()
            if ph.kind in ("scale", "zero_point") and name not in self.values
        ]
        if missing:
            raise CalibrationError(
                f"calibration left placeholder(s) {missing[:5]} without a value; "
                "a calibration callback must return every scale and zero point "
                "named in info.input_scale_zps and info.output_scale_zps"
            )

    def release(self) -> None:
        """Drop the onnxruntime sessions and the kept feeds.

        Each session holds a copy of the weights (548 MB for VGG19) that later steps do not need.
        """
        self._float_session = self._quant_session = None
        self._quant_inits: dict[str, onnx.TensorProto] = {}
        self.sample_feeds = []

    def merge(self, rec: PatternRecord, chosen: Mapping[str, Any]) -> None:
        """Add a pattern's values; a placeholder already set keeps its value (conflict noted)."""
        known = self.quantizer.placeholders
        for name, value in chosen.items():
            if name not in known:
                raise CalibrationError(
                    f"callback of {rec.label} '{rec.node}' returned a value for "
                    f"'{name}', which is not a placeholder of the model"
                )
            arr = np.asarray(value)
            # a fixed output grid (Sigmoid, Softmax: 1/255) defines its tensor: it wins over an
            # observed range whichever pattern came first, and a consumer's differing observed
            # range of it is no conflict
            fixed = getattr(rec.pattern, "fixed_output", False) and any(
                name in pair for pair in rec.output_scale_zps
            )
            if name in self.values and not (fixed and name not in self._fixed):
                same = np.array_equal(self.values[name], arr.astype(self.values[name].dtype))
                if not same and name not in self._fixed:
                    if known[name].kind == "scale":  # solving keeps one grid and costs it
                        self.report.asks.append((name, f"{rec.label} '{rec.node}'", arr))
                    elif known[name].kind != "zero_point":
                        self.report.conflicts.append(
                            f"{rec.label} '{rec.node}' asked {name}={arr.tolist()}, kept "
                            f"{self.values[name].tolist()} set by an earlier pattern"
                        )
                continue
            if fixed:
                self._fixed.add(name)
            ph = known[name]
            if ph.kind == "scale" and (not np.all(np.isfinite(arr)) or np.any(arr <= 0)):
                raise CalibrationError(
                    f"callback of {rec.label} '{rec.node}' set scale '{name}' to "
                    f"{arr.tolist()}; scales must be finite and > 0"
                )
            if arr.size != int(np.prod(ph.shape)):
                raise CalibrationError(
                    f"callback of {rec.label} '{rec.node}' set '{name}' with "
                    f"shape {list(arr.shape)}; expected {list(ph.shape)} "
                    f"({'per channel' if ph.shape else 'a scalar'})"
                )
            self.values[name] = arr.astype(np.dtype(ph.dtype)).reshape(ph.shape)
            self._version += 1

    # ----------------------------------------------------------------------------------------
    # the streaming pass

    def _observe(self, records: list[PatternRecord]) -> None:
        wanted: dict[tuple[str, str], CalibrationCallback] = {}
        for rec in records:
            cb = self.callback_for(rec)
            if cb.observer_key is None:
                continue
            for qt in [*rec.inputs, *rec.outputs]:
                if qt.role == "activation":
                    wanted.setdefault((qt.tensor, cb.observer_key), cb)
        if not wanted and not self.taps:
            return
        if self.dataset_manager is None:
            raise CalibrationError("calibration needs data: pass a DatasetManager (or --data)")
        self.observers = {key: cb.make_observer() for key, cb in wanted.items()}
        names = sorted({t for t, _ in wanted} | set(self.channel_axes) | set(self.taps))
        by_tensor: dict[str, list[Observer]] = {}
        for (tensor, _), obs in self.observers.items():
            by_tensor.setdefault(tensor, []).append(obs)
        stats = Statistics(
            by_tensor,
            taps=self.taps,
            channel_axes=self.channel_axes,
            clamps=clamped_by_reader(self.quantizer.float_model),
        )
        refs = _float_outputs(self.quantizer.float_model) if self.reference_batches else []
        keep = max((getattr(self.callback_for(r), "feeds_needed", 0) for r in records), default=0)
        batches = self.dataset_manager.batches()
        bar = progress(batches, self.dataset_manager.num_batches(), "calibrating", self.progress)
        if self.ray_data is not None:
            self._observe_ray(stats, names)
        elif self.workers > 1:
            self._observe_shards(stats, names, bar, keep)
        else:
            fetch = names + [r for r in refs if r not in names]
            it = iter(bar)
            first = next(it, None)
            fold = _Fold(stats, names, fetch, refs, keep)
            size = (
                batch_bytes(self.quantizer.float_model, fetch, first) if first is not None else None
            )
            lone = size is not None and size > AHEAD_BYTES
            session = self._float(names, streaming=True, lone=lone)
            # the Hessians' products on a thread of their own when the process has the cores
            # (nudenet_320n: the folding thread spent 2.6 of its 4.6 s in them, a core idle)
            beside = self.threads is None and available_cores() > 1
            taps = [t for observers in self.taps.values() for t in observers] if beside else []
            depth = stream_depth(self.threads)
            with one_blas_thread(), products_beside(taps):
                start = 0
                if first is not None and self.threads is None:
                    run, folded, made = self._first_batch(fold, session, first)
                    if (lone or size is None) and _switch(lone, run, folded, made):
                        del session
                        session = self._float(names, streaming=True, lone=not lone)
                    if folded > run:  # the folding is the critical path: a second run in
                        depth = 1  # flight would only wait, holding one more batch
                    start = 1
                elif first is not None:
                    it = itertools.chain([first], it)
                self._stream(fold, session, it, start, depth)
        if stats.batches == 0:
            raise CalibrationError(
                "the calibration data source yielded no samples; give at "
                "least one sample per model input"
            )
        self.channel_sums = stats.channel_totals()
        self.report.batches, self.report.samples = stats.batches, stats.samples
        for name in self._graph_order([*names, *sorted(set(stats.nonfinite) - set(names))]):
            if name in stats.nonfinite:
                self.report.nonfinite[name] = (
                    self.report.nonfinite.get(name, 0) + stats.nonfinite[name]
                )
        hopeless = [n for n in self.report.nonfinite if n not in stats.finite]
        if hopeless:
            raise CalibrationError(
                f"tensor '{shown(hopeless[0])}' held no finite value on the calibration data "
                f"({stats.nonfinite[hopeless[0]]} NaN/Inf values"
                + (f"; {len(hopeless) - 1} more tensor(s) too" if len(hopeless) > 1 else "")
                + "), so no range can be chosen for it; check the data for NaN/Inf (e.g. "
                "numpy.isfinite(x).all()) or exclude the nodes that compute it"
            )
        self.report.outliers = outlier_warnings(stats, self._graph_order(names))
        self.report.tensors_observed = len(names)
        self.report.observer_bytes = sum(o.nbytes() for o in self.observers.values())

    def _stream(
        self, fold: _Fold, session: Any, batches: Iterable[Feed], start: int, depth: int
    ) -> None:
        """The pass in this process: onnxruntime runs the next batch while this one is folded.

        ``start``: the index of the first of ``batches`` (batches before it already folded);
        ``depth``: runs in flight at once (:func:`stream_depth`).
        """
        ran = run_ahead(session, fold.fetch, batches, depth=depth)
        for index, (feeds, outs) in enumerate(ran, start):
            self._fold(fold, feeds, outs, index)

    def _fold(self, fold: _Fold, feeds: Feed, outs: list[Any], index: int) -> None:
        """Batch ``index``'s outputs into the statistics (and the reference runs kept)."""
        if len(self.reference) < self.reference_batches:
            got = dict(zip(fold.fetch, outs))
            self.reference.append((dict(feeds), {r: got[r] for r in fold.refs}))
        if len(self.sample_feeds) < fold.keep:
            self.sample_feeds.append(feeds)
        fold.stats.add(fold.names, outs, feed_samples(feeds), index, release=True)
        # the outputs were allocated on onnxruntime's thread and freed on this one: glibc keeps
        # them in that thread's arena, and the process climbs batch after batch
        self._resident = trim_heap_if_grown(self._resident, FOLD_TRIM_GROWTH)

    def _first_batch(self, fold: _Fold, session: Any, feeds: Feed) -> tuple[float, float, int]:
        """Run and fold the first batch one after the other: (run s, fold s, output bytes).

        For the runs the rest of the pass keeps in flight (:data:`STREAM_DEPTH`) and, when it
        runs one batch at a time or may (the outputs' size not known from the model's
        shapes), for :func:`_switch`.
        """
        t0 = time.perf_counter()
        outs = run_checked(session, fold.fetch, feeds, 0)
        t1 = time.perf_counter()
        made = outputs_bytes(outs)  # before folding lets the outputs go
        self._fold(fold, feeds, outs, 0)
        return t1 - t0, time.perf_counter() - t1, made

    def _graph_order(self, names: list[str]) -> list[str]:
        """``names`` as the data flows: graph inputs, then outputs node by node, then the rest."""
        g = self.quantizer.float_model.graph
        order = [i.name for i in g.input] + [o for n in g.node for o in n.output]
        rank = {t: i for i, t in enumerate(order)}
        return sorted(names, key=lambda t: (rank.get(t, len(rank)), t))

    def _observe_ray(self, stats: Statistics, names: list[str]) -> None:
        """The pass as Ray tasks, each reading its own share of the data."""
        from onnxq.calibrate.cluster import observe_on_ray
        from onnxq.calibrate.dataset import model_inputs

        assert self.ray_data is not None
        inputs = model_inputs(self.quantizer.float_model)
        shards = self.workers if self.workers > 1 else None
        for shard in observe_on_ray(
            self.quantizer.float_model,
            names,
            stats,
            self.ray_data,
            inputs,
            self.ray_address,
            shards,
            self.threads,
        ):
            stats.merge(shard)

    def _observe_shards(
        self, stats: Statistics, names: list[str], batches: Iterable[Feed], keep: int
    ) -> None:
        """The pass on ``self.workers`` local processes, each folding every N-th batch."""
        from onnxq.calibrate.shards import observe_in_processes

        def kept(it: Iterable[Feed]) -> Iterator[Feed]:
            for feeds in it:
                if len(self.sample_feeds) < keep:
                    self.sample_feeds.append(feeds)
                yield feeds

        for shard in observe_in_processes(
            self.quantizer.float_model, names, stats, kept(batches), self.workers, self.threads
        ):
            stats.merge(shard)

    def channel_mean(self, name: str) -> np.ndarray | None:
        """The mean per channel of ``name`` over the calibration data (if it was asked for)."""
        if name not in self.channel_sums:
            return self.loaded_means.get(name)
        sums, count = self.channel_sums[name]
        return sums / max(count, 1)

    # ----------------------------------------------------------------------------------------
    # sessions for CalibrationInfo

    def _float(self, names: list[str], streaming: bool = False, lone: bool = False) -> Any:
        """The float session exposing ``names`` (``streaming``: sized for the one pass).

        The one pass's session gets the cores but one (the last folds the statistics while
        two runs share them), or every core when ``lone``: one run at a time (outputs too
        large for a second), whose statistics wait for it anyway. ViT-S (132 MiB exposed a
        sample) took 24.2 s at 128 samples on one thread of two cores, 15.3 s on both. That
        session's pool does not spin while it waits (its threads would take the core the
        statistics are folded on: PP-OCRv6's recogniser, MSE, 1.82 → 1.57 s).
        """
        if streaming:
            spare = 0 if lone else 1
            threads = self.threads or max(1, available_cores() - spare)
            return make_session(
                self.quantizer.float_model, threads=threads, expose=names, spin=not lone
            )
        if self._float_session is None or not set(names) <= set(self._float_names):
            all_names = sorted(
                {
                    q.tensor
                    for r in self.quantizer.records
                    for q in [*r.inputs, *r.outputs]
                    if q.role == "activation"
                }
                | set(names)
            )
            self._float_session = make_session(
                self.quantizer.float_model, threads=self.threads or 0, expose=all_names
            )
            self._float_names = all_names
        return self._float_session

    def run_float(self, names: list[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Values of float-model tensors (constants come from the model) for one feed."""
        out: dict[str, np.ndarray] = {}
        dynamic = []
        for n in names:
            if self.quantizer.has_float_value(n):
                out[n] = self.quantizer.float_value(n)
            else:
                dynamic.append(n)
        if dynamic:
            res = self._float(dynamic).run(dynamic, dict(feeds))
            out.update(zip(dynamic, res))
        return [out[n] for n in names]

    def run_quantized(self, names: list[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Values in the quantized model materialized with the values chosen so far."""
        if self._quant_session is None or self._quant_version != self._version:
            model = self.quantizer.materialize(self.values, form="qoperator")  # as its kernels
            self._quant_inits = {i.name: i for i in model.graph.initializer}
            produced = {o for n in model.graph.node for o in n.output}
            dyn = sorted(n for n in self._all_quant_names() if n in produced)
            self._quant_session = make_session(model, exact=True, expose=dyn)
            self._quant_version = self._version
        res: dict[str, np.ndarray] = {}
        dynamic = [n for n in names if n not in self._quant_inits]
        for n in names:
            if n in self._quant_inits:
                res[n] = tensor_array(self._quant_inits[n])
        if dynamic:
            res.update(zip(dynamic, self._quant_session.run(dynamic, dict(feeds))))
        return [res[n] for n in names]

    def _all_quant_names(self) -> set[str]:
        return {
            name
            for r in self.quantizer.records
            for q in [*r.inputs, *r.outputs]
            for name in (q.tensor, q.quantized)
        }


@dataclass(frozen=True)
class _Fold:
    """What the one-process pass folds each batch into, and what it keeps of it."""

    stats: Statistics
    names: list[str]  # the tensors observed
    fetch: list[str]  # those and the float outputs of the reference runs
    refs: list[str]
    keep: int  # feeds kept for the callbacks that need some


def _switch(lone: bool, run: float, fold: float, made: int) -> bool:
    """Whether the one-process pass changes its session's cores after the first batch.

    ``lone``: the session has every core (outputs over :data:`AHEAD_BYTES`, one run at a time);
    else the cores but one. A lone pass whose folding took longer than its run gives the rest
    of the pass the cores but one: the folding thread is then the critical path, and
    onnxruntime's second thread only takes cores from it (PP-OCRv6's recogniser, MSE ranges:
    90 ms to fold a batch that runs in 28 ms). A pass of the cores but one whose outputs were
    over the bound after all (their size was not known from the model's shapes: RapidOCR's
    recogniser) gets every core unless folding took as long as the run would on every core.
    """
    cores = available_cores()
    if lone:
        return fold > run
    return made > AHEAD_BYTES and cores > 1 and fold < run * (cores - 1) / cores


def _float_outputs(model: onnx.ModelProto) -> list[str]:
    return [
        o.name for o in model.graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    ]
