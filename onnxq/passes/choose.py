"""Choose: the recipe whose int8 outputs are closest to fp32 on batches it was not fitted on.

With ``recipe`` auto and 32 or more calibration batches, the data is opened split
(onnxq.passes.stream.open_dataset): every 8th batch is held back, and every statistic, Hessian
and bias correction is fitted on the others. This pass then fits the candidates on those and
scores each on the held-back batches (onnxq.simulate.heldback: output SQNR of the emulation,
per sample). Auto's pick is fitted first; then three stages each add the candidates of one
axis, on the values the earlier stages kept (an axis leaves auto's value only for a candidate
above it by more than the noise, below):

1. **ranges**: the calibration method's (MSE by default), MinMax and Percentile, all read
   from the same histograms (no second stream), each with the bias correction of stage 3's
   cheapest candidate. Entropy is not a candidate: on eight zoo models it scored 2.6 to 81 dB
   below auto's pick on the held-back batches, never within the noise of the best;
2. **rounding**: optimized (where auto picks it: the Hessians were gathered) and nearest;
3. **bias correction**: auto's pick (sequential for CNNs) and the others that need no
   further stream (fast, none).

The candidate with the best mean SQNR over the held-back batches is written if it is above
auto's pick by more than their noise (twice the standard error of the paired per-sample
difference); otherwise auto's pick is. So the choice never scores below any candidate by
more than the noise, and leaves auto's pick only on evidence.

With the caller's ``metric`` (and no ``max_drop``, whose fallback has its metric), each
candidate is also finished into the model it would write (the ``finish`` passes: materialize
to the lowering) and scored by that metric (onnxq.simulate.metric), and every comparison above
is made on it instead: on per-sample scores with the same noise rule, on a single number by
the number alone (its noise is unknown). Nothing is held back then: the metric reads data of
its own, so every candidate is fitted on every batch (and has no SQNR column).
An option the caller set (``--rounding``, ``--bias-correction``, a ``--method`` other than
the default) is not searched. The optimized rounding is computed once and shared by every
candidate that uses it (the weight grids do not depend on the activation ranges), and so is
the sequential correction's float stream.

Needs the calibrated ``state.values`` and the three passes it runs for every candidate
(handed in by the pipeline). Leaves what those passes leave for the candidate chosen, the
options it was fitted with, and ``state.choice`` (every candidate with its score and time,
the choice and why) for the report. Without a split it runs the three passes as they are.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx

from onnxq.calibrate.dataset import feed_samples
from onnxq.calibrators import (
    DEFAULT_METHOD,
    ExtremaCallback,
    HistogramViewCallback,
    PercentileCallback,
)
from onnxq.core.callbacks import ObserverCallback
from onnxq.io.progress import Ticker
from onnxq.io.session import release_shared_arena, trim_heap
from onnxq.lower.fakequantize import FakeQuantizeCache
from onnxq.options import spell
from onnxq.passes.defaults import bias_mode, choosing, runs
from onnxq.passes.manager import Pass, PassRecord, PassResult, State
from onnxq.simulate.emulate import emulate
from onnxq.simulate.heldback import beats, gain, references, sqnr
from onnxq.simulate.metric import Metric, metric_beats, metric_gain, metric_label, user_metric

#: methods whose observers are histograms with exact extremes (MinMax is read from them)
HISTOGRAM_METHODS = ("mse", "percentile", "entropy")


@dataclass
class Candidate:
    """One recipe, fitted and scored."""

    ranges: str
    rounding: str
    bias: str
    stage: str
    state: State
    #: output SQNR (dB) per held-back sample
    scores: np.ndarray
    seconds: float
    #: the caller's metric of the model this candidate writes (one value, or one per sample)
    metric: np.ndarray | None = None

    @property
    def name(self) -> str:
        """``RANGES/ROUNDING/BIAS``, the name ``--recipe`` takes."""
        return f"{self.ranges}/{self.rounding}/{self.bias}"

    @property
    def mean(self) -> float:
        """Mean SQNR over the held-back samples (dB)."""
        return float(np.mean(self.scores)) if self.scores.size else float("nan")

    @property
    def rank(self) -> float:
        """What the choice ranks it by: the caller's metric (its mean) if any, else :attr:`mean`."""
        return float(np.mean(self.metric)) if self.metric is not None else self.mean

    def beats(self, other: Candidate) -> bool:
        """Above ``other`` by more than the noise, on the metric the choice uses."""
        if self.metric is not None and other.metric is not None:
            return metric_beats(self.metric, other.metric)
        return beats(self.scores, other.scores)


#: an optimized rounding shared between candidates: (rounded weights, per-layer report, record)
Rounded = tuple[dict[str, Any], dict[str, Any], PassRecord]


def run_timed(state: State, step: Pass) -> None:
    """Run ``step`` over ``state`` and record it as the pass manager would.

    The memory it freed goes back to the system as after a pass of the manager's (the shared
    arena's free memory, then glibc's free heap), so the candidates fitted after it start from
    what is in use.
    """
    start = time.perf_counter()
    result = step.run(state)
    release_shared_arena()
    trim_heap()
    state.records.append(PassRecord(step.name, time.perf_counter() - start, result.changed))


class Choose:
    """Fit the candidates, score them on the held-back batches, keep the best."""

    name = "choose"

    def __init__(self, solve: Pass, rounding: Pass, bias: Pass, finish: Sequence[Pass] = ()):
        """The three passes each candidate runs, and the passes that finish its model.

        ``finish`` (materialize to the lowering) turns a candidate into the model it writes, to
        score it with the caller's metric; empty: candidates are scored by held-back SQNR alone.
        """
        self.solve, self.rounding, self.bias = solve, rounding, bias
        self.finish = list(finish)

    def run(self, state: State) -> PassResult:
        """Leave the chosen candidate's values and constants on ``state``."""
        if choosing(state) and not state.values:  # every candidate would write the same
            state.choice = {"skipped": "the main graph has nothing to quantize"}
        if not choosing(state) or not state.values:
            self.fit(state)
            why = state.choice.get("skipped")
            if self.finish and why:  # the data turned it off (options that do are refused)
                state.choice["warning"] = (
                    f"{spell('metric', state.options.cli)} was not used: it scores the recipe "
                    f"choice, which is off ({why})"
                )
            return PassResult(f"off ({why})" if why else "off")
        return _Search(self, state).run()

    def fit(self, state: State, rounded: Rounded | None = None) -> Rounded | None:
        """Solve, round and correct ``state`` for its options; a step set off is not run.

        ``rounded``: an optimized rounding already computed for another candidate (the
        weight grids do not depend on the activation ranges), used instead of running it
        again. Returns the optimized rounding this fit used, if any.
        """
        o = state.options
        run_timed(state, self.solve)
        if o.rounding != "nearest":  # a step set off is not listed as run
            if rounded is not None and runs("rounding", state):
                weights, layers, record = rounded
                state.constants.update(weights)
                state.rounding = dict(layers)
                state.records.append(record)
            else:
                before = dict(state.constants)
                run_timed(state, self.rounding)
                if runs("rounding", state):
                    new = {k: v for k, v in state.constants.items() if before.get(k) is not v}
                    rounded = (new, dict(state.rounding), state.records[-1])
        if o.bias_correction != "none":
            run_timed(state, self.bias)
        return rounded


class _Search:
    """One choice: the candidates fitted so far and the shared work between them."""

    def __init__(self, steps: Choose, state: State):
        self.steps, self.state = steps, state
        #: none when the caller's metric scores the candidates (every batch is fitted on)
        self.held = state.dataset.held()
        self.refs = references(state.quantizer.float_model, self.held) if self.held else []
        state.held_back = list(zip(self.held, self.refs, strict=True))
        self.candidates: list[Candidate] = []
        #: the optimized rounding, computed once
        self.rounded: Rounded | None = None
        #: the candidates' FakeQuantize graph, built once (they differ in values)
        self.fq_cache = FakeQuantizeCache()
        #: the default callback of each range candidate: the method's, and MinMax read from
        #: its histograms
        o, calibrator = state.options, state.calibrator
        cb = calibrator.default_callback
        self.callbacks = {o.method: cb}
        histograms = o.method == DEFAULT_METHOD and o.method in HISTOGRAM_METHODS
        if histograms and isinstance(cb, ObserverCallback):
            self.callbacks["minmax"] = ExtremaCallback(cb)
            percentile = PercentileCallback(o.percentile, o.bins)
            self.callbacks["percentile"] = HistogramViewCallback(cb, percentile)
        #: calibrated values per range candidate
        self.ranges = {o.method: dict(state.values)}
        for name, callback in list(self.callbacks.items())[1:]:
            self.ranges[name] = calibrator.recalibrate(callback)
        self.ticker = Ticker(None, "choosing the recipe", o.progress, "candidate")
        #: the caller's metric, when the candidates are scored by it
        self.metric: Metric | None = None
        self.metric_name = ""
        if steps.finish and o.choice_metric is not None:
            runtime = o.output_format.runtime
            hint = (
                f"the models it is given are {o.output_format.name} models: run them with "
                f"{'OpenVINO' if runtime == 'openvino' else runtime}"
                if runtime != "onnxruntime"
                else ""
            )
            self.metric = user_metric(o.choice_metric, spell("metric", o.cli), hint)
            self.metric_name = metric_label(o.choice_metric)

    def run(self) -> PassResult:
        """Auto's pick, the three stages, then the choice (a bar names each candidate)."""
        try:
            return self._run()
        finally:
            self.ticker.close()

    def _run(self) -> PassResult:
        start = time.perf_counter()
        state, o = self.state, self.state.options
        auto_round = "optimized" if runs("rounding", state) else "nearest"
        auto_bias = bias_mode(state)
        roundings = [auto_round]
        if o.rounding == "auto" and auto_round != "nearest":
            roundings.append("nearest")
        biases = [auto_bias]
        if o.bias_correction == "auto":
            biases += [b for b in ("fast", "none") if b != auto_bias]
        # stages 1 and 2 fit with the cheapest bias correction of stage 3 that corrects
        cheap = next((b for b in ("fast", "none") if b in biases), auto_bias)
        ranges = list(self.ranges)
        self.auto = (ranges[0], auto_round, auto_bias)
        auto = self._fit("auto", *self.auto)
        r = self._stage("ranges", [(x, auto_round, cheap) for x in ranges]).ranges
        rounding = self._stage("rounding", [(r, x, cheap) for x in roundings]).rounding
        self._stage("bias", [(r, rounding, b) for b in biases])
        best = max(self.candidates, key=lambda c: c.rank)
        chosen = best if best.beats(auto) else auto
        self._adopt(chosen)
        state.choice = self._report(chosen, auto, time.perf_counter() - start)
        judge = (
            f"by {self.metric_name}"
            if self.metric is not None
            else f"on {state.choice['held_back_samples']} held-back samples"
        )
        if chosen is auto:
            return PassResult(
                f"auto's {auto.name} kept: none of {len(self.candidates) - 1} other candidates "
                f"better by more than the noise {judge}"
            )
        if chosen.metric is not None and auto.metric is not None:
            gained, known = metric_gain(chosen.metric, auto.metric)
            noise = f"noise ±{known:.4g}" if known is not None else "noise unknown"
            return PassResult(
                f"{chosen.name} over auto's {auto.name}: {gained:+.4g} ({noise}) {judge}"
            )
        mean, sqnr_noise = gain(chosen.scores, auto.scores)
        return PassResult(
            f"{chosen.name} over auto's {auto.name}: {mean:+.2f} dB output SQNR (noise "
            f"±{sqnr_noise:.2f}) {judge}"
        )

    def _stage(self, stage: str, recipes: list[tuple[str, str, str]]) -> Candidate:
        """Fit and score ``recipes`` (those not fitted yet); keep the first.

        The first holds auto's value on this axis; the best replaces it only when it scores
        above it by more than the noise.
        """
        scored = [self._find(*x) or self._fit(stage, *x) for x in recipes]
        best = max(scored, key=lambda c: c.rank)
        return best if best.beats(scored[0]) else scored[0]

    def _find(self, ranges: str, rounding: str, bias: str) -> Candidate | None:
        key = (ranges, rounding, bias)
        return next((c for c in self.candidates if (c.ranges, c.rounding, c.bias) == key), None)

    def _fit(self, stage: str, ranges: str, rounding: str, bias: str) -> Candidate:
        """One candidate fitted on the batches not held back, and scored on the held-back ones."""
        self.ticker.start("/".join((ranges, rounding, bias)))
        start = time.perf_counter()
        base = self.state
        s = copy.copy(base)
        # an axis on auto's pick keeps the caller's setting (auto, and its reasons, stay)
        o, picked = base.options, (ranges, rounding, bias)
        setting: dict[str, Any] = {
            field: value
            for field, value, auto in zip(
                ("method", "rounding", "bias_correction"), picked, self.auto, strict=True
            )
            if value != auto
        }
        s.options = replace(o, recipe="/".join(picked), **setting)
        s.values, s.constants = dict(self.ranges[ranges]), dict(base.constants)
        s.rounding, s.bias_corrections, s.records = {}, {}, []
        first = len(base.data_reads)  # the list is shared: the candidate's reads land there too
        self.rounded = self.steps.fit(s, self.rounded)
        for read in base.data_reads[first:]:
            read["pass"] += f" (candidate {s.options.recipe})"
        scores = (
            sqnr(emulate(s, float_branches=False, fq_cache=self.fq_cache), self.held, self.refs)
            if self.held
            else np.empty(0)
        )
        measured = self.metric(self._model(s)) if self.metric is not None else None
        seconds = time.perf_counter() - start
        c = Candidate(ranges, rounding, bias, stage, s, scores, seconds, measured)
        self.candidates.append(c)
        return c

    def _model(self, fitted: State) -> onnx.ModelProto:
        """The model ``fitted`` writes: the finishing passes on a copy of it."""
        s = fitted.fork()
        for step in self.steps.finish:
            step.run(s)
        return s.proto()

    def _adopt(self, chosen: Candidate) -> None:
        """Leave the chosen candidate's results on the pipeline's state."""
        state, s = self.state, chosen.state
        for name in ("values", "solution", "constants", "rounding", "bias_corrections"):
            setattr(state, name, getattr(s, name))
        state.hessians, state.output_sums = {}, {}
        state.options = s.options
        state.records.extend(s.records)
        if len(self.callbacks) > 1:  # the calibrator's ranges and conflicts as chosen
            state.calibrator.recalibrate(self.callbacks[chosen.ranges])

    def _report(self, chosen: Candidate, auto: Candidate, seconds: float) -> dict[str, Any]:
        """What the report lists: every candidate against auto's pick, and the choice."""
        rows = []
        for c in self.candidates:
            mean, noise = gain(c.scores, auto.scores)
            rows.append(
                {
                    "recipe": c.name,
                    "stage": c.stage,
                    "sqnr_db": round(c.mean, 3) if self.held else None,
                    "vs_auto_db": round(mean, 3) if self.held else None,
                    "noise_db": round(noise, 3) if self.held else None,
                    "seconds": round(c.seconds, 3),
                }
            )
            if c.metric is not None and auto.metric is not None:
                gained, known = metric_gain(c.metric, auto.metric)
                rows[-1].update(
                    metric=float(np.mean(c.metric)), metric_vs_auto=gained, metric_noise=known
                )
        held = self.held
        samples = sum(feed_samples(f) for f in held)
        by = f" (scored by {self.metric_name})" if self.metric is not None else ""
        why = (
            f"auto's pick: no candidate above it by more than the noise{by}"
            if chosen is auto
            else f"above auto's pick by more than the noise{by}"
        )
        out = {
            "chosen": chosen.name,
            "auto": auto.name,
            "why": why,
            "held_back_batches": len(held),
            "held_back_samples": samples,
            "seconds": round(seconds, 3),
            "candidates": rows,
        }
        if self.metric is not None:
            out["metric"] = self.metric_name
        return out
