"""Prepare: the float model preprocessed once, before any float rewrite reads it.

Needs ``state.float_model`` (loaded). Leaves it preprocessed (onnxq.prepare.preprocess: unique
node names, constant subgraphs folded, BatchNormalization folded into the layer before it,
HardSwish fused, Loop/Scan input projections hoisted out of their bodies, shapes inferred) and
``state.float_graph``, the same model as the one graph the annotation copies (the call's one
onnx-graphsurgeon import). The float rewrites after it (equalization, SmoothQuant, depthwise
scaling) see the folded model; one that changes it lets go of the graph, and the annotation
preprocesses their result again (new nodes need shapes).
"""

from __future__ import annotations

from dataclasses import replace

from onnxq.annotate.quantizer import body_node_names, refuse_shared_names
from onnxq.passes.manager import PassResult, State, op_changes, op_histogram
from onnxq.prepare.preprocess import prepare_hoisting


class Prepare:
    """Preprocess the float model."""

    name = "prepare"

    def run(self, state: State) -> PassResult:
        """Fold, fuse, name and infer shapes; keep the graph."""
        before = op_histogram(state.float_model)
        # a body node named as inspect and the report name it (HOLDER/BODY/NODE): its own name
        o = state.options
        plain = body_node_names(state.float_model, o.exclude)
        if plain != tuple(o.exclude):
            state.options = o = replace(o, exclude=plain)
        if o.user is not None and o.user.node:
            keys = list(o.user.node)
            named = body_node_names(state.float_model, keys)
            if list(named) != keys:
                tables = dict(zip(named, o.user.node.values(), strict=True))
                state.options = replace(o, user=replace(o.user, node=tables))
        # an --exclude name several nodes share is refused before preprocessing renames them
        refuse_shared_names(state.float_model, state.options.quantizer_config().exclude)
        kept = state.options.kept_float(state.float_model)
        state.float_model, state.float_graph, moved = prepare_hoisting(state.float_model, kept)
        changed = op_changes(before, op_histogram(state.float_model))
        if moved:  # what a user sees as new MatMuls in the main graph
            changed += f"; moved before their loop, computed once: {', '.join(moved)}"
        return PassResult(changed)
