"""``onnxq debug``: from "it lost accuracy" to a config that wins it back.

One command, five steps, each on the same samples:

1. **Quantize** the model as ``onnxq quantize`` would for the target and measure the metric:
   the user's ``--eval module:function`` (called with a model file's path, higher is better),
   else the mean output cosine with fp32 on the calibration samples, in % (in-sample: prefer
   ``--eval`` on held-out data). Where int8 loses, measure the metric's **noise**: its
   difference between two quantizations calibrated on the two halves of the data
   (:func:`calibration_noise`). A loss within it is "nothing to fix", and a fix must gain
   more than it.
2. **Rank** every quantized group (onnxq.simulate.sensitivity: each group alone quantized and alone
   left float on an emulation of this quantization, weights and activations apart).
   Before it, **where the loss sits** (onnxq.simulate.loss_parts): the metric of the float model
   with only its inputs on their 8-bit grids, and of the model quantized anew with int16
   activations (int8 weights): what no choice of activation ranges can beat.
3. **Bisect** over the ranking: the fewest best-ranked groups whose return to float recovers
   ``recover`` (default 80%) of the lost metric, each step a full quantization with those groups
   float (k doubles, then bisection: about 2·log2(:data:`MAX_GROUPS`) quantizations at most).
4. **Write the fix** as a ``--config`` TOML (``keep_float`` per node, a comment with each
   group's measured share of the output noise), **apply it** with ``quantize --config`` and
   measure again: the promised figure is the applied one. A fix whose model runs slower
   than fp32 says so, with both latencies.
5. **Cross-check** the target runtime against the fake-quantized model
   (onnxq.simulate.crosscheck). It runs before the bisection: a group whose output the target
   computes more than ``PART_STEPS`` int8 steps from the fake-quantized model on the same inputs
   is a fault the ranking cannot see (it measures the emulation), so every such group goes to
   float first and the bisection adds ranked groups to them (OpenVINO on nudenet's box head:
   three Convs, and the box IoU goes from 78% to 97%).

Where the target runs int16 activations (``Target.int16_activations``, or ``fallback="int16"``)
steps 2-4 return a group to int16 activations with its int8 weights instead of to float
(``activation_dtype = "int16"`` entries), unless its own noise is in its weights
(onnxq.simulate.sensitivity.fix); the model then stays integer on that runtime.

Time: five quantizations (the int8 model, the two halves, the int16-activation one, the
fix), at most
2·log2(:data:`MAX_GROUPS`) more, and the ranking's budget (``budget`` seconds; it
cuts its samples to stay within it).
"""

from __future__ import annotations

import math
import os
import shlex
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import tomli_w

from onnxq.annotate.config import UserConfig
from onnxq.api import quantize_state
from onnxq.calibrate.dataset import model_inputs
from onnxq.calibrate.sources import as_dataset
from onnxq.core.errors import ConfigError, DataError
from onnxq.fallback import Metric, fewest, latency_ms, output_cosine, user_metric
from onnxq.io.graph import load_model, write_text_atomic
from onnxq.io.paths import reads_of, refuse_collisions, writes_of
from onnxq.io.text import escaped
from onnxq.lower.fakequantize import holds_fakequantize
from onnxq.options import resolve, returned_label
from onnxq.passes.load import refuse_quantized
from onnxq.report import build_report
from onnxq.simulate.compare import compare
from onnxq.simulate.crosscheck import PART_STEPS, CrossCheck, cross_check
from onnxq.simulate.emulate import emulate
from onnxq.simulate.loss_parts import LossParts, float_inputs, loss_parts
from onnxq.simulate.sensitivity import BUDGET_S, GroupScore, Ranking, db, fix, fix_entry, rank

#: the most best-ranked groups the bisection may return to float
MAX_GROUPS = 32
#: batches the default metric and the cross-runtime check run on
CHECK_BATCHES = 32
#: groups inside If/Loop/Scan bodies measured one by one, at most
MAX_BODY_GROUPS = 16


@dataclass
class BodyGroup:
    """A group inside an If branch or a Loop/Scan body, measured with it alone float."""

    #: the node holding the body, the body's attribute, the group's node inside it
    holder: str
    body: str
    node: str
    #: the metric with this group float (every other group as quantize leaves it)
    metric: float

    @property
    def name(self) -> str:
        """As the report names it."""
        return f"{self.holder}/{self.body}/{self.node}"


@dataclass
class Step:
    """One quantization of the bisection."""

    #: best-ranked groups returned (to float, or to int16 activations)
    groups: int
    metric: float
    #: int8 latency per batch, 1 thread, median of 3 passes over a few batches
    ms: float

    def row(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"groups": self.groups, "metric": self.metric, "ms": round(self.ms, 3)}


@dataclass
class DebugResult:
    """What ``onnxq debug`` found."""

    model: str
    target: str
    metric: str
    fp32: float
    int8: float
    ranking: Ranking
    steps: list[Step]
    #: the groups the fix returns (to float, or to int16 activations), best-ranked first
    chosen: list[GroupScore]
    #: the metric with the written config applied (None: nothing to fix)
    fixed: float | None
    recover: float
    config: str | None
    command: str | None
    check: CrossCheck
    int8_nodes: int
    int8_nodes_fixed: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    #: what a chosen group returns to: "float", or "int16" activations where the target runs
    #: them (a group whose noise is in its weights still to float: sensitivity.fix)
    fallback: str = "float"
    #: nodes of the fixed model at int16 activations (not counted in int8_nodes_fixed)
    int16_nodes_fixed: int = 0
    #: groups returned to float because the target computes them apart from the fake-quantized
    #: model (group node → RMS int8 steps on the same inputs), first in ``chosen``
    parted: dict[str, float] = field(default_factory=dict)
    #: the metric with one part of the quantization on (None: int8 lost nothing)
    parts: LossParts | None = None
    #: how far the metric moves between two quantizations calibrated on the two halves of
    #: the data (None: one batch); a loss or a gain within it is not acted on
    noise: float | None = None
    #: fp32 latency per batch (1 thread, the steps' batches)
    fp32_ms: float = 0.0
    #: groups inside If/Loop/Scan bodies, each measured with it float (the emulation behind
    #: the ranking covers the main graph), best first
    body_groups: list[BodyGroup] = field(default_factory=list)

    def kind(self, group: GroupScore) -> str:
        """What ``group`` went back to: "float" or "int16"."""
        return _kind(group, self.parted, self.fallback)

    @property
    def returned_to(self) -> str:
        """Where the groups went, for labels (options.returned_label)."""
        return returned_label(self.fallback)

    @property
    def int16_kept(self) -> str:
        """The clause ", N at int16 activations" after the int8 nodes kept, where any are."""
        n = self.int16_nodes_fixed
        return f", {n} at int16 activations" if n else ""

    def returned(self) -> str:
        """The chosen groups and what each went back to, for the summary."""
        names = ", ".join(
            g.node
            + ("" if self.kind(g) == "float" else " → int16")
            + (" [runtime parts]" if g.node in self.parted else "")
            for g in self.chosen
        )
        return f"{len(self.chosen)} group(s) {self.returned_to} ({names})"

    @property
    def loss(self) -> float:
        """Metric points int8 loses against fp32."""
        return self.fp32 - self.int8

    @property
    def recovered(self) -> float | None:
        """The share of the loss the fix wins back (None without a loss or a fix)."""
        if self.fixed is None or self.loss <= 0:
            return None
        return (self.fixed - self.int8) / self.loss

    def summary(self) -> str:
        """The terminal report."""
        lines = [
            f"onnxq debug {self.model} (target {self.target}; {self.seconds:.0f} s)",
            f"metric: {self.metric}",
            f"  fp32 {self.fp32:.4f}, int8 {self.int8:.4f} (loss {self.loss:.4f}"
            + (f"; noise {self.noise:.4f}" if self.noise is not None else "")
            + ")",
            *(
                f"  {'where the loss sits: ' if i == 0 else ''}{text}"
                for i, text in enumerate(self.parts_lines())
            ),
            "",
            self.ranking.table(),
            "",
        ]
        if self.body_groups:
            lines.append(
                f"inside If/Loop/Scan bodies, each group measured with it alone float "
                f"({self.config_hint}):"
            )
            lines += [
                f"  {g.name}: {g.metric:.4f} ({g.metric - self.int8:+.4f})"
                for g in self.body_groups
            ]
            advice = self.body_advice()
            if advice:
                lines.append(advice)
            lines.append("")
        if self.fixed is None:
            lines.append(
                "nothing to fix: int8 loses nothing on this metric"
                if self.loss <= 0
                else f"nothing to fix: int8 loses {self.loss:.4f}, within the noise "
                f"{self.noise:.4f} (the metric's spread between two quantizations calibrated "
                "on the two halves of the data)"
                if self.noise is not None and self.loss <= self.noise
                else "no fix found (see the notes)"
            )
        else:
            rec = self.recovered
            kept = self.int8_nodes_fixed / self.int8_nodes if self.int8_nodes else 0.0
            to = self.returned_to
            if self.parted:
                lo, hi = min(self.parted.values()), max(self.parted.values())
                span = f"{lo:.1f}" if lo == hi else f"{lo:.1f}-{hi:.1f}"
                lines.append(
                    f"runtime: {len(self.parted)} group(s) float first: {self.check.runtime} "
                    f"computes them {span} int8 steps (RMS) from the fake-quantized model on "
                    "the same inputs, which the ranking (an emulation) cannot see"
                )
            lines += [
                f"bisection: {len(self.steps) - 1} quantizations ("
                + ", ".join(f"{s.groups} {to} → {s.metric:.4f}" for s in self.steps[1:])
                + ")",
                f"fix: {self.returned()}: metric {self.int8:.4f} → {self.fixed:.4f} (fp32 "
                f"{self.fp32:.4f}; recovers {100 * rec:.0f}% of the loss, goal "
                f"{100 * self.recover:.0f}%), {self.int8_nodes_fixed} of {self.int8_nodes} int8 "
                f"nodes kept ({100 * kept:.0f}%){self.int16_kept}"
                if rec is not None
                else "fix: none found",
                f"config: {self.config}",
                f"apply:  {self.command}",
            ]
            slower = self.fixed_ms > self.fp32_ms > 0
            if slower:
                lines.append(
                    f"speed: the fix runs {self.fixed_ms:.3f} ms per batch, slower than fp32's "
                    f"{self.fp32_ms:.3f} ms (1 thread): fp32 itself is faster and more accurate"
                )
        lines += ["", self.check.summary()]
        if self.body_groups:
            lines.append(
                "  (the fake-quantized model keeps the If/Loop/Scan bodies float: the outputs' "
                "gap above is theirs, the layers compared are the main graph's)"
            )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    @property
    def config_hint(self) -> str:
        """How a body group is returned to float by hand."""
        return '--exclude NODE, or [node."NODE"] keep_float = true in --config'

    def body_advice(self) -> str | None:
        """The body group whose float return wins back most, where that is above the noise.

        The fix below leaves body groups out (its emulation covers the main graph), so this
        is said apart; None when no group gains more than the noise (or without a noise).
        """
        best = self.body_groups[0] if self.body_groups else None
        if best is None or self.noise is None or best.metric - self.int8 <= self.noise:
            return None
        gain = best.metric - self.int8
        share = f" ({100 * gain / self.loss:.0f}% of the loss)" if self.loss > 0 else ""
        return (
            f"  advice: --exclude {best.name} wins back {gain:.4f}{share}, above the noise "
            f"{self.noise:.4f}; the fix below does not return body groups"
        )

    @property
    def fixed_ms(self) -> float:
        """Latency per batch of the bisection step the fix applies (0 without a fix)."""
        k = len(self.chosen)
        return next((st.ms for st in self.steps if st.groups == k), 0.0) if k else 0.0

    def parts_lines(self) -> list[str]:
        """Where the loss sits, and what that says (nothing when int8 lost nothing)."""
        if self.parts is None:
            return []
        said = [self.parts.advice(), self.parts.ties()]
        return [self.parts.line(), *(x for x in said if x), *self.parts.notes]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "model": self.model,
            "target": self.target,
            "metric": self.metric,
            "fp32": self.fp32,
            "int8": self.int8,
            "loss": self.loss,
            "loss_parts": None if self.parts is None else self.parts.to_dict(),
            "noise": self.noise,
            "fp32_ms": round(self.fp32_ms, 3),
            "fixed_ms": round(self.fixed_ms, 3),
            "recover": self.recover,
            "fixed": self.fixed,
            "recovered": self.recovered,
            "fallback": self.fallback,
            "chosen": [g.node for g in self.chosen],
            "chosen_fix": [self.kind(g) for g in self.chosen],
            "runtime_parted": {n: round(v, 3) for n, v in self.parted.items()},
            "steps": [s.row() for s in self.steps],
            "config": self.config,
            "command": self.command,
            "int8_nodes": self.int8_nodes,
            "int8_nodes_fixed": self.int8_nodes_fixed,
            "int16_nodes_fixed": self.int16_nodes_fixed,
            "seconds": round(self.seconds, 3),
            "ranking": self.ranking.to_dict(),
            "body_groups": [
                {"node": g.name, "metric": g.metric, "gain": g.metric - self.int8}
                for g in self.body_groups
            ],
            "cross_check": self.check.to_dict(),
            "notes": self.notes,
        }


def debug(
    model: str | os.PathLike[str] | onnx.ModelProto,
    data: Any,
    *,
    eval: str | None = None,
    target: str | None = None,
    fallback: str | None = None,
    recover: float = 0.8,
    budget: float = BUDGET_S,
    batch_size: int | None = None,
    samples: int | None = None,
    preprocess: str | None = None,
    output: str | os.PathLike[str] | None = None,
    data_label: str = "CALIB",
    target_file: str | None = None,
    report: str | os.PathLike[str] | None = None,
    cli: bool = False,
    base_dir: str | os.PathLike[str] | None = None,
) -> DebugResult:
    """Rank, bisect, write and check; see the module docstring.

    ``output``: the config file; ``report``: an HTML report (onnxq.tools.html) to write.
    ``base_dir``: for a ModelProto with external data, the folder its files are in.
    ``fallback``: what a group returns to, "float" or "int16" (None: the target's choice).
    ``data_label`` and ``target_file`` are what the printed command names.
    """
    start = time.perf_counter()
    name = str(model) if not isinstance(model, onnx.ModelProto) else "model.onnx"
    if not cli:  # the command line checked its own paths, under their option names
        refuse_collisions(
            [
                *reads_of("model", model),
                *reads_of("data", data),
                *reads_of("target_file", target_file),
            ],
            [
                *writes_of("output", output if output is not None else default_fix_path(name)),
                *writes_of("report", report),
            ],
        )
    if not 0 < recover <= 1:
        raise ConfigError(f"{_flag('recover', cli)} {recover} must be in (0, 1]")
    mode = resolve(target=target, fallback=fallback, cli=cli).fallback
    # loaded now: an evaluation that cannot be is refused before any data is read
    user: Metric | None = user_metric(eval, cli, "eval") if eval is not None else None
    # a path is checked here; a ModelProto by the quantize passes (external data resolved
    # against base_dir either way)
    source = load_model(model, check=not isinstance(model, onnx.ModelProto), base_dir=base_dir)
    refuse_quantized(source, f"'{name}'", "debug")
    feeds = [
        dict(f)
        for f in as_dataset(data, model_inputs(source), batch_size, samples, preprocess).batches()
    ]
    if not feeds:
        raise DataError(f"{_flag('data', cli)} gave no samples")
    kw: dict[str, Any] = {"target": target, "progress": False}
    state = quantize_state(source, feeds, **kw)
    int8_model = state.model
    int8_report = build_report(state)
    int8_nodes = len(int8_report.quantized_nodes)
    check_feeds = feeds[:CHECK_BATCHES]
    if user is not None:
        metric: Metric = user
        metric_name = f"{eval} (higher is better)"
    else:
        metric = output_cosine(source, check_feeds)
        metric_name = (
            f"output cosine with fp32 (%) on {len(check_feeds)} calibration batch(es) "
            f"(in-sample; {_flag('eval', cli)} module:function measures your own metric)"
        )
    fp32 = metric(source)
    int8 = metric(int8_model)
    noise = calibration_noise(source, feeds, metric, kw) if fp32 > int8 else None
    emulation = emulate(state)
    inside = [
        (b.node, b.branch, d.node)
        for b in state.branches
        for d in b.decisions
        if d.quantized and d.pattern not in ("", "requantize", "branches")
    ]
    if fp32 <= int8:
        parts = None
    elif inside:  # the emulation's bodies are float: its parts would leave their loss out
        parts = LossParts(
            fp32,
            int8,
            None,
            None,
            notes=(
                f"not measured: the emulation covers the main graph only, and {len(inside)} "
                "group(s) inside If/Loop/Scan bodies are int8 (each measured below)",
            ),
        )
    else:
        parts = loss_parts(
            emulation,
            metric,
            fp32,
            int8,
            float_inputs(source),
            lambda: emulate(
                quantize_state(source, feeds, activation_dtype="int16", format="qdq", **kw)
            ).fixed(),
        )
    ranking = rank(emulation, feeds, budget, fallback=mode)
    check = cross_check(
        emulation, state.quantizer.float_model, int8_model, check_feeds, state.options.target.name
    )
    del state, emulation
    body_groups = []
    if int8 < fp32:
        for holder, body, node in inside[:MAX_BODY_GROUPS]:
            config = UserConfig.from_dict({"node": {node: fix_entry("float")}}, "debug")
            trial = quantize_state(source, feeds, config=config, **kw)
            body_groups.append(BodyGroup(holder, body, node, metric(trial.model)))
        body_groups.sort(key=lambda g: -g.metric)
    target_name = target or "ort-cpu"
    loss = fp32 - int8
    timing = check_feeds[:4]
    steps = [Step(0, int8, latency_ms(int8_model, timing))]
    fp32_ms = latency_ms(source, timing)
    chosen: list[GroupScore] = []
    fixed = config_path = command = None
    int8_fixed = int8_nodes
    int16_fixed = 0
    notes: list[str] = []
    parted = _parted(ranking.groups, check)

    def kind(g: GroupScore) -> str:
        return _kind(g, parted, mode)

    if loss > 0 and (noise is None or loss > noise):
        # the groups where the runtimes part first (always float), then the ranking's best
        first = [g for g in ranking.groups if g.node in parted]
        candidates = first + [g for g in ranking.groups if g.score > 0 and g.node not in parted]
        candidates = candidates[: len(first) + MAX_GROUPS]
        # a gain within the noise is not one: the goal is above it (and below fp32's)
        goal = int8 + max(recover * loss, noise or 0.0)
        measured: dict[int, float] = {0: int8}

        def quantized_with(k: int) -> float:
            if k not in measured:
                # as the written config will: [node] entries, not --exclude
                entries = {n: fix_entry(kind(g)) for g in candidates[:k] for n in g.nodes}
                config = UserConfig.from_dict({"node": entries}, f"debug step {k}")
                trial = quantize_state(source, feeds, config=config, **kw)
                measured[k] = metric(trial.model)
                steps.append(Step(k, measured[k], latency_ms(trial.model, timing)))
            return measured[k]

        base = len(first)
        if base and quantized_with(base) >= goal:
            found: int | None = base
        else:
            more = fewest(len(candidates) - base, lambda k: quantized_with(base + k) >= goal)
            found = None if more is None else base + more
        k = found if found is not None else max(measured, key=lambda n: (measured[n], -n))
        if found is None:
            notes.append(
                f"no set of up to {len(candidates)} best-ranked groups recovers "
                f"{100 * recover:.0f}% of the loss; the config holds the best one measured"
                if k
                else f"none of the {len(steps) - 1} sets of groups returned raised the "
                "metric; no config written"
            )
        chosen = candidates[:k]
    if loss > 0 and chosen:
        config_path = Path(output) if output is not None else Path(default_fix_path(name))
        text = _config_text(
            name,
            target_name,
            metric_name,
            fp32,
            int8,
            measured[k],
            chosen,
            ranking,
            [kind(g) for g in chosen],
            {g.node: parted[g.node] for g in chosen if g.node in parted},
            check.runtime,
        )
        write_text_atomic(config_path, text)
        same = "".join(
            f" --{flag} {shlex.quote(str(value))}"
            for flag, value in (
                ("batch-size", batch_size),
                ("samples", samples),
                ("preprocess", preprocess),
            )
            if value is not None
        )
        if target_file is not None:
            same += f" --target-file {shlex.quote(target_file)}"
        command = (
            f"onnxq quantize {shlex.quote(name)} --data {shlex.quote(data_label)}{same} "
            f"--target {target_name} --config {shlex.quote(str(config_path))} "
            f"-o {shlex.quote(Path(name).stem + '_int8.onnx')}"
        )
        applied = quantize_state(source, feeds, config=str(config_path), **kw)
        fixed = metric(applied.model)
        wide = {n for g in chosen if kind(g) == "int16" for n in g.nodes}
        done = build_report(applied).quantized_nodes
        int16_fixed = len(set(done) & wide)
        int8_fixed = len(done) - int16_fixed
        if not math.isclose(fixed, measured[k], rel_tol=1e-9, abs_tol=1e-9):
            notes.append(
                f"the written config measured {fixed:.6f}, the bisection {measured[k]:.6f}"
            )
    result = DebugResult(
        name,
        target_name,
        metric_name,
        fp32,
        int8,
        ranking,
        steps,
        chosen,
        fixed,
        recover,
        None if config_path is None else str(config_path),
        command,
        check,
        int8_nodes,
        int8_fixed,
        time.perf_counter() - start,
        notes,
        mode,
        int16_fixed,
        {g.node: parted[g.node] for g in chosen if g.node in parted},
        parts,
        noise,
        fp32_ms,
        body_groups,
    )
    if report is not None:
        write_text_atomic(report, _html(result, source, int8_model, int8_report, check_feeds))
    return result


def calibration_noise(
    source: onnx.ModelProto, feeds: list[dict[str, Any]], metric: Metric, kw: dict[str, Any]
) -> float | None:
    """How far ``metric`` moves between quantizations calibrated on the two halves of ``feeds``.

    The same model, options and metric; only which samples calibrate differs (even and odd
    batches). A loss or a recovery smaller than this is one the data cannot tell from which
    samples happened to calibrate. None with a single batch.
    """
    if len(feeds) < 2:
        return None
    halves = [quantize_state(source, feeds[i::2], **kw).model for i in (0, 1)]
    return abs(metric(halves[0]) - metric(halves[1]))


def _html(
    result: DebugResult,
    source: onnx.ModelProto,
    int8_model: onnx.ModelProto,
    int8_report: Any,
    feeds: list[dict[str, Any]],
) -> str:
    """The HTML report of a debug run."""
    from onnxq.tools import html

    page = html.Report(f"onnxq debug: {Path(result.model).name}")
    rec = result.recovered
    page.summary = [
        ("model", result.model),
        ("target", result.target),
        ("metric", result.metric),
        ("fp32", f"{result.fp32:.4f}"),
        ("int8", f"{result.int8:.4f} (loss {result.loss:.4f})"),
        (
            "where the loss sits",
            " ".join(result.parts_lines()) or "-",
        ),
        (
            "fix",
            "nothing to fix"
            if result.fixed is None
            else f"{result.returned()} → {result.fixed:.4f}"
            + ("" if rec is None else f" (recovers {100 * rec:.0f}% of the loss)")
            + f"; {result.int8_nodes_fixed} of {result.int8_nodes} int8 nodes kept"
            + result.int16_kept,
        ),
        ("config", result.config or "-"),
        ("apply", result.command or "-"),
        ("cross-runtime check", result.check.summary().splitlines()[-1].strip()),
        ("time", f"{result.seconds:.0f} s"),
    ]
    r = result.ranking
    page.add(
        "Sensitivity ranking",
        f"Each group alone quantized and alone returned to {r.fallback} on the emulation of this "
        f"quantization ({r.samples} samples, {r.runs} runs, {r.seconds:.0f} s); output SQNR "
        f"with every group int8: {r.sqnr_db:.2f} dB. " + " ".join(r.notes),
        html.ranking_chart(r.groups, returned=r.fallback)
        + html.table(
            [
                "group",
                "op",
                "alone dB",
                "weights dB",
                "activations dB",
                f"{r.fallback} → dB",
                "share %",
            ],
            [
                (
                    g.node,
                    g.op,
                    db(g.alone),
                    "-" if g.weights is None else db(g.weights),
                    "-" if g.activations is None else db(g.activations),
                    "-" if g.without is None else db(g.without),
                    100 * g.score,
                )
                for g in r.groups
            ],
        ),
    )
    if result.body_groups:
        page.add(
            "Groups inside If branches and Loop/Scan bodies",
            "Each measured by a full quantization with that group alone float (the emulation "
            "behind the ranking covers the main graph); the fix leaves them out: "
            + result.config_hint
            + ".",
            html.table(
                ["group", "metric with it float", "against int8"],
                [(g.name, g.metric, g.metric - result.int8) for g in result.body_groups],
            ),
        )
    if len(result.steps) > 1:
        page.add(
            "Accuracy and latency of the bisection's steps",
            f"Each step is a full quantization with the best-ranked groups {result.returned_to}"
            + ("" if result.fallback == "float" else " (to int16 activations, or float)")
            + "; latency: int8 per batch, 1 thread, onnxruntime CPU.",
            html.tradeoff_chart(
                [(s.groups, s.metric, s.ms) for s in result.steps],
                result.fp32,
                result.returned_to,
            ),
        )
    if not holds_fakequantize(int8_model):  # OpenVINO's layers: the cross-check's drift below
        comparison = compare(source, int8_model, as_dataset(feeds, model_inputs(source)))
        html.comparison_sections(page, source, int8_model, comparison, feeds)
    c = result.check
    page.add(
        "Cross-runtime check",
        c.summary().replace("\n", " "),
        html.table(
            ["node", "tensor", "drift: agreement dB", "drift: drop dB", "same inputs: steps RMS"],
            [(x.node, x.tensor, x.agreement_db, x.drop_db, x.steps) for x in c.layers],
        ),
    )
    page.decisions = [
        (d.node, d.op, "int8" if d.quantized else "float", d.pattern, d.reason)
        for d in int8_report.decisions
    ]
    return page.html()


def _kind(group: GroupScore, parted: dict[str, float], fallback: str) -> str:
    """What ``group`` returns to: float where the runtime parts, else as ``fallback`` says."""
    return "float" if group.node in parted else fix(group, fallback)


def _parted(groups: list[GroupScore], check: CrossCheck) -> dict[str, float]:
    """Groups the target computes apart from the fake-quantized model: group node → steps.

    Apart: more than PART_STEPS int8 steps (RMS) on the same inputs; in graph order.
    """
    by_node = {n: g for g in groups for n in g.nodes}
    parted: dict[str, float] = {}
    for layer in check.layers:
        g = by_node.get(layer.node)
        if g is not None and math.isfinite(layer.steps) and layer.steps > PART_STEPS:
            parted[g.node] = max(parted.get(g.node, 0.0), layer.steps)
    return parted


def _flag(option: str, cli: bool) -> str:
    return f"--{option}" if cli else option


def _sqnr(noise: float) -> str:
    """An SQNR for a sentence: ``33.8 dB``, or ``no error`` where the noise is none."""
    value = db(noise)
    return "no error" if math.isinf(value) else f"{value:.1f} dB"


def default_fix_path(model: str | os.PathLike[str]) -> str:
    """Where ``debug`` writes its config when no output is named: MODEL_fix.toml, here."""
    return f"{Path(model).stem}_fix.toml"


def _config_text(
    model: str,
    target: str,
    metric: str,
    fp32: float,
    int8: float,
    fixed: float,
    chosen: list[GroupScore],
    ranking: Ranking,
    kinds: list[str],
    parted: dict[str, float],
    runtime: str,
) -> str:
    """The fix as ``--config`` TOML, every entry with what it was measured to do.

    ``kinds``: what each chosen group returns to; ``parted``: the groups the target computes
    apart from the fake-quantized model (node → RMS int8 steps), run in ``runtime``.
    """
    wide = kinds.count("int16")
    back = (
        "back to float"
        if not wide
        else f"back to int16 activations ({wide}) or float ({len(chosen) - wide})"
    )
    lines = [
        f"# onnxq debug: {len(chosen)} group(s) of {Path(model).name} {back} (target {target})",
        f"# metric: {metric}",
        f"# fp32 {fp32:.6f}; int8 {int8:.6f}; with this config {fixed:.6f}",
        f"# output SQNR with every group int8: {ranking.sqnr_db:.2f} dB "
        f"({ranking.samples} samples)",
        "",
    ]
    document: dict[str, dict[str, Any]] = {"node": {}}
    for g, kind in zip(chosen, kinds, strict=True):
        split = (
            ""
            if g.weights is None or g.activations is None
            else f"; alone, its weights {_sqnr(g.weights)} and its activations "
            f"{_sqnr(g.activations)}"
        )
        returned = "float" if ranking.fallback == "float" else "at int16 activations"
        floated = (
            f"not measured alone {returned} (budget)"
            if g.without is None or g.float_share is None
            else f"{100 * g.float_share:.1f}% of the output noise goes when it is {returned} "
            f"(output SQNR {ranking.sqnr_db:.2f} → {db(g.without):.2f} dB)"
        )
        why = (
            f"; float: {runtime} computes it {parted[g.node]:.1f} int8 steps (RMS) from the "
            "fake-quantized model on the same inputs (the cross-runtime check)"
            if g.node in parted
            else "; float, not int16: its noise is in its weights"
            if ranking.fallback == "int16" and kind == "float"
            else ""
        )
        lines.append(
            f"# {g.node} ({g.op}): {100 * g.alone_share:.1f}% of the output noise comes back "
            f"when it alone is int8 ({db(g.alone):.2f} dB); {floated}{split}{why}"
        )
        tables = {node: fix_entry(kind) for node in g.nodes}
        document["node"].update(tables)
        lines.append(tomli_w.dumps({"node": tables}))
    return toml_document(lines, document)


def toml_document(lines: list[str], document: dict[str, Any]) -> str:
    """TOML text from comment lines and tables written by a TOML writer, checked.

    Comment lines (starting with ``#``) are escaped (a name holding a newline cannot start a
    line of its own); the tables come from ``tomli_w``. The text is parsed back and must give
    ``document`` exactly, and be a valid ``--config``, before anything is written.
    """
    text = "\n".join(escaped(line) if line.startswith("#") else line for line in lines)
    if tomllib.loads(text) != document:
        raise AssertionError("the config written does not read back as written")
    UserConfig.from_dict(document, "the config onnxq debug writes")
    return text
