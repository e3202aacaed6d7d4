"""A Loop or Scan body's calibration data: its inputs on every iteration of every sample."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import onnx

from onnxq.calibrate.dataset import DatasetManager, Feed
from onnxq.io.bodies import (
    MIN_FEEDS,
    STACK_ROWS,
    Layout,
    body_iterations,
    layout,
    same_outputs,
    stacked_iterations,
    steps_together,
    trip_count,
)
from onnxq.io.session import make_session

#: rows run together, and how their feeds join (None: one row alone)
Group = tuple[list[int], Layout | None]


class Iterations(DatasetManager):
    """A Loop or Scan body's calibration feeds: its inputs on every iteration, every sample.

    Computed afresh on each read (the float body run iteration by iteration), so memory holds
    one iteration's values whatever the number of iterations.

    Rows that run the same iterations are stacked on their batch axis, up to
    :data:`~onnxq.io.bodies.STACK_ROWS` in one feed and one body run a step, as far as that
    leaves :data:`~onnxq.io.bodies.MIN_FEEDS` feeds: one run a step instead of one per row,
    the same values observed. Only where the body gives every row what it gives it alone,
    checked once on the first iteration of the first stack (a body with a shape written into
    it runs each row alone).
    """

    def __init__(
        self,
        node: onnx.NodeProto,
        body: onnx.ModelProto,
        free: list[str],
        rows: list[Feed],
        sizes: list[int] | None = None,
    ):
        """Feeds of ``node``'s body.

        ``body``: the float body model (onnxq.post.subgraphs.branch_model); ``free``: its dynamic
        free variables; ``rows``: per outer batch, the node's inputs and those variables;
        ``sizes``: the samples of each batch (None: each row runs alone).
        """
        super().__init__()
        self.node = node
        self.model = body
        self.free = free
        self.rows = rows
        self.sizes = sizes
        #: iterations the last complete read gave, a row's iteration counted once
        self.count = 0
        #: rows per body run at most (1 when they run alone), known after the first read
        self.stacked = 1
        self._session: Any = None
        self._groups: list[Group] | None = None

    def _raw(self) -> Iterator[Feed]:
        if self._session is None:
            self._session = make_session(self.model, optimize=False)
        if self._groups is None:
            self._groups = self._group()
            self.stacked = max(len(rows) for rows, _ in self._groups)
        count = 0
        for group, how in self._groups:
            rows = [self.rows[i] for i in group]
            if how is None:
                feeds = body_iterations(self.node, self._session, rows[0], self.free)
            else:
                sizes = [self.sizes[i] for i in group]  # type: ignore[index]
                feeds = stacked_iterations(self.node, self._session, rows, self.free, how, sizes)
            for feed in feeds:
                count += len(group)
                yield feed
        self.count = count

    def _group(self) -> list[Group]:
        """Consecutive rows with the same trip count whose first feeds join, checked once."""
        alone: list[Group] = [([i], None) for i in range(len(self.rows))]
        sizes = self.sizes
        if sizes is None or len(self.rows) < 2 or not steps_together(self.node):
            return alone
        trips = [trip_count(self.node, row) for row in self.rows]
        if any(t is None for t in trips):
            return alone
        depth = min(STACK_ROWS, sum(trips) // MIN_FEEDS)  # type: ignore[arg-type]
        if depth < 2:
            return alone
        firsts: dict[int, Feed] = {}  # each row's first feed, rows that run one
        for i, r in enumerate(self.rows):
            first = next(body_iterations(self.node, None, r, self.free), None)
            if first is not None:
                firsts[i] = first
        groups: list[Group] = []
        rows: list[int] = []
        how: Layout | None = None
        for i in range(len(self.rows)):
            if rows and len(rows) < depth and i in firsts and trips[i] == trips[rows[0]]:
                joined = layout([firsts[j] for j in [*rows, i]], [sizes[j] for j in [*rows, i]])
                if joined is not None:
                    rows, how = [*rows, i], joined
                    continue
            if rows:
                groups.append((rows, how))
            rows, how = [i], None
            if i not in firsts:  # no iteration: nothing to join it with
                groups.append((rows, None))
                rows = []
        if rows:
            groups.append((rows, how))
        stacks = [(g, h) for g, h in groups if h is not None]
        if not stacks:
            return alone
        g, h = stacks[0]
        if not same_outputs(self._session, [firsts[i] for i in g], h, [sizes[i] for i in g]):
            return alone
        return groups

    def describe(self) -> str:
        """How the source is named in messages."""
        return f"the iterations of {self.node.op_type} '{self.node.name}'"
