"""Cross-runtime check: does the target runtime compute what the fake-quantized model does.

The reference is the emulation of the quantization with every quantizer on
(onnxq.simulate.emulate: the float graph with Q/DQ on every quantized edge, run by onnxruntime in
float). The quantized model runs in its target's runtime: onnxruntime for the QOperator and QDQ
formats (ort-cpu, generic), OpenVINO for FakeQuantize (openvino). For ``tensorrt`` no GPU is
assumed: its QDQ model runs in onnxruntime, whose QDQ fusion is the nearest CPU stand-in for
TensorRT's, and the result says so.

Two comparisons, per output and per layer (every float tensor of the float graph the target
exposes under the same name: a tensor name, or a quantized op's ``<tensor>_scale``):

* **drift**: both models run end to end; the agreement of target and reference per tensor, as
  an SQNR. Integer kernels and the float emulation round an occasional value differently and a
  deep network carries those steps forward (on MobileNetV2 the agreement falls from 88 dB after
  the first layer to about 21 dB at the output), and an exponential op amplifies them (a
  Softmax whose input logits moved by one step moves its large outputs by many). Drift says how
  far the runtimes end apart, not where one of them is wrong;
* **local**: the reference run again with every tensor it shares with the target replaced by
  the target's own values, so each layer of the reference computes from exactly the inputs the
  target's layer had. A faithful kernel then lands within a step of its int8 grid of
  the reference (onnxruntime's integer Softmax on ViT: 0.06 steps RMS); a conversion or kernel
  fault does not. The first layer in graph order more than :data:`PART_STEPS` steps (RMS) from
  the reference is where the runtimes part.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxq.calibrate.dataset import feed_samples, model_inputs, shared_batch
from onnxq.calibrate.sources import as_dataset
from onnxq.io.graph import serialize, tensor_array
from onnxq.lower.fakequantize import holds_fakequantize
from onnxq.simulate.compare import TensorStats, compare, dequantized, link_inputs, tensor_plan
from onnxq.simulate.emulate import FLAGS, Emulation, held_float

#: the RMS distance, in steps of a tensor's int8 grid, beyond which a layer parts
PART_STEPS = 1.0
#: batches the local comparison runs on
LOCAL_BATCHES = 4


@dataclass
class Layer:
    """One compared tensor: target against the fake-quantized reference."""

    node: str
    tensor: str
    #: drift: SQNR of target against reference, both run end to end
    agreement_db: float
    #: the drift's agreement lost against the layer's inputs' (both capped at 60 dB)
    drop_db: float
    #: local: RMS distance in int8 steps when both computed from the target's inputs
    #: (nan: not a quantized tensor the target exposes)
    steps: float = math.nan


@dataclass
class CrossCheck:
    """Target runtime against the fake-quantized reference and fp32."""

    runtime: str
    #: per output: (name, SQNR target vs reference, target vs fp32, reference vs fp32)
    outputs: list[tuple[str, float, float, float]]
    #: per layer in graph order
    layers: list[Layer]
    #: the first layer more than PART_STEPS from the reference on the same inputs, or None
    first_part: Layer | None
    notes: list[str] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        """No layer parts."""
        return self.first_part is None

    def summary(self) -> str:
        """A few lines for the terminal."""
        lines = [
            f"cross-runtime check ({self.runtime} vs the fake-quantized model in onnxruntime):"
        ]
        for name, tr, tf, rf in self.outputs:
            lines.append(
                f"  output {name}: target vs fake-quantized {_fmt(tr)} dB; vs fp32 {_fmt(tf)} dB "
                f"(fake-quantized vs fp32 {_fmt(rf)} dB)"
            )
        local = [x for x in self.layers if not math.isnan(x.steps)]
        if self.first_part is not None:
            f = self.first_part
            lines.append(
                f"  the runtimes part first at {f.node} (tensor {f.tensor}): computed from the "
                f"same inputs, the target is {f.steps:.1f} int8 steps (RMS) from the "
                "fake-quantized model; check its conversion and kernel"
            )
        else:
            worst = max((x.steps for x in local), default=0.0)
            lines.append(
                f"  {len(self.layers)} layers compared ({len(local)} fed the same inputs): the "
                f"runtimes agree on every one (at most {worst:.2f} int8 steps apart, RMS; "
                f"{PART_STEPS:g} would count as a difference)"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "runtime": self.runtime,
            "part_steps": PART_STEPS,
            "agrees": self.agrees,
            "outputs": [
                {"name": n, "vs_reference_db": a, "vs_fp32_db": b, "reference_vs_fp32_db": c}
                for n, a, b, c in self.outputs
            ],
            "layers": [asdict(layer) for layer in self.layers],
            "first_part": None if self.first_part is None else asdict(self.first_part),
            "notes": self.notes,
        }


def _fmt(v: float) -> str:
    return "inf" if math.isinf(v) and v > 0 else f"{v:.2f}"


#: samples a feed holds at most here: every shared tensor of both models and the target is
#: handed out per run (magika's batches of 128 files held 3.3 GB at once)
PART_SAMPLES = 8


def split_feeds(feeds: Sequence[dict[str, np.ndarray]], size: int) -> list[dict[str, np.ndarray]]:
    """Each feed cut into parts of at most ``size`` samples along its shared batch axis.

    A feed whose inputs share no batch axis (an LSTM state beside its input) stays whole.
    """
    out = []
    for feed in feeds:
        n = feed_samples(feed)
        if not shared_batch(feed) or n <= size:
            out.append(dict(feed))
            continue
        out += [{k: v[i : i + size] for k, v in feed.items()} for i in range(0, n, size)]
    return out


def cross_check(
    emulation: Emulation,
    float_model: onnx.ModelProto,
    target: onnx.ModelProto,
    feeds: Sequence[dict[str, np.ndarray]],
    target_name: str = "",
) -> CrossCheck:
    """Compare ``target`` (in its runtime) with the fake-quantized ``emulation`` and fp32.

    ``float_model``: the float graph the emulation was made from (its tensor names are the
    layers).
    """
    from onnxq.io.session import make_session, output_types

    notes = []
    openvino = holds_fakequantize(target)
    runtime = "openvino" if openvino else "onnxruntime"
    if target_name == "tensorrt":
        notes.append(
            "TensorRT is not run (no GPU assumed): its QDQ model runs in onnxruntime, whose "
            "Q/DQ fusion stands in for TensorRT's; layer placement specific to TensorRT is not "
            "emulated"
        )
    feeds = split_feeds(feeds, PART_SAMPLES)
    reference = emulation.fixed()
    names = [o.name for o in float_model.graph.output]
    fp32 = make_session(float_model)
    ref = make_session(reference)
    # every float tensor of the float graph both models hold (not the graph outputs)
    written = {o for n in reference.graph.node for o in n.output}
    try:
        types = output_types(onnx.shape_inference.infer_shapes(float_model))
    except Exception:  # shape inference is best effort: untyped tensors are not shared
        types = output_types(float_model)
    shared = [
        o
        for n in float_model.graph.node
        for o in n.output
        if o in written and o not in names and types.get(o) == onnx.TensorProto.FLOAT
    ]
    read = _openvino_reader(target, shared) if openvino else _onnxruntime_reader(target, shared)
    stats: dict[str, list[TensorStats]] = {
        n: [TensorStats(n, True, 0) for _ in range(3)] for n in names
    }
    for feed in feeds:
        f = fp32.run(names, feed)
        r = ref.run(names, feed)
        t = read(feed, names)
        for i, n in enumerate(names):
            if not np.issubdtype(np.asarray(f[i]).dtype, np.floating):
                continue
            stats[n][0].add(np.asarray(r[i]), np.asarray(t[n]))
            stats[n][1].add(np.asarray(f[i]), np.asarray(t[n]))
            stats[n][2].add(np.asarray(f[i]), np.asarray(r[i]))
    outputs = [(n, *(s.sqnr_db for s in stats[n])) for n in names if stats[n][0].count]
    if openvino:
        compared = _openvino_layers(float_model, reference, read, feeds)
    else:
        comparison = compare(reference, target, as_dataset(list(feeds), model_inputs(float_model)))
        # the reference's graph hides what its If nodes read: link through the float graph
        link_inputs(float_model, {s.name: s for s in [*comparison.outputs, *comparison.layers]})
        producers = {o: n.name for n in float_model.graph.node for o in n.output}
        compared = [
            (producers.get(s.name, s.node), s)
            for s in sorted(comparison.layers, key=lambda s: s.order)
        ]
    local = _local(reference, read, shared, emulation, feeds[:LOCAL_BATCHES])
    layers = [
        Layer(node, s.name, s.sqnr_db, s.drop_db, local.get(s.name, math.nan))
        for node, s in compared
        if not s.name.startswith(FLAGS)
    ]
    first = next((x for x in layers if x.steps > PART_STEPS), None)
    return CrossCheck(runtime, outputs, layers, first, notes)


Reader = Any  # (feed, tensor names) -> {name: float values}, with .available


def _onnxruntime_reader(target: onnx.ModelProto, tensors: Sequence[str]) -> Reader:
    """The target's outputs and its (dequantized) values of ``tensors``.

    A tensor the target quantizes for its int8 readers and holds in float for the others
    (onnxq.simulate.emulate.held_float) is read in float: fed to the reference, its float readers
    read what the target's read, and its quantizer gives the int8 readers theirs.
    """
    from onnxq.io.session import make_session

    inits = {i.name: tensor_array(i) for i in target.graph.initializer}
    plan = tensor_plan(list(tensors), target, inits)
    plan.update({t: (t, None, "") for t in held_float(target) if t in plan})
    outputs = [o.name for o in target.graph.output]
    fetch = sorted({v[0] for v in plan.values()} - set(outputs))
    session = make_session(target, expose=fetch)

    def read(feed: dict[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
        values = dict(zip(outputs + fetch, session.run(outputs + fetch, feed), strict=True))
        got = {n: np.asarray(values[n]) for n in names if n in values}
        got.update(dequantized(plan, inits, values))
        return got

    read.available = set(plan)  # type: ignore[attr-defined]
    # tensors whose value is read on an integer grid (a quantized op's output, a Q's output)
    read.quantized = {n for n, (_, scale, _) in plan.items() if scale}  # type: ignore[attr-defined]
    return read


def _openvino_reader(model: onnx.ModelProto, extra: Sequence[str]) -> Reader:
    """The FakeQuantize model in OpenVINO, with ``extra`` tensors added as outputs."""
    import openvino as ov

    from onnxq.io.openvino import openvino_compile

    core = ov.Core()
    ov_model = core.read_model(serialize(model))
    for name in extra:
        try:
            ov_model.add_outputs([name])
        except Exception:  # a tensor OpenVINO folded away or renamed is not compared
            continue
    compiled = openvino_compile(ov_model)
    by_name = {n: out for out in compiled.outputs for n in out.get_names()}

    def read(feed: dict[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
        result = compiled(feed)
        return {n: np.asarray(result[by_name[n]]) for n in names if n in by_name}

    read.available = set(by_name)  # type: ignore[attr-defined]
    return read


def _local(
    reference: onnx.ModelProto,
    read: Reader,
    shared: Sequence[str],
    emulation: Emulation,
    feeds: Sequence[dict[str, np.ndarray]],
) -> dict[str, float]:
    """Per quantized tensor: RMS steps between target and reference on the same inputs.

    Every tensor the target exposes becomes an input of the reference, fed with the target's
    values (quantized or not, so that each layer reads what the target's layer read); the node
    that wrote it writes ``<tensor>/computed`` instead, which is compared where the tensor is
    on an int8 grid. Where the target's value is the quantized one (a float op's output that a
    QuantizeLinear reads is taken at that Q's output) the computed value is put on the
    reference's grid first: a float op computes it exactly, and the rounding and clipping of
    the grid are no fault of the runtime.
    """
    from onnxq.io.session import make_session

    steps = emulation.steps()
    on_grid: set[str] = getattr(read, "quantized", set())
    forced = [t for t in shared if t in read.available]
    measured = [t for t in forced if t in steps]
    if not measured:
        return {}
    model = onnx.ModelProto()
    model.CopyFrom(reference)
    graph = model.graph
    wanted = set(forced)
    for node in graph.node:
        for j, out in enumerate(node.output):
            if out in wanted:
                node.output[j] = f"{out}/computed"
    keep = [v for v in graph.value_info if v.name not in wanted]
    del graph.value_info[:]
    graph.value_info.extend(keep)
    graph.input.extend(
        helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in forced
    )
    computed = [f"{t}/computed" for t in measured]
    session = make_session(model, expose=computed)
    sums = dict.fromkeys(measured, 0.0)
    counts = dict.fromkeys(measured, 0)
    for feed in feeds:
        target = read(feed, forced)
        inputs = {**feed, **{t: np.asarray(target[t], np.float32) for t in forced}}
        for t, value in zip(measured, session.run(computed, inputs), strict=True):
            if t in on_grid:
                value = emulation.on_grid(t, value)
            diff = (np.asarray(value, np.float64) - target[t]) / steps[t]
            sums[t] += float(np.sum(diff * diff))
            counts[t] += diff.size
    return {t: math.sqrt(sums[t] / counts[t]) for t in measured if counts[t]}


def _openvino_layers(
    float_model: onnx.ModelProto,
    reference: onnx.ModelProto,
    read: Reader,
    feeds: Sequence[dict[str, np.ndarray]],
) -> list[tuple[str, TensorStats]]:
    """Drift per layer for a FakeQuantize model: OpenVINO's tensors against onnxruntime's."""
    from onnxq.io.session import make_session

    producers = {o: n for n in float_model.graph.node for o in n.output}
    outputs = {o.name for o in float_model.graph.output}
    available = [t for t in producers if t not in outputs and t in read.available]
    ref = make_session(reference, expose=available)
    stats = {t: TensorStats(t, False, i) for i, t in enumerate(available)}
    for feed in feeds:
        r = ref.run(available, feed)
        t = read(feed, available)
        for name, a in zip(available, r, strict=True):
            b = t[name]
            if np.issubdtype(np.asarray(a).dtype, np.floating) and np.shape(a) == np.shape(b):
                stats[name].add(np.asarray(a), np.asarray(b))
    link_inputs(float_model, stats)
    return [(producers[n].name or n, s) for n, s in stats.items() if s.count]
