"""Branches: the bodies of top-level If, Loop and Scan nodes quantized as models of their own.

Needs ``state.model``, ``state.quantizer`` and ``state.dataset``. Leaves ``state.model`` with
those bodies replaced, each constant they hold several times kept once
(onnxq.io.graph.share_body_constants), and ``state.branches`` (what became of each, for the
decisions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx

from onnxq.calibrate.dataset import HeldBack, feed_samples
from onnxq.calibrate.iterations import Iterations
from onnxq.io.graph import share_body_constants
from onnxq.options import QuantizeOptions
from onnxq.passes.defaults import settle
from onnxq.passes.manager import PassResult, State
from onnxq.post.subgraphs import BODY_OPS, BranchResult, has_branches, quantize_branches

#: quantizes one body model: (model, feeds or a DatasetManager, options) -> (quantized, report)
BranchQuantizer = Callable[[onnx.ModelProto, Any, QuantizeOptions], Any]


class Branches:
    """Quantize each If branch and Loop/Scan body with the call's options.

    ``quantize`` is the API's driver.
    """

    name = "branches"

    def __init__(self, quantize: BranchQuantizer):
        self.quantize = quantize

    def run(self, state: State) -> PassResult:
        """Quantize the bodies, or say why they stay float."""
        q, fmt = state.quantizer, state.options.output_format
        if not has_branches(q.float_model):
            return PassResult()
        ifs = [n.name for n in q.float_model.graph.node if n.op_type in BODY_OPS]
        if state.dataset is None or not fmt.branches:
            why = (
                "no calibration data (a loaded range table covers the main graph only)"
                if state.dataset is None
                else "FakeQuantize output covers the main graph only"
            )
            reason = f"its bodies stay float: {why}"
            state.branches = [BranchResult(n, "branches", reason=reason) for n in ifs]
            shared = _saved(share_body_constants(state.model))
            return PassResult(f"{len(ifs)} If/Loop/Scan nodes left float{shared}")
        state.dataset.reset()
        source = state.dataset
        if isinstance(source, HeldBack) and not state.values:
            # the main graph quantizes nothing, so nothing was judged on the held-back batches:
            # the bodies calibrate on every batch (and hold back their own for their choice)
            source = source.inner
        feeds = [dict(f) for f in source.batches()]
        sizes = [feed_samples(f) for f in feeds]  # the rows of a body's feeds, per outer feed
        options = settle(state.options.for_branches(), state.over_budget)

        def run(model: onnx.ModelProto, samples: Any) -> Any:
            return self.quantize(model, samples, options)

        state.model, state.branches = quantize_branches(
            q.float_model,
            state.model,
            feeds,
            run,
            lambda node, body, free, rows: Iterations(node, body, free, rows, sizes),
            state.options.kept_float(q.float_model),
        )
        done = sum(1 for b in state.branches if b.quantized)
        shared = _saved(share_body_constants(state.model))
        return PassResult(f"{done} of {len(state.branches)} bodies quantized{shared}")


def _saved(saved: int) -> str:
    """The bytes one copy of each repeated body constant saved, for the pass line."""
    return f"; {saved / 1024:.0f} KiB of repeated body constants kept once" if saved else ""
