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
