"""One frozen options object per call: the target's defaults merged with explicit arguments.

:func:`resolve` is the only place where ``quantize()``'s keyword arguments, the CLI's flags and
``inspect`` meet a target: each option the caller left as None takes the target's value, the
combination is validated once, and automatic choices (7-bit weights on CPUs whose onnxruntime
kernels would clip) are made and explained once. Errors name the option the way the caller
wrote it: ``weight_bits=`` from Python, ``--weight-bits`` from the CLI.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from onnxq.annotate.config import UserConfig
from onnxq.annotate.quantizer import ACTIVATION_DTYPES, QuantizerConfig
from onnxq.annotate.targets import Target, get_target
from onnxq.calibrators import DEFAULT_METHOD, METHODS, method_callback
from onnxq.core.callbacks import CalibrationCallback
from onnxq.core.errors import ConfigError
from onnxq.io.hostcheck import auto_weight_bits, saturation_warning
from onnxq.io.loader import load_object
from onnxq.lower.formats import FORMATS, Format, get_format
from onnxq.patterns import default_patterns
from onnxq.patterns.rule import QuantizerPattern
from onnxq.prepare.kind import KINDS

_FLAG = object()


def spell(option: str, cli: bool, value: Any = _FLAG) -> str:
    """``option`` (with ``value``) as the caller writes it.

    From the CLI ``--weight-bits 8`` (a True flag is the bare ``--per-tensor``); from Python
    ``weight_bits=8``. Without a value: ``--weight-bits`` or ``weight_bits``.
    """
    if cli:
        flag = "--" + option.replace("_", "-")
        return flag if value is _FLAG or value is True else f"{flag} {value}"
    return option if value is _FLAG else f"{option}={value!r}"


#: the bias corrections quantize() runs after solving
BIAS_CORRECTIONS = ("auto", "none", "fast", "layerwise", "sequential")
SMOOTHQUANT = ("auto", "on", "off")
#: cross-layer equalization of Conv chains (onnxq.passes.equalize)
EQUALIZATIONS = ("auto", "on", "off")
DEPTHWISE_SCALINGS = ("auto", "off", "on")
#: how weights are rounded to their grid (onnxq.solve.rounding)
ROUNDINGS = ("auto", "nearest", "optimized")
#: ``recipe``: ``auto`` (chosen on held-back batches), ``fixed`` (auto's picks, every batch
#: fitted on) or one candidate's name, RANGES/ROUNDING/BIAS (onnxq.passes.choose)
RECIPES = ("auto", "fixed")
RECIPE_ROUNDINGS = ("nearest", "optimized")
RECIPE_BIASES = ("none", "fast", "layerwise", "sequential")
#: what the accuracy-driven fallback and onnxq debug return a group to (onnxq.fallback)
FALLBACKS = ("float", "int16")


def returned_label(fallback: str) -> str:
    """How summaries name the groups a fallback returned: "float", or "returned" under int16.

    Under int16 each went to int16 activations or, weight-dominated, to float.
    """
    return "float" if fallback == "float" else "returned"


#: CLI flags that are quantize() parameters, and the values each can take in a message
_PARAMETERS: dict[str, tuple[str, ...] | None] = {
    "format": tuple(FORMATS),
    "activation-dtype": ACTIVATION_DTYPES,
    "weight-dtype": ("int8", "int4"),
    "method": METHODS,
    "bias-correction": BIAS_CORRECTIONS,
    "smoothquant": SMOOTHQUANT,
    "equalization": EQUALIZATIONS,
    "depthwise-scaling": DEPTHWISE_SCALINGS,
    "rounding": ROUNDINGS,
    "model-kind": KINDS,
    "fallback": FALLBACKS,
    "budget": (),
    "recipe": None,
    "weight-bits": (),
    "bins": (),
    "percentile": (),
    "batch-size": (),
    "samples": (),
    "block-size": (),
    "target": None,
    "config": None,
    "exclude": None,
    "data": None,
    "preprocess": None,
    "callback": None,
    "save-ranges": None,
    "load-ranges": None,
    "output": None,
    "unsigned-after-relu": None,
    "symmetric-activations": None,
}
_FLAG_RE = re.compile(r"--([a-z][a-z0-9-]*)(?: ([A-Za-z0-9_./:-]+))?")


def pythonize(message: str) -> str:
    """``message`` with the CLI flags of quantize() options spelled as Python parameters.

    ``--weight-bits 8`` → ``weight_bits=8``, ``--format qdq`` → ``format='qdq'``,
    ``--per-tensor`` → ``per_channel=False``, ``--exclude`` → ``exclude``; other flags
    (CLI-only ones such as ``--target-file``) are left as they are.
    """

    def one(m: re.Match[str]) -> str:
        flag, value = m.group(1), m.group(2)
        tail = f" {value}" if value is not None else ""
        if flag in ("per-tensor", "per-channel"):
            return f"per_channel={flag == 'per-channel'}{tail}"
        if flag not in _PARAMETERS:
            return m.group(0)
        if flag == "exclude" and value is not None:  # a node name
            node = value.rstrip(".")
            return f"exclude=[{node!r}]{value[len(node) :]}"
        name, values = flag.replace("-", "_"), _PARAMETERS[flag]
        if value is not None and values is not None:
            if value in values:
                return f"{name}={value!r}"
            if values == () and re.fullmatch(r"-?[0-9.]+", value.rstrip(".")):
                number = value.rstrip(".")
                return f"{name}={number}{value[len(number) :]}"
        return f"{name}{tail}"

    return _FLAG_RE.sub(one, message)


@dataclass(frozen=True)
class Options:
    """What one ``quantize`` call is asked, as the caller writes it.

    ``onnxq.quantize(model, data, options=Options(...), **overrides)``: a keyword argument
    named as a field overrides the object's field, so one object can serve many calls
    (``quantize(m, d, options=base, method="mse")``). Left as None, a field takes the
    target's value; :func:`resolve` merges them and validates the whole once.
    """

    #: where the model will run: a target name (``ort-cpu``, the default; ``tensorrt``,
    #: ``openvino``, ``qnn``, ``generic``, or one from a target file) or a
    #: :class:`~onnxq.annotate.targets.Target`. It sets the defaults of format, activation
    #: dtype and symmetry, per-channel weights, weight bits and the patterns
    target: Any = None
    #: ``qoperator`` (QLinear ops, onnxruntime CPU), ``qdq`` (standard Q/DQ around float ops;
    #: the opset is raised to 13 when per-channel scales need it) or ``openvino`` (a float
    #: graph with FakeQuantize, run by the OpenVINO runtime)
    format: str | None = None
    #: one scale per output channel of each weight (False: one per tensor)
    per_channel: bool | None = None
    #: ``uint8``, ``int8`` or ``int16`` (QDQ only)
    activation_dtype: str | None = None
    symmetric_activations: bool | None = None
    #: uint8 for tensors that are never negative (after Relu) even with int8 activations
    unsigned_after_relu: bool | None = None
    #: 8, or 7 (weights in [-63, 63] for CPUs without VNNI; chosen on its own where this
    #: CPU's onnxruntime kernels would clip)
    weight_bits: int | None = None
    #: ``int8``, or ``int4`` (weight-only, standard QDQ with ``block_size``; no calibration)
    weight_dtype: str = "int8"
    block_size: int = 32
    #: node names (or ``re:`` patterns) left float
    exclude: Sequence[str] = ()
    #: the rules that annotate (default: the target's, ``onnxq.patterns.default_patterns()``)
    patterns: Sequence[QuantizerPattern] | None = None
    #: a per-node/per-op TOML file or dict (docs/usage.md)
    config: Any = None
    #: the calibrator: ``minmax``, ``average-max``, ``percentile``, ``entropy``, ``mse``
    #: (the default) or ``output-aware``; ``callback`` replaces it
    method: str = DEFAULT_METHOD
    #: your own :class:`~onnxq.core.callbacks.CalibrationCallback` (docs/python.md)
    callback: CalibrationCallback | None = None
    #: the percentile of the ``percentile`` method, and the histogram bins of the histogram
    #: methods
    percentile: float = 99.999
    bins: int = 2048
    #: samples per calibration batch (default: the data's own batches)
    batch_size: int | None = None
    #: at most this many calibration samples
    samples: int | None = None
    #: local processes for the calibration pass, each taking every N-th batch (the script
    #: must start under ``if __name__ == "__main__":``)
    workers: int = 1
    #: onnxruntime threads of each calibration process (default: onnxruntime's choice, or
    #: the cores shared out among the workers)
    threads: int | None = None
    #: run the calibration pass as Ray tasks: ``""`` on a local cluster started for the call,
    #: else the cluster's address (``"auto"``, ``"HOST:PORT"``); the data must be a folder,
    #: an ``.npz`` path or ``"module:function"`` taking ``(shard, shards)``
    ray: str | None = None
    #: how image files are turned into inputs (``"imagenet"``, ``"module:function"``, ...)
    preprocess: str | None = None
    #: write the chosen activation ranges as JSON, or reuse such a file instead of data
    save_ranges: str | os.PathLike[str] | None = None
    load_ranges: str | os.PathLike[str] | None = None
    #: a progress bar on stderr (default: when stderr is a terminal)
    progress: bool | None = None
    #: also write the model here, atomically (the input model is never modified)
    output: str | os.PathLike[str] | None = None
    #: time fp32 against int8 after quantizing and warn when int8 is slower
    latency_check: bool = False
    #: ``auto`` (sequential for CNNs), ``none``, ``fast`` (the mean shift the weight rounding
    #: causes), ``layerwise`` or ``sequential`` (the int8 model run layer after layer on the
    #: first 64 samples, each bias set so the layer's output mean matches the float layer's)
    bias_correction: str = "auto"
    #: activation outliers of MatMul/Gemm inputs moved into their weights: ``auto`` (on for
    #: transformers), ``on`` or ``off``
    smoothquant: str = "auto"
    #: channel ranges of Conv → [Relu/Clip/Pad] → Conv chains equalized (exact in float):
    #: ``auto`` (on for CNNs with per-tensor weights), ``on`` or ``off``
    equalization: str = "auto"
    #: each depthwise input's channels scaled into its filters where the factor folds
    #: upstream: ``auto`` (kept where the held-back batches score it higher), ``on`` or ``off``
    depthwise_scaling: str = "auto"
    #: weights rounded for the least output error on the layer's calibration inputs
    #: (GPTQ-style): ``auto`` (CNNs and transformers), ``nearest`` or ``optimized``
    rounding: str = "auto"
    #: what ``auto`` reads the model as: ``auto`` (from its graph), ``cnn``, ``transformer``,
    #: ``rnn`` or ``other``
    model_kind: str = "auto"
    #: the accuracy-driven fallback: the largest drop of the metric allowed; every 8th
    #: calibration batch is held back and the fewest groups go back to float until it holds
    max_drop: float | None = None
    #: your evaluation: ``"module:function"`` (or from Python the function) called with a
    #: model file's path, higher is better, one number or one per sample. It scores the recipe
    #: choice's candidates, or with ``max_drop`` the fallback's trials (default there: the
    #: mean output cosine with fp32, in %)
    metric: str | Callable[[str], Any] | None = None
    #: what the fallback returns a group to: ``float``, or ``int16`` activations (default:
    #: the target's)
    fallback: str | None = None
    #: seconds the whole call may take: default algorithms that would not fit are left out
    budget: float | None = None
    #: ``auto`` (the default): with 32 or more calibration batches, every 8th is held back
    #: and the candidates (ranges MSE or MinMax, rounding, bias correction) are each fitted on
    #: the rest and scored on them; the report lists each with its score. ``fixed``: auto's
    #: picks fitted on every batch. A name such as ``minmax/nearest/fast`` pins one candidate
    #: (ranges/rounding/bias correction) and fits it on every batch
    recipe: str = "auto"


def option_names() -> tuple[str, ...]:
    """The fields of :class:`Options`, in order."""
    return tuple(f.name for f in fields(Options))


def with_overrides(options: Options | None, overrides: dict[str, Any]) -> Options:
    """``options`` (default: a fresh :class:`Options`) with ``overrides`` written over it.

    An unknown name is refused, with the nearest known one.
    """
    if options is not None and not isinstance(options, Options):
        raise ConfigError(
            f"options must be an onnxq.Options, not {type(options).__name__}; "
            "write onnxq.Options(method='mse', ...) or pass the options as keywords"
        )
    names = option_names()
    for name in overrides:
        if name not in names:
            near = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(
                f"quantize() has no option {name!r}; {hint}the options are the fields of "
                "onnxq.Options (docs/python.md)"
            )
    return replace(options if options is not None else Options(), **overrides)


@dataclass(frozen=True)
class QuantizeOptions:
    """Everything one ``quantize`` call was asked, resolved against its target."""

    target: Target
    format: str
    per_channel: bool
    activation_dtype: str
    symmetric_activations: bool
    unsigned_after_relu: bool
    weight_bits: int
    weight_dtype: str = "int8"
    block_size: int = 32
    exclude: tuple[str, ...] = ()
    patterns: tuple[QuantizerPattern, ...] | None = None
    method: str = DEFAULT_METHOD
    callback: CalibrationCallback | None = None
    percentile: float = 99.999
    bins: int = 2048
    batch_size: int | None = None
    samples: int | None = None
    #: local processes the calibration pass runs on (see onnxq.calibrate.shards)
    workers: int = 1
    #: onnxruntime threads of each calibration process (None: see Calibrator.threads)
    threads: int | None = None
    #: run the calibration pass as Ray tasks: "" on a local cluster, else the cluster's
    #: address (None: no Ray; see onnxq.calibrate.cluster)
    ray: str | None = None
    preprocess: str | None = None
    save_ranges: str | os.PathLike[str] | None = None
    load_ranges: str | os.PathLike[str] | None = None
    user: UserConfig | None = None
    progress: bool | None = None
    output: str | os.PathLike[str] | None = None
    latency_check: bool = False
    #: the model is a body of a larger model (an If branch, a Loop/Scan body): ``--config``
    #: and ``exclude`` may name nodes of the other graphs
    body: bool = False
    #: bias correction after solving: "auto" (fast for CNNs), "none" or "fast"
    bias_correction: str = "auto"
    #: SmoothQuant before annotation: "auto" (on for transformers), "on" or "off"
    smoothquant: str = "auto"
    #: cross-layer equalization: "auto" (on for CNNs with per-tensor weights), "on" or "off"
    equalization: str = "auto"
    #: depthwise inputs scaled per channel into the filters (onnxq.passes.depthwise_scaling):
    #: "auto" (tried beside the unscaled model and kept where the held-back batches score it
    #: higher by more than their noise), "on" or "off"
    depthwise_scaling: str = "auto"
    #: weight rounding: "auto" (optimized for CNNs and transformers), "nearest" or "optimized"
    rounding: str = "auto"
    #: accuracy-driven fallback: the largest metric drop allowed (None: off); the caller's
    #: metric scores its trials, else the recipe choice's candidates (:attr:`choice_metric`)
    max_drop: float | None = None
    metric: str | Callable[[str], Any] | None = None
    #: what the fallback returns a group to: "float", or "int16" activations with int8
    #: weights (the default where the target runs them: Target.int16_activations)
    fallback: str = "float"
    #: the model's kind, or "auto" to read it from the graph (onnxq.prepare.kind)
    model_kind: str = "auto"
    #: seconds the whole call may take: default algorithms that would not fit are left out
    #: (None: no limit, every default runs; onnxq.passes.budget)
    budget: float | None = None
    #: "auto" (chosen on held-back batches: onnxq.passes.choose), "fixed", or the pinned
    #: candidate's name (its method, rounding and bias correction are set from it)
    recipe: str = "auto"
    #: choices onnxq made on its own (e.g. 7-bit weights), for the report
    notes: tuple[str, ...] = ()
    #: explicit choices this machine's runtime will not run exactly
    warnings: tuple[str, ...] = ()
    #: errors name CLI flags (True) or Python parameters (False)
    cli: bool = field(default=False, compare=False)

    @property
    def output_format(self) -> Format:
        """What the output format can hold and how it is lowered."""
        return get_format(self.format)

    @property
    def choice_metric(self) -> str | Callable[[str], Any] | None:
        """The caller's metric when it scores the recipe choice (``max_drop`` unset), or None."""
        return self.metric if self.max_drop is None else None

    def quantizer_config(self) -> QuantizerConfig:
        """The annotation's part of the options."""
        return QuantizerConfig(
            user=self.user,
            activation_dtype=self.activation_dtype,
            activation_symmetric=self.symmetric_activations,
            unsigned_after_relu=self.unsigned_after_relu,
            per_channel=self.per_channel,
            exclude=self.exclude,
            weight_bits=self.weight_bits,
            format=self.format,
            target=self.target.name,
            int16_activations=self.target.int16_activations,
            body=self.body,
        )

    def kept_float(self, model: Any) -> set[str]:
        """The nodes of ``model`` the call keeps float: ``exclude`` and ``keep_float`` entries.

        The passes that rewrite the float model before annotation (SmoothQuant, equalization)
        leave these alone, whichever way they were asked.
        """
        names = set(self.exclude)
        if self.user is not None:
            names |= {
                n.name for n in model.graph.node if self.user.resolve(n.name, n.op_type).keep_float
            }
        return names

    def named_nodes(self) -> set[str]:
        """The nodes the call names one by one: ``exclude`` and ``[node."…"]`` entries.

        A pass that rewrites the float model before annotation does not replace these (their
        names must still be there when the entries are applied).
        """
        names = set(self.exclude)
        if self.user is not None:
            names |= set(self.user.node)
        return names

    def asks(self, option: str, value: Any) -> bool:
        """The call or any node of its ``--config`` asks ``option`` = ``value``."""
        if getattr(self, option, None) == value:
            return True
        return self.user is not None and self.user.asks(option, value)

    def for_branches(self) -> QuantizeOptions:
        """The options an If branch is quantized with: the same choices, nothing written."""
        return replace(
            self, output=None, save_ranges=None, progress=False, latency_check=False, body=True
        )


def resolve(
    *,
    target: Any = None,
    format: str | None = None,
    per_channel: bool | None = None,
    activation_dtype: str | None = None,
    symmetric_activations: bool | None = None,
    unsigned_after_relu: bool | None = None,
    weight_bits: int | None = None,
    config: Any = None,
    patterns: Sequence[QuantizerPattern] | None = None,
    exclude: Sequence[str] = (),
    fallback: str | None = None,
    cli: bool = False,
    **rest: Any,
) -> QuantizeOptions:
    """Merge explicit options (not None) over ``target``'s defaults and validate them once.

    ``rest``: the options no target sets (method, callback, percentile, bins, batch_size,
    samples, workers, threads, ray, preprocess, save_ranges, load_ranges, progress, output,
    latency_check, weight_dtype, block_size). ``fallback`` None: the target's
    (:func:`fallback_for`).
    """
    tgt = target if isinstance(target, Target) else get_target(target or "ort-cpu")
    fmt = get_format(tgt.format if format is None else format, spell("format", cli))
    activation_dtype = tgt.activation_dtype if activation_dtype is None else activation_dtype
    symmetric = (
        tgt.symmetric_activations if symmetric_activations is None else symmetric_activations
    )
    unsigned = tgt.unsigned_after_relu if unsigned_after_relu is None else unsigned_after_relu
    if isinstance(config, Mapping):  # the TOML document as a dict
        user: UserConfig | None = UserConfig.from_dict(dict(config), "config")
    elif isinstance(config, UserConfig) or config is None:
        user = config
    elif isinstance(config, str | os.PathLike):
        user = UserConfig.load(config)
    else:
        raise ConfigError(
            f"config is a {type(config).__name__}; give a TOML file's path, its contents as a "
            "dict, or a UserConfig"
        )
    _check(fmt, activation_dtype, symmetric, unsigned, cli)
    bits, notes, warnings = _weight_bits(weight_bits, tgt, fmt, activation_dtype, unsigned, user)
    if rest.get("callback") is None and rest.get("load_ranges") is None:
        # an unknown method is refused before any model is read
        method_callback(
            rest.get("method", DEFAULT_METHOD),
            rest.get("percentile", 99.999),
            rest.get("bins", 2048),
        )
    for key, allowed in (
        ("bias_correction", BIAS_CORRECTIONS),
        ("smoothquant", SMOOTHQUANT),
        ("equalization", EQUALIZATIONS),
        ("rounding", ROUNDINGS),
        ("model_kind", KINDS),
    ):
        if rest.get(key, "auto") not in allowed:
            raise ConfigError(
                f"{spell(key, cli, rest[key])} is unknown; choose one of {', '.join(allowed)}"
            )
    if rest.get("depthwise_scaling", "auto") not in DEPTHWISE_SCALINGS:
        raise ConfigError(
            f"{spell('depthwise_scaling', cli, rest['depthwise_scaling'])} is unknown; choose "
            f"one of {', '.join(DEPTHWISE_SCALINGS)}"
        )
    rest.update(pinned(rest.get("recipe", "auto"), cli))
    max_drop = rest.get("max_drop")
    if max_drop is not None and (
        isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) or not max_drop >= 0
    ):
        raise ConfigError(
            f"{spell('max_drop', cli, max_drop)} must be a number ≥ 0 (metric points)"
        )
    budget = rest.get("budget")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0
    ):
        raise ConfigError(f"{spell('budget', cli, budget)} must be a number of seconds > 0")
    metric = rest.get("metric")
    if metric is not None and not (isinstance(metric, str) or callable(metric)):
        raise ConfigError(
            f"{spell('metric', cli)} is a {type(metric).__name__}; give 'module:function' or "
            "a function taking a model file's path"
        )
    if metric is not None and max_drop is None:
        _check_metric_choice(rest, cli)
    # loaded now: a metric that cannot be is refused before any data is read
    if isinstance(metric, str) and not callable(load_object(metric, spell("metric", cli))):
        raise ConfigError(f"{spell('metric', cli)} {metric!r} is not a function")
    if patterns is None and tgt.patterns is not None:
        patterns = target_patterns(tgt)
    fallback = fallback_for(tgt, fmt, activation_dtype, symmetric, fallback, cli)
    return QuantizeOptions(
        target=tgt,
        format=fmt.name,
        per_channel=tgt.per_channel if per_channel is None else per_channel,
        activation_dtype=activation_dtype,
        symmetric_activations=symmetric,
        unsigned_after_relu=unsigned,
        weight_bits=bits,
        exclude=tuple(exclude),
        fallback=fallback,
        patterns=None if patterns is None else tuple(patterns),
        user=user,
        notes=tuple(notes),
        warnings=tuple(warnings),
        cli=cli,
        **rest,
    )


def pinned(recipe: str, cli: bool) -> dict[str, str]:
    """The options a recipe name sets: {} for ``auto`` and ``fixed``.

    ``RANGES/ROUNDING/BIAS``, e.g. ``minmax/nearest/fast``: the calibration method, the
    weight rounding and the bias correction of one candidate of the held-back choice.
    """
    if recipe in RECIPES:
        return {}
    parts = recipe.split("/") if isinstance(recipe, str) else []
    if (
        len(parts) != 3
        or parts[0] not in METHODS
        or parts[1] not in RECIPE_ROUNDINGS
        or parts[2] not in RECIPE_BIASES
    ):
        raise ConfigError(
            f"{spell('recipe', cli, recipe)} is unknown; give auto, fixed or "
            f"RANGES/ROUNDING/BIAS with RANGES one of {', '.join(METHODS)}, ROUNDING one of "
            f"{', '.join(RECIPE_ROUNDINGS)} and BIAS one of {', '.join(RECIPE_BIASES)} "
            "(e.g. mse/optimized/sequential; the report lists the candidates it scored)"
        )
    return {"method": parts[0], "rounding": parts[1], "bias_correction": parts[2]}


def fallback_for(
    tgt: Target,
    fmt: Format,
    activation_dtype: str,
    symmetric: bool,
    fallback: str | None,
    cli: bool,
) -> str:
    """What the fallback returns a group to: ``fallback``, else the target's choice.

    The target's: int16 activations where it runs them (Target.int16_activations) and the
    format writes them, else float. Asked for explicitly, int16 needs a format with int16
    activations, 8-bit activations elsewhere, and on a target of symmetric activations one
    that declares int16 ones (TensorRT runs none).
    """
    if fallback is None:
        runs = tgt.int16_activations and fmt.int16 and activation_dtype != "int16"
        return "int16" if runs else "float"
    if fallback not in FALLBACKS:
        raise ConfigError(
            f"{spell('fallback', cli, fallback)} is unknown; choose one of {', '.join(FALLBACKS)}"
        )
    if fallback == "int16" and not fmt.int16:
        raise ConfigError(
            f"{spell('fallback', cli, 'int16')} returns groups to int16 activations, written as "
            f"QDQ (opset 21); {spell('format', cli, fmt.name)} has none — add "
            f"{spell('format', cli, 'qdq')}"
        )
    if fallback == "int16" and activation_dtype == "int16":
        raise ConfigError(
            f"{spell('fallback', cli, 'int16')}: the activations are int16 already; use "
            f"{spell('fallback', cli, 'float')}"
        )
    if fallback == "int16" and symmetric and not tgt.int16_activations:
        raise ConfigError(
            f"{spell('fallback', cli, 'int16')}: target '{tgt.name}' runs symmetric "
            f"{activation_dtype} activations only; a target whose runtime runs int16 ones "
            "declares int16_activations = true in its [target.NAME] table"
        )
    return fallback


def _check_metric_choice(rest: dict[str, Any], cli: bool) -> None:
    """``metric`` without ``max_drop`` scores the recipe choice: refuse what turns it off.

    What the data decides (too few batches to hold some back) is said in the report instead.
    """
    recipe = rest.get("recipe", "auto")
    off = ""
    if recipe != "auto":
        off = f"{spell('recipe', cli, recipe)} pins one recipe"
    elif all(
        rest.get(name, "auto") not in ("auto", DEFAULT_METHOD)
        for name in ("method", "rounding", "bias_correction")
    ):
        off = "the method, rounding and bias correction are all set (one candidate)"
    else:
        given = [n for n in ("callback", "load_ranges", "ray", "budget") if rest.get(n) is not None]
        if given:
            off = f"{spell(given[0], cli)} turns the choice off"
    if off:
        raise ConfigError(
            f"{spell('metric', cli)} scores the recipe choice (or, with {spell('max_drop', cli)}, "
            f"the accuracy-driven fallback), but {off}; drop one of them"
        )


def _check(fmt: Format, activation_dtype: str, symmetric: bool, unsigned: bool, cli: bool) -> None:
    """Combinations no output can hold."""

    def f(option: str, value: Any = _FLAG) -> str:
        return spell(option, cli, value)

    if unsigned:
        if not (symmetric and activation_dtype == "int8"):
            raise ConfigError(
                f"{f('unsigned_after_relu')} applies to symmetric int8 activations: add "
                f"{f('activation_dtype', 'int8')} {f('symmetric_activations', True)} (asymmetric "
                "uint8 already gives a Relu output the range [0, max])"
            )
        if not fmt.mixed_activation_dtypes:
            raise ConfigError(
                f"{f('unsigned_after_relu')} mixes uint8 and int8 activations, which "
                f"onnxruntime's QLinear kernels do not take in one op; use {f('format', 'qdq')} "
                f"or {f('format', 'openvino')}"
            )
    if activation_dtype == "int16" and not fmt.int16:
        raise ConfigError(
            f"int16 activations are written as QDQ (opset 21); {f('format', fmt.name)} has no "
            f"int16 kernels — add {f('format', 'qdq')}"
        )


def _weight_bits(
    requested: int | None,
    tgt: Target,
    fmt: Format,
    activation_dtype: str,
    unsigned_after_relu: bool,
    user: UserConfig | None,
) -> tuple[int, list[str], list[str]]:
    """Resolve the weight bits: explicit, the target's, or ``auto`` (see onnxq.io.hostcheck).

    Returns the bits, the notes explaining an automatic choice and the warnings for an explicit
    8-bit choice that this machine's runtime would clip.
    """
    # onnxruntime runs QDQ through its U8S8 kernels whatever the activation dtype (it turns
    # int8 QDQ into uint8 on x86), OpenVINO its FakeQuantize models alike; only the int8
    # QLinear ops of QOperator output are exact
    runtime = fmt.runtime if fmt.runtime != "onnxruntime" else tgt.runtime
    clipping_path = not fmt.exact_int8_activations or (
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


def target_patterns(tgt: Target) -> list[QuantizerPattern]:
    """The rules ``tgt`` names, one instance each, from the library (onnxq.patterns)."""
    library = {p.label(): p for p in default_patterns()}
    unknown = [n for n in tgt.patterns or () if n not in library]
    if unknown:
        raise ConfigError(
            f"target {tgt.name!r} names pattern(s) {unknown} that onnxq does not "
            f"have; known patterns: {', '.join(sorted(library))}"
        )
    return [library[n] for n in tgt.patterns or ()]
