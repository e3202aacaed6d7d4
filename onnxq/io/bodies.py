"""Running a Loop or Scan body the way onnxruntime runs it, one iteration at a time.

onnxruntime runs a body inside the outer graph and hands out none of its tensors. To
calibrate a body on the values it sees when it runs, onnxq runs the body as a model of its
own (onnxq.post.subgraphs makes it) and drives it here: a Loop until its trip count or
condition stops it, its carried values fed back; a Scan once per slice of its scan inputs,
along their axes and directions, its states fed back. Each iteration's inputs are one feed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxq.io.graph import graphs_of

#: one feed of the body model: its inputs by name
Feed = dict[str, np.ndarray]
#: iterations one Loop is driven for at most per sample (a Loop with neither a trip count nor
#: a condition input ends only when its body says so)
MAX_ITERATIONS = 10_000


def _scalar_like(value: Any, declared: onnx.ValueInfoProto, dtype: Any) -> np.ndarray:
    """``value`` as the body input ``declared`` takes it: a scalar, or of the rank it declares."""
    tt = declared.type.tensor_type
    rank = len(tt.shape.dim) if tt.HasField("shape") else 0
    return np.asarray(value, dtype).reshape([1] * rank)


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    """Attribute ``name`` of ``node``, or ``default``."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def body_iterations(
    node: onnx.NodeProto, session: Any, row: dict[str, np.ndarray], free: list[str]
) -> Iterator[Feed]:
    """The inputs of ``node``'s body on each iteration it runs for one sample.

    ``session``: the float body model's session; ``row``: the node's inputs and the body's
    dynamic free variables ``free`` on that sample. The body runs as onnxruntime runs it: a
    Loop until its trip count or condition stops it, its carried values fed back; a Scan once
    per slice of its scan inputs, its states fed back.
    """
    body = dict(graphs_of(node))["body"]
    own = list(body.input)
    outer = {n: row[n] for n in free}
    if node.op_type == "Loop":
        trips = node.input[0] if node.input else ""
        cond_in = node.input[1] if len(node.input) > 1 else ""
        limit = int(np.asarray(row[trips]).reshape(-1)[0]) if trips else MAX_ITERATIONS
        cond = bool(np.asarray(row[cond_in]).reshape(-1)[0]) if cond_in else True
        carried = [row[n] for n in node.input[2:]]
        fetch = [o.name for o in body.output[: 1 + len(carried)]]
        i = 0
        while cond and i < min(limit, MAX_ITERATIONS):
            feed = {
                own[0].name: _scalar_like(i, own[0], np.int64),
                own[1].name: _scalar_like(cond, own[1], np.bool_),
                **{v.name: c for v, c in zip(own[2:], carried, strict=True)},
                **outer,
            }
            yield feed
            got = session.run(fetch, feed)
            cond, carried = bool(np.asarray(got[0]).reshape(-1)[0]), got[1:]
            i += 1
        return
    scans = int(_attr(node, "num_scan_inputs", 0))
    states = [row[n] for n in node.input[: len(node.input) - scans]]
    inputs = [row[n] for n in node.input[len(node.input) - scans :]]
    axes = list(_attr(node, "scan_input_axes", [0] * scans))
    directions = list(_attr(node, "scan_input_directions", [0] * scans))
    steps = np.asarray(inputs[0]).shape[axes[0] % np.ndim(inputs[0])] if inputs else 0
    fetch = [o.name for o in body.output[: len(states)]]
    for t in range(steps):
        slices = [
            np.take(x, steps - 1 - t if d else t, axis=a % np.ndim(x))
            for x, a, d in zip(inputs, axes, directions, strict=True)
        ]
        feed = {
            **{v.name: s for v, s in zip(own[: len(states)], states, strict=True)},
            **{v.name: s for v, s in zip(own[len(states) :], slices, strict=True)},
            **outer,
        }
        yield feed
        states = list(session.run(fetch, feed)) if states else []


def first_iteration(node: onnx.NodeProto, rows: list[Feed], free: list[str]) -> Feed | None:
    """The body's inputs on the first iteration any sample runs, or None.

    Their dtypes and ranks type the body model. No body run is needed for it.
    """
    for row in rows:
        feed = next(body_iterations(node, None, row, free), None)
        if feed is not None:
            return feed
    return None


#: rows (the values of one outer batch each) whose iterations one body run takes at most
STACK_ROWS = 16
#: body feeds kept at least when rows are stacked, where the rows allow: the held-back split
#: keeps every 8th of them (32), enough for the recipe choice and its noise
MIN_FEEDS = 256
#: the largest difference, relative to an output's largest magnitude, between a body run on
#: stacked rows and on each row alone that still counts as the same values (the runtime's
#: kernels for a batch of 16 and of 1 sum in other orders: ~1e-6 apart)
STACK_TOLERANCE = 1e-4


def trip_count(node: onnx.NodeProto, row: dict[str, np.ndarray]) -> int | None:
    """The iterations ``node`` runs on ``row`` when known before running it.

    A Scan: its first scan input's length along its axis. A Loop: its trip count (at most
    :data:`MAX_ITERATIONS`), or 0 when its condition input is false; None without a trip
    count.
    """
    if node.op_type == "Scan":
        scans = int(_attr(node, "num_scan_inputs", 0))
        if not scans:
            return 0
        first = np.asarray(row[node.input[len(node.input) - scans]])
        axis = int(list(_attr(node, "scan_input_axes", [0] * scans))[0])
        return int(first.shape[axis % first.ndim])
    cond_in = node.input[1] if len(node.input) > 1 else ""
    if cond_in and not bool(np.asarray(row[cond_in]).reshape(-1)[0]):
        return 0
    if not node.input or not node.input[0]:
        return None
    return min(int(np.asarray(row[node.input[0]]).reshape(-1)[0]), MAX_ITERATIONS)


def steps_together(node: onnx.NodeProto) -> bool:
    """Whether rows that start with the same trip count run the same iterations.

    A Scan runs once per slice. A Loop stops on its trip count or on the condition its body
    returns: rows stay in step only when that condition is the one it was given (through
    Identity nodes) or a constant, not one computed from a row's values.
    """
    if node.op_type == "Scan":
        return True
    body = dict(graphs_of(node))["body"]
    if len(body.input) < 2 or not body.output:
        return False
    produced = {o: n for n in body.node for o in n.output}
    constants = {t.name for t in body.initializer}
    name = body.output[0].name
    while name in produced and produced[name].op_type == "Identity":
        name = produced[name].input[0]
    if name == body.input[1].name or name in constants:
        return True
    return name in produced and produced[name].op_type == "Constant"


#: how each input of a body feed is joined across rows: the axis its rows are stacked on, or
#: None when every row has the same value (a Loop's iteration number, a shape)
Layout = dict[str, int | None]


def _batch_axis(shapes: list[tuple[int, ...]], sizes: list[int]) -> int | None:
    """The first axis on which each shape has its row's ``sizes`` and all agree elsewhere."""
    first = shapes[0]
    for axis in range(len(first)):
        if all(
            len(s) == len(first)
            and s[axis] == n
            and s[:axis] + s[axis + 1 :] == first[:axis] + first[axis + 1 :]
            for s, n in zip(shapes, sizes, strict=True)
        ):
            return axis
    return None


def layout(feeds: list[Feed], sizes: list[int]) -> Layout | None:
    """How ``feeds`` (one per row, ``sizes`` samples each) join into one, or None if they cannot.

    An input is stacked on the first axis that has its row's samples in every feed, the rest
    of its shape and its dtype agreeing (a time-major sequence is stacked on axis 1); shared
    when it is the same array in every feed. The axis is a guess where a dimension happens to
    equal the samples: :func:`same_outputs` checks it.
    """
    out: Layout = {}
    for name in feeds[0]:
        arrays = [np.asarray(f[name]) for f in feeds]
        first = arrays[0]
        axis = None
        if all(a.dtype == first.dtype for a in arrays):
            axis = _batch_axis([a.shape for a in arrays], sizes)
        if axis is not None:
            out[name] = axis
        elif all(a.shape == first.shape and np.array_equal(a, first) for a in arrays[1:]):
            out[name] = None
        else:
            return None
    return out


def join(feeds: list[Feed], how: Layout) -> Feed:
    """One feed of ``feeds``' rows, each input stacked or shared as ``how`` says."""
    return {
        k: feeds[0][k] if axis is None else np.concatenate([f[k] for f in feeds], axis=axis)
        for k, axis in how.items()
    }


def split(outputs: list[np.ndarray], sizes: list[int]) -> list[list[np.ndarray]]:
    """Each row's part of a stacked run's ``outputs``: rows ``sizes`` samples each.

    An output is cut on its first axis of every row's samples together; one without such an
    axis (a condition, a count) is every row's.
    """
    total, cuts = sum(sizes), np.cumsum(sizes)[:-1]
    parts = []
    for o in outputs:
        axis = next((a for a, d in enumerate(np.shape(o)) if d == total), None)
        parts.append([o] * len(sizes) if axis is None else np.split(o, cuts, axis=axis))
    return [list(row) for row in zip(*parts, strict=True)]


def same_outputs(session: Any, feeds: list[Feed], how: Layout, sizes: list[int]) -> bool:
    """Whether the body run once on ``feeds`` joined gives each row what it gives it alone.

    Each output is compared with its row's alone, float ones to :data:`STACK_TOLERANCE` of
    their largest magnitude, others exactly. A run that fails on the joined feed (a shape
    written into the body) is no agreement.
    """
    alone = [session.run(None, f) for f in feeds]
    try:
        together = split(session.run(None, join(feeds, how)), sizes)
    except Exception:  # noqa: BLE001 - onnxruntime's errors have no common type
        return False
    for mine, theirs in zip(together, alone, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape or a.dtype != b.dtype:
                return False
            if not np.issubdtype(b.dtype, np.floating):
                if not np.array_equal(a, b):
                    return False
                continue
            scale = float(np.max(np.abs(b))) if b.size else 0.0
            if b.size and float(np.max(np.abs(a - b))) > STACK_TOLERANCE * scale:
                return False
    return True


class _Stepped:
    """The session one row's iterations see: its part of one run on every row's feed."""

    def __init__(self, rows: _Lockstep, index: int):
        self.rows, self.index = rows, index

    def run(self, fetch: list[str], feed: Feed) -> list[np.ndarray]:
        return self.rows.outputs(fetch)[self.index]


class _Lockstep:
    """One body run per iteration for several rows: their feeds joined, the outputs cut."""

    def __init__(self, session: Any, how: Layout, sizes: list[int]):
        self.session, self.how, self.sizes = session, how, sizes
        self.feed: Feed = {}
        self._parts: list[list[np.ndarray]] | None = None

    def joined(self, feeds: list[Feed]) -> Feed:
        """The current iteration's feed of every row (run at the first row's request)."""
        self.feed, self._parts = join(feeds, self.how), None
        return dict(self.feed)

    def outputs(self, fetch: list[str]) -> list[list[np.ndarray]]:
        if self._parts is None:
            self._parts = split(self.session.run(fetch, self.feed), self.sizes)
        return self._parts


def stacked_iterations(
    node: onnx.NodeProto,
    session: Any,
    rows: list[dict[str, np.ndarray]],
    free: list[str],
    how: Layout,
    sizes: list[int],
) -> Iterator[Feed]:
    """The inputs of ``node``'s body on each iteration, every row of ``rows`` in one feed.

    The rows must run the same iterations (:func:`trip_count`, :func:`steps_together`) and
    join as ``how`` says (:func:`layout`); ``sizes``: each row's samples. One body run a step
    for all of them: each row is driven by :func:`body_iterations` as alone, on its part of
    that run's outputs.
    """
    step = _Lockstep(session, how, sizes)
    drivers = [body_iterations(node, _Stepped(step, r), row, free) for r, row in enumerate(rows)]
    while True:
        feeds = [next(d, None) for d in drivers]
        if any(f is None for f in feeds):  # all at once: the rows run the same iterations
            return
        yield step.joined(feeds)  # type: ignore[arg-type]
