"""One call from Python: ``onnxq.quantize(model, data, **options) -> (model, report)``."""

from __future__ import annotations

import gc
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import onnx

from onnxq.annotate.quantizer import Decision, Quantizer, QuantizerConfig, QuantizerPattern
from onnxq.calibrate.calibration import (
    CalibrationCallback,
    CalibrationReport,
    Calibrator,
    RangeTableCallback,
)
from onnxq.calibrate.dataset import as_dataset, model_inputs
from onnxq.calibrators import DEFAULT_METHOD
from onnxq.errors import ConfigError, ModelError
from onnxq.io.graph import check_model, load_model, save_model
from onnxq.io.session import free_memory, make_session
from onnxq.lower.qdq import FORMATS, PER_CHANNEL_OPSET, dedicated_qdq_pairs, to_qdq
from onnxq.post.requantize import Requantizer, RequantizeStats, rescales
from onnxq.post.subgraphs import has_branches
from onnxq.prepare.preprocess import raise_opset
from onnxq.solve.constraints import share_concat_scales, solve

QUANTIZED_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "QLinearConv",
        "QLinearMatMul",
        "QGemm",
        "QLinearAdd",
        "QLinearMul",
        "MatMulInteger",
        "ConvInteger",
        "DynamicQuantizeLinear",
    }
)


@dataclass
class QuantizeReport:
    """What quantization did, node by node, with timings and calibration statistics."""

    decisions: list[Decision]
    calibration: CalibrationReport
    requantize: RequantizeStats
    seconds: dict[str, float] = field(default_factory=dict)
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

    @property
    def quantized_nodes(self) -> list[str]:
        """Names of float nodes now computed in int8."""
        return [d.node for d in self.decisions if d.quantized]

    def summary(self) -> str:
        """A few lines for a terminal."""
        q = sum(d.quantized for d in self.decisions)
        cal = self.calibration
        lines = [
            f"quantized {q} of {len(self.decisions)} nodes; calibrated on {cal.samples} samples "
            f"({cal.batches} batches, {cal.tensors_observed} tensors, "
            f"{cal.observer_bytes} bytes of "
            "statistics)",
            f"requantize: {self.requantize.folded_pairs} DQ→Q pairs folded, "
            f"{self.requantize.rescaled_pairs} rescaled into QLinear ops, "
            f"{len(self.requantize.crossed_ops)} ops carried int8, "
            f"{len(self.requantize.relus_removed)} Relus removed",
            "time: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.seconds.items()),
        ]
        if self.latency:
            lines.append(
                f"latency: fp32 {self.latency['fp32_ms']:.3f} ms, int8 "
                f"{self.latency['int8_ms']:.3f} ms per batch ({self.latency['ratio']:.2f}× "
                "fp32, 1 thread)"
            )
        if self.rescales:
            lines.append(
                f"{len(self.rescales)} rescale(s) (DQ→Q) kept, where the activation dtype "
                "changes or a shared scale meets a conflicting constraint: "
                + ", ".join(self.rescales)
            )
        lines.extend(f"note: {n}" for n in self.notes)
        lines.extend(f"constraint: {c}" for c in self.constraints)
        for name, count in cal.nonfinite.items():
            lines.append(
                f"warning: tensor '{name}' held {count} NaN/Inf values during "
                "calibration; they were ignored"
            )
        lines.extend(f"warning: {c}" for c in cal.conflicts)
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "decisions": [asdict(d) for d in self.decisions],
            "calibration": asdict(self.calibration),
            "requantize": asdict(self.requantize),
            "seconds": self.seconds,
            "ops_before": self.ops_before,
            "ops_after": self.ops_after,
            "rescales": self.rescales,
            "constraints": self.constraints,
            "warnings": self.warnings,
            "notes": self.notes,
            "latency": self.latency,
        }


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """Count of each op type in the main graph."""
    return dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


def refuse_quantized(model: onnx.ModelProto, where: str, command: str = "quantize") -> None:
    """Raise when ``model`` already holds quantized ops."""
    found = sorted({n.op_type for n in model.graph.node if n.op_type in QUANTIZED_OPS})
    if found:
        raise ModelError(
            f"{where} is already quantized (it holds {', '.join(found)}); {command} the float "
            "model instead, or retarget this one with `onnxq convert`"
        )


def quantize(
    model: str | os.PathLike[str] | onnx.ModelProto,
    data: Any = None,
    *,
    method: str = DEFAULT_METHOD,
    per_channel: bool | None = None,
    activation_dtype: str | None = None,
    symmetric_activations: bool | None = None,
    unsigned_after_relu: bool | None = None,
    exclude: Sequence[str] = (),
    patterns: Sequence[QuantizerPattern] | None = None,
    callback: CalibrationCallback | None = None,
    batch_size: int | None = None,
    samples: int | None = None,
    percentile: float = 99.999,
    bins: int = 2048,
    preprocess: str | None = None,
    save_ranges: str | os.PathLike[str] | None = None,
    load_ranges: str | os.PathLike[str] | None = None,
    format: str | None = None,
    weight_bits: int | None = None,
    weight_dtype: str = "int8",
    block_size: int = 32,
    config: Any = None,
    target: Any = None,
    progress: bool | None = None,
    output: str | os.PathLike[str] | None = None,
    latency_check: bool = False,
) -> tuple[onnx.ModelProto, QuantizeReport]:
    """Quantize ``model`` with calibration ``data``; return the int8 model and a report.

    ``data``: an .npz path, a folder of .npy/.npz files (or images, with ``preprocess``), a dict
    of arrays (samples on axis 0), an iterable of feed dicts, an onnxruntime
    CalibrationDataReader, or ``"module:function"``. ``method`` names a calibrator (``minmax``,
    ``average-max``, ``percentile``, ``entropy``, ``mse``, ``output-aware``) unless ``callback``
    is given. ``samples`` caps the calibration samples. ``save_ranges`` writes the chosen
    activation ranges as JSON; ``load_ranges`` reuses such a file instead of data. ``format``
    is ``qoperator`` (QLinear ops, onnxruntime CPU), ``qdq`` (standard ONNX Q/DQ around float
    ops; the opset is raised to 13 when per-channel scales need it) or ``openvino`` (float graph
    with FakeQuantize, run by the OpenVINO runtime). ``weight_bits=7`` restricts weights to
    [-63, 63] for CPUs without VNNI. ``target`` (a name or
    :class:`~onnxq.annotate.targets.Target`) sets the defaults of format, activation dtype and
    symmetry, per-channel, weight bits and the patterns; explicit arguments win. With
    ``output`` the model is also written atomically. The input model is never modified. Every
    float output is compared with fp32 on a few calibration batches (a warning below 15 dB
    SQNR names the first layer below it); ``latency_check`` also times fp32 against int8 and
    warns when int8 is slower (the CLI does this unless ``--no-latency-check``).
    """
    from onnxq.annotate.targets import Target, get_target
    from onnxq.calibrate.ranges import read_ranges, write_ranges
    from onnxq.calibrators import method_callback

    if weight_dtype == "int4":
        return _int4(model, format, block_size, output)
    if weight_dtype != "int8":
        raise ConfigError(f"--weight-dtype {weight_dtype!r} is not supported; use int8 or int4")

    # explicit options win over the target's conventions (default target: ort-cpu)
    tgt = target if isinstance(target, Target) else get_target(target or "ort-cpu")
    format = tgt.format if format is None else format
    per_channel = tgt.per_channel if per_channel is None else per_channel
    activation_dtype = tgt.activation_dtype if activation_dtype is None else activation_dtype
    if symmetric_activations is None:
        symmetric_activations = tgt.symmetric_activations
    if unsigned_after_relu is None:
        unsigned_after_relu = tgt.unsigned_after_relu
    if unsigned_after_relu:
        if not (symmetric_activations and activation_dtype == "int8"):
            raise ConfigError(
                "--unsigned-after-relu applies to symmetric int8 activations: add "
                "--activation-dtype int8 --symmetric-activations (asymmetric uint8 already "
                "gives a Relu output the range [0, max])"
            )
        if format == "qoperator":
            raise ConfigError(
                "--unsigned-after-relu mixes uint8 and int8 activations, which onnxruntime's "
                "QLinear kernels do not take in one op; use --format qdq or --format openvino"
            )
    from onnxq.annotate.config import UserConfig

    user = config if isinstance(config, UserConfig) or config is None else UserConfig.load(config)
    weight_bits, notes, bit_warnings = _weight_bits(
        weight_bits, tgt, format, activation_dtype, unsigned_after_relu, user
    )
    if patterns is None and tgt.patterns is not None:
        patterns = _target_patterns(tgt)

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    where = f"'{model}'" if not isinstance(model, onnx.ModelProto) else "the given model"
    if format not in FORMATS:
        raise ConfigError(f"--format {format!r} is unknown; choose one of {', '.join(FORMATS)}")
    float_model = load_model(model)
    refuse_quantized(float_model, where)
    if activation_dtype == "int16":  # A16W8: only standard Q/DQ has int16, from opset 21
        if format != "qdq":
            raise ConfigError(
                f"int16 activations are written as QDQ (opset 21); --format "
                f"{format} has no int16 kernels — add --format qdq"
            )
    qconfig = QuantizerConfig(
        user=user,
        activation_dtype=activation_dtype,
        activation_symmetric=symmetric_activations,
        unsigned_after_relu=unsigned_after_relu,
        per_channel=per_channel,
        exclude=tuple(exclude),
        weight_bits=weight_bits,
        format=format,
        target=tgt.name,
    )
    if format == "qdq" and (
        activation_dtype == "int16" or (user is not None and user.asks("activation_dtype", "int16"))
    ):
        float_model = raise_opset(float_model, 21, "int16 activations")
    if user is not None and user.asks("weight_dtype", "int4") and not qconfig.int4_refused:
        from onnxq.post.weight_only import INT4_OPSET

        float_model = raise_opset(float_model, INT4_OPSET, "int4 weights")
    if format == "qdq" and (per_channel or (user is not None and user.asks("per_channel", True))):
        float_model = raise_opset(float_model, PER_CHANNEL_OPSET, "per-channel QDQ")
    if load_ranges is not None:
        cb: CalibrationCallback = RangeTableCallback(read_ranges(load_ranges), f"'{load_ranges}'")
    else:
        cb = callback or method_callback(method, percentile, bins)
    quantizer = Quantizer(float_model, patterns, qconfig)
    gc.collect()  # graphsurgeon graphs are reference cycles: free the stages' copies now
    times["match+rewrite"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    inputs = model_inputs(quantizer.float_model)
    dataset = (
        None
        if load_ranges is not None and data is None
        else as_dataset(data, inputs, batch_size, samples, preprocess)
    )
    node_callbacks = (
        {}
        if load_ranges is not None
        else {n: method_callback(m, percentile, bins) for n, m in quantizer.node_methods.items()}
    )
    calibrator = Calibrator(quantizer, dataset, cb, progress, node_callbacks)
    calibrator.reference_batches = CHECK_BATCHES if format != "openvino" else 0
    values = calibrator.calibrate()
    calibrator.release()
    free_memory()
    solution = solve(quantizer, values, set(tgt.shared_scale_ops))
    values = solution.values
    times["calibrate"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    requantizer = Requantizer()
    result = requantizer.requantize(quantizer.materialize(values))
    if "Concat" in tgt.shared_scale_ops and format != "openvino":
        result, _ = share_concat_scales(result)
    if format == "qoperator":
        from onnxq.prepare.fusions import fuse_gelu

        result, _ = fuse_gelu(result)
    if format == "qdq":
        result = to_qdq(result)
        if tgt.dedicated_qdq_pairs:
            result = dedicated_qdq_pairs(result)
    elif format == "openvino":
        from onnxq.lower.fakequantize import to_fakequantize

        result = to_fakequantize(quantizer, (-64, 63) if weight_bits == 7 else None)
    free_memory()
    times["requantize"] = time.perf_counter() - t2

    if quantizer.int4_nodes:
        from onnxq.post.weight_only import quantize_weights_int4

        result, _ = quantize_weights_int4(
            result, block_size, nodes=set(quantizer.int4_nodes), prepare=False
        )

    branches: list[Any] = []
    if has_branches(quantizer.float_model):
        branches_kw = dict(
            method=method,
            per_channel=per_channel,
            activation_dtype=activation_dtype,
            symmetric_activations=symmetric_activations,
            unsigned_after_relu=unsigned_after_relu,
            patterns=patterns,
            callback=callback,
            percentile=percentile,
            bins=bins,
            format=format,
            weight_bits=weight_bits,
            target=tgt,
        )
        result, branches = _quantize_branches(quantizer, result, dataset, format, branches_kw)

    t3 = time.perf_counter()
    session = verify(
        result,
        runtime="openvino" if format == "openvino" else "onnxruntime",
        float_model=quantizer.float_model,
    )
    times["verify"] = time.perf_counter() - t3
    t4 = time.perf_counter()
    checked, latency = _checks(
        quantizer.float_model, result, session, dataset, format, latency_check, calibrator.reference
    )
    times["check"] = time.perf_counter() - t4
    if output is not None:
        save_model(result, output)
    if save_ranges is not None:
        write_ranges(save_ranges, calibrator.ranges, method if callback is None else "callback")
    decisions = mark_carried(quantizer, requantizer.stats.crossed_ops)
    decisions += _branch_decisions(quantizer, branches)
    report = QuantizeReport(
        decisions=decisions,
        calibration=calibrator.report,
        requantize=requantizer.stats,
        seconds=times,
        ops_before=op_histogram(float_model),
        ops_after=op_histogram(result),
        values={k: v.tolist() for k, v in quantizer.final_values.items()},
        rescales=rescales(result) if format != "openvino" else [],
        constraints=solution.shared + [str(r) for r in solution.rescales],
        warnings=list(quantizer.warnings)
        + bit_warnings
        + (dataset.warnings if dataset is not None else [])
        + checked,
        notes=notes + _widened_notes(quantizer.widened_biases),
        latency=latency,
    )
    _explain_constraints(report.decisions, solution)
    return result, report


def mark_carried(quantizer: Quantizer, crossed: Sequence[str] | None = None) -> list[Decision]:
    """The quantizer's decisions with the ops requantize carries int8 through marked quantized.

    ``crossed``: the ops requantize crossed; None runs requantize on the model materialized
    with default scales (what it crosses depends on the graph and opset, not on the values),
    for ``inspect``, which then counts what ``quantize`` will.
    """
    if crossed is None:
        from onnxq.solve.qparams import qrange

        # default values, but a Relu-folded output's zero point at its type's minimum (an int16
        # one is -32768; the default 0 was refused as a broken fold)
        folds = {
            qt.zero_point: np.asarray(qrange(qt.dtype)[0])
            for rec in quantizer.records
            if rec.relu_folded
            for qt in rec.outputs
        }
        probe = Requantizer()
        probe.requantize(quantizer.materialize(folds))
        crossed = probe.stats.crossed_ops
    decisions = list(quantizer.decisions.values())
    carried = set(crossed)
    for d in decisions:
        if d.node in carried:
            d.quantized, d.pattern = True, "requantize"
            d.reason = "carries int8 through (commutes with the affine map)"
    return decisions


#: calibration batches the accuracy check runs
CHECK_BATCHES = 4


def _checks(
    float_model: onnx.ModelProto,
    result: onnx.ModelProto,
    session: Any,
    dataset: Any,
    format: str,
    latency_check: bool,
    reference: list[tuple[dict[str, Any], dict[str, Any]]],
) -> tuple[list[str], dict[str, float]]:
    """Accuracy (always) and latency (on request) of an onnxruntime output (onnxq.tools.checks).

    ``session``: verify's onnxruntime session of ``result``, reused for the accuracy check.
    ``reference``: feeds and fp32 outputs kept by the calibration pass (when it ran one).
    """
    from onnxq.errors import DataError
    from onnxq.tools.checks import accuracy_warnings, latency

    if format == "openvino" or dataset is None:
        return [], {}
    feeds = [feed for feed, _ in reference]
    if not reference:
        try:
            dataset.reset()
            for feed in dataset.batches():
                feeds.append(feed)
                if len(feeds) >= CHECK_BATCHES:
                    break
        except DataError:  # a one-shot iterator: nothing left to check with
            return [], {}
    outputs = [out for _, out in reference] if reference else None
    warnings = accuracy_warnings(float_model, result, feeds, session, outputs)
    if not latency_check or not feeds:
        return warnings, {}
    lat = latency(float_model, result, feeds[0])
    slower = lat.warning()
    if slower:
        warnings.append(slower)
    return warnings, {"fp32_ms": lat.fp32_ms, "int8_ms": lat.int8_ms, "ratio": lat.ratio}


def _widened_notes(widened: dict[str, int]) -> list[str]:
    """One note per bias whose weight scale was widened to keep the int32 accumulator exact."""
    return [
        f"bias '{bias}': the weight scale of {n} channel(s) was widened so that bias plus the "
        "worst-case sum of products fits the int32 accumulator (those channels are nearly "
        "constant, e.g. a BatchNormalization with gamma ≈ 0)"
        for bias, n in sorted(widened.items())
    ]


def _weight_bits(
    requested: int | None,
    tgt: Any,
    format: str,
    activation_dtype: str,
    unsigned_after_relu: bool,
    user: Any,
) -> tuple[int, list[str], list[str]]:
    """Resolve the weight bits: explicit, the target's, or ``auto`` (see onnxq.io.hostcheck).

    Returns the bits, the notes explaining an automatic choice and the warnings for an explicit
    8-bit choice that this machine's onnxruntime would clip.
    """
    from onnxq.io.hostcheck import auto_weight_bits, saturation_warning

    # onnxruntime runs QDQ through its U8S8 kernels whatever the activation dtype (it turns
    # int8 QDQ into uint8 on x86), OpenVINO its FakeQuantize models alike; the int8 QLinear
    # ops of QOperator output are exact
    runtime = "openvino" if format == "openvino" else tgt.runtime
    clipping_path = format != "qoperator" or (
        activation_dtype == "uint8"
        or unsigned_after_relu
        or (user is not None and user.asks("activation_dtype", "uint8"))
    )
    bits = requested if requested is not None else tgt.weight_bits
    if bits is None:
        bits, why = auto_weight_bits(runtime, clipping_path)
        return bits, [why] if why else [], []
    warning = saturation_warning(runtime, clipping_path, bits) if requested is not None else ""
    return bits, [], [warning] if warning else []


def _explain_constraints(decisions: list[Decision], solution: Any) -> None:
    """A Concat whose input is rescaled says so in its decision."""
    by_node = {d.node: d for d in decisions}
    for r in solution.rescales:
        d = by_node.get(r.node)
        if d is not None:
            extra = f"input '{r.tensor}' is rescaled (DQ→Q) to the shared scale: {r.reason}"
            d.reason = f"{d.reason}; {extra}" if d.reason else extra


def _quantize_branches(
    quantizer: Quantizer, result: onnx.ModelProto, dataset: Any, format: str, kw: dict[str, Any]
) -> tuple[onnx.ModelProto, list[Any]]:
    """Quantize the branches of top-level If nodes as models of their own (onnxq.post.subgraphs)."""
    from onnxq.post.subgraphs import BranchResult, quantize_branches

    ifs = [n.name for n in quantizer.float_model.graph.node if n.op_type == "If"]
    if dataset is None or format == "openvino":
        why = (
            "no calibration data (a loaded range table covers the main graph only)"
            if dataset is None
            else "FakeQuantize output covers the main graph only"
        )
        return result, [
            BranchResult(n, "branches", reason=f"its branches stay float: {why}") for n in ifs
        ]
    dataset.reset()
    feeds = [dict(f) for f in dataset.batches()]

    def run(model: onnx.ModelProto, samples: list[dict[str, Any]]) -> tuple[onnx.ModelProto, Any]:
        return quantize(model, samples, progress=False, **kw)

    return quantize_branches(quantizer.float_model, result, feeds, run)


def _branch_decisions(quantizer: Quantizer, branches: list[Any]) -> list[Decision]:
    """The If nodes' decisions say what became of each branch; branch nodes are listed too."""
    out: list[Decision] = []
    by_if: dict[str, list[str]] = {}
    for b in branches:
        if b.quantized:
            line = f"{b.branch}: {b.quantized} of {b.nodes} nodes int8 ({b.samples} samples)"
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
            d.reason = "each branch quantized as its own graph; " + "; ".join(lines)
    return out


def _int4(
    model: Any, format: str | None, block_size: int, output: Any
) -> tuple[onnx.ModelProto, QuantizeReport]:
    """Weight-only block-wise int4 (no calibration)."""
    from onnxq.post.weight_only import quantize_weights_int4

    if format not in (None, "qdq"):
        raise ConfigError(
            f"int4 weights are written as standard QDQ (opset 21 DequantizeLinear "
            f"with block_size); --format {format} is not available for them"
        )
    t0 = time.perf_counter()
    where = f"'{model}'" if not isinstance(model, onnx.ModelProto) else "the given model"
    float_model = load_model(model)
    refuse_quantized(float_model, where)
    result, wo = quantize_weights_int4(float_model, block_size)
    verify(result)
    if output is not None:
        save_model(result, output)
    decisions = [Decision(n, "", True, "int4-weights") for n in wo.quantized]
    decisions += [Decision(n, "", False, "int4-weights", why) for n, why in wo.skipped.items()]
    return result, QuantizeReport(
        decisions,
        CalibrationReport(),
        RequantizeStats(),
        {"int4": time.perf_counter() - t0},
        op_histogram(float_model),
        op_histogram(result),
    )


def _target_patterns(tgt: Any) -> list[QuantizerPattern]:
    from onnxq.patterns import default_patterns

    library = {p.label(): p for p in default_patterns()}
    unknown = [n for n in tgt.patterns if n not in library]
    if unknown:
        raise ConfigError(
            f"target {tgt.name!r} names pattern(s) {unknown} that onnxq does not "
            f"have; known patterns: {', '.join(sorted(library))}"
        )
    return [library[n] for n in tgt.patterns]


def verify(
    model: onnx.ModelProto,
    runtime: str = "onnxruntime",
    float_model: onnx.ModelProto | None = None,
) -> Any:
    """The output must pass onnx.checker and load in its runtime (OpenVINO when installed).

    Returns the onnxruntime session it built (None for OpenVINO), for checks that run the model.
    When OpenVINO refuses the output, ``float_model`` (if given) tells whether it refuses the
    float model too, which the error then says.
    """
    check_model(model, "the quantized model")
    if runtime == "onnxruntime":
        return make_session(model)
    try:
        import openvino as ov
    except ImportError:
        return None  # checked structurally only; `pip install openvino` to run it
    from onnxq.io.graph import serialize

    try:
        ov.Core().compile_model(ov.Core().read_model(serialize(model)), "CPU")
    except Exception as exc:  # OpenVINO raises RuntimeError and others
        reason = _openvino_reason(exc)
        float_reason = _float_loads_in_openvino(float_model)
        either = ""
        if float_reason:
            same = "for the same reason" if float_reason == reason else f"({float_reason})"
            either = f"; it cannot load the float model either, {same}"
        raise ModelError(
            f"the OpenVINO runtime cannot load the model: {reason}{either}; use --format qdq "
            "or qoperator for onnxruntime"
        ) from None
    return None


def _openvino_reason(exc: BaseException) -> str:
    """The informative line of an OpenVINO exception (its first lines are source locations)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for marker in ("While validating", "-- "):
        for ln in lines:
            if ln.startswith(marker) or marker in ln:
                return ln.lstrip("- ").split(" failed at ")[0][:300]
    useful = [ln for ln in lines if not ln.startswith(("Exception from", "Check '"))]
    return (useful or lines or [type(exc).__name__])[0][:300]


def _float_loads_in_openvino(float_model: onnx.ModelProto | None) -> str:
    """'' when OpenVINO loads ``float_model`` (or none is given), else its reason."""
    if float_model is None:
        return ""
    import openvino as ov

    from onnxq.io.graph import serialize

    try:
        ov.Core().compile_model(ov.Core().read_model(serialize(float_model)), "CPU")
    except Exception as exc:  # OpenVINO raises RuntimeError and others
        return _openvino_reason(exc)
    return ""
