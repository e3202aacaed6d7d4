"""The Quantizer: match QuantizerPatterns and annotate each group with frozen specs.

The rules annotate (``onnxq.patterns.rule``): each group becomes a PatternRecord naming its
quantized edges (QTensor: dtype, axis, symmetry, placeholders) and the op it becomes. Every scale
and zero point is a placeholder with a deterministic name (``<tensor>_scale``,
``<tensor>_zero_point``); quantized weights and biases are *derived* placeholders
(``<weight>_quantized``, ``<node>.bias_quantized``) computed from the float constants once the
scales are known. The Quantizer only annotates: the output format's writer turns the records
into the *template*, a valid ONNX model holding the placeholders, when it is first asked for
(:meth:`Quantizer.template_of`: QOperator, onnxq.lower.qoperator, or its sibling QDQ,
onnxq.lower.qdq); :meth:`Quantizer.materialize` (``onnxq.lower.materialize``) turns values for
them into a concrete model.

One set of parameters exists per tensor edge: a tensor read by two patterns is quantized by one
QuantizeLinear node whose parameters both patterns share, and a pattern's output placeholder is
the same one the next pattern's input uses, so the Requantizer can fold the DQ→Q pair.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxq.annotate.config import most_specific
from onnxq.annotate.explain import explain
from onnxq.annotate.placement import attention_masks, expectations
from onnxq.core.errors import ConfigError, QuantizationError
from onnxq.core.specs import (
    BiasDerivation,
    Decision,
    PatternRecord,
    Placeholder,
    QTensor,
    WeightDerivation,
)
from onnxq.io.graph import (
    GraphEditor,
    constant_value,
    copy_graph,
    graphs_of,
    in_file,
    is_file_weight,
    load_model,
    node_label,
    producer,
    tensor_array,
)
from onnxq.io.text import shown
from onnxq.lower.formats import WRITERS, Format, get_format
from onnxq.lower.materialize import materialize, materialize_graph
from onnxq.lower.qoperator import Template
from onnxq.match.dfpattern import Match
from onnxq.match.rewrite import Partition, partition
from onnxq.patterns import default_patterns
from onnxq.patterns.rule import QuantizerPattern
from onnxq.prepare.opset import default_opset
from onnxq.prepare.preprocess import prepare, unique_names

ACTIVATION_DTYPES = ("uint8", "int8", "int16")


def _names(graph: gs.Graph, top: bool = True) -> list[tuple[str, str]]:
    """(name, op) of the nodes of ``graph`` and of the If/Loop/Scan bodies nested in it.

    A body's unnamed nodes by the name its own preprocessing gives them when it is quantized
    (onnxq.prepare.preprocess: op and first output, made unique within the body), the name
    ``inspect`` shows.
    """
    nodes = list(graph.nodes)
    bases = [_base_name(n.name, n.op, n.outputs[0].name if n.outputs else None) for n in nodes]
    out = list(zip([n.name for n in nodes] if top else unique_names(bases), [n.op for n in nodes]))
    for n in nodes:
        for v in n.attrs.values():
            if isinstance(v, gs.Graph):
                out += _names(v, top=False)
    return out


def _base_name(name: str, op: str, first_output: str | None) -> str:
    """A body node's name before it is made unique: its own, else its op and first output."""
    return name or f"{op}_{first_output if first_output is not None else 'node'}"


def all_node_names(graph: gs.Graph) -> set[str]:
    """Node names of ``graph``, its bodies included.

    ``--config`` and ``--exclude`` reach them: each body is quantized with the call's options.
    """
    return {name for name, _ in _names(graph)}


def all_op_types(graph: gs.Graph) -> set[str]:
    """Op types of ``graph``, its bodies included."""
    return {op for _, op in _names(graph)}


@dataclass(frozen=True)
class QuantizerConfig:
    """What the user asks for. Validated on creation."""

    activation_dtype: str = "uint8"
    activation_symmetric: bool = False
    weight_dtype: str = "int8"
    per_channel: bool = True
    exclude: tuple[str, ...] = ()
    weight_bits: int = 8
    #: symmetric int8 activations, except tensors a Relu makes non-negative: uint8, zero point 0
    #: (twice the resolution there; OpenVINO's convention)
    unsigned_after_relu: bool = False
    #: per-node settings (onnxq.annotate.config.UserConfig) from --config
    user: Any = None
    #: the output format (QDQ islands need qdq or openvino)
    format: str = "qoperator"
    #: the target's name, for messages about requests it cannot run
    target: str = "ort-cpu"
    #: the target runs int16 activations next to its symmetric 8-bit ones
    #: (Target.int16_activations)
    int16_activations: bool = False
    #: the model is a body of a larger model: ``user`` and ``exclude`` may name nodes of the
    #: other graphs (the outer model checked them)
    body: bool = False

    def __post_init__(self) -> None:
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ConfigError(
                f"activation dtype {self.activation_dtype!r} is not supported; use uint8 or int8"
            )
        if self.weight_dtype != "int8":
            raise ConfigError(f"weight dtype {self.weight_dtype!r} is not supported; use int8")
        if self.weight_bits not in (7, 8):
            raise ConfigError(f"--weight-bits {self.weight_bits} is not supported; use 8 or 7")
        object.__setattr__(self, "exclude", tuple(self.exclude))

    def refused_dtype(self, dtype: str) -> str:
        """Why a per-node request for activations of ``dtype`` cannot run here ('' if it can)."""
        if dtype == "int16" and not get_format(self.format).int16:
            return (
                f"--format {self.format} has no int16 kernels (int16 activations need --format qdq)"
            )
        if self.activation_symmetric and dtype != self.activation_dtype:
            if dtype == "int16" and self.int16_activations:
                return ""  # symmetric int16 (zero point 0), as its 8-bit ones
            return f"target '{self.target}' runs symmetric {self.activation_dtype} activations only"
        return ""

    @property
    def output(self) -> Format:
        """The output format: what it can hold (onnxq.lower.formats)."""
        return get_format(self.format)

    @property
    def int4_refused(self) -> str:
        """Why per-node int4 weights cannot be written in this format ('' when they can)."""
        return "" if get_format(self.format).int4 else "FakeQuantize output has 8-bit weights only"


def refuse_shared_names(model: onnx.ModelProto, exclude: Sequence[str]) -> None:
    """An ``--exclude`` name that several nodes share is ambiguous: refused, with the matches.

    Preprocessing gives each node a unique name (``mm``, ``mm_1``, ``mm_2``), so the name
    matched one of them, silently.
    """
    counts = Counter(n.name for n in model.graph.node if n.name in set(exclude))
    shared = sorted(name for name, k in counts.items() if k > 1)
    if shared:
        name = shared[0]
        given = [n.name or "\0" for n in model.graph.node]  # unnamed: never the name asked
        renamed = [r for g, r in zip(given, unique_names(given), strict=True) if g == name]
        raise ConfigError(
            f"--exclude {shown(name)} is ambiguous: {counts[name]} nodes of the model are "
            f"named so; onnxq names them {', '.join(shown(r) for r in renamed)} (`onnxq "
            "inspect MODEL --explain` lists them): exclude those names"
        )


def body_node_names(model: onnx.ModelProto, exclude: Sequence[str]) -> tuple[str, ...]:
    """Node names (``exclude``, ``[node."…"]`` keys), a body node's given as ``inspect`` does plain.

    ``inspect --explain`` and the report's decisions name a node of an If branch or a Loop/Scan
    body ``HOLDER/ATTRIBUTE/NODE`` (``If_0/then_branch/…/stft/Conv``); each body is quantized
    as a model of its own, where the node is ``NODE``. A name that is a node of the main graph,
    or that names no body's node, stays as it is (refused later with the name as given).
    """
    top = {n.name for n in model.graph.node}

    def resolve(graph: onnx.GraphProto, name: str) -> str | None:
        for node in graph.node:
            for attr, body in graphs_of(node):
                prefix = f"{node.name}/{attr}/"
                if not node.name or not name.startswith(prefix):
                    continue
                rest = name[len(prefix) :]
                # a body's unnamed nodes by the names its own preprocessing gives them
                bases = [
                    _base_name(n.name, n.op_type, n.output[0] if n.output else None)
                    for n in body.node
                ]
                if rest in set(unique_names(bases)):
                    return rest
                deeper = resolve(body, rest)
                if deeper is not None:
                    return deeper
        return None

    return tuple(e if e in top else resolve(model.graph, e) or e for e in exclude)


class Quantizer:
    """Match ``patterns`` in ``model`` and annotate every group (templates are written on demand).

    ``model`` is a path or ModelProto (never modified); ``patterns`` defaults to
    ``onnxq.patterns.default_patterns()``; ``kept_float``: nodes an earlier pass added that stay
    float, with the reason the decisions give (SmoothQuant's Mul by 1/s); ``copy=False``: a
    ModelProto the caller gives up (it is not copied first; the pipeline's own model);
    ``prepared``: ``model`` is preprocessed already (onnxq.prepare.preprocess.prepare) and
    this is its graph, taken as the float graph instead of preprocessing again.
    """

    def __init__(
        self,
        model: Any,
        patterns: Sequence[QuantizerPattern] | None = None,
        config: QuantizerConfig | None = None,
        kept_float: dict[str, str] | None = None,
        copy: bool = True,
        prepared: gs.Graph | None = None,
    ):
        self.config = config or QuantizerConfig()
        # copy=False: the caller hands its (checked) ModelProto over and keeps no reference,
        # so the preprocessed copy replaces it instead of joining it (a model's worth of memory)
        proto = load_model(model) if copy or not isinstance(model, onnx.ModelProto) else model
        del model
        self.float_model: onnx.ModelProto
        if prepared is not None:  # preprocessed already (onnxq.passes.prepare), with its graph
            self.float_model, float_graph = proto, prepared
        else:
            refuse_shared_names(proto, self.config.exclude)
            self.float_model, float_graph = prepare(proto, self.config.exclude)
        del proto
        self.patterns = list(patterns) if patterns is not None else default_patterns()
        self.records: list[PatternRecord] = []
        self.placeholders: dict[str, Placeholder] = {}
        #: why each node of the float model is or is not quantized (onnxq.annotate.explain)
        self.decisions: dict[str, Decision] = {}
        #: quantized weights and int32 biases, derived from float constants once scales are known
        self.weights: dict[str, WeightDerivation] = {}
        self.biases: dict[str, BiasDerivation] = {}
        self._qtensors: dict[str, QTensor] = {}
        #: (tensor, kind, requested name) -> placeholder; a tensor read in two dtypes has two
        self._by_tensor: dict[tuple[str, str, str], str] = {}
        self._float_values: dict[str, np.ndarray] = {}
        #: weights equal to an initializer of float_model: read from it when needed instead of
        #: held as a second copy (VGG19: 548 MB)
        self._float_inits = {i.name: i for i in self.float_model.graph.initializer}
        self._lazy_floats: set[str] = set()
        #: node -> (rule, reason) for groups a rule matched and left float
        self.left_float: dict[str, tuple[str, str]] = {}
        #: the float model as a graph (preprocessing's: the one import); the annotation
        #: rewrites a copy of it
        self._float_graph: gs.Graph = float_graph
        #: scales and zero points of the last materialized model (after bias widening)
        self.final_values: dict[str, np.ndarray] = {}
        #: biases whose weight scale was widened so bias + accumulation fit int32: channels
        self.widened_biases: dict[str, int] = {}

        graph = copy_graph(self._float_graph)
        self._check_exclusions(graph)
        self.editor = GraphEditor(graph)
        for p in self.patterns:
            p.quantizer = self
        excluded = set(self.config.exclude)
        kept: dict[str, str] = {}
        #: calibration method per node from the user configuration, and its priority level
        self.node_methods: dict[str, str] = {}
        self.node_method_levels: dict[str, int] = {}
        #: activation dtype per node from the user configuration (--config activation_dtype)
        self.node_dtypes: dict[str, str] = {}
        self.node_dtype_sources: dict[str, str] = {}
        self.node_dtype_levels: dict[str, int] = {}
        #: per-channel weights per node (--config per_channel)
        self.node_per_channel: dict[str, bool] = {}
        self.node_per_channel_levels: dict[str, int] = {}
        #: MatMul/Gemm nodes whose weights become block-wise int4 (--config weight_dtype)
        self.int4_nodes: dict[str, str] = {}
        #: requests the target cannot run, per node, and the warnings they raise
        self.ignored: dict[str, list[str]] = {}
        self.warnings: list[str] = []
        #: the activation dtype and per-channel setting of the group being rewritten
        self._group_dtype: str | None = None
        self._group_per_channel: bool | None = None
        if self.config.user is not None:
            self._resolve_user(graph, kept)
        #: nodes the graph itself keeps float (onnxq.annotate.placement), and why
        placed = {**attention_masks(graph), **expectations(graph), **(kept_float or {})}
        self.placement = {n: w for n, w in placed.items() if n not in kept}
        kept.update(self.placement)
        part = self._annotate(graph, excluded, kept)
        self.decisions = explain(self, part)
        #: the annotation written in each form asked for so far (:meth:`template_of`)
        self._templates: dict[str, Template] = {}

    def template_of(self, form: str | None = None) -> Template:
        """The annotation written in ``form`` ("qoperator" or "qdq"; None: the output format's).

        Written on first use, from the records, by the form's writer (onnxq.lower.formats),
        into a copy of the annotated graph: the QOperator and QDQ lowerings are siblings.
        """
        writer = self.config.output.writer if form is None else WRITERS[form]
        if writer.form not in self._templates:
            editor = self.editor.fork()
            write = writer(editor.graph, editor, self.placeholders)
            self._templates[writer.form] = write.write_all(self.records, self.float_model)
        return self._templates[writer.form]

    @property
    def template(self) -> onnx.ModelProto:
        """The output format's template: a valid model whose placeholders hold defaults."""
        return self.template_of().model

    @property
    def template_graph(self) -> gs.Graph:
        """:attr:`template` as a graph (materialize_graph fills a copy of it)."""
        return self.template_of().graph

    def _annotate(self, graph: gs.Graph, excluded: set[str], kept: dict[str, str]) -> Partition:
        """Partition ``graph`` into groups and let each group's rule annotate it."""
        part = partition(
            self.patterns,
            graph,
            node_filter=lambda n: (
                f"{node_label(n)} is in --exclude"
                if n.name in excluded
                else f"{node_label(n)} is kept float by {kept[n.name]}"
                if n.name in kept
                else None
            ),
        )
        for p in self.patterns:
            p.partition = part
        for g in part.groups:
            rule = g.callback
            assert isinstance(rule, QuantizerPattern)  # partitioned from self.patterns
            rec = rule.annotate_match(g.match)
            if rec is not None:
                self.records.append(rec)
        return part

    def _resolve_user(self, graph: gs.Graph, kept: dict[str, str]) -> None:
        """Apply --config to every node; requests the target cannot run are ignored (warned)."""
        user = self.config.user
        missing = [] if self.config.body else user.unknown_nodes(all_node_names(graph))
        if missing:
            raise ConfigError(
                f"{user.path} names node(s) {shown(str(missing))} that are not in the "
                "model; `onnxq inspect MODEL` lists node names"
            )
        absent = set() if self.config.body else user.unknown_op_types(all_op_types(graph))
        if absent:
            self.warnings.append(
                f"{user.path} configures op type(s) {shown(str(absent))} that the model does "
                "not have; those tables change nothing (`onnxq inspect MODEL` lists its ops)"
            )
        for n in graph.nodes:
            st = user.resolve(n.name, n.op)
            if st.keep_float:
                kept[n.name] = f"--config ({st.sources['keep_float']})"
            if st.method is not None:
                self.node_methods[n.name] = st.method
                self.node_method_levels[n.name] = st.level("method")
            dt = st.activation_dtype
            where = f"--config {st.sources.get('activation_dtype')}"
            refused = self.config.refused_dtype(dt) if dt is not None else ""
            if refused:
                self._ignore(n.name, f"activation_dtype {dt} ({where}) is ignored: {refused}")
            elif dt is not None:
                self.node_dtypes[n.name] = dt
                self.node_dtype_sources[n.name] = where
                self.node_dtype_levels[n.name] = st.level("activation_dtype")
            if st.per_channel is not None:
                self.node_per_channel[n.name] = st.per_channel
                self.node_per_channel_levels[n.name] = st.level("per_channel")
            if st.weight_dtype == "int4":
                where = f"--config {st.sources['weight_dtype']}"
                why = self.config.int4_refused or _int4_unfit(n)
                if why:
                    self._ignore(n.name, f"weight_dtype int4 ({where}) is ignored: {why}")
                else:
                    self.int4_nodes[n.name] = where
                    kept[n.name] = f"{where}: weights int4 block-wise, activations float"

    def _ignore(self, node: str, why: str) -> None:
        self.ignored.setdefault(node, []).append(why)
        self.warnings.append(f"node '{node}': {why}")

    # ----------------------------------------------------------------------------------------
    # helpers used by QuantizerPattern.quantize_match

    def quantize_input(self, tensor: gs.Tensor) -> QTensor:
        """The spec of activation ``tensor`` as an input (one per tensor and dtype, shared)."""
        key = f"{tensor.name}#{self._activation_dtype(tensor)[0]}"
        if key not in self._qtensors:
            self._qtensors[key] = self._activation_qtensor(tensor)
        return self._qtensors[key]

    def quantize_output(self, root: gs.Tensor) -> QTensor:
        """The spec of the quantized form of ``root``, the tensor a group produces."""
        return self._activation_qtensor(root, output=True)

    def quantize_weight(self, tensor: gs.Tensor, axis: int | None) -> QTensor:
        """The spec of constant ``tensor`` as an int8 weight, per channel on ``axis``.

        The int8 values are derived from the float constant once the scale is solved.
        """
        value = constant_value(tensor)
        if value is None:
            raise QuantizationError(
                f"weight '{tensor.name}' is not constant; onnxq quantizes only "
                "constant weights — fold it first or exclude the node"
            )
        per_channel = self._group_per_channel
        if per_channel is None:
            per_channel = self.config.per_channel
        axis = axis if per_channel else None
        key = f"{tensor.name}@{axis}"
        if key in self._qtensors:
            return self._qtensors[key]
        base = tensor.name
        shape = (value.shape[axis],) if axis is not None else ()
        wdt = self.config.weight_dtype
        scale = self._placeholder(f"{base}_scale", "scale", base, "float32", shape)
        zp = self._placeholder(f"{base}_zero_point", "zero_point", base, wdt, shape)
        q = self._placeholder(f"{base}_quantized", "weight", base, wdt, tuple(value.shape))
        self._keep_float(base, value, in_file(tensor))
        qt = QTensor(base, q, scale, zp, "weight", wdt, axis, True, self.config.weight_bits)
        self.weights[q] = WeightDerivation(base, scale, zp, axis)
        self._qtensors[key] = qt
        return qt

    def quantize_bias(self, node: gs.Node, bias: np.ndarray, x: QTensor, w: QTensor) -> str:
        """The placeholder of an int32 bias with scale ``s_x · s_w`` and zero point 0."""
        name = f"{node.name or node.outputs[0].name}.bias"
        self._float_values[name] = np.asarray(bias, np.float32).reshape(-1)
        q = self._placeholder(f"{name}_quantized", "bias", name, "int32", (int(bias.size),))
        self.biases[q] = BiasDerivation(
            name, x.scale, w.scale, w.axis, w.tensor, x.zero_point, x.dtype
        )
        return q

    def _activation_dtype(self, tensor: gs.Tensor) -> tuple[str, bool]:
        """(dtype, symmetric) of ``tensor`` as the group being rewritten reads or writes it."""
        dt = self._group_dtype or self.config.activation_dtype
        symmetric = self.config.activation_symmetric
        if self.config.unsigned_after_relu and symmetric and dt == "int8" and _after_relu(tensor):
            dt, symmetric = "uint8", False  # range [0, max]: the zero point comes out 0
        return dt, symmetric

    def _activation_qtensor(self, tensor: gs.Tensor, output: bool = False) -> QTensor:
        name = tensor.name
        dt, symmetric = self._activation_dtype(tensor)
        # a tensor read in another dtype than the global one (--config activation_dtype) gets
        # its own parameters; where it meets the other dtype a DQ→Q rescale stays in the model
        base = (
            name
            if dt == self.config.activation_dtype or self._group_dtype is None
            else f"{name}_{dt}"
        )
        scale = self._placeholder(f"{base}_scale", "scale", name, "float32", (), reuse=True)
        zp = self._placeholder(f"{base}_zero_point", "zero_point", name, dt, (), reuse=True)
        qname = self.editor.unique_name(f"{name}_quantized")
        return QTensor(name, qname, scale, zp, "activation", dt, None, symmetric)

    def _placeholder(
        self,
        name: str,
        kind: str,
        tensor: str,
        dtype: str,
        shape: tuple[int, ...],
        reuse: bool = False,
    ) -> str:
        key = (tensor, kind, name)  # one placeholder per tensor, kind and view (dtype)
        if reuse and key in self._by_tensor:
            return self._by_tensor[key]
        final = self.editor.unique_name(name)
        self._by_tensor.setdefault(key, final)
        self.placeholders[final] = Placeholder(final, kind, tensor, dtype, shape)
        return final

    # ----------------------------------------------------------------------------------------
    # bookkeeping

    def _check_exclusions(self, graph: gs.Graph) -> None:
        names = all_node_names(graph)
        missing = [] if self.config.body else [e for e in self.config.exclude if e not in names]
        if missing:
            raise ConfigError(
                f"--exclude: node(s) {missing} are not in the model; "
                "`onnxq inspect MODEL --explain` lists node names"
            )

    @property
    def opset(self) -> int:
        """The float model's ai.onnx opset (after any raise the output format needed)."""
        return default_opset(self.float_model)

    @property
    def float_graph(self) -> gs.Graph:
        """The float model as a graph, imported once and shared by the stages that read it.

        Read it, never change it: a stage that rewrites the float graph (the annotation, the
        FakeQuantize lowering) works on a copy (onnxq.io.graph.copy_graph).
        """
        return self._float_graph

    def is_left_float(self, node: str) -> bool:
        """A rule matched ``node`` and left its group float (:meth:`leave_float`)."""
        return node in self.left_float

    @contextlib.contextmanager
    def group(self, nodes: list[str]) -> Iterator[None]:
        """The scope of one group's rewrite: its per-node dtype and per-channel settings apply.

        Among the group's nodes the most specific setting wins, as for the calibration
        method: a dtype named for the Conv beats a global one reaching its folded Relu.
        """
        self._group_dtype = most_specific(nodes, self.node_dtypes, self.node_dtype_levels)
        self._group_per_channel = most_specific(
            nodes, self.node_per_channel, self.node_per_channel_levels
        )
        try:
            yield
        finally:
            self._group_dtype = self._group_per_channel = None

    def leave_float(self, pattern: QuantizerPattern, m: Match, reason: str) -> None:
        """Record why a matched group is left float (the callback then returns None)."""
        for n in m.nodes:
            self.left_float[n.name] = (pattern.label(), reason)

    # ----------------------------------------------------------------------------------------
    # placeholders → concrete model

    def float_value(self, name: str) -> np.ndarray:
        """The float value of a quantized weight or bias."""
        if name in self._lazy_floats:
            return tensor_array(self._float_inits[name])
        return self._float_values[name]

    def has_float_value(self, name: str) -> bool:
        """Whether ``name`` is a quantized weight or bias (with a float value)."""
        return name in self._float_values or name in self._lazy_floats

    def _keep_float(self, name: str, value: np.ndarray, from_file: bool = False) -> None:
        """Remember a weight's float value: as the float model's initializer where it is one.

        ``from_file``: the value was read from the model's data file, where the float
        model's initializer of that name also stays (no need to compare them).
        """
        init = self._float_inits.get(name)
        if (
            init is not None
            and init.data_type == onnx.TensorProto.FLOAT
            and ((from_file and is_file_weight(init)) or np.array_equal(tensor_array(init), value))
        ):
            self._lazy_floats.add(name)
        else:
            self._float_values[name] = np.asarray(value, np.float32)

    def materialize(
        self,
        values: dict[str, np.ndarray],
        constants: dict[str, np.ndarray] | None = None,
        form: str | None = None,
    ) -> onnx.ModelProto:
        """The template with ``values`` for the scale/zero-point placeholders and derived weights.

        Missing placeholders keep their defaults (scale 1, zero point 0). Biases that would
        overflow int32 enlarge their weight's scale (per channel) instead of being clipped;
        ``final_values`` and ``widened_biases`` then say what the model holds
        (onnxq.lower.materialize). ``constants``: float biases and weights to use instead
        of the model's, by name (bias correction, optimized rounding). ``form``: the
        template's ("qoperator" or "qdq"; None: the output format's).
        """
        done = materialize(self, values, constants, form)
        self.final_values, self.widened_biases = done.values, done.widened
        return done.model

    def materialize_graph(
        self, values: dict[str, np.ndarray], constants: dict[str, np.ndarray] | None = None
    ) -> gs.Graph:
        """:meth:`materialize` as a graph of its own, for the passes that edit it further."""
        graph, self.final_values, self.widened_biases = materialize_graph(self, values, constants)
        return graph

    def records_in_order(self) -> list[PatternRecord]:
        """Records in the float model's topological order."""
        order = {}
        for i, node in enumerate(self.float_model.graph.node):
            order[node.name or node.output[0]] = i
        return sorted(self.records, key=lambda r: min(order.get(n, 0) for n in r.nodes))


def _int4_unfit(node: gs.Node) -> str:
    """Why ``node`` cannot take block-wise int4 weights ('' when it can)."""
    if node.op not in ("MatMul", "Gemm"):
        return f"int4 weights are block-wise for MatMul and Gemm only, not {node.op}"
    if len(node.inputs) < 2 or constant_value(node.inputs[1]) is None:
        return "its weight (input 1) is not a constant"
    return ""


def _after_relu(tensor: gs.Tensor) -> bool:
    """``tensor`` is non-negative by construction: a Relu's output, or a Clip's with min ≥ 0."""
    node = producer(tensor)
    if node is None:
        return False
    if node.op == "Relu":
        return True
    if node.op != "Clip":
        return False
    if len(node.inputs) >= 2 and node.inputs[1].name:  # opset ≥ 11: min is an input
        value = constant_value(node.inputs[1])
        return value is not None and float(np.asarray(value).reshape(-1)[0]) >= 0.0
    low = node.attrs.get("min")  # opset < 11: an attribute
    return low is not None and float(low) >= 0.0
