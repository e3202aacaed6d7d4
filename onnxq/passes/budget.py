"""Budget: which default algorithms fit in the seconds ``budget`` gives the whole call.

Runs after loading, only when ``budget`` is set. Needs ``state.float_model``, ``state.kind`` and
the calibration data. Leaves ``state.over_budget`` (algorithm -> why it is left out), which the
bias correction, equalization, SmoothQuant and rounding passes read: an algorithm their ``auto``
setting would run is left out when it does not fit (the sequential bias correction falls back
to fast). An algorithm asked for by name (``on``, ``optimized``, ``sequential``, ``layerwise``)
always runs; its estimate is spent first. Leaves ``state.budget`` for the report.

The unit of every estimate is one float inference pass over the calibration data, measured by
running the float model on the first batch (once to warm the session up, then the fastest of
three runs) times the number of batches. Each algorithm costs a fixed number of such passes:
the median ratio measured on four zoo models (:data:`COST`), so an estimate can err either
way by about 2x (docs/performance.md, "A time budget"); the summary puts the whole
estimate beside the time taken. The calibrate pass and the rest of the call are reserved
before any algorithm is kept. When not all fit, they are kept in :data:`PRIORITY` order (the
largest accuracy gains measured first).

The choice depends on this machine's speed, so a budget that cuts an algorithm may cut it on
one machine and not another: the report names what was left out, so a run can be repeated with
the algorithms written out (``--rounding nearest``, ...). Without a budget nothing is timed and
the output depends on the inputs only.
"""

from __future__ import annotations

import time
from typing import Any

from onnxq.io.session import make_session
from onnxq.options import spell
from onnxq.passes.defaults import DEFAULTS, picks
from onnxq.passes.manager import PassResult, State, record_read
from onnxq.passes.stream import open_dataset
from onnxq.solve.bias_correction import SEQUENTIAL_SAMPLES

#: float passes over the calibration data each algorithm costs: the median ratio of its
#: measured time to one float pass (the ``--verbose`` pass times, with and without it) on
#: MobileNetV2, EfficientNet-Lite1, nudenet_320n and MiniLM-L3, remeasured when the passes got
#: faster. Rounding counts its Hessians, which the calibrate pass gathers, and its solve
#: (6.6, 4.0, 11 and 2.9 passes); the sequential bias correction runs on at most its first
#: SEQUENTIAL_SAMPLES samples, so its cost is per pass over those (11, 6 and 4.4 on the CNNs),
#: scaled by their share of the data; the fast correction it falls back to costs next to
#: nothing. SmoothQuant: 4 on MiniLM-L3. The ratios spread about 2x either way of the median.
COST = {
    "bias-correction": 6.0,
    "equalization": 5.0,
    "smoothquant": 4.0,
    "rounding": 5.5,
    "layerwise": 6.0,
}
#: float passes the calibrate pass costs per method (MinMax: 3.4, 2.3, 3.4, 1.8 on the four;
#: the MSE histograms 7.1, 3.0, 4.8, 2.3: :data:`HISTOGRAMS`, the other histogram methods
#: alike). The Hessians of optimized rounding are counted in its own cost.
CALIBRATE = {"minmax": 3.0, "average-max": 3.0, "output-aware": 50.0}
HISTOGRAMS = 4.0
#: the rest of the call (load, annotate, materialize, lower, verify, checks): passes and
#: seconds (1.4 to 3.3 s on the four)
REST_PASSES, REST_SECONDS = 1.0, 1.0
#: timed runs of the first batch after the warm-up; the fastest is taken (one run alone came
#: out up to 1.6× slow on EfficientNet-Lite1, and every estimate with it)
TIMED_RUNS = 3
#: the algorithms a budget may leave out, kept in this order when not all fit
PRIORITY = ("bias-correction", "equalization", "smoothquant", "rounding")


def pass_seconds(state: State) -> tuple[float | None, str]:
    """One float pass over the calibration data, in seconds, and how it was found."""
    model = state.float_model
    ds = open_dataset(state)
    if not ds.replayable:
        return None, "a one-shot data source cannot be read ahead to time it"
    n = ds.num_batches()
    if n is None:
        return None, "the data's number of batches is not known before it is read"
    first = next(iter(ds.batches()))
    ds.reset()
    session = make_session(model)
    session.run(None, first)  # warm-up: allocations, first-run kernels
    times = []
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        session.run(None, first)
        times.append(time.perf_counter() - start)
    one = min(times)
    record_read(state, "budget", 1, "the float model timed on the first batch")
    return one * n, f"{n} batches × {one * 1e3:.1f} ms"


def sequential_share(state: State) -> float:
    """The share of the calibration data the sequential bias correction runs on."""
    ds = state.dataset
    n = ds.num_batches() if ds is not None else None
    if not n:
        return 1.0
    samples = n * (ds.batch_size() or 1)
    return min(1.0, SEQUENTIAL_SAMPLES / samples)


def calibrate_cost(method: str) -> float:
    """Float passes the calibrate pass of ``method`` costs."""
    return CALIBRATE.get(method, HISTOGRAMS)


class Budget:
    """Keep the default algorithms that fit in ``budget`` seconds, the most valuable first."""

    name = "budget"

    def run(self, state: State) -> PassResult:
        """Time one float pass, reserve the required steps, keep what fits."""
        o = state.options
        limit = o.budget
        if limit is None:
            return PassResult("")
        wanted = [
            n for n in PRIORITY if picks(n, state) and getattr(o, DEFAULTS[n].option) == "auto"
        ]
        asked = [n for n in PRIORITY if getattr(o, DEFAULTS[n].option) == DEFAULTS[n].on]
        if o.bias_correction == "layerwise":
            asked.append("layerwise")
        plan: dict[str, Any] = {"seconds": limit, "wanted": wanted, "asked": asked}
        state.budget = plan
        if state.data is None or o.load_ranges is not None:
            plan["note"] = "no calibration data is read: nothing to plan"
            return PassResult(f"{limit:g} s: no calibration data is read, nothing to plan")
        start = time.perf_counter()
        p, how = pass_seconds(state)
        spent = sum(r.seconds for r in state.records) + (time.perf_counter() - start)
        if p is None:
            plan["note"] = f"{how}: every default algorithm runs"
            return PassResult(f"{limit:g} s: {how}; every default algorithm runs")
        reserve = p * (calibrate_cost(o.method) + REST_PASSES) + REST_SECONDS
        share = sequential_share(state)

        def cost(n: str) -> float:
            return COST[n] * p * (share if n == "bias-correction" else 1.0)

        left = limit - spent - reserve - sum(cost(n) for n in asked)
        plan.update(
            {
                "float_pass_seconds": round(p, 3),
                "float_pass": how,
                "spent_before_seconds": round(spent, 3),
                "reserved_seconds": round(reserve, 3),
                "estimates": {n: round(cost(n), 3) for n in wanted + asked},
            }
        )
        kept, cut = [], []
        for n in wanted:
            seconds = cost(n)
            if seconds <= left:
                left -= seconds
                kept.append(n)
                continue
            state.over_budget[n] = (
                f"over the {limit:g} s budget: about {seconds:.1f} s, "
                f"{max(left, 0.0):.1f} s left after the required steps"
            )
            cut.append(n)
        plan["kept"], plan["left_out"] = kept, cut
        runs = sum(cost(n) for n in kept + asked)
        plan["estimated_seconds"] = round(spent + reserve + runs, 3)
        plan["to_run_anyway"] = " ".join(
            spell(DEFAULTS[n].option, o.cli, DEFAULTS[n].on) for n in cut
        )
        parts = [f"{limit:g} s; a float pass ≈ {p:.2f} s; required steps ≈ {reserve:.1f} s"]
        if kept:
            parts.append("kept " + ", ".join(f"{n} (≈ {cost(n):.1f} s)" for n in kept))
        if cut:
            parts.append("left out " + ", ".join(f"{n} (≈ {cost(n):.1f} s)" for n in cut))
        if not wanted:
            parts.append("no default algorithm to weigh")
        return PassResult("; ".join(parts))


def budget_line(plan: dict[str, Any], took: float) -> str:
    """The summary's budget line: the limit, what was left out and the time taken."""
    limit = plan["seconds"]
    head = f"budget {limit:g} s"
    if "estimated_seconds" in plan:
        head += f", estimated {plan['estimated_seconds']:.1f} s"
    head += f", the passes took {took:.1f} s"
    if took > limit:
        head += f" ({took - limit:.1f} s over)"
    if "note" in plan:
        return f"{head}: {plan['note']}"
    cut = plan.get("left_out", [])
    tail = (
        f"left out {', '.join(cut)} ({plan['to_run_anyway']} to run "
        + ("it" if len(cut) == 1 else "them")
        + " anyway)"
        if cut
        else "every default algorithm fit"
    )
    return f"{head}: {tail}"
