"""Dataflow patterns over onnx-graphsurgeon graphs (private; the public face is onnxq.pattern).

A pattern matches a *tensor* (a ``gs.Variable`` or ``gs.Constant``). Call patterns match the node
producing the tensor and recurse into its inputs; leaves match any tensor (``wildcard``), a
constant (initializer or Constant node output) or a graph input. Bindings are consistent: a
pattern object used twice must match the same tensor both times.

Matching never mutates the graph. A failed match carries the reason of its deepest near miss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxq.core.errors import PatternError
from onnxq.io.graph import (
    constant_value,
    holds_constant,
    is_absent,
    node_label,
    present_inputs,
    producer,
)

COMMUTATIVE_OPS = frozenset({"Add", "Mul", "Max", "Min", "Sum", "And", "Or", "Xor", "Equal"})


class DFPattern:
    """Base class of all patterns; supports ``|``, ``p(...)`` for op patterns and predicates."""

    def __or__(self, other: DFPattern) -> AltPattern:
        return AltPattern(self, other)

    def __call__(self, *args: DFPattern | None) -> CallPattern:
        raise PatternError(f"{self!r} is not an op pattern and cannot be called with arguments")

    def has_attr(self, attrs: dict[str, Any]) -> AttrPattern:
        """Require the producing node's attributes (schema defaults count) to equal ``attrs``."""
        return AttrPattern(self, attrs)

    def has_dtype(self, dtype: Any) -> DtypePattern:
        """Require the tensor's element type (numpy dtype or name)."""
        return DtypePattern(self, dtype)

    def has_shape(self, shape: Sequence[int | None]) -> ShapePattern:
        """Require the tensor's shape; ``None`` entries match any dimension."""
        return ShapePattern(self, shape)

    def has_rank(self, rank: int) -> RankPattern:
        """Require the tensor's rank."""
        return RankPattern(self, rank)

    def check(self, fn: Callable[[gs.Tensor], bool], reason: str = "check failed") -> CheckPattern:
        """Require ``fn(tensor)`` to be true; ``reason`` explains a failure."""
        return CheckPattern(self, fn, reason)

    def optional(self, option: Callable[[DFPattern], DFPattern]) -> AltPattern:
        """``self`` or ``option(self)``: e.g. ``conv.optional(lambda x: is_op("Relu")(x))``."""
        return AltPattern(option(self), self)

    def match(self, tensor: gs.Tensor) -> Match | None:
        """Match this pattern rooted at ``tensor``; None when it does not match."""
        return match_explain(self, tensor).match

    # introspection used by the grouper
    def root_ops(self) -> frozenset[str] | None:
        """The op types the root node may have, or None when any tensor may match."""
        return None

    def size(self) -> int:
        """Number of call patterns (nodes) in the pattern; the default priority."""
        return 0

    def describe(self) -> str:
        """Short text used in failure reasons."""
        return type(self).__name__


class WildcardPattern(DFPattern):
    """Matches any present tensor."""

    def describe(self) -> str:
        return "any tensor"

    def __repr__(self) -> str:
        return "wildcard()"


class ConstantPattern(DFPattern):
    """Matches an initializer or the output of a Constant node."""

    def describe(self) -> str:
        return "a constant"

    def __repr__(self) -> str:
        return "is_constant()"


class InputPattern(DFPattern):
    """Matches a graph input (optionally with a given name)."""

    def __init__(self, name: str | None = None):
        self.name = name

    def describe(self) -> str:
        return f"graph input '{self.name}'" if self.name else "a graph input"

    def __repr__(self) -> str:
        return f"is_input({self.name!r})" if self.name else "is_input()"


class OpPattern(DFPattern):
    """Matches a tensor produced by a node of one op type (any inputs); call it to give inputs."""

    def __init__(self, op_type: str, domain: str = "", commutative: bool | None = None):
        self.op_type = op_type
        self.domain = domain
        self.commutative = op_type in COMMUTATIVE_OPS if commutative is None else commutative

    def __call__(self, *args: DFPattern | None) -> CallPattern:
        return CallPattern(self, list(args))

    def accepts(self, node: gs.Node) -> bool:
        """True when ``node`` has this op type and domain."""
        dom = node.domain or ""
        want = self.domain or ""
        return node.op == self.op_type and (dom == want or {dom, want} <= {"", "ai.onnx"})

    def root_ops(self) -> frozenset[str] | None:
        return frozenset({self.op_type})

    def size(self) -> int:
        return 1

    def describe(self) -> str:
        return self.op_type

    def __repr__(self) -> str:
        return f"is_op({self.op_type!r})"


class CallPattern(DFPattern):
    """``op(args...)``: the producing node matches ``op`` and its inputs match ``args``.

    A ``None`` argument requires that optional input to be absent; inputs past the last
    argument must be absent. Commutative ops (Add, Mul, ...) also try their first two arguments
    swapped. ``p[i]`` matches output ``i`` of a multi-output node.
    """

    def __init__(self, op: DFPattern, args: list[DFPattern | None], output_index: int = 0):
        if not _is_op_like(op):
            raise PatternError(f"{op!r} cannot be called: only is_op(...) patterns take arguments")
        for a in args:
            if a is not None and not isinstance(a, DFPattern):
                raise PatternError(f"argument {a!r} of {op!r} is not a pattern or None")
        self.op = op
        self.args = args
        self.output_index = output_index

    def __getitem__(self, index: int) -> CallPattern:
        return CallPattern(self.op, self.args, index)

    def root_ops(self) -> frozenset[str] | None:
        return self.op.root_ops()

    def size(self) -> int:
        return 1 + sum(a.size() for a in self.args if a is not None)

    def describe(self) -> str:
        return self.op.describe()

    def __repr__(self) -> str:
        inner = ", ".join("None" if a is None else repr(a) for a in self.args)
        suffix = f"[{self.output_index}]" if self.output_index else ""
        return f"{self.op!r}({inner}){suffix}"


class AltPattern(DFPattern):
    """``left | right``: the first of the two that matches."""

    def __init__(self, left: DFPattern, right: DFPattern):
        self.left = left
        self.right = right

    def __call__(self, *args: DFPattern | None) -> CallPattern:
        return CallPattern(self, list(args))

    def root_ops(self) -> frozenset[str] | None:
        a, b = self.left.root_ops(), self.right.root_ops()
        return None if a is None or b is None else a | b

    def size(self) -> int:
        return max(self.left.size(), self.right.size())

    def describe(self) -> str:
        return f"{self.left.describe()} or {self.right.describe()}"

    def __repr__(self) -> str:
        return f"({self.left!r} | {self.right!r})"


class _Wrapped(DFPattern):
    """A pattern plus a predicate on the matched tensor."""

    def __init__(self, inner: DFPattern):
        self.inner = inner

    def __call__(self, *args: DFPattern | None) -> CallPattern:
        return CallPattern(self, list(args))

    def root_ops(self) -> frozenset[str] | None:
        return self.inner.root_ops()

    def size(self) -> int:
        return self.inner.size()

    def describe(self) -> str:
        return self.inner.describe()

    def test(self, tensor: gs.Tensor) -> str | None:
        """Return None when the predicate holds, else the reason it does not."""
        raise NotImplementedError


class AttrPattern(_Wrapped):
    """The producing node's attributes equal the given values (schema defaults apply)."""

    def __init__(self, inner: DFPattern, attrs: dict[str, Any]):
        super().__init__(inner)
        self.attrs = dict(attrs)

    def test(self, tensor: gs.Tensor) -> str | None:
        node = producer(tensor)
        if node is None:
            return f"'{tensor.name}' has no producing node to carry attributes {self.attrs}"
        for key, want in self.attrs.items():
            got = node_attr(node, key)
            if not _attr_equal(got, want):
                return f"{node_label(node)} has {key}={got!r}, expected {want!r}"
        return None

    def __repr__(self) -> str:
        return f"{self.inner!r}.has_attr({self.attrs!r})"


class DtypePattern(_Wrapped):
    """The tensor's element type equals ``dtype``; unknown types do not match."""

    def __init__(self, inner: DFPattern, dtype: Any):
        super().__init__(inner)
        self.dtype = np.dtype(dtype)

    def test(self, tensor: gs.Tensor) -> str | None:
        got = tensor_dtype(tensor)
        if got != self.dtype:
            return f"tensor '{tensor.name}' has dtype {got}, expected {self.dtype}"
        return None

    def __repr__(self) -> str:
        return f"{self.inner!r}.has_dtype({self.dtype.name!r})"


class ShapePattern(_Wrapped):
    """The tensor's static shape equals ``shape`` (``None`` entries match anything)."""

    def __init__(self, inner: DFPattern, shape: Sequence[int | None]):
        super().__init__(inner)
        self.shape = list(shape)

    def test(self, tensor: gs.Tensor) -> str | None:
        got = tensor_shape(tensor)
        ok = got is not None and len(got) == len(self.shape)
        if ok and got is not None:
            ok = all(w is None or g == w for g, w in zip(got, self.shape))
        return None if ok else f"tensor '{tensor.name}' has shape {got}, expected {self.shape}"

    def __repr__(self) -> str:
        return f"{self.inner!r}.has_shape({self.shape!r})"


class RankPattern(_Wrapped):
    """The tensor's rank equals ``rank``."""

    def __init__(self, inner: DFPattern, rank: int):
        super().__init__(inner)
        self.rank = rank

    def test(self, tensor: gs.Tensor) -> str | None:
        got = tensor_shape(tensor)
        if got is None or len(got) != self.rank:
            n = "unknown" if got is None else len(got)
            return f"tensor '{tensor.name}' has rank {n}, expected {self.rank}"
        return None

    def __repr__(self) -> str:
        return f"{self.inner!r}.has_rank({self.rank})"


class CheckPattern(_Wrapped):
    """A free predicate ``fn(tensor) -> bool``."""

    def __init__(self, inner: DFPattern, fn: Callable[[gs.Tensor], bool], reason: str):
        super().__init__(inner)
        self.fn = fn
        self.reason = reason

    def test(self, tensor: gs.Tensor) -> str | None:
        return None if self.fn(tensor) else f"tensor '{tensor.name}': {self.reason}"

    def __repr__(self) -> str:
        return f"{self.inner!r}.check({self.reason!r})"


# --------------------------------------------------------------------------------------------
# sugar


def wildcard() -> WildcardPattern:
    """Match any tensor."""
    return WildcardPattern()


def is_constant() -> ConstantPattern:
    """Match an initializer or the output of a Constant node."""
    return ConstantPattern()


def is_input(name: str | None = None) -> InputPattern:
    """Match a graph input, optionally by name."""
    return InputPattern(name)


def is_op(op_type: str, domain: str = "", commutative: bool | None = None) -> OpPattern:
    """Match a node of ``op_type``; call the result with input patterns."""
    return OpPattern(op_type, domain, commutative)


def has_attr(attrs: dict[str, Any], pattern: DFPattern | None = None) -> AttrPattern:
    """Attribute predicate on ``pattern`` (default: any node)."""
    return AttrPattern(pattern if pattern is not None else wildcard(), attrs)


def has_dtype(dtype: Any, pattern: DFPattern | None = None) -> DtypePattern:
    """Dtype predicate on ``pattern`` (default: any tensor)."""
    return DtypePattern(pattern if pattern is not None else wildcard(), dtype)


def has_shape(shape: Sequence[int | None], pattern: DFPattern | None = None) -> ShapePattern:
    """Shape predicate on ``pattern`` (default: any tensor)."""
    return ShapePattern(pattern if pattern is not None else wildcard(), shape)


def has_rank(rank: int, pattern: DFPattern | None = None) -> RankPattern:
    """Rank predicate on ``pattern`` (default: any tensor)."""
    return RankPattern(pattern if pattern is not None else wildcard(), rank)


# --------------------------------------------------------------------------------------------
# tensor facts


def tensor_dtype(tensor: gs.Tensor) -> np.dtype | None:
    """The tensor's numpy dtype, or None when unknown."""
    if isinstance(tensor, gs.Constant):
        known = tensor.dtype  # a lazy initializer's dtype without reading it
        return known if isinstance(known, np.dtype) else np.asarray(tensor.values).dtype
    value = constant_value(tensor)
    if value is not None:
        return value.dtype
    dt = tensor.dtype
    if dt is None:
        return None
    try:
        if isinstance(dt, int):
            return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dt))
        return np.dtype(dt)
    except (TypeError, KeyError):
        return None


def tensor_shape(tensor: gs.Tensor) -> list[int | None] | None:
    """The tensor's shape with unknown dimensions as None, or None when the rank is unknown."""
    value = constant_value(tensor)
    if value is not None:
        return list(value.shape)
    shape = tensor.shape
    if shape is None:
        return None
    return [d if isinstance(d, int) and d >= 0 else None for d in shape]


def node_attr(node: gs.Node, name: str) -> Any:
    """Attribute value of ``node`` or its schema default (None when neither exists)."""
    if name in node.attrs:
        return node.attrs[name]
    try:
        schema = onnx.defs.get_schema(node.op, domain=node.domain or "")
    except Exception:  # unknown op or domain: no defaults
        return None
    attr = schema.attributes.get(name)
    if attr is None or not attr.default_value.name:
        return None
    return onnx.helper.get_attribute_value(attr.default_value)


def _attr_equal(got: Any, want: Any) -> bool:
    if isinstance(got, bytes):
        got = got.decode()
    if isinstance(got, list | tuple) or isinstance(want, list | tuple):
        return got is not None and list(got) == list(want)
    if isinstance(got, float) or isinstance(want, float):
        return got is not None and abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(want))
    return bool(got == want)


def _is_op_like(p: DFPattern) -> bool:
    if isinstance(p, OpPattern):
        return True
    if isinstance(p, AltPattern):
        return _is_op_like(p.left) and _is_op_like(p.right)
    if isinstance(p, AttrPattern):
        return _is_op_like(p.inner)
    return False


def _op_kind(p: DFPattern, node: gs.Node) -> str:
    """Kind "op" when ``node``'s op type is not one ``p`` can match, else "structure"."""
    ops = p.root_ops()
    return "op" if ops is not None and node.op not in ops else "structure"


def _op_accepts(p: DFPattern, node: gs.Node) -> str | None:
    """None when op pattern ``p`` accepts ``node``, else the reason."""
    if isinstance(p, OpPattern):
        return None if p.accepts(node) else f"{node_label(node)} is {node.op}, expected {p.op_type}"
    if isinstance(p, AltPattern):
        left = _op_accepts(p.left, node)
        return None if left is None else _op_accepts(p.right, node)
    if isinstance(p, AttrPattern):
        inner = _op_accepts(p.inner, node)
        return inner if inner is not None else p.test(node.outputs[0])
    return f"{p!r} is not an op pattern"


def _is_commutative(p: DFPattern, node: gs.Node) -> bool:
    if isinstance(p, OpPattern):
        return p.commutative
    if isinstance(p, AltPattern | AttrPattern):
        parts = [p.left, p.right] if isinstance(p, AltPattern) else [p.inner]
        return any(_is_commutative(q, node) for q in parts if _op_accepts(q, node) is None)
    return False


# --------------------------------------------------------------------------------------------
# matching


@dataclass
class Match:
    """A successful match: the root tensor, what each pattern bound, and the matched nodes."""

    root: gs.Tensor
    bindings: dict[DFPattern, gs.Tensor]
    nodes: list[gs.Node]

    @property
    def node_map(self) -> dict[DFPattern, list[gs.Tensor]]:
        """TVM-style map from pattern to the list of tensors it matched."""
        return {p: [t] for p, t in self.bindings.items()}

    def __contains__(self, pattern: DFPattern) -> bool:
        return pattern in self.bindings

    def tensor(self, pattern: DFPattern) -> gs.Tensor:
        """The tensor bound to ``pattern`` (KeyError when the pattern took no part)."""
        return self.bindings[pattern]

    def node(self, pattern: DFPattern) -> gs.Node:
        """The node producing the tensor bound to ``pattern``."""
        node = producer(self.bindings[pattern])
        if node is None:
            raise PatternError(
                f"pattern {pattern!r} matched '{self.bindings[pattern].name}', "
                "which no node produces"
            )
        return node

    def get(self, pattern: DFPattern) -> gs.Tensor | None:
        """The tensor bound to ``pattern`` or None."""
        return self.bindings.get(pattern)


@dataclass
class MatchResult:
    """Outcome of a match attempt: the match, or the reason of the deepest near miss."""

    match: Match | None
    reason: str = ""
    #: the node the failure is about (the source), when there is one
    node: gs.Node | None = None
    #: what failed: "op" (the node is another op type: the weakest near miss), "structure"
    #: (inputs, attributes, dtypes, shapes), "check" (a rule's own condition), "claimed"
    #: (another group owns a node), "filter" (--exclude, --config), "escape" (a value escapes)
    kind: str = "check"

    @property
    def ok(self) -> bool:
        """True when the pattern matched."""
        return self.match is not None

    @staticmethod
    def fail(reason: str, node: gs.Node | None = None, kind: str = "check") -> MatchResult:
        """A failed result: a readable reason, the node it is about, and its kind."""
        return MatchResult(None, reason, node, kind)


@dataclass
class _State:
    bindings: dict[DFPattern, gs.Tensor] = field(default_factory=dict)
    nodes: list[gs.Node] = field(default_factory=list)

    def bind(self, p: DFPattern, t: gs.Tensor, node: gs.Node | None = None) -> _State:
        b = dict(self.bindings)
        b[p] = t
        nodes = self.nodes + [node] if node is not None and node not in self.nodes else self.nodes
        return _State(b, nodes)


class _Matcher:
    def __init__(self, graph_inputs: Iterable[gs.Tensor] | None = None):
        self.best_reason = ""
        self.best_node: gs.Node | None = None
        self.best_kind = "structure"
        self.best_depth = -1
        self.graph_inputs = {id(t) for t in graph_inputs} if graph_inputs is not None else None

    def fail(
        self, state: _State, reason: str, node: gs.Node | None = None, kind: str = "structure"
    ) -> _State | None:
        depth = len(state.bindings) + len(state.nodes)
        if depth >= self.best_depth:
            self.best_depth, self.best_reason, self.best_node = depth, reason, node
            self.best_kind = kind
        return None

    def run(self, p: DFPattern, t: gs.Tensor, s: _State) -> _State | None:
        if p in s.bindings:
            if s.bindings[p] is t:
                return s
            return self.fail(
                s,
                f"'{t.name}' differs from '{s.bindings[p].name}' bound earlier "
                f"to the same pattern {p!r}",
            )
        if is_absent(t):
            return self.fail(s, f"an optional input is absent, expected {p.describe()}")
        if isinstance(p, WildcardPattern):
            return s.bind(p, t)
        if isinstance(p, ConstantPattern):
            if not holds_constant(t):
                return self.fail(
                    s, f"'{t.name}' is not a constant (initializer or Constant node)", producer(t)
                )
            return s.bind(p, t)
        if isinstance(p, InputPattern):
            is_graph_input = (
                id(t) in self.graph_inputs
                if self.graph_inputs is not None
                else isinstance(t, gs.Variable) and not t.inputs
            )
            if not is_graph_input or (p.name is not None and t.name != p.name):
                return self.fail(s, f"'{t.name}' is not {p.describe()}")
            return s.bind(p, t)
        if isinstance(p, AltPattern):
            left = self.run(p.left, t, s)
            if left is not None:
                return left.bind(p, t)
            right = self.run(p.right, t, s)
            return right.bind(p, t) if right is not None else None
        if isinstance(p, _Wrapped):
            reason = p.test(t)
            if reason is not None:
                return self.fail(s, reason, producer(t))
            inner = self.run(p.inner, t, s)
            return inner.bind(p, t) if inner is not None else None
        if isinstance(p, OpPattern):
            node = producer(t)
            if node is None:
                return self.fail(s, f"'{t.name}' is not produced by a node, expected {p.op_type}")
            reason = _op_accepts(p, node)
            if reason is not None:
                return self.fail(s, reason, node, _op_kind(p, node))
            return s.bind(p, t, node)
        if isinstance(p, CallPattern):
            return self.run_call(p, t, s)
        raise PatternError(f"unknown pattern type {type(p).__name__}")

    def run_call(self, p: CallPattern, t: gs.Tensor, s: _State) -> _State | None:
        node = producer(t)
        if node is None:
            return self.fail(s, f"'{t.name}' is not produced by a node, expected {p.describe()}")
        reason = _op_accepts(p.op, node)
        if reason is not None:
            return self.fail(s, reason, node, _op_kind(p.op, node))
        if node.outputs.index(t) != p.output_index:
            return self.fail(
                s,
                f"'{t.name}' is output {node.outputs.index(t)} of "
                f"{node_label(node)}, expected output {p.output_index}",
                node,
            )
        inputs = present_inputs(node)
        if len(inputs) > len(p.args):
            return self.fail(
                s,
                f"{node_label(node)} has {len(inputs)} inputs, the pattern expects {len(p.args)}",
                node,
            )
        orders = [list(p.args)]
        if len(p.args) >= 2 and _is_commutative(p.op, node):
            orders.append([p.args[1], p.args[0], *p.args[2:]])
        for args in orders:
            cur: _State | None = s.bind(p, t, node)
            for i, ap in enumerate(args):
                inp = inputs[i] if i < len(inputs) else None
                assert cur is not None
                if ap is None:
                    if not is_absent(inp):
                        cur = self.fail(
                            cur,
                            f"input {i} of {node_label(node)} is present, the "
                            "pattern expects it absent",
                            node,
                        )
                        break
                    continue
                if inp is None or is_absent(inp):
                    cur = self.fail(
                        cur,
                        f"input {i} of {node_label(node)} is absent, expected {ap.describe()}",
                        node,
                    )
                    break
                cur = self.run(ap, inp, cur)
                if cur is None:
                    break
            if cur is not None:
                # the op pattern itself is bound too, so is_op(...) objects can be looked up
                if isinstance(p.op, OpPattern) and p.op not in cur.bindings:
                    cur = cur.bind(p.op, t)
                return cur
        return None


def match_explain(
    pattern: DFPattern, tensor: gs.Tensor, graph_inputs: Iterable[gs.Tensor] | None = None
) -> MatchResult:
    """Match ``pattern`` at ``tensor`` and return the match or the deepest failure reason."""
    matcher = _Matcher(graph_inputs)
    state = matcher.run(pattern, tensor, _State())
    if state is None:
        reason = matcher.best_reason or "no match"
        return MatchResult.fail(reason, matcher.best_node, matcher.best_kind)
    return MatchResult(Match(tensor, state.bindings, state.nodes))


def match(pattern: DFPattern, tensor: gs.Tensor) -> Match | None:
    """Match ``pattern`` rooted at ``tensor``; None when it does not match."""
    return match_explain(pattern, tensor).match
