"""Explain: why each node of the float model is or is not quantized (``inspect --explain``).

Reads what annotation left (the records, the groups left float, the per-node settings from
``--config``) and the partition's attempts (every rule tried at every node, with the kind of
failure and the node it is about, so no reason text is parsed back).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.core.optable import CARRIERS
from onnxq.core.specs import Decision
from onnxq.io.graph import iter_subgraph_nodes, nodes_in_order
from onnxq.match.dfpattern import tensor_dtype
from onnxq.match.rewrite import Partition


def explain(q: Any, part: Partition) -> dict[str, Decision]:
    """Why each node of ``q.float_graph`` is or is not quantized, after annotation."""
    decisions: dict[str, Decision] = {}
    quantized = {n: r.label for r in q.records for n in r.nodes}
    float_graph = q.float_graph
    for node in nodes_in_order(float_graph):
        name = node.name
        attempts = part.reasons_for(name)
        if name in q.int4_nodes:
            why = f"weights int4 block-wise ({q.int4_nodes[name]}); activations float"
            decisions[name] = Decision(name, node.op, True, "int4-weights", why)
        elif name in quantized:
            why = ""
            if name in q.node_dtypes:
                why = f"activations {q.node_dtypes[name]} ({q.node_dtype_sources[name]})"
            decisions[name] = Decision(name, node.op, True, quantized[name], why)
        elif name in q.placement:
            decisions[name] = Decision(name, node.op, False, "placement", q.placement[name])
        elif name in q.left_float:
            pattern, reason = q.left_float[name]
            decisions[name] = Decision(name, node.op, False, pattern, reason)
        elif attempts:
            # the near misses that got past the op type say the most
            specific = [a for a in attempts if a.kind != "op"]
            chosen = (specific or attempts)[:3]
            reason = "; ".join(f"{a.pattern}: {a.reason}" for a in chosen)
            decisions[name] = Decision(name, node.op, False, attempts[0].pattern, reason)
        else:
            decisions[name] = Decision(name, node.op, False, "", _inside_reason(node, part))
        if name in q.ignored:
            d = decisions[name]
            d.reason = "; ".join([d.reason, *q.ignored[name]] if d.reason else q.ignored[name])
    return decisions


def _inside_reason(node: gs.Node, part: Partition) -> str:
    """Why a node that no pattern was rooted at stays float."""
    # a rejected pattern rooted at a consumer may name this node (an escaping value, …)
    for out in node.outputs:
        for user in out.outputs:
            for a in part.reasons_for(user.name):
                if not a.accepted and a.source == node.name:
                    return f"{a.pattern} (rooted at '{a.node}'): {a.reason}"
    bodies = [v for v in node.attrs.values() if isinstance(v, gs.Graph)]
    if bodies:
        inner = sum(1 for b in bodies for _ in iter_subgraph_nodes(b))
        if node.op == "If":
            return (
                f"holds {len(bodies)} branches with {inner} node(s): quantize treats each "
                "branch as a graph of its own, calibrated on the samples that take it"
            )
        return (
            f"holds a body of {inner} node(s): quantize treats it as a graph of its own, "
            "calibrated on every iteration the calibration samples run"
        )
    dtypes = {tensor_dtype(o) for o in node.outputs}
    if node.op in CARRIERS and dtypes <= {np.dtype(np.float32), None}:
        return (
            "no pattern: it carries int8 through when its input comes from a quantized op "
            "(requantize pass)"
        )
    if dtypes and not dtypes & {np.dtype(np.float32), None}:
        kinds = ", ".join(sorted(str(d) for d in dtypes if d is not None))
        return f"computes {kinds} values (shapes, indices): nothing to quantize"
    return _FLOAT_OPS.get(node.op, "no quantizer pattern handles this op")


_NO_KERNEL = "no int8 kernel in onnxruntime CPU"
#: why common ops without a pattern stay float (shown by inspect --explain)
_FLOAT_OPS = {
    "HardSigmoid": f"{_NO_KERNEL}: it runs in float between DQ and Q (OpenVINO fuses it into "
    "the preceding convolution of a FakeQuantize model)",
    "HardSwish": f"{_NO_KERNEL}: it runs in float between DQ and Q (OpenVINO fuses it into the "
    "preceding convolution of a FakeQuantize model)",
    "LSTM": "recurrent cell: no int8 pattern (its gates need float accumulation); stays float",
    "GRU": "recurrent cell: no int8 pattern (its gates need float accumulation); stays float",
    "RNN": "recurrent cell: no int8 pattern; stays float",
    "ReduceMean": "normalisation statistics stay float: int8 would lose small variances",
    "LayerNormalization": "normalisation stays float: int8 would lose small variances",
    "Erf": f"{_NO_KERNEL}; GELU's Erf runs in float",
    "Tanh": f"{_NO_KERNEL}; runs in float",
    "ConvTranspose": f"{_NO_KERNEL} (a BatchNormalization after it is folded in)",
}
