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
compare``) is where the runtimes part, the place to look for a conversion or kernel fault. Only
quantized tensors can part: float ops such as a Sigmoid amplify the drift they are given.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from onnxq.calibrate.dataset import model_inputs
from onnxq.calibrate.sources import as_dataset
from onnxq.lower.fakequantize import OV_DOMAIN
from onnxq.tools.compare import TensorStats, compare, link_inputs

#: the agreement (dB) a layer may lose against its inputs' before the runtimes are said to part
PART_DROP_DB = 15.0


@dataclass
class CrossCheck:
    """Target runtime against the fake-quantized reference and fp32."""

    runtime: str
    #: per output: (name, SQNR target vs reference, target vs fp32, reference vs fp32)
    outputs: list[tuple[str, float, float, float]]
    #: per layer in graph order: (node, tensor, SQNR target vs reference, its drop against
    #: the layer's inputs)
    layers: list[tuple[str, str, float, float]]
    #: the first layer whose drop exceeds PART_DROP_DB, or None
    first_part: tuple[str, str, float, float] | None
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
            node, tensor, value, drop = self.first_part
            lines.append(
                f"  the runtimes part first at {node} (tensor {tensor}): {_fmt(value)} dB, "
                f"{drop:.1f} dB below its inputs' agreement; check its conversion and kernel"
            )
        else:
            worst = max((layer[3] for layer in self.layers), default=0.0)
            lines.append(
                f"  {len(self.layers)} layers compared; none parts (largest drop {worst:.1f} dB "
                f"≤ {PART_DROP_DB:.0f} dB)"
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
            "layers": [dict(zip(_KEYS, layer, strict=True)) for layer in self.layers],
            "first_part": None
            if self.first_part is None
            else dict(zip(_KEYS, self.first_part, strict=True)),
            "notes": self.notes,
        }


_KEYS = ("node", "tensor", "vs_reference_db", "drop_db")


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
    quantized: Collection[str] | None = None,
) -> CrossCheck:
    """Compare ``target`` (in its runtime) with ``reference`` (onnxruntime) and fp32.

    ``reference``: the emulation with every switch on, as a plain model
    (:meth:`~onnxq.tools.emulate.Emulation.fixed`); ``float_model``: the float graph both were
    made from (its tensor names are the layers); ``quantized``: the tensors the quantization
    puts on an int8 grid (the emulation's activation switches), the only ones that can part: a
    float op amplifies the drift it is given (a Sigmoid's tail turns a 1% error of its input
    into 10%), while a conversion or kernel fault shows at a quantized tensor.
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
        layers = _openvino_layers(float_model, reference, target, feeds)
    else:
        dataset = as_dataset(list(feeds), model_inputs(float_model))
        comparison = compare(reference, target, dataset)
        # the reference's graph hides what its If nodes read: link through the float graph
        link_inputs(float_model, {s.name: s for s in [*comparison.outputs, *comparison.layers]})
        graph_order = sorted(comparison.layers, key=lambda s: s.order)
        producers = {o: n.name for n in float_model.graph.node for o in n.output}
        layers = [
            (producers.get(s.name, s.node), s.name, s.sqnr_db, s.drop_db) for s in graph_order
        ]
    layers = [layer for layer in layers if not layer[1].startswith("onnxq_debug_flags")]
    first = next(
        (
            layer
            for layer in layers
            if layer[3] > PART_DROP_DB and (quantized is None or layer[1] in quantized)
        ),
        None,
    )
    return CrossCheck(runtime, outputs, layers, first, notes)


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
) -> list[tuple[str, str, float, float]]:
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
    return [(producers[n].name or n, n, s.sqnr_db, s.drop_db) for n, s in stats.items() if s.count]
