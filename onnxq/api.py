"""One call from Python: ``onnxq.quantize(model, data, options=None, **overrides)``.

``quantize`` resolves its options against the target once (:mod:`onnxq.options`), builds the
pass list for them (:mod:`onnxq.passes.pipeline`), runs it over one state and reports what
every pass did (:mod:`onnxq.report`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import onnx

from onnxq.calibrate.calibration import CalibrationReport
from onnxq.core.errors import ConfigError, OnnxqError
from onnxq.core.specs import Decision
from onnxq.fallback import search
from onnxq.io.graph import load_model, with_file_weights
from onnxq.io.paths import reads_of, refuse_collisions, writes_of
from onnxq.options import (
    Options,
    QuantizeOptions,
    option_names,
    pythonize,
    resolve,
    spell,
    with_overrides,
)
from onnxq.passes import pipeline
from onnxq.passes.manager import State, op_histogram, run_passes
from onnxq.post.requantize import RequantizeStats
from onnxq.report import QuantizeReport, build_report


def quantize(
    model: str | os.PathLike[str] | onnx.ModelProto,
    data: Any = None,
    *,
    options: Options | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> tuple[onnx.ModelProto, QuantizeReport]:
    """Quantize ``model`` with calibration ``data``; return the int8 model and a report.

    ``model`` is a path or a ModelProto; a ModelProto whose initializers keep their data in
    external files needs ``base_dir``, the folder those files are in (relative locations
    inside it only, as for a model file). The input model is never modified.

    ``data``: an .npz path, a folder of .npy/.npz files (or images, with ``preprocess``), a dict
    of arrays (samples on axis 0), an iterable of feed dicts, an onnxruntime
    CalibrationDataReader, or ``"module:function"``.

    The options are the fields of :class:`onnxq.Options`, each documented there: pass an
    ``Options`` object, keywords (``method="minmax"``, ``target="tensorrt"``), or both (the
    keywords win). Every float output is compared with fp32 on a few calibration batches
    after quantizing (a warning below 15 dB SQNR names the first layer below it); the
    report's ``algorithms`` says what ran and why.
    """
    try:
        opts = with_overrides(options, overrides)
        refuse_collisions(
            [
                *reads_of("model", model),
                *reads_of("data", data),
                *reads_of("config", opts.config),
                *reads_of("load_ranges", opts.load_ranges),
            ],
            [
                *writes_of("output", opts.output, model=True),
                *writes_of("save_ranges", opts.save_ranges),
            ],
        )
        model = _model_of(model, base_dir)
        qmodel, report = quantize_with(model, data, resolve_call(opts))
        # weights the output shares with a model file's external data are read in: the
        # caller gets a self-contained model (the CLI's writer reads them one at a time)
        return with_file_weights(qmodel), report
    except OnnxqError as exc:  # name Python parameters where the message names CLI flags
        text = pythonize(str(exc))
        if text == str(exc):
            raise
        raise type(exc)(text) from None


def _model_of(
    model: str | os.PathLike[str] | onnx.ModelProto, base_dir: str | os.PathLike[str] | None
) -> str | os.PathLike[str] | onnx.ModelProto:
    """A ModelProto with its external data resolved as a file's (inside ``base_dir``)."""
    if isinstance(model, onnx.ModelProto):
        return load_model(model, check=False, base_dir=base_dir)
    if base_dir is not None:
        raise ConfigError(
            "base_dir is for a ModelProto with external data; a model file's external "
            "data is read from the file's own folder"
        )
    return model


def resolve_call(options: Options, cli: bool = False) -> QuantizeOptions:
    """The resolved options of one ``quantize`` call."""
    kw = {name: getattr(options, name) for name in option_names()}
    for name, value, none_ok in (
        ("workers", kw["workers"], False),
        ("threads", kw["threads"], True),
    ):
        if value is None and none_ok:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{spell(name, cli, value)} must be a whole number >= 1")
    if kw["fallback"] is not None and kw["max_drop"] is None:
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
    model: str | os.PathLike[str] | onnx.ModelProto,
    data: Any,
    *,
    options: Options | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> State:
    """Run ``quantize(model, data, ...)``'s passes and return their whole state.

    For tools that need more than the model and report: the annotation (``state.quantizer``),
    the chosen scales (``state.values``) and replaced constants, e.g. onnxq.simulate.emulate.
    The accuracy-driven fallback (``max_drop``) is not run.
    """
    opts = replace(with_overrides(options, overrides), max_drop=None, metric=None)
    resolved = resolve_call(opts)
    return run_passes(
        State(resolved, _model_of(model, base_dir), data), pipeline.build(resolved, quantize_with)
    )


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
