"""Grouping and rewriting with dataflow patterns (private; the public face is onnxq.pattern).

The grouping discipline follows TVM's PatternGrouper: nodes are visited outputs first; at each
node the patterns are tried in priority order (largest first unless a callback says otherwise);
a match is accepted only when none of its nodes already belongs to a group and none of its
interior values (an output of a matched node other than the root) is read outside the match or
is a graph output. Every rejected attempt is recorded with its reason, which is what
``onnxq inspect --explain`` prints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import onnx_graphsurgeon as gs

from onnxq.io.graph import GraphEditor, node_label, nodes_in_order
from onnxq.match.dfpattern import DFPattern, Match, MatchResult, match_explain


class DFPatternCallback:
    """A rewrite rule: ``self.pattern`` plus ``callback(pre, post, node_map)``.

    ``callback`` returns the tensor that replaces the match's root, or None for "no rewrite".
    Because ONNX graphs are edited in place, ``pre`` and ``post`` are the same root tensor; the
    signature is kept so rules read like TVM's. While a rewrite runs, ``self.editor`` is the
    :class:`~onnxq.io.graph.GraphEditor` to build new nodes with and ``self.match`` the current
    :class:`Match`.
    """

    pattern: DFPattern
    #: higher runs first; None means the pattern's size (longest first)
    priority: int | None = None
    #: a short name for reports
    name: str = ""

    editor: GraphEditor
    match: Match
    partition: Partition

    def __init__(self, pattern: DFPattern | None = None, priority: int | None = None):
        if pattern is not None:
            self.pattern = pattern
        if priority is not None:
            self.priority = priority

    def check(self, match: Match) -> MatchResult:
        """Extra conditions after the structural match; return ``MatchResult.fail(reason)``."""
        return MatchResult(match)

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        """Build the replacement of ``pre`` and return it, or return None to leave it."""
        raise NotImplementedError

    def effective_priority(self) -> int:
        """The priority used to order patterns."""
        return self.priority if self.priority is not None else self.pattern.size()

    def label(self) -> str:
        """Name used in reports."""
        return self.name or type(self).__name__

    def in_group(self, node: gs.Node | None) -> bool:
        """True when ``node`` belongs to a group of the partition being rewritten."""
        part = getattr(self, "partition", None)
        return node is not None and part is not None and id(node) in part.grouped_ids()


@dataclass
class Group:
    """A non-overlapping match chosen by the grouper."""

    callback: DFPatternCallback
    match: Match

    @property
    def root(self) -> gs.Tensor:
        """The tensor the group produces."""
        return self.match.root

    @property
    def nodes(self) -> list[gs.Node]:
        """The matched nodes, root first."""
        return self.match.nodes


@dataclass
class Attempt:
    """A pattern tried at a node: accepted, or rejected with a reason."""

    node: str
    pattern: str
    accepted: bool
    reason: str = ""
    #: the kind of failure (onnxq.match.dfpattern.MatchResult.kind), "" when accepted
    kind: str = ""
    #: the node the failure is about, when it is another than the root
    source: str = ""


@dataclass
class Partition:
    """The groups chosen for a graph, plus every attempt (for explain reports)."""

    groups: list[Group] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)

    def grouped_ids(self) -> set[int]:
        """Identities of every node in a group (cached)."""
        if not hasattr(self, "_ids"):
            self._ids = {id(n) for g in self.groups for n in g.nodes}
        return self._ids

    def reasons_for(self, node_name: str) -> list[Attempt]:
        """The attempts made with ``node_name`` as root (indexed on first use)."""
        if getattr(self, "_by_node_count", -1) != len(self.attempts):
            self._by_node: dict[str, list[Attempt]] = {}
            for a in self.attempts:
                self._by_node.setdefault(a.node, []).append(a)
            self._by_node_count = len(self.attempts)
        return self._by_node.get(node_name, [])


NodeFilter = Callable[[gs.Node], "str | None"]


def _escapes(m: Match, graph_outputs: set[int]) -> MatchResult | None:
    """The first interior value of ``m`` used outside it, as a failure naming its reader."""
    inside = {id(n) for n in m.nodes}
    for node in m.nodes:
        for out in node.outputs:
            if out is m.root:
                continue
            if id(out) in graph_outputs:
                why = f"interior value '{out.name}' of the match is a graph output"
                return MatchResult.fail(why, node, "escape")
            for user in out.outputs:
                if id(user) not in inside:
                    why = f"interior value '{out.name}' of the match is also read by "
                    return MatchResult.fail(why + node_label(user), user, "escape")
    return None


def partition(
    callbacks: Sequence[DFPatternCallback | DFPattern],
    graph: gs.Graph,
    node_filter: NodeFilter | None = None,
) -> Partition:
    """Choose non-overlapping groups for ``callbacks`` (or bare patterns) in ``graph``.

    ``node_filter(node)`` may return a reason to keep a node out of every group.
    """
    cbs = [c if isinstance(c, DFPatternCallback) else DFPatternCallback(c) for c in callbacks]
    order = sorted(range(len(cbs)), key=lambda i: (-cbs[i].effective_priority(), i))
    ranked = [cbs[i] for i in order]
    graph_outputs = {id(t) for t in graph.outputs}
    graph_inputs = list(graph.inputs)
    claimed: set[int] = set()
    result = Partition()
    for node in reversed(nodes_in_order(graph)):
        if id(node) in claimed:
            continue
        name = node.name or node.outputs[0].name
        for cb in ranked:
            ops = cb.pattern.root_ops()
            if ops is not None and node.op not in ops:
                continue
            for out in node.outputs:
                res = match_explain(cb.pattern, out, graph_inputs)
                failed = _accept(res, cb, claimed, graph_outputs, node_filter)
                result.attempts.append(_attempt(name, cb.label(), failed))
                if failed is None and res.match is not None:
                    result.groups.append(Group(cb, res.match))
                    claimed.update(id(n) for n in res.match.nodes)
                    break
            if id(node) in claimed:
                break
    return result


def _attempt(node: str, pattern: str, failed: MatchResult | None) -> Attempt:
    if failed is None:
        return Attempt(node, pattern, True)
    source = failed.node.name if failed.node is not None else ""
    return Attempt(node, pattern, False, failed.reason, failed.kind, source)


def _accept(
    res: MatchResult,
    cb: DFPatternCallback,
    claimed: set[int],
    graph_outputs: set[int],
    node_filter: NodeFilter | None,
) -> MatchResult | None:
    """None when the match is taken, else the failure (its reason, node and kind)."""
    m = res.match
    if m is None:
        return res
    for n in m.nodes:
        if id(n) in claimed:
            return MatchResult.fail(
                f"{node_label(n)} already belongs to another group", n, "claimed"
            )
    if node_filter is not None:
        for n in m.nodes:
            why = node_filter(n)
            if why:
                return MatchResult.fail(why, n, "filter")
    esc = _escapes(m, graph_outputs)
    if esc is not None:
        return esc
    checked = cb.check(m)
    return None if checked.ok else checked


def find_all(pattern: DFPattern, graph: gs.Graph) -> list[Match]:
    """Every match of ``pattern`` rooted at any tensor, outputs first (groups may overlap)."""
    found = []
    for node in reversed(nodes_in_order(graph)):
        for out in node.outputs:
            res = match_explain(pattern, out, graph.inputs)
            if res.match is not None:
                found.append(res.match)
    return found


@dataclass
class RewriteResult:
    """What a rewrite did: the graph, whether it changed, iterations, and the last partition."""

    graph: gs.Graph
    modified: bool
    iterations: int
    converged: bool
    rewritten: list[Group] = field(default_factory=list)
    partitions: list[Partition] = field(default_factory=list)


def rewrite(
    callbacks: DFPatternCallback | Iterable[DFPatternCallback],
    graph: gs.Graph,
    max_iterations: int = 8,
    node_filter: NodeFilter | None = None,
    editor: GraphEditor | None = None,
) -> RewriteResult:
    """Apply ``callbacks`` until no callback rewrites anything, at most ``max_iterations`` times.

    Contract: requires a topologically sortable graph; ensures a clean, sorted graph in which no
    remaining group of any callback would be rewritten again (when ``converged``).
    """
    cbs = [callbacks] if isinstance(callbacks, DFPatternCallback) else list(callbacks)
    editor = editor or GraphEditor(graph)
    result = RewriteResult(graph, False, 0, False)
    for _ in range(max_iterations):
        result.iterations += 1
        part = partition(cbs, graph, node_filter)
        result.partitions.append(part)
        changed = False
        for cb in cbs:
            cb.partition = part
        for group in part.groups:
            cb = group.callback
            cb.editor = editor
            cb.match = group.match
            new = cb.callback(group.root, group.root, group.match.node_map)
            if new is not None and new is not group.root:
                editor.replace_producer(group.root, new)
                result.rewritten.append(group)
                changed = True
        editor.finish()
        if not changed:
            result.converged = True
            break
        result.modified = True
    return result
