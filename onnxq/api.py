"""One call from Python: ``onnxq.quantize(model, data, **options) -> (model, report)``.

``quantize`` resolves its options against the target once (:mod:`onnxq.options`), builds the
pass list for them (:mod:`onnxq.passes.pipeline`), runs it over one state and reports what
every pass did (:mod:`onnxq.report`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import onnx

from onnxq.calibrate.calibration import CalibrationReport
from onnxq.calibrators import DEFAULT_METHOD
from onnxq.core.callbacks import CalibrationCallback
from onnxq.core.errors import ConfigError, OnnxqError
from onnxq.core.specs import Decision
from onnxq.fallback import search
from onnxq.io.graph import load_model, with_file_weights
from onnxq.io.paths import reads_of, refuse_collisions, writes_of
from onnxq.options import QuantizeOptions, pythonize, resolve, spell
from onnxq.passes import pipeline
from onnxq.passes.manager import State, op_histogram, run_passes
from onnxq.patterns.rule import QuantizerPattern
from onnxq.post.requantize import RequantizeStats
from onnxq.report import QuantizeReport, build_report


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
    workers: int = 1,
    threads: int | None = None,
    ray: str | None = None,
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
    bias_correction: str = "auto",
    smoothquant: str = "auto",
    equalization: str = "auto",
    depthwise_scaling: str = "off",
    rounding: str = "auto",
    model_kind: str = "auto",
    max_drop: float | None = None,
    metric: str | None = None,
    fallback: str | None = None,
    budget: float | None = None,
    base_dir: str | os.PathLike[str] | None = None,
) -> tuple[onnx.ModelProto, QuantizeReport]:
    """Quantize ``model`` with calibration ``data``; return the int8 model and a report.

    ``model`` is a path or a ModelProto; a ModelProto whose initializers keep their data in
    external files needs ``base_dir``, the folder those files are in (relative locations
    inside it only, as for a model file).

    ``data``: an .npz path, a folder of .npy/.npz files (or images, with ``preprocess``), a dict
    of arrays (samples on axis 0), an iterable of feed dicts, an onnxruntime
    CalibrationDataReader, or ``"module:function"``. ``method`` names a calibrator (``minmax``,
    ``average-max``, ``percentile``, ``entropy``, ``mse``, ``output-aware``) unless ``callback``
    is given. ``samples`` caps the calibration samples. ``workers`` runs the calibration pass
    on that many local processes, each taking every N-th batch (statistics merged; the script
    must start under ``if __name__ == "__main__":``); ``threads`` sets each calibration
    process's onnxruntime threads (default: onnxruntime's choice, or the cores shared out
    among the workers). ``ray`` runs the pass as Ray tasks instead: ``""`` on a local
    cluster started for the call, else the address of the user's cluster (``"auto"``,
    ``"HOST:PORT"``); ``workers`` tasks (default: the cluster's CPUs), each reading its own
    share of ``data``, which must be a folder, an ``.npz`` path or ``"module:function"``
    taking ``(shard, shards)`` (see onnxq.calibrate.cluster). ``save_ranges`` writes the chosen
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
    ``bias_correction="sequential"`` runs the int8 model layer after layer on the first 64
    calibration samples and sets each Conv/Gemm/MatMul bias so that the layer's output mean
    per channel matches the float layer's, every earlier correction applied; ``"fast"``
    subtracts the mean output shift the weight rounding causes (from the per-channel input
    means); ``"layerwise"`` the shift of the int8 layer on its int8 input.
    ``smoothquant="on"`` moves activation outliers of MatMul/Gemm inputs into their weights,
    alpha chosen per layer. ``equalization="on"`` equalizes the channel ranges of Conv →
    [Relu/Clip/Pad] → Conv chains and absorbs activation offsets into the next bias (exact in
    float; a Clip's bound becomes per channel). ``depthwise_scaling="on"`` scales each
    channel of a depthwise convolution's input so that it spans the tensor's int8 range, the
    filters taking the inverse, where the factor folds into a constant Mul/Div/Add, a
    BatchNormalization or a Conv upstream (exact in float; onnxq.passes.depthwise_scaling; off
    by default: it helps PP-LCNet detectors and can hurt recognisers).
    ``rounding="optimized"`` rounds each
    Conv/Gemm/MatMul weight for the least output error on the layer's calibration inputs
    (GPTQ-style) instead of to nearest.
    All four but depthwise scaling default to ``"auto"``: what helps the model's kind, read
    from its graph (sequential bias correction for CNNs, equalization for CNNs with
    per-tensor weights, SmoothQuant for transformers, optimized rounding for both;
    ``model_kind`` overrides the detection: ``cnn``, ``transformer``, ``rnn`` or ``other``).
    The report's ``algorithms`` says what ran. ``budget`` (seconds) bounds the whole call:
    a default algorithm whose estimated time does not fit, after the calibration and the other
    required steps are reserved, is left out (onnxq.passes.budget; the estimates come from
    timing the float model on the first batch, so the choice depends on the machine);
    algorithms asked for by name always run. ``max_drop`` turns on the accuracy-driven
    fallback (onnxq.fallback): every 8th calibration batch is held back, and the fewest
    groups, ranked by the output error each causes (onnxq.simulate.sensitivity), go back to float
    until the metric (``metric``:
    ``"module:function"`` called with a model file's path, higher is better; by default the
    mean output cosine with fp32 in %) is at most ``max_drop`` below fp32's; ``report.fallback``
    lists every trial. ``fallback="int16"`` returns groups to int16 activations (int8 weights,
    QDQ format) instead, a group whose own error is in its weights still to float; the default
    is the target's (int16 where it runs int16 activations, ``Target.int16_activations``).
    """
    try:
        refuse_collisions(
            [
                *reads_of("model", model),
                *reads_of("data", data),
                *reads_of("config", config),
                *reads_of("load_ranges", load_ranges),
            ],
            [*writes_of("output", output, model=True), *writes_of("save_ranges", save_ranges)],
        )
        if isinstance(model, onnx.ModelProto):  # its external data resolved as a file's
            model = load_model(model, check=False, base_dir=base_dir)
        elif base_dir is not None:
            raise ConfigError(
                "base_dir is for a ModelProto with external data; a model file's external "
                "data is read from the file's own folder"
            )
        options = resolve_call({k: v for k, v in locals().items() if k != "base_dir"})
        qmodel, report = quantize_with(model, data, options)
        # weights the output shares with a model file's external data are read in: the
        # caller gets a self-contained model (the CLI's writer reads them one at a time)
        return with_file_weights(qmodel), report
    except OnnxqError as exc:  # name Python parameters where the message names CLI flags
        text = pythonize(str(exc))
        if text == str(exc):
            raise
        raise type(exc)(text) from None


def resolve_call(args: dict[str, Any], cli: bool = False) -> QuantizeOptions:
    """The options of one ``quantize`` call (its keyword arguments as a dict)."""
    kw = {k: v for k, v in args.items() if k not in ("model", "data")}
    for name, value, none_ok in (
        ("workers", kw.get("workers", 1), False),
        ("threads", kw.get("threads"), True),
    ):
        if value is None and none_ok:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{spell(name, cli, value)} must be a whole number >= 1")
    if kw.get("fallback") is not None and kw.get("max_drop") is None:
        raise ConfigError(
            f"{spell('fallback', cli)} is what the accuracy-driven fallback returns groups to; "
            f"add {spell('max_drop', cli)} with the largest drop allowed"
        )
    weight_dtype = kw["weight_dtype"]
    if weight_dtype not in ("int8", "int4"):
        flag = spell("weight_dtype", cli, weight_dtype)
        raise ConfigError(f"{flag} is not supported; use int8 or int4")
    if weight_dtype == "int4":
        if kw["format"] not in (None, "qdq"):
            raise ConfigError(
                f"int4 weights are written as standard QDQ (opset 21 DequantizeLinear "
                f"with block_size); {spell('format', cli, kw['format'])} is not available for them"
            )
        kw["format"] = "qdq"
    return resolve(cli=cli, **kw)


def quantize_with(
    model: str | os.PathLike[str] | onnx.ModelProto, data: Any, options: QuantizeOptions
) -> tuple[onnx.ModelProto, QuantizeReport]:
    """Run the pipeline ``options`` call for; see :func:`quantize`."""
    if options.max_drop is not None:
        return search(model, data, options, quantize_with)
    state = run_passes(State(options, model, data), pipeline.build(options, quantize_with))
    report = _int4_report(state) if options.weight_dtype == "int4" else build_report(state)
    return state.model, report


def quantize_state(
    model: str | os.PathLike[str] | onnx.ModelProto, data: Any, **kwargs: Any
) -> State:
    """Run ``quantize(model, data, **kwargs)``'s passes and return their whole state.

    For tools that need more than the model and report: the annotation (``state.quantizer``),
    the chosen scales (``state.values``) and replaced constants, e.g. onnxq.simulate.emulate.
    The accuracy-driven fallback (``max_drop``) is not run.
    """
    import inspect

    args = {
        k: p.default
        for k, p in inspect.signature(quantize).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    unknown = set(kwargs) - set(args)
    if unknown:
        raise ConfigError(f"quantize() has no parameter {sorted(unknown)[0]!r}")
    args.update(kwargs, max_drop=None, metric=None)
    base_dir = args.pop("base_dir")
    if isinstance(model, onnx.ModelProto):
        model = load_model(model, check=False, base_dir=base_dir)
    options = resolve_call(args)
    return run_passes(State(options, model, data), pipeline.build(options, quantize_with))


def _int4_report(state: State) -> QuantizeReport:
    """Whole-model int4: one decision per weight, no calibration."""
    wo = state.weight_only
    decisions = [Decision(n, "", True, "int4-weights") for n in wo.quantized]
    decisions += [Decision(n, "", False, "int4-weights", why) for n, why in wo.skipped.items()]
    return QuantizeReport(
        decisions,
        CalibrationReport(),
        RequantizeStats(),
        list(state.records),
        op_histogram(state.float_model),
        op_histogram(state.model),
    )
