"""Cross-runtime check: does the target runtime compute what the fake-quantized model does.

The reference is the emulation of the quantization with every quantizer on
(onnxq.tools.emulate: the float graph with Q/DQ on every quantized edge, run by onnxruntime in
float). The quantized model runs in its target's runtime: onnxruntime for the QOperator and QDQ
formats (ort-cpu, generic), OpenVINO for FakeQuantize (openvino). For ``tensorrt`` no GPU is
assumed: its QDQ model runs in onnxruntime, whose QDQ fusion is the nearest CPU stand-in for
TensorRT's, and the result says so.

Per output and per layer (every float tensor of the float graph the target model exposes under
the same name: a tensor name, or a quantized op's ``<tensor>_scale``), the agreement of target
and reference is an SQNR. Integer kernels and the float emulation round an occasional value
differently, and a deep network amplifies those steps layer by layer (on MobileNetV2 the
agreement falls from 88 dB after the first layer to about 21 dB at the output, as far from the
emulation as both are from fp32, with no layer losing more than 9 dB), so a fault is not a low
agreement but a sudden one: the first layer in graph order whose agreement falls more than
:data:`PART_DROP_DB` below that of the tensors it reads (both capped at 60 dB, as in ``onnxq
compare``) and that is more than one step of its int8 grid from the reference (RMS) is where
the runtimes part, the place to look for a conversion or kernel fault. Only quantized tensors
can part: a float op amplifies the drift it is given (a Sigmoid's tail turns a 1% error of its
input into 10%), and a kernel that rounds a few values the other way stays within a step (an
integer Add agreed to 41 dB, 18 dB below its inputs, but 0.5 steps apart).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx

from onnxq.calibrate.dataset import model_inputs
from onnxq.calibrate.sources import as_dataset
from onnxq.lower.fakequantize import OV_DOMAIN
from onnxq.tools.compare import TensorStats, compare, link_inputs
from onnxq.tools.emulate import FLAGS

#: the agreement (dB) a layer may lose against its inputs' before the runtimes are said to part
PART_DROP_DB = 15.0


@dataclass
class Layer:
    """One compared tensor: target against the fake-quantized reference."""

    node: str
    tensor: str
    agreement_db: float
    #: the agreement lost against the layer's inputs' (both capped at 60 dB)
    drop_db: float
    #: RMS difference in steps of the tensor's int8 grid (nan: not a quantized tensor)
    steps: float


@dataclass
class CrossCheck:
    """Target runtime against the fake-quantized reference and fp32."""

    runtime: str
    #: per output: (name, SQNR target vs reference, target vs fp32, reference vs fp32)
    outputs: list[tuple[str, float, float, float]]
    #: per layer in graph order
    layers: list[Layer]
    #: the first quantized layer that parts (see PART_DROP_DB), or None
    first_part: Layer | None
    notes: list[str] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        """No layer parts (see :data:`PART_DROP_DB`)."""
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
        if self.first_part is not None:
            f = self.first_part
            lines.append(
                f"  the runtimes part first at {f.node} (tensor {f.tensor}): {_fmt(f.agreement_db)}"
                f" dB, {f.drop_db:.1f} dB below its inputs' agreement, {f.steps:.1f} int8 steps "
                "apart (RMS); check its conversion and kernel"
            )
        else:
            worst = max((layer.drop_db for layer in self.layers), default=0.0)
            lines.append(
                f"  {len(self.layers)} layers compared; none parts (no quantized tensor falls "
                f"over {PART_DROP_DB:.0f} dB below its inputs' agreement and over one int8 step "
                f"from the reference; largest drop {worst:.1f} dB)"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "runtime": self.runtime,
            "part_drop_db": PART_DROP_DB,
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


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    s = TensorStats("", False, 0)
    s.add(np.asarray(ref), np.asarray(got))
    return s.sqnr_db


def cross_check(
    float_model: onnx.ModelProto,
    reference: onnx.ModelProto,
    target: onnx.ModelProto,
    feeds: Sequence[dict[str, np.ndarray]],
    target_name: str = "",
    quantized: Mapping[str, float] | None = None,
) -> CrossCheck:
    """Compare ``target`` (in its runtime) with ``reference`` (onnxruntime) and fp32.

    ``reference``: the emulation with every switch on, as a plain model
    (:meth:`~onnxq.tools.emulate.Emulation.fixed`); ``float_model``: the float graph both were
    made from (its tensor names are the layers); ``quantized``: the tensors the quantization
    puts on an int8 grid, with their step (:meth:`~onnxq.tools.emulate.Emulation.steps`), the
    only ones that can part (None: any tensor, by the drop alone).
    """
    from onnxq.io.session import make_session

    notes = []
    openvino = any(n.domain == OV_DOMAIN for n in target.graph.node)
    runtime = "openvino" if openvino else "onnxruntime"
    if target_name == "tensorrt":
        notes.append(
            "TensorRT is not run (no GPU assumed): its QDQ model runs in onnxruntime, whose "
            "Q/DQ fusion stands in for TensorRT's; layer placement specific to TensorRT is not "
            "emulated"
        )
    names = [o.name for o in float_model.graph.output]
    fp32 = make_session(float_model)
    ref = make_session(reference)
    if openvino:
        run_target = _openvino_runner(target, [])
    else:
        session = make_session(target)

        def run_target(feed: dict[str, np.ndarray], wanted: Sequence[str]) -> list[np.ndarray]:
            return list(session.run(list(wanted), feed))

    stats: dict[str, list[TensorStats]] = {
        n: [TensorStats(n, True, 0) for _ in range(3)] for n in names
    }
    for feed in feeds:
        f = fp32.run(names, feed)
        r = ref.run(names, feed)
        t = run_target(feed, names)
        for i, n in enumerate(names):
            if not np.issubdtype(np.asarray(f[i]).dtype, np.floating):
                continue
            stats[n][0].add(np.asarray(r[i]), np.asarray(t[i]))
            stats[n][1].add(np.asarray(f[i]), np.asarray(t[i]))
            stats[n][2].add(np.asarray(f[i]), np.asarray(r[i]))
    outputs = [(n, *(s.sqnr_db for s in stats[n])) for n in names if stats[n][0].count]
    if openvino:
        compared = _openvino_layers(float_model, reference, target, feeds)
    else:
        dataset = as_dataset(list(feeds), model_inputs(float_model))
        comparison = compare(reference, target, dataset)
        # the reference's graph hides what its If nodes read: link through the float graph
        link_inputs(float_model, {s.name: s for s in [*comparison.outputs, *comparison.layers]})
        producers = {o: n.name for n in float_model.graph.node for o in n.output}
        compared = [
            (producers.get(s.name, s.node), s)
            for s in sorted(comparison.layers, key=lambda s: s.order)
        ]
    steps = quantized or {}
    layers = [
        Layer(
            node,
            s.name,
            s.sqnr_db,
            s.drop_db,
            math.sqrt(s.ee / s.count) / steps[s.name] if s.name in steps and s.count else math.nan,
        )
        for node, s in compared
        if not s.name.startswith(FLAGS)
    ]
    first = next((layer for layer in layers if _parts(layer, quantized is not None)), None)
    return CrossCheck(runtime, outputs, layers, first, notes)


def _parts(layer: Layer, only_quantized: bool) -> bool:
    """A sudden drop that a kernel's rounding cannot explain: more than one int8 step apart."""
    if layer.drop_db <= PART_DROP_DB:
        return False
    if not only_quantized:
        return True
    return not math.isnan(layer.steps) and layer.steps > 1.0


def _openvino_runner(model: onnx.ModelProto, extra: Sequence[str]) -> Any:
    import openvino as ov

    core = ov.Core()
    ov_model = core.read_model(model.SerializeToString())
    added = []
    for name in extra:
        try:
            ov_model.add_outputs([name])
            added.append(name)
        except Exception:  # a tensor OpenVINO folded away or renamed is not compared
            continue
    compiled = core.compile_model(ov_model, "CPU")
    by_name = {}
    for out in compiled.outputs:
        for n in out.get_names():
            by_name[n] = out

    def run(feed: dict[str, np.ndarray], names: Sequence[str]) -> list[np.ndarray]:
        result = compiled(feed)
        return [np.asarray(result[by_name[n]]) for n in names]

    run.available = set(by_name)  # type: ignore[attr-defined]
    return run


def _openvino_layers(
    float_model: onnx.ModelProto,
    reference: onnx.ModelProto,
    target: onnx.ModelProto,
    feeds: Sequence[dict[str, np.ndarray]],
) -> list[tuple[str, TensorStats]]:
    """Per layer for a FakeQuantize model: OpenVINO's tensors against onnxruntime's."""
    from onnxq.io.session import make_session

    producers = {o: n for n in float_model.graph.node for o in n.output}
    outputs = {o.name for o in float_model.graph.output}
    tensors = [t for t in producers if t not in outputs]
    run = _openvino_runner(target, tensors)
    available = [t for t in tensors if t in run.available]
    ref = make_session(reference, expose=available)
    stats = {t: TensorStats(t, False, i) for i, t in enumerate(available)}
    for feed in feeds:
        r = ref.run(available, feed)
        t = run(feed, available)
        for name, a, b in zip(available, r, t, strict=True):
            if np.issubdtype(np.asarray(a).dtype, np.floating) and np.shape(a) == np.shape(b):
                stats[name].add(np.asarray(a), np.asarray(b))
    link_inputs(float_model, stats)
    return [(producers[n].name or n, s) for n, s in stats.items() if s.count]
