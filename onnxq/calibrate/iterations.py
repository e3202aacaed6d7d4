"""A Loop or Scan body's calibration data: its inputs on every iteration of every sample."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import onnx

from onnxq.calibrate.dataset import DatasetManager, Feed
from onnxq.io.bodies import body_iterations
from onnxq.io.session import make_session


class Iterations(DatasetManager):
    """A Loop or Scan body's calibration feeds: its inputs on every iteration, every sample.

    Computed afresh on each read (the float body run iteration by iteration), so memory holds
    one iteration's values whatever the number of iterations.
    """

    def __init__(
        self, node: onnx.NodeProto, body: onnx.ModelProto, free: list[str], rows: list[Feed]
    ):
        """Feeds of ``node``'s body.

        ``body``: the float body model (onnxq.post.subgraphs.branch_model); ``free``: its dynamic
        free variables; ``rows``: per sample, the node's inputs and those variables.
        """
        super().__init__()
        self.node = node
        self.model = body
        self.free = free
        self.rows = rows
        #: iterations the last complete read gave
        self.count = 0
        self._session: Any = None

    def _raw(self) -> Iterator[Feed]:
        if self._session is None:
            self._session = make_session(self.model, optimize=False)
        count = 0
        for row in self.rows:
            for feed in body_iterations(self.node, self._session, row, self.free):
                count += 1
                yield feed
        self.count = count

    def describe(self) -> str:
        """How the source is named in messages."""
        return f"the iterations of {self.node.op_type} '{self.node.name}'"
