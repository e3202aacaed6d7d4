"""The pass manager: one state, a list of named passes, a record of what each did.

A pass is a small object with a ``name`` and a ``run(state) -> PassResult``; it reads what
earlier passes left on the :class:`State` and leaves what it guarantees (its docstring says
both). :func:`run_passes` runs them in order, times each and keeps a :class:`PassRecord`, which
the report lists (``--report`` JSON and the summary).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import onnx

from onnxq.io.graph import export_model
from onnxq.io.progress import progress
from onnxq.io.session import free_memory, release_shared_arena, trim_heap
from onnxq.options import QuantizeOptions

#: calibration batches the accuracy check after quantizing runs (their fp32 outputs are kept)
CHECK_BATCHES = 4


@dataclass(frozen=True)
class PassResult:
    """What a pass did, in a few words for the report ("" when it changed nothing)."""

    changed: str = ""


@dataclass(frozen=True)
class PassRecord:
    """One pass as it ran: its name, its wall time and what it changed."""

    name: str
    seconds: float
    changed: str


class Pass(Protocol):
    """A named step over the :class:`State`."""

    name: str

    def run(self, state: State) -> PassResult:
        """Do the step; leave its results on ``state``."""
        ...


@dataclass
class State:
    """What the passes of one ``quantize`` call share.

    Fields start empty and are filled in pipeline order: ``float_model`` by loading, the
    ``quantizer`` (the annotated template) by annotation, ``values`` by calibration and solving,
    ``model`` by materialisation and then each post pass and the lowering.
    """

    options: QuantizeOptions
    #: the model as the caller gave it (a path or a ModelProto; never modified)
    source: Any
    #: the calibration data as the caller gave it
    data: Any = None
    #: the float model to annotate (opset raised where the output needs it); empty until loaded
    float_model: onnx.ModelProto = field(default_factory=onnx.ModelProto)
    #: the preprocessed ``float_model`` as a graph (onnxq.passes.prepare); None when a float
    #: rewrite changed the model since
    float_graph: Any = None
    quantizer: Any = None
    dataset: Any = None
    calibrator: Any = None
    #: placeholder name -> value (scales, zero points), after solving
    values: dict[str, Any] = field(default_factory=dict)
    #: float constants an algorithm replaced (name -> value): corrected biases, rounded
    #: weights; materialize and the lowering use them instead of the model's
    constants: dict[str, Any] = field(default_factory=dict)
    #: bias correction: bias name -> the largest shift it removed, in output steps
    bias_corrections: dict[str, float] = field(default_factory=dict)
    #: the model's kind (onnxq.prepare.kind) and why, set by loading
    kind: str = ""
    kind_reason: str = ""
    #: optimized rounding: layer -> errors before and after, or why it was skipped
    rounding: dict[str, Any] = field(default_factory=dict)
    #: optimized rounding's layer input Hessians while calibration streams (node -> layer, obs)
    hessians: dict[str, Any] = field(default_factory=dict)
    #: the sequential bias correction's float output sums per batch, gathered while calibration
    #: streams (tensor -> onnxq.passes.bias_correction.BatchSums)
    output_sums: dict[str, Any] = field(default_factory=dict)
    #: cross-layer equalization: "first → second" Conv -> activation, range spreads, absorbed
    equalization: dict[str, Any] = field(default_factory=dict)
    #: depthwise scaling: convolution -> its input, where the factors went, spreads, gain
    depthwise_scaling: dict[str, Any] = field(default_factory=dict)
    #: SmoothQuant: input tensor -> alpha, readers, errors, where 1/s went
    smoothing: dict[str, Any] = field(default_factory=dict)
    #: nodes an earlier pass added that stay float, with the reason (SmoothQuant's 1/s Mul)
    float_nodes: dict[str, str] = field(default_factory=dict)
    #: nodes an earlier pass wrote in place of one of the caller's (equalization's Relu and
    #: Min for a Clip) -> that node: the name ``--exclude`` and ``--config`` entries take
    derived: dict[str, str] = field(default_factory=dict)
    #: int8 MatMul/Gemm nodes that write float (onnxq.post.float_outputs)
    float_outputs: list[str] = field(default_factory=list)
    #: the budget pass (budget set): algorithm -> why it is left out, and the plan it made
    over_budget: dict[str, str] = field(default_factory=dict)
    budget: dict[str, Any] = field(default_factory=dict)
    solution: Any = None
    #: the held-back batches of the recipe choice with the float model's outputs on them
    #: (feed, {output: array}); the check after quantizing runs on them
    held_back: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    #: the recipe chosen on held-back batches (onnxq.passes.choose): every candidate with its
    #: score, the one chosen and why; or {"skipped": why not}
    choice: dict[str, Any] = field(default_factory=dict)
    #: the model being produced; empty until materialized (then see :meth:`proto`)
    model: onnx.ModelProto = field(default_factory=onnx.ModelProto)
    #: the model being produced as a graph, from materialize through the passes that edit it
    #: (requantize, share-scales, float-outputs, lower's GELU fusion); None once :meth:`proto`
    #: has exported it
    graph: Any = None
    requantize_stats: Any = None
    #: the If branches' results (onnxq.post.subgraphs.BranchResult)
    branches: list[Any] = field(default_factory=list)
    #: onnxruntime session of the output built by verification (reused by the checks)
    session: Any = None
    #: warnings of the checks after quantizing, and the latency figures
    check_warnings: list[str] = field(default_factory=list)
    latency: dict[str, float] = field(default_factory=dict)
    #: what whole-model int4 weight-only quantization did (onnxq.post.weight_only)
    weight_only: Any = None
    records: list[PassRecord] = field(default_factory=list)
    #: every read of the calibration data, in order: the pass, the batches it read and what
    #: for (:func:`record_read`); the report lists them
    data_reads: list[dict[str, Any]] = field(default_factory=list)

    def fork(self) -> State:
        """A shallow copy whose lists and dicts are its own (passes append to and fill them)."""
        forked = copy.copy(self)
        for f in fields(State):
            value = getattr(forked, f.name)
            if isinstance(value, list | dict):
                setattr(forked, f.name, copy.copy(value))
        return forked

    def proto(self) -> onnx.ModelProto:
        """The model being produced as a ModelProto: the graph exported, once, if it is one.

        The passes from materialize on edit one graph; the first that needs a ModelProto (a
        lowering, the checks) calls this, and the graph is let go of.
        """
        if self.graph is not None:
            self.model = export_model(self.graph, self.quantizer.template)
            self.graph = None
        return self.model


def record_read(state: State, reader: str, batches: int, why: str) -> None:
    """Note that ``reader`` read ``batches`` calibration batches, and ``why`` it needed them."""
    state.data_reads.append({"pass": reader, "batches": batches, "why": why})


def graph_histogram(graph: Any) -> dict[str, int]:
    """Count of each op type in a graphsurgeon graph's main graph (:func:`op_histogram`)."""
    return dict(sorted(Counter(n.op for n in graph.nodes).items()))


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """Count of each op type in the main graph."""
    return dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


def op_changes(before: dict[str, int], after: dict[str, int]) -> str:
    """``+3 QLinearConv, -3 Conv`` between two op histograms ('' when equal)."""
    parts = []
    for op in sorted(set(before) | set(after)):
        d = after.get(op, 0) - before.get(op, 0)
        if d:
            parts.append(f"{d:+d} {op}")
    return ", ".join(parts)


def release(state: State) -> None:
    """Hand the memory a pass let go of back to the system, for a large model.

    Measured on the model that holds the weights: the annotated float model once there is one
    (``state.float_model`` is then a weightless skeleton, and a light graph's weights appear
    only when preprocessing folds them).
    """
    q = state.quantizer
    free_memory(q.float_model if q is not None else state.float_model)


def _name(p: Pass) -> str:
    return p.name


def run_passes(state: State, passes: Sequence[Pass]) -> State:
    """Run ``passes`` in order over ``state``; each leaves a PassRecord in ``state.records``.

    A bar names the pass under way (after two seconds, on a terminal: onnxq.io.progress).
    """
    steps = progress(passes, len(passes), "quantizing", state.options.progress, "step", _name)
    return run_nested(state, steps)


def run_nested(state: State, passes: Iterable[Pass]) -> State:
    """Run ``passes`` in order over ``state``, each recorded, without a bar of their own.

    For a pass that runs others (onnxq.passes.depthwise_scaling.DepthwiseTrial).
    """
    for p in passes:
        start, before = time.perf_counter(), len(state.records)
        result = p.run(state)
        release_shared_arena()
        trim_heap()  # the next pass starts from what is in use, not from this one's peak
        # a pass that runs others (onnxq.passes.choose) records them: its own time is the rest
        nested = sum(r.seconds for r in state.records[before:])
        seconds = time.perf_counter() - start - nested
        state.records.append(PassRecord(p.name, seconds, result.changed))
    return state
