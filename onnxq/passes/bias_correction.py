"""Bias correction: the mean output shift of the int8 layers, taken out of their biases.

Needs ``state.quantizer``, the solved ``state.values``, and either the calibration data again
(``sequential``, ``layerwise``) or ``state.calibrator`` holding the per-channel input means that
:func:`requests` asked the calibrate pass to collect (``fast``).

* ``fast`` removes the shift of the weights' rounding, ``E[ΔW·x]``, from the float inputs' means;
* ``layerwise`` streams the data once more through the float model and removes the shift of the
  int8 layer on its int8 input, ``E[Wq·x̂] − E[W·x]`` (x̂: the input on its solved grid), which
  also covers the input grid's clipping and rounding bias;
* ``sequential`` (the CNN default) runs the int8 model itself, layer after layer in graph order
  on the first :data:`SEQUENTIAL_SAMPLES` calibration samples, and sets each bias so that the
  layer's output mean per channel, on the input the int8 model with every earlier correction
  gives it, equals the float layer's: the errors of all earlier layers, not only this one's.

Sequential and layerwise need a data source that can be read again; otherwise they fall back to
fast and say so. Leaves ``state.constants`` (corrected float biases by name; materialize derives
the int32 biases from them) and ``state.bias_corrections`` (per bias: the largest shift removed,
in steps of the layer's output scale), which the report lists.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.calibrate.dataset import feed_samples, inner_shapes
from onnxq.calibrate.streaming import run_ahead, run_checked
from onnxq.core.errors import CalibrationError
from onnxq.core.qparams import QParams, dequantize, quantize
from onnxq.io.session import make_session
from onnxq.match.dfpattern import node_attr
from onnxq.passes.defaults import bias_mode as mode
from onnxq.passes.defaults import choosing
from onnxq.passes.manager import PassResult, State, record_read, release
from onnxq.solve.bias_correction import (
    SEQUENTIAL_SAMPLES,
    Layer,
    channel_means,
    expected_shift,
    input_axis,
    layerwise_shift,
    output_mean,
)


def _layers(q: Any) -> list[tuple[Any, Any, str, str, Any]]:
    """(record, bias derivation, kind, input tensor, float node) of every layer with a bias."""
    nodes = {n.name: n for n in q.float_graph.nodes}
    out = []
    for rec in q.records:
        node = nodes.get(rec.node)
        if rec.bias is None or node is None or len(rec.inputs) != 2:
            continue
        if node.op == "Gemm" and int(node_attr(node, "transA") or 0):
            continue  # the input's channels are its rows: not corrected
        kind = "conv" if node.op == "Conv" else "dense"
        out.append((rec, q.biases[rec.bias], kind, rec.inputs[0].tensor, node))
    return out


def active(state: State) -> bool:
    """Whether bias correction runs."""
    return mode(state) != "none"


def requests(state: State) -> dict[str, int]:
    """The inputs whose per-channel means the correction needs, with their channel axis."""
    if choosing(state):  # the fast correction is a candidate: it needs the means
        return {x: input_axis(kind) for _, _, kind, x, _ in _layers(state.quantizer)}
    if not active(state):
        return {}
    o = state.options
    if mode(state) == "sequential" and o.save_ranges is None and o.load_ranges is None:
        ds = state.dataset
        if ds is not None and ds.replayable:  # measured on the model itself, not from means
            return {}
    return {x: input_axis(kind) for _, _, kind, x, _ in _layers(state.quantizer)}


class BiasCorrection:
    """Subtract each layer's mean output shift from its float bias."""

    name = "bias-correction"

    def run(self, state: State) -> PassResult:
        """Correct every bias of a Conv/Gemm/MatMul layer (and of float layers on int8 inputs)."""
        if not active(state):
            return PassResult(f"off ({state.options.bias_correction}, {state.kind} model)")
        q, values = state.quantizer, state.values
        layers = _layers(q)
        how = mode(state)
        floats = _float_layers(state)
        grids = {x: (_grid(values, qt), input_axis(kind)) for _, kind, x, _, qt in floats}
        if how == "sequential" and _replayable(state):
            return _sequential(state, layers, floats)
        if how == "layerwise":
            for rec, _, kind, x, _ in layers:
                grids[x] = (_grid(values, rec.inputs[0]), input_axis(kind))
        quantized = _quantized_input_means(state, grids)
        fallback = how in ("layerwise", "sequential") and not quantized and bool(layers)
        float_done = _correct_float_layers(state, floats, quantized)
        for rec, b, kind, x, node in layers:
            mean = state.calibrator.channel_mean(x) if state.calibrator is not None else None
            layer_wise = how == "layerwise" and x in quantized
            if mean is None and not layer_wise:
                continue
            wq = rec.inputs[1]
            layer = Layer(
                kind,
                q.float_value(b.weight),
                QParams(values[wq.scale], values[wq.zero_point], wq.axis),
                group=int(node_attr(node, "group") or 1),
                transposed=node.op == "Gemm" and bool(int(node_attr(node, "transB") or 0)),
                rounded=state.constants.get(b.weight),
            )
            if layer_wise:
                shift = layerwise_shift(layer, *quantized[x])
            elif mean is not None:
                shift = expected_shift(layer, mean)
            bias = np.asarray(q.float_value(b.bias), np.float64).reshape(-1)
            state.constants[b.bias] = (bias - shift).astype(np.float32)
            out_scale = float(np.max(values[rec.outputs[0].scale]))
            state.bias_corrections[b.bias] = float(np.max(np.abs(shift))) / out_scale
        steps = list(state.bias_corrections.values())
        floats_note = (
            f"; {float_done} float layer(s) corrected for their int8 input's grid"
            if float_done
            else ""
        )
        if not steps:
            return PassResult(f"nothing to correct{floats_note}")
        done = how
        if fallback:
            done = "fast (the data cannot be read again)"
        elif how == "fast" and "bias-correction" in state.over_budget:
            done = f"fast (sequential left out: {state.over_budget['bias-correction']})"
        return PassResult(
            f"{len(steps)} biases corrected, {done} (largest shift {max(steps):.2f} output "
            f"steps, median {float(np.median(steps)):.2f}){floats_note}"
        )


def _replayable(state: State) -> bool:
    ds = state.dataset
    return ds is not None and ds.replayable


def _sequential(
    state: State, layers: list[tuple[Any, Any, str, str, Any]], floats: list[Any]
) -> PassResult:
    """Correct the biases one layer after another on the int8 model's own activations.

    Each layer's bias is set so that the mean of its output per channel, on the input the int8
    model with every earlier correction gives it, equals the float layer's on the float input
    (zero padding and clipping included: the means are measured, not derived from the weight).
    The int8 model is the emulation of this quantization (onnxq.simulate.emulate, every switch
    on: QDQ arithmetic in float; the biases float, since materialize sets their grids), run in
    pieces by onnxq.calibrate.sequential; the float means come from one float run on the same
    batches.
    """
    from onnxq.calibrate.sequential import run_in_order
    from onnxq.simulate.emulate import emulate

    q = state.quantizer
    float_nodes = {n.name: n for n in q.float_graph.nodes}
    # (bias name, its float value, quantized record or None, node name, kind)
    jobs: list[tuple[str, np.ndarray, Any, str, str]] = []
    for bias_name, rec, node, kind in _jobs(state, layers, floats):
        if bias_name in state.constants:
            value = state.constants[bias_name]
        else:  # a quantized layer's float bias, or a float layer's own
            value = q.float_value(bias_name) if rec is not None else node.inputs[2].values
        jobs.append((bias_name, np.asarray(value, np.float64).reshape(-1), rec, node.name, kind))
    if not jobs:
        return PassResult("nothing to correct")
    float_names = [float_nodes[j[3]].outputs[0].name for j in jobs]
    batches = _first_samples(state, SEQUENTIAL_SAMPLES)
    # the float layers' output sums for each batch as the data gives it, then per run: from
    # the calibrate stream where it gathered them all (one float pass fewer), else from a
    # float run of their own, before the emulation is built, so that the float session's
    # weights and the emulation's are never held at once (every layer's output exposed for
    # joined batches of 16 held 1.5 GB more on EfficientNet-Lite1)
    gathered = [state.output_sums.get(name) for name in float_names]
    state.output_sums = {}
    session = None
    if all(g is not None and g.covers(len(batches)) for g in gathered):
        per_batch = [g.first(len(batches)) for g in gathered if g is not None]
    else:
        axes = [input_axis(j[4]) for j in jobs]
        session = make_session(q.float_model, expose=float_names)
        per_batch = _output_sums(session, float_names, batches, axes)
        record_read(
            state,
            "bias-correction",
            len(batches),
            "the float layers' output means (not gathered while calibrating)",
        )
    runs, sizes = _merged(state, batches)
    if len(runs) < len(batches):
        if session is None:
            session = make_session(q.float_model, expose=float_names[:1])
        try:  # does the model run joined batches (some declare a dynamic one and do not)?
            run_checked(session, float_names[:1], runs[0], 0)
        except CalibrationError:
            runs, sizes = batches, [1] * len(batches)
    del session, batches  # the runs hold the inputs, joined or not (run_in_order lets them go)
    release(state)
    # every switch on: no float branches (materialize sets the biases' grids)
    emulation = emulate(state, int32_biases=False, float_branches=False)
    written = _written(emulation.model)
    kept = [k for k, j in enumerate(jobs) if j[3] in written]
    jobs, per_batch = [jobs[k] for k in kept], [per_batch[k] for k in kept]
    if not jobs:
        return PassResult("nothing to correct")
    targets = [(written[j[3]], input_axis(j[4])) for j in jobs]
    # the weights as arrays beside a weightless graph, each let go of after its last piece
    # (a protobuf message holds every tensor it ever held until it is freed whole)
    graph, weights = emulation.resolved_apart()
    del emulation  # its graph still holds the weights it replaced while building
    release(state)
    float_sums = [_grouped(sums, sizes) for sums in per_batch]
    skipped: list[str] = []

    def correct(k: int, sums: np.ndarray, count: int, used: int) -> np.ndarray | None:
        bias_name, bias, rec, node_name, _ = jobs[k]
        f_sum = sum(s for s, _ in float_sums[k][:used])
        f_count = sum(n for _, n in float_sums[k][:used])
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite: skipped below
            shift = np.asarray(f_sum, np.float64) / max(f_count, 1) - sums / max(count, 1)
        if shift.shape != bias.shape or not np.all(np.isfinite(shift)):
            skipped.append(node_name)
            return None
        state.constants[bias_name] = (bias + shift).astype(np.float32)
        if rec is not None:
            out_scale = float(np.max(state.values[rec.outputs[0].scale]))
            state.bias_corrections[bias_name] = float(np.max(np.abs(shift))) / out_scale
        return shift

    counts = [feed_samples(b) for b in runs]
    used = run_in_order(graph, targets, runs, correct, weights=weights, let_go=True)
    del graph, weights
    record_read(
        state,
        "bias-correction",
        sum(sizes[:used]),
        "the int8 model run layer by layer: each bias is set on the outputs of the layers "
        "corrected before it",
    )
    samples = sum(counts[:used])
    steps = list(state.bias_corrections.values())
    floats_done = sum(1 for j in jobs if j[2] is None and j[3] not in skipped)
    text = (
        f"{len(steps)} biases corrected, sequential on {samples} samples"
        + (
            f" (largest shift {max(steps):.2f} output steps, median {float(np.median(steps)):.2f})"
            if steps
            else ""
        )
        + (f"; {floats_done} float layer(s) corrected for their int8 input" if floats_done else "")
        + (
            f"; {len(skipped)} left as they were ({skipped[0]}...: no per-channel mean)"
            if skipped
            else ""
        )
    )
    return PassResult(text)


def _jobs(
    state: State, layers: list[tuple[Any, Any, str, str, Any]], floats: list[Any]
) -> list[tuple[str, Any, Any, str]]:
    """(bias name, quantized record or None, float node, kind) of every layer to correct.

    The layers with a bias, then the float layers on int8 inputs; those of the float graph.
    """
    float_nodes = {n.name for n in state.quantizer.float_graph.nodes}
    out = [(b.bias, rec, node, kind) for rec, b, kind, _, node in layers]
    out += [(bias, None, node, kind) for node, kind, _, bias, _ in floats]
    return [j for j in out if j[2].name in float_nodes]


class BatchSums:
    """A float layer output's per-channel sums on each of the first batches, as they stream.

    A tap of the calibrate pass (``observe(array, index=, block=)``, ``merge``): the sequential
    correction compares its layers with these instead of running the float model again. Keeps
    the first :data:`SEQUENTIAL_SAMPLES` batches (each holds a sample at least); a batch the
    stream skipped (NaN or Inf in the tensor) leaves a gap, and the correction runs the float
    model itself.
    """

    def __init__(self, axis: int):
        self.axis = axis
        self.sums: dict[int, tuple[np.ndarray, int]] = {}

    def observe(self, x: np.ndarray, index: int | None = None, block: int | None = None) -> None:
        """Keep batch ``index``'s channel sums (the next batch by default)."""
        index = len(self.sums) if index is None else index
        if index < SEQUENTIAL_SAMPLES:
            self.sums[index] = channel_means(np.asarray(x), self.axis)

    def merge(self, other: BatchSums) -> None:
        """Take another shard's batches."""
        self.sums.update(other.sums)

    def covers(self, batches: int) -> bool:
        """Whether the first ``batches`` batches are all here."""
        return all(i in self.sums for i in range(batches))

    def first(self, batches: int) -> list[tuple[np.ndarray, int]]:
        """The sums of the first ``batches`` batches, in order."""
        return [self.sums[i] for i in range(batches)]


def taps(state: State) -> dict[str, list[BatchSums]]:
    """Ask the calibrate pass for the float outputs the sequential correction compares with."""
    state.output_sums = {}
    if mode(state) != "sequential" or not _replayable(state) or state.options.load_ranges:
        return {}
    out: dict[str, list[BatchSums]] = {}
    for _, _, node, kind in _jobs(state, _layers(state.quantizer), _float_layers(state)):
        tensor = node.outputs[0].name
        if tensor not in state.output_sums:
            state.output_sums[tensor] = BatchSums(input_axis(kind))
            out[tensor] = [state.output_sums[tensor]]
    return out


def _written(model: Any) -> dict[str, str]:
    """Node name -> the tensor it writes in the emulation (a switched node's If's output).

    A function of its own: a node left bound to a loop variable would keep the whole model
    alive (a protobuf message lives as long as any part of it is referenced).
    """
    written = {n.name: n.output[0] for n in model.graph.node if n.output}
    for n in model.graph.node:
        if n.op_type == "If" and n.name.endswith("/If"):
            written[n.name[: -len("/If")]] = n.output[0]
    return written


def _output_sums(
    session: Any, names: list[str], batches: list[dict[str, Any]], axes: list[int]
) -> list[list[tuple[np.ndarray, int]]]:
    """Per output, per batch: its channel sums and how many values each holds."""
    sums: list[list[tuple[np.ndarray, int]]] = [[] for _ in names]
    for _, outs in run_ahead(session, names, batches):
        for k, (axis, arr) in enumerate(zip(axes, outs, strict=True)):
            sums[k].append(channel_means(np.asarray(arr), axis))
    return sums


#: samples per run when the sequential correction joins batches of a dynamic batch dimension
JOINED_BATCH = 4


def _grouped(sums: list[tuple[np.ndarray, int]], sizes: list[int]) -> list[tuple[np.ndarray, int]]:
    """Per-batch (sums, count) added up over consecutive groups of ``sizes`` batches."""
    out = []
    start = 0
    for size in sizes:
        part = sums[start : start + size]
        out.append((np.sum([s for s, _ in part], axis=0), sum(n for _, n in part)))
        start += size
    return out


def _merged(state: State, batches: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """Consecutive batches of the same shapes joined into runs of up to JOINED_BATCH samples.

    Returns the runs and how many batches each joins. Calibration feeds one sample at a time
    when the batch dimension is dynamic (so that the statistics of AverageMax are per sample);
    the sequential correction only sums, and a run per sample and piece was most of its time
    (MobileNetV2: 7,040 runs). Joined by 4, not more: on EfficientNet-Lite1 runs of 16 took as
    long and peaked 0.7 GB higher. Batches are left as they are unless every input declares a
    symbolic first dimension and every input of a feed has the same first one (a recurrent
    state whose batch is its second axis does not).
    """
    specs = state.dataset.inputs or []
    if not specs or any(not s.shape or s.shape[0] is not None for s in specs):
        return batches, [1] * len(batches)  # a fixed or undeclared batch dimension

    sizes: list[int] = []
    out: list[dict[str, Any]] = []
    group: list[dict[str, Any]] = []
    for feed in [*batches, None]:
        if group and (
            feed is None
            or inner_shapes(feed) != inner_shapes(group[0])
            or sum(feed_samples(g) for g in group) + feed_samples(feed) > JOINED_BATCH
        ):
            leading = {np.shape(v)[0] for v in group[0].values() if np.ndim(v)}
            if (
                len(group) == 1
                or len(leading) != 1
                or any(np.ndim(v) == 0 for v in group[0].values())
            ):
                out += group
                sizes += [1] * len(group)
            else:
                out.append({k: np.concatenate([g[k] for g in group]) for k in group[0]})
                sizes.append(len(group))
            group = []
        if feed is not None:
            group.append(feed)
    return out, sizes


def _first_samples(state: State, limit: int) -> list[dict[str, Any]]:
    """The first batches of the calibration data, ``limit`` samples at most (one batch at least)."""
    ds = state.dataset
    ds.reset()
    out: list[dict[str, Any]] = []
    seen = 0
    for feed in ds.batches():
        out.append(dict(feed))
        seen += feed_samples(feed)
        if seen >= limit:
            break
    ds.reset()
    return out


def _grid(values: dict[str, Any], qt: Any) -> QParams:
    return QParams(values[qt.scale], values[qt.zero_point])


def _float_layers(state: State) -> list[tuple[Any, str, str, str, Any]]:
    """Every Conv/Gemm left float that reads a tensor the int8 model quantizes.

    As (float node, kind, input tensor, bias initializer, the input's QTensor); only layers with
    a constant weight and bias.
    """
    q = state.quantizer
    grouped = {n for rec in q.records for n in rec.nodes}
    grids: dict[str, Any] = {}
    for rec in q.records:
        for qt in [*rec.inputs, *rec.outputs]:
            if qt.role == "activation":
                grids.setdefault(qt.tensor, qt)
    out = []
    for node in q.float_graph.nodes:
        if node.name in grouped or node.op not in ("Conv", "Gemm") or len(node.inputs) < 3:
            continue
        if node.op == "Gemm" and int(node_attr(node, "transA") or 0):
            continue
        x, w, b = node.inputs[0], node.inputs[1], node.inputs[2]
        if x.name not in grids or not isinstance(w, gs.Constant) or not isinstance(b, gs.Constant):
            continue
        out_channels = w.shape[0] if node.op == "Conv" else None
        if node.op == "Gemm":
            out_channels = w.shape[0] if int(node_attr(node, "transB") or 0) else w.shape[1]
        if len(b.outputs) != 1 or int(np.prod(b.shape)) != out_channels:
            continue  # a shared or broadcast bias: left as it is
        kind = "conv" if node.op == "Conv" else "dense"
        out.append((node, kind, x.name, b.name, grids[x.name]))
    return out


def _correct_float_layers(
    state: State, layers: list[tuple[Any, str, str, str, Any]], means: dict[str, Any]
) -> int:
    """Subtract from each float layer's bias the shift its int8 input's grid causes."""
    done = 0
    for node, kind, x, bias_name, _ in layers:
        if x not in means:
            continue
        mean, quantized_mean = means[x]
        w = np.asarray(node.inputs[1].values)
        geometry = (
            int(node_attr(node, "group") or 1),
            node.op == "Gemm" and bool(int(node_attr(node, "transB") or 0)),
        )
        shift = output_mean(kind, w, quantized_mean, *geometry) - output_mean(
            kind, w, mean, *geometry
        )
        bias = np.asarray(node.inputs[2].values, np.float64)
        state.constants[bias_name] = (bias - shift.reshape(bias.shape)).astype(np.float32)
        done += 1
    return done


def _quantized_input_means(
    state: State, grids: dict[str, tuple[QParams, int]]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Input tensor -> (float channel means, channel means on its int8 grid), one more stream.

    ``grids``: tensor -> (its quantization, its channel axis). Empty when the data cannot be
    streamed again (a one-shot source, or ranges loaded).
    """
    ds = state.dataset
    if ds is None or not ds.replayable or not grids:
        return {}
    names = sorted(grids)
    sums: dict[str, list[Any]] = {}
    ds.reset()
    session = make_session(state.quantizer.float_model, expose=names)
    read = 0
    for feed in ds.batches():
        read += 1
        for x, arr in zip(names, session.run(names, feed), strict=True):
            arr = np.asarray(arr)
            qp, axis = grids[x]
            if arr.ndim <= (axis % max(arr.ndim, 1)) or not np.all(np.isfinite(arr)):
                continue
            f_sum, count = channel_means(arr, axis)
            q_sum, _ = channel_means(dequantize(quantize(arr, qp), qp), axis)
            acc = sums.setdefault(x, [0.0, 0.0, 0])
            acc[0], acc[1], acc[2] = acc[0] + f_sum, acc[1] + q_sum, acc[2] + count
    ds.reset()
    record_read(
        state,
        "bias-correction",
        read,
        "the layers' inputs on their solved int8 grids, known only after calibration",
    )
    return {x: (f / max(n, 1), q / max(n, 1)) for x, (f, q, n) in sums.items()}
