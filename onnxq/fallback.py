"""Accuracy-driven fallback: the fewest quantized groups returned to float to meet ``max_drop``.

``quantize(..., max_drop=X)`` holds back every 8th calibration batch (never calibrated on),
quantizes on the rest and measures the metric on the held-back batches: by default the mean
cosine of every float output with fp32, per sample, as a percentage (so ``max_drop=0.5`` allows
0.5 points); ``metric="module:function"`` names the user's own evaluation instead, called with
the path of a model file and returning a number where higher is better (it reads its own data).
When the drop is over the bar, the :data:`CANDIDATES` groups ranked first by the
sensitivity ranking on the held-back batches (onnxq.simulate.sensitivity, the ranking ``onnxq
debug`` prints: each group alone quantized and alone left float) are each tried alone in float
(the whole group: a Conv with its folded Relu); those that raise the metric, best first, then go
back to float together, 2, 4, ... of them until the bar is met, and bisection finds the
fewest. Every trial is a full quantization with those nodes excluded, so each algorithm runs
as it would for the user. The best model found is returned (and written): the fewest groups
meeting the bar (of those, the one that cuts the fewest int8 chains: a single group meeting
the bar in the middle of a chain lets the other candidates be tried for one at a chain's end),
else the best metric. ``report.fallback`` lists every trial: the float groups, the metric, the
drop, the int8 latency on the held-back batches and the edges between int8 and float nodes.

Where the target runs int16 activations (``Target.int16_activations``, or ``fallback="int16"``),
a group goes back to int16 activations with its int8 weights instead of to float (a
``[node."…"] activation_dtype = "int16"`` entry for its nodes), so the model stays integer on
that runtime; a group whose own noise the ranking finds in its weights still goes to float
(onnxq.simulate.sensitivity.fix). The ranking then measures each group returned to int16.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx

from onnxq.annotate.config import UserConfig
from onnxq.calibrate.dataset import model_inputs
from onnxq.calibrate.sources import as_dataset
from onnxq.core.errors import ConfigError, DataError
from onnxq.io.graph import load_model, save_model
from onnxq.io.openvino import OpenVINOSession
from onnxq.io.openvino import available as openvino_available
from onnxq.io.session import make_session
from onnxq.lower.fakequantize import holds_fakequantize
from onnxq.options import QuantizeOptions, spell
from onnxq.passes.defaults import settle
from onnxq.passes.manager import State, run_passes
from onnxq.passes.pipeline import build
from onnxq.report import QuantizeReport, build_report
from onnxq.simulate import metric as simulate_metric
from onnxq.simulate.emulate import emulate
from onnxq.simulate.sensitivity import fix, fix_entry, rank

#: every HOLDOUT-th calibration batch is held back to measure the drop
HOLDOUT = 8
#: groups (the best-ranked) whose effect alone is measured before combining them
CANDIDATES = 8
#: seconds the sensitivity ranking of the candidates may take
RANKING_BUDGET_S = 60.0

Metric = Callable[[onnx.ModelProto], float]
#: a group returned: its nodes and what they go to ("float" or "int16")
Returned = tuple[list[str], str]


@dataclass
class Trial:
    """One quantization of the search."""

    #: groups returned (to float or to int16 activations) and of those, to float
    groups: int
    floats: int
    excluded: list[str]
    #: nodes returned to int16 activations
    int16: list[str]
    metric: float
    drop: float
    int8_ms: float
    #: edges between an int8 node and a float one (onnxq.fallback.breaks): each costs a
    #: QuantizeLinear or DequantizeLinear at run time
    breaks: int
    #: kept only while this trial could still be the one returned (see _best)
    model: onnx.ModelProto | None
    report: QuantizeReport | None

    def row(self) -> dict[str, Any]:
        """JSON-ready, without the model."""
        return {
            "groups": self.groups,
            "float_groups": self.floats,
            "int16_groups": self.groups - self.floats,
            "excluded": self.excluded,
            "int16": self.int16,
            "metric": round(self.metric, 6),
            "drop": round(self.drop, 6),
            "int8_ms": round(self.int8_ms, 3),
            "int8_float_edges": self.breaks,
        }


def split(data: Any, model: onnx.ModelProto, o: QuantizeOptions) -> tuple[list[Any], list[Any]]:
    """(calibration batches, held-back batches): every :data:`HOLDOUT`-th batch held back."""
    ds = as_dataset(data, model_inputs(model), o.batch_size, o.samples, o.preprocess)
    feeds = [dict(f) for f in ds.batches()]
    if len(feeds) < 2:
        raise DataError(
            f"{spell('max_drop', o.cli)} holds back every {HOLDOUT}th calibration batch to "
            f"measure the drop, but the data has {len(feeds)} batch(es); give more samples or "
            f"a smaller {spell('batch_size', o.cli)}"
        )
    if len(feeds) < HOLDOUT:
        return feeds[:-1], feeds[-1:]
    held = feeds[HOLDOUT - 1 :: HOLDOUT]
    return [f for i, f in enumerate(feeds) if i % HOLDOUT != HOLDOUT - 1], held


def output_cosine(float_model: onnx.ModelProto, held: list[Any]) -> Metric:
    """The default metric: mean cosine with fp32 of every float output per sample, in %."""
    session = make_session(float_model)
    names = [o.name for o in session.get_outputs()]
    reference = [session.run(names, f) for f in held]

    def metric(model: onnx.ModelProto) -> float:
        q = runtime_session(model)  # the target's: a FakeQuantize model runs in OpenVINO
        cosines = []
        for feed, ref in zip(held, reference, strict=True):
            for r, g in zip(ref, q.run(names, feed), strict=True):
                r = np.asarray(r, np.float64)
                g = np.asarray(g, np.float64)
                if not np.issubdtype(r.dtype, np.floating) or r.ndim == 0:
                    continue
                r, g = r.reshape(len(r), -1), g.reshape(len(g), -1)
                den = np.linalg.norm(r, axis=1) * np.linalg.norm(g, axis=1)
                same = np.all(r == g, axis=1)
                cos = np.where(den > 0, (r * g).sum(1) / np.where(den > 0, den, 1), same * 1.0)
                cosines.extend(cos.tolist())
        return 100.0 * float(np.mean(cosines)) if cosines else 100.0

    return metric


def user_metric(ref: str | Callable[..., Any], cli: bool, name: str = "metric") -> Metric:
    """``module:function`` called with a model file's path: its score (a per-sample list's mean).

    ``name``: the option as the caller spells it (``metric``, debug's ``eval``).
    """
    scores = simulate_metric.user_metric(ref, spell(name, cli))
    return lambda model: float(np.mean(scores(model)))


def runtime_session(model: onnx.ModelProto, threads: int = 0) -> Any:
    """A session of ``model`` in its runtime (``threads`` 0: the runtime's choice).

    OpenVINO for a FakeQuantize model (onnxruntime cannot load one: debug on the openvino target
    failed here), else onnxruntime.
    """
    if not holds_fakequantize(model):
        return make_session(model, threads=threads)
    if not openvino_available():
        raise ConfigError(
            "the model holds OpenVINO FakeQuantize nodes, which only the OpenVINO runtime "
            "runs; pip install openvino"
        )
    return OpenVINOSession(model, threads=threads or None)


def latency_ms(model: onnx.ModelProto, held: list[Any]) -> float:
    """Latency per batch of ``held`` in ms in the model's runtime: 1 thread, median of 3 passes."""
    session = runtime_session(model, threads=1)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for feed in held:
            session.run(None, feed)
        times.append((time.perf_counter() - start) * 1e3 / len(held))
    return statistics.median(times)


#: the options the first quantization settles for the trials after it
FITTED = ("recipe", "method", "rounding", "bias_correction", "depthwise_scaling")


def search(
    model: Any, data: Any, options: QuantizeOptions, quantize_branch: Any
) -> tuple[onnx.ModelProto, QuantizeReport]:
    """Quantize ``model`` meeting ``options.max_drop`` with the fewest float groups."""
    if options.output_format.runtime != "onnxruntime":
        raise ConfigError(
            f"{spell('max_drop', options.cli)} measures each trial with onnxruntime; use "
            f"{spell('format', options.cli, 'qoperator')} or {spell('format', options.cli, 'qdq')}"
            " and convert the chosen model (onnxq convert)"
        )
    source = model if isinstance(model, onnx.ModelProto) else load_model(model)
    calib, held = split(data, source, options)
    base = replace(options, max_drop=None, metric=None, output=None, latency_check=False)
    metric = (
        user_metric(options.metric, options.cli) if options.metric else output_cosine(source, held)
    )
    fp32 = metric(source)
    bar = float(options.max_drop or 0.0)

    def run(groups: list[Returned]) -> tuple[Trial, State]:
        excluded = sorted({n for g, kind in groups if kind == "float" for n in g})
        wide = sorted({n for g, kind in groups if kind == "int16" for n in g})
        opts = replace(base, exclude=tuple(base.exclude) + tuple(excluded))
        if wide:
            user = base.user if base.user is not None else UserConfig(path="the fallback")
            opts = replace(opts, user=user.with_nodes({n: fix_entry("int16") for n in wide}))
        state = run_passes(State(opts, source, calib), build(opts, quantize_branch))
        value = metric(state.model)
        latency = latency_ms(state.model, held)
        drop = fp32 - value
        report = build_report(state)
        edges = breaks(source, report)
        floats = sum(kind == "float" for _, kind in groups)
        t = Trial(
            len(groups), floats, excluded, wide, value, drop, latency, edges, state.model, report
        )
        return t, state

    trials: list[Trial] = []

    def trial(groups: list[Returned]) -> Trial:
        t = run(groups)[0]
        trials.append(t)
        _best(trials, bar)  # drops the models that can no longer be returned
        return t

    first, state = run([])
    # the trials repeat the first one's budget plan, the recipe it chose on held-back batches
    # (written into its options by onnxq.passes.choose) and its depthwise scaling as decided:
    # a trial differs from it in the groups returned to float, not in how the rest was fitted
    chosen = {f: getattr(state.options, f) for f in FITTED}
    base = settle(replace(base, **chosen), state.over_budget)
    trials.append(first)
    ranked = _ranked_groups(state, held, options.fallback)[:CANDIDATES] if first.drop > bar else []
    del state
    # each candidate alone: a group's own SQNR loss does not say that making it float helps
    # (its output is still quantized for its int8 readers), so the order is the measured gain,
    # and groups that do not help are dropped
    singles = []
    for group in ranked:
        t = trial([group])
        singles.append((t, group))
        # one group meeting the bar ends the search unless it cut an int8 chain in its middle
        # (two more edges; a chain's end adds one): then the other candidates are tried for one
        # that meets it at a chain's end
        if t.drop <= bar and t.breaks - first.breaks < 2:
            break
    helpful = [g for t, g in sorted(singles, key=lambda p: -p[0].metric) if t.metric > first.metric]
    if not any(t.drop <= bar for t in trials):
        fewest(len(helpful), lambda k: trial(helpful[:k]).drop <= bar, start=2)
    best = _best(trials, bar)
    assert best.model is not None and best.report is not None
    report = best.report
    report.fallback = {
        "metric": (
            simulate_metric.metric_label(options.metric)
            if options.metric
            else "output cosine with fp32 (%)"
        ),
        "fallback": options.fallback,
        "held_back_batches": len(held),
        "fp32": round(fp32, 6),
        "max_drop": bar,
        "met": best.drop <= bar,
        "chosen": best.groups,
        "chosen_excluded": best.excluded,
        "chosen_int16": best.int16,
        "fp32_ms": round(latency_ms(source, held), 3),
        "trials": [t.row() for t in trials],
    }
    if options.output is not None:
        save_model(best.model, options.output)
    return best.model, report


def fewest(count: int, meets: Callable[[int], bool], start: int = 1) -> int | None:
    """The smallest ``k`` in [start, count] with ``meets(k)``, taking more as never worse.

    ``k`` doubles from ``start`` (the last step is ``count``) until it meets, then bisection
    between the last miss and the hit: about 2·log2(count) calls. None when ``count`` misses.
    """
    lo, k = start - 1, start
    while True:
        if k > count:
            return None
        if meets(k):
            hi = k
            break
        lo = k
        k = count if k < count < 2 * k else 2 * k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _best(trials: list[Trial], bar: float) -> Trial:
    """The trial to return: the fewest float groups meeting the bar, else the best metric.

    Of the trials meeting it with the fewest groups, the one with the fewest of them float,
    then the fewest int8/float edges (int8 chains kept whole), then the best metric. The
    other trials' models and reports are dropped (a search keeps one model in memory).
    """
    meeting = [t for t in trials if t.drop <= bar]
    best = (
        min(meeting, key=lambda t: (t.groups, t.floats, t.breaks, -t.metric))
        if meeting
        else max(trials, key=lambda t: t.metric)
    )
    for t in trials:
        if t is not best:
            t.model = t.report = None
    return best


def breaks(model: onnx.ModelProto, report: QuantizeReport) -> int:
    """Edges of ``model``'s graph between a node quantized in ``report`` and a float one.

    Each is a QuantizeLinear or DequantizeLinear at run time, whatever the format: a group
    returned to float at the end of an int8 chain adds one, one in the middle adds two.
    """
    quantized = {d.node: d.quantized for d in report.decisions}
    producer = {o: n.name for n in model.graph.node for o in n.output}
    count = 0
    for n in model.graph.node:
        for t in n.input:
            p = producer.get(t)
            if p is not None and quantized.get(p, False) != quantized.get(n.name, False):
                count += 1
    return count


def _ranked_groups(state: State, held: list[Any], fallback: str) -> list[Returned]:
    """The quantized groups that cost output accuracy, the largest cost first, and their fix.

    The ranking of ``onnxq debug`` (onnxq.simulate.sensitivity) on the held-back batches: each
    group alone quantized and alone returned (to float, or to int16 activations), on the
    emulation of this quantization.
    """
    ranking = rank(emulate(state), held, budget=RANKING_BUDGET_S, fallback=fallback)
    return [(list(g.nodes), fix(g, fallback)) for g in ranking.groups if g.score > 0]
