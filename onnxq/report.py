"""The report of one ``quantize`` call: what was quantized and why the rest was not.

:func:`build_report` gathers it from the pipeline's final state: every node's decision (ops
that requantize carries int8 through count as quantized, If branches say what became of them),
the calibration statistics, every pass with its time and what it changed, and the notes and
warnings of every stage.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import onnx

from onnxq.annotate.quantizer import Quantizer
from onnxq.calibrate.calibration import CalibrationReport
from onnxq.core.optable import CARRIERS
from onnxq.core.qparams import qrange
from onnxq.core.specs import Decision
from onnxq.io.graph import tensor_array
from onnxq.io.text import shown
from onnxq.options import pythonize, returned_label, spell
from onnxq.passes.budget import budget_line
from onnxq.passes.manager import PassRecord, State, op_histogram
from onnxq.post.requantize import Requantizer, RequantizeStats, rescales


@dataclass
class QuantizeReport:
    """What quantization did, node by node, with timings and calibration statistics."""

    decisions: list[Decision]
    calibration: CalibrationReport
    requantize: RequantizeStats
    #: every pass in the order it ran, with its wall time and what it changed
    passes: list[PassRecord] = field(default_factory=list)
    ops_before: dict[str, int] = field(default_factory=dict)
    ops_after: dict[str, int] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    #: tensors where a DQ→Q pair changes the activation dtype (--config activation_dtype)
    rescales: list[str] = field(default_factory=list)
    #: what constraint propagation decided: shared-scale groups and conflicting edges rescaled
    constraints: list[str] = field(default_factory=list)
    #: per-node requests the target cannot run (ignored for that node), and other warnings
    warnings: list[str] = field(default_factory=list)
    #: choices onnxq made on its own that the user should know about (e.g. 7-bit weights)
    notes: list[str] = field(default_factory=list)
    #: fp32 and int8 milliseconds per batch and their ratio (with latency_check)
    latency: dict[str, float] = field(default_factory=dict)
    #: bias correction: bias -> the largest mean shift removed, in output steps
    bias_corrections: dict[str, float] = field(default_factory=dict)
    #: the model's kind as detected (or given) and why: it picks the default algorithms
    model_kind: str = ""
    model_kind_reason: str = ""
    #: each optional algorithm: what it did, or why it did not run
    algorithms: dict[str, str] = field(default_factory=dict)
    #: SmoothQuant per input tensor: alpha (None: left alone), readers, errors, where 1/s went
    smoothing: dict[str, Any] = field(default_factory=dict)
    #: cross-layer equalization per Conv pair: the path between, the channel range spread of
    #: the first weight (largest over median) before and after, the channels absorbed
    equalization: dict[str, Any] = field(default_factory=dict)
    #: depthwise scaling per convolution: its input, where the factors went, the channel
    #: range spread before and after, the int8 noise it sees (dB less)
    depthwise_scaling: dict[str, Any] = field(default_factory=dict)
    #: optimized rounding per layer: output SQNR of nearest and of the chosen rounding (dB),
    #: rows changed, or why the layer kept nearest rounding
    rounding: dict[str, Any] = field(default_factory=dict)
    #: accuracy-driven fallback (max_drop): the metric, the bar, every trial and the choice
    fallback: dict[str, Any] = field(default_factory=dict)
    #: the time budget (budget set): the float pass timed, each estimate, what was left out
    budget: dict[str, Any] = field(default_factory=dict)
    #: the recipe chosen on held-back batches: every candidate with its output SQNR on them,
    #: its difference from auto's pick and that difference's noise (dB), its seconds; the
    #: choice and why; or {"skipped": why not}
    choice: dict[str, Any] = field(default_factory=dict)
    #: every read of the calibration data in order: the pass, the batches read and what for
    data_reads: list[dict[str, Any]] = field(default_factory=list)
    #: bias -> how many of its channels had their weight scale widened so that the int32
    #: accumulator cannot wrap (one note in :attr:`notes` says how many in all)
    widened_biases: dict[str, int] = field(default_factory=dict)
    #: each If branch and Loop/Scan body: its holder and attribute, nodes int8 of nodes, the
    #: calibration batches (``samples``: an If takes a branch per batch) and iterations it
    #: saw, or why it stayed float
    bodies: list[dict[str, Any]] = field(default_factory=list)

    @property
    def quantized_nodes(self) -> list[str]:
        """Names of float nodes now computed in int8."""
        return [d.node for d in self.decisions if d.quantized]

    @property
    def seconds(self) -> dict[str, float]:
        """Wall time per pass."""
        return {p.name: p.seconds for p in self.passes}

    def summary(self, verbose: bool = False) -> str:
        """A few lines for a terminal: what runs int8, what stays float, what ran, the speed.

        ``verbose`` adds the detail: calibration, requantize, every algorithm's result with
        its reason and every pass with its time (all of it is in :meth:`to_dict` too).
        """
        q = [d for d in self.decisions if d.quantized]
        left = Counter(d.op for d in self.decisions if not d.quantized)
        floats = ", ".join(f"{op} {k}" for op, k in sorted(left.items())) or "none"
        total = sum(p.seconds for p in self.passes)
        lines = [
            f"int8: {len(q)} of {len(self.decisions)} nodes; float: {floats}"
            + (" (`onnxq inspect MODEL --explain` says why)" if left else ""),
        ]
        ran = [
            f"{name} ({text.split(' (')[0]})"
            for name, text in self.algorithms.items()
            if not text.startswith("off")
        ]
        cal = self.calibration
        calibrated = f"calibrated on {cal.samples} samples"
        if not cal.tensors_observed and any(b["quantized"] for b in self.bodies):
            calibrated = "the main graph has nothing to calibrate"
        lines.append(
            f"{calibrated}; "
            + (f"{self.model_kind} model: {', '.join(ran)}" if ran else "no extra algorithm ran")
            + f"; {total:.1f} s in all"
        )
        if self.bodies:
            lines.append("bodies: " + "; ".join(body_words(b) for b in self.bodies))
        if self.choice.get("chosen"):
            lines.append(choice_line(self.choice))
        if self.latency:
            ratio = self.latency["ratio"]
            lines.append(
                f"speed: int8 takes {ratio:.2f}× fp32's time per batch "
                f"({self.latency['int8_ms']:.3f} vs {self.latency['fp32_ms']:.3f} ms, 1 thread)"
            )
        if self.budget:  # what a --budget left out, in every summary
            lines.append(budget_line(self.budget, total))
        if verbose:
            lines += self._details()
        if self.fallback:
            lines.append(fallback_line(self.fallback))
        lines.extend(f"note: {n}" for n in self.notes)
        lines.extend(f"warning: {c}" for c in cal.conflicts)
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)

    def _details(self) -> list[str]:
        """The lines ``summary(verbose=True)`` adds."""
        cal = self.calibration
        lines = [
            f"calibration: {cal.samples} samples in {cal.batches} batches, {cal.tensors_observed} "
            f"tensors observed, {cal.observer_bytes} bytes of statistics",
            f"requantize: {self.requantize.folded_pairs} DequantizeLinear→QuantizeLinear pairs "
            f"folded, {self.requantize.rescaled_pairs} rescaled into QLinear ops, "
            f"{len(self.requantize.crossed_ops)} ops carrying int8, "
            f"{len(self.requantize.relus_removed)} Relus removed",
            f"model kind: {self.model_kind} ({self.model_kind_reason})",
        ]
        if self.choice.get("skipped"):
            lines.append(f"recipe: not chosen on held-back samples ({self.choice['skipped']})")
        lines += [f"  {name}: {text}" for name, text in self.algorithms.items()]
        if self.data_reads:
            lines.append(f"data read {len(self.data_reads)} time(s):")
            lines += [f"  {r['pass']}: {r['batches']} batches, {r['why']}" for r in self.data_reads]
        lines.append("passes:")
        lines += [
            f"  {p.name} {p.seconds:.2f} s" + (f": {p.changed}" if p.changed else "")
            for p in self.passes
        ]
        if self.rescales:
            lines.append(
                f"{len(self.rescales)} rescale(s) (DequantizeLinear→QuantizeLinear) kept, where "
                "the activation dtype changes or a shared scale meets a conflicting constraint: "
                + ", ".join(self.rescales)
            )
        lines.extend(f"constraint: {c}" for c in self.constraints)
        return lines

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "decisions": [asdict(d) for d in self.decisions],
            "calibration": asdict(self.calibration),
            "requantize": asdict(self.requantize),
            "passes": [asdict(p) for p in self.passes],
            "seconds": self.seconds,
            "ops_before": self.ops_before,
            "ops_after": self.ops_after,
            "rescales": self.rescales,
            "constraints": self.constraints,
            "warnings": self.warnings,
            "notes": self.notes,
            "latency": self.latency,
            "bias_corrections": self.bias_corrections,
            "model_kind": self.model_kind,
            "model_kind_reason": self.model_kind_reason,
            "algorithms": self.algorithms,
            "smoothing": self.smoothing,
            "equalization": self.equalization,
            "depthwise_scaling": self.depthwise_scaling,
            "rounding": self.rounding,
            "fallback": self.fallback,
            "budget": self.budget,
            "choice": self.choice,
            "data_reads": self.data_reads,
            "widened_biases": self.widened_biases,
            "bodies": self.bodies,
        }


def body_words(body: dict[str, Any]) -> str:
    """One body for the summary: ``If_0/then_branch 12 of 120 nodes int8 (128 samples)``."""
    where = f"{body['node']}/{body['branch']}"
    if not body["quantized"]:
        return f"{where} float ({body['reason']})"
    seen = f"{body['samples']} batches"
    if body["iterations"]:
        seen += f", {body['iterations']:,} iterations"
    return f"{where} {body['quantized']} of {body['nodes']} nodes int8 ({seen})"


def choice_line(choice: dict[str, Any]) -> str:
    """One line for the summary: the recipe written, and what it was chosen over."""
    rows = {r["recipe"]: r for r in choice["candidates"]}
    chosen, auto = rows[choice["chosen"]], rows[choice["auto"]]
    judge = (
        f"by {choice['metric']}"
        if "metric" in choice
        else f"on {choice['held_back_samples']} held-back samples"
    )
    head = (
        f"recipe: {choice['chosen']}, chosen {judge} ({len(rows)} candidates, "
        f"{choice['seconds']:.1f} s): "
    )
    if "metric" in choice:
        return head + _metric_words(chosen, auto, rows, choice["auto"])
    if chosen is auto:
        best = max(rows.values(), key=lambda r: r["sqnr_db"])
        if best is auto:
            return head + f"auto's pick scored best ({auto['sqnr_db']:.1f} dB output SQNR)"
        return head + (
            f"auto's pick kept; the best, {best['recipe']}, was {best['vs_auto_db']:+.2f} dB, "
            f"within the noise (±{best['noise_db']:.2f} dB)"
        )
    return head + (
        f"{chosen['vs_auto_db']:+.2f} dB output SQNR over auto's {choice['auto']} "
        f"(noise ±{chosen['noise_db']:.2f} dB)"
    )


def _metric_words(
    chosen: dict[str, Any], auto: dict[str, Any], rows: dict[str, Any], auto_name: str
) -> str:
    """The end of :func:`choice_line` for a choice scored by the caller's metric."""

    def noise(r: dict[str, Any]) -> str:
        known = r["metric_noise"]
        return f"noise ±{known:.4g}" if known is not None else "one score a model: noise unknown"

    if chosen is auto:
        best = max(rows.values(), key=lambda r: r["metric"])
        if best is auto:
            return f"no candidate scored above auto's pick ({auto['metric']:.6g})"
        return (
            f"auto's pick kept; the best, {best['recipe']}, was {best['metric_vs_auto']:+.4g}, "
            f"within the noise ({noise(best)})"
        )
    return (
        f"{chosen['metric']:.6g}, {chosen['metric_vs_auto']:+.4g} over auto's {auto_name} "
        f"({noise(chosen)})"
    )


def nonfinite_warnings(nonfinite: dict[str, int], shown_at_most: int = 4) -> list[str]:
    """One warning naming the tensors that held NaN/Inf on the calibration data, in graph order."""
    if not nonfinite:
        return []
    worst = list(nonfinite.items())
    named = ", ".join(f"'{shown(n)}' {c}" for n, c in worst[:shown_at_most])
    more = f" and {len(worst) - shown_at_most} more tensor(s)" if len(worst) > shown_at_most else ""
    return [
        f"NaN/Inf values on the calibration data were left out of the ranges: {named}{more} "
        "(values per tensor); check the data with numpy.isfinite, or the model for ops that "
        "overflow on it"
    ]


#: what the report keeps of each body (onnxq.post.subgraphs.BranchResult)
BODY_FIELDS = ("node", "branch", "quantized", "nodes", "samples", "iterations", "reason")


def build_report(state: State) -> QuantizeReport:
    """The report of a finished quantize pipeline."""
    q, o, sol = state.quantizer, state.options, state.solution
    stats = state.requantize_stats
    decisions = mark_carried(q, stats.crossed_ops, o, state.model)
    decisions += branch_decisions(q, state.branches)
    dataset_warnings = state.dataset.warnings if state.dataset is not None else []
    report = QuantizeReport(
        decisions=decisions,
        calibration=state.calibrator.report,
        requantize=stats,
        passes=list(state.records),
        ops_before=op_histogram(state.float_model),
        ops_after=op_histogram(state.model),
        values={k: v.tolist() for k, v in state.values.items()},
        rescales=rescales(state.model) if o.output_format.from_requantized else [],
        constraints=sol.shared + [str(r) for r in sol.rescales] + sol.merged,
        warnings=nonfinite_warnings(state.calibrator.report.nonfinite)
        + list(state.calibrator.report.outliers)
        + list(q.warnings)
        + list(o.warnings)
        + dataset_warnings
        + ([state.choice["warning"]] if "warning" in state.choice else [])
        + state.check_warnings,
        notes=list(o.notes) + widened_notes(q.widened_biases),
        widened_biases=dict(sorted(q.widened_biases.items())),
        latency=state.latency,
        bias_corrections=dict(state.bias_corrections),
        model_kind=state.kind,
        model_kind_reason=state.kind_reason,
        algorithms=algorithms(state),
        smoothing=dict(state.smoothing),
        equalization=dict(state.equalization),
        depthwise_scaling=dict(state.depthwise_scaling),
        rounding=dict(state.rounding),
        budget=dict(state.budget),
        choice=dict(state.choice),
        data_reads=list(state.data_reads),
        bodies=[{k: getattr(b, k) for k in BODY_FIELDS} for b in state.branches],
    )
    explain_constraints(report.decisions, sol)
    if not o.cli:
        speak_python(report)
    return report


#: the optional algorithms, by pass name, and the option that switches each
ALGORITHMS = {
    "equalization": "equalization",
    "smoothquant": "smoothquant",
    "depthwise-scaling": "depthwise_scaling",
    "rounding": "rounding",
    "bias-correction": "bias_correction",
}


def algorithms(state: State) -> dict[str, str]:
    """What each optional algorithm did, or ``off (...)`` with the reason."""
    ran = {r.name: r.changed for r in state.records}
    out = {}
    for name, option in ALGORITHMS.items():
        if name in ran:
            out[name] = ran[name] or "ran, changed nothing"
        else:
            out[name] = f"off ({spell(option, state.options.cli, getattr(state.options, option))})"
    return out


def speak_python(report: QuantizeReport) -> None:
    """Reasons, warnings and notes that name quantize() options by their Python parameters.

    Messages are written once with CLI flags (``--exclude``, ``--format qdq``); a report for a
    Python caller says ``exclude`` and ``format='qdq'`` instead.
    """
    for d in report.decisions:
        d.reason = pythonize(d.reason)
    report.warnings = [pythonize(w) for w in report.warnings]
    report.notes = [pythonize(n) for n in report.notes]


def mark_carried(
    quantizer: Quantizer,
    crossed: Sequence[str] | None = None,
    options: Any = None,
    model: onnx.ModelProto | None = None,
) -> list[Decision]:
    """The quantizer's decisions with the ops that run on int8 data marked quantized.

    ``crossed``: the ops requantize carried int8 through (QOperator); ``model``: the QDQ
    output, whose float ops between DequantizeLinear and QuantizeLinear the runtime runs on
    int8 (:func:`qdq_int8_nodes`). None of either: predicted from the model materialized with
    default scales (what is carried depends on the graph and opset, not on the values), for
    ``inspect``, which then counts what ``quantize`` will. ``options`` says the output format.
    """
    qdq = options is not None and options.output_format.name == "qdq"
    if crossed is None:
        # default values, but a Relu-folded output's zero point at its type's minimum (an int16
        # one is -32768; the default 0 was refused as a broken fold)
        folds = {
            qt.zero_point: np.asarray(qrange(qt.dtype)[0])
            for rec in quantizer.records
            if rec.relu_folded
            for qt in rec.outputs
        }
        probe = Requantizer(qdq_ops=quantizer.template_of().ops)
        probed = probe.requantize(quantizer.materialize(folds))
        crossed = probe.stats.crossed_ops
        if qdq and model is None:
            model = options.output_format.lower(probed, quantizer, {}, options, {})
    fused = qdq_int8_nodes(model, options.target.runtime == "tensorrt") if qdq and model else []
    decisions = list(quantizer.decisions.values())
    carried, between = set(crossed), set(fused)
    for d in decisions:
        if d.quantized:
            continue
        if d.node in carried:
            d.quantized, d.pattern = True, "requantize"
            d.reason = "carries int8 through (commutes with the affine map)"
        elif d.node in between:
            d.quantized, d.pattern = True, "int8 data"
            d.reason = (
                "runs on int8 data between DequantizeLinear and QuantizeLinear (the runtime "
                "fuses it)"
            )
    return decisions


def qdq_int8_nodes(model: onnx.ModelProto, fused_activations: bool = False) -> list[str]:
    """Float nodes of a QDQ model that the runtime runs on int8 data.

    A data-moving op (:data:`~onnxq.core.optable.CARRIERS`: MaxPool, Reshape, Flatten, ...) whose
    input comes from a DequantizeLinear and whose outputs all go to QuantizeLinear, directly
    or through more such ops: runtimes drop the Q/DQ around it and move int8 values. A Relu or
    Clip counts where the runtime folds it into the quantization: always with
    ``fused_activations`` (TensorRT fuses it into the layer before it, whose output it may then
    read in float), else where its QuantizeLinear's zero point is the type's minimum
    (onnxruntime then drops it).
    """
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output if o}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in g.output}

    def clamps_at_qmin(n: onnx.NodeProto) -> bool:
        qs = readers.get(n.output[0], [])
        if not qs or any(q.op_type != "QuantizeLinear" or len(q.input) < 3 for q in qs):
            return False
        for q in qs:
            zp = inits.get(q.input[2])
            if zp is None:
                return False
            z = tensor_array(zp)
            if not np.all(z == np.iinfo(z.dtype).min):
                return False
        return True

    def fusable(n: onnx.NodeProto) -> bool:
        if n.op_type in CARRIERS:
            return True
        return n.op_type in ("Relu", "Clip") and (fused_activations or clamps_at_qmin(n))

    @functools.cache
    def int8_in(t: str) -> bool:
        p = producer.get(t)
        if p is None:
            return False
        if p.op_type == "DequantizeLinear":
            return p.input[0] not in inits
        return fusable(p) and bool(p.input) and int8_in(p.input[0])

    @functools.cache
    def int8_out(t: str) -> bool:
        if t in outputs or not readers.get(t):
            return False
        return all(
            r.op_type == "QuantizeLinear" or (fusable(r) and all(int8_out(o) for o in r.output))
            for r in readers[t]
        )

    def int8_layer_output(t: str) -> bool:
        """``t`` is written by a layer that reads int8 data (TensorRT fuses what follows)."""
        p = producer.get(t)
        return p is not None and p.op_type in _LAYERS and bool(p.input) and int8_in(p.input[0])

    def reads_int8(n: onnx.NodeProto) -> bool:
        if int8_in(n.input[0]):
            return True
        return fused_activations and n.op_type in ("Relu", "Clip") and int8_layer_output(n.input[0])

    return [
        n.name
        for n in g.node
        if fusable(n) and n.input and reads_int8(n) and all(int8_out(o) for o in n.output)
    ]


#: the layers a runtime that fuses activations runs them with
_LAYERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


def widened_notes(widened: dict[str, int]) -> list[str]:
    """One note for the biases whose weight scale was widened to keep the int32 accumulator exact.

    One line whatever their number (EfficientNet-Lite1 has 36 such biases: a line each buried
    the summary); the report's ``widened_biases`` lists every bias and its channels.
    """
    if not widened:
        return []
    most = max(sorted(widened), key=lambda b: widened[b])
    where = (
        f"bias '{most}'"
        if len(widened) == 1
        else f"{len(widened)} biases, most in '{most}' ({widened[most]}); each in the report's "
        "widened_biases"
    )
    channels = sum(widened.values())
    return [
        f"the weight scale of {channels} channel(s) was widened ({where}) so that bias plus the "
        "worst-case sum of products fits the int32 accumulator (those channels are nearly "
        "constant, e.g. a BatchNormalization with gamma ≈ 0)"
    ]


def explain_constraints(decisions: list[Decision], solution: Any) -> None:
    """A Concat whose input is rescaled says so in its decision."""
    by_node = {d.node: d for d in decisions}
    for r in solution.rescales:
        d = by_node.get(r.node)
        if d is not None:
            extra = f"input '{r.tensor}' is rescaled (DQ→Q) to the shared scale: {r.reason}"
            d.reason = f"{d.reason}; {extra}" if d.reason else extra


def branch_decisions(quantizer: Quantizer, branches: list[Any]) -> list[Decision]:
    """The If, Loop and Scan nodes' decisions say what became of each body.

    The body nodes are listed too.
    """
    out: list[Decision] = []
    by_if: dict[str, list[str]] = {}
    loops: set[str] = set()
    for b in branches:
        if b.iterations:
            loops.add(b.node)
            line = (
                f"{b.branch}: {b.quantized} of {b.nodes} nodes int8 ({b.samples} batches, "
                f"{b.iterations:,} iterations)"
            )
        elif b.quantized:
            line = f"{b.branch}: {b.quantized} of {b.nodes} nodes int8 ({b.samples} batches)"
        else:
            line = f"{b.branch}: {b.reason}"
        by_if.setdefault(b.node, []).append(line)
        for d in b.decisions:
            out.append(replace(d, node=f"{b.node}/{b.branch}/{d.node}"))
    for name, lines in by_if.items():
        d = quantizer.decisions.get(name)
        if d is not None:
            d.quantized = any(b.quantized for b in branches if b.node == name)
            d.pattern = "branches" if d.quantized else d.pattern
            how = (
                "its body quantized as a graph of its own, calibrated on every iteration"
                if name in loops
                else "each branch quantized as its own graph"
            )
            d.reason = f"{how}; " + "; ".join(lines)
    return out


def fallback_line(fb: dict[str, Any]) -> str:
    """The accuracy-driven fallback in one line: what was chosen and what each count gave."""
    chosen = next(
        t
        for t in fb["trials"]
        if t["excluded"] == fb["chosen_excluded"] and t["int16"] == fb["chosen_int16"]
    )
    tried = ", ".join(
        f"{t['groups']}: {t['metric']:.3f} ({t['int8_ms']:.2f} ms)" for t in fb["trials"]
    )
    verdict = "met" if fb["met"] else "NOT met (the best model found is written)"
    wide = chosen["int16_groups"]
    returned = (
        f"{chosen['float_groups']} group(s) float"
        if fb["fallback"] == "float"
        else f"{wide} group(s) at int16 activations and {chosen['float_groups']} float"
    )
    return (
        f"fallback: {fb['metric']} fp32 {fb['fp32']:.3f}, int8 {chosen['metric']:.3f} with "
        f"{returned} (drop {chosen['drop']:.3f}, max {fb['max_drop']}: "
        f"{verdict}); {returned_label(fb['fallback'])} groups: metric (int8 ms per batch) "
        f"{tried}; fp32 {fb['fp32_ms']:.2f} ms"
    )
