"""Per-kernel constraints on quantization parameters, as data (the MLIR RFC's op traits).

A target lists the kernels whose ports must share one scale and zero point
(``Target.shared_scale_ops``); this table says which ports each such kernel ties together and
why. The work-list pass (onnxq.solve.constraints) reads only the table, so a kernel is added
here, not in code:

* **same scale, all ports** (Concat): the runtime copies each input into the output buffer;
* **same scale, inputs** (Add under TensorRT): the runtime adds two int8 tensors without
  rescaling either, so both inputs are on one grid (the output keeps its own);
* **derived** (the carriers of the op table: MaxPool, Reshape, Slice, Gather, nearest Resize,
  Pad, Split…): int8 values pass unchanged, so the output is read on its input's grid. Every
  target has these (the requantize pass depends on them); a target may list them too.

Fixed output grids (Sigmoid, Softmax) and zero points at the minimum (a folded Relu) are
properties of the rules that write them; the bias scale (input scale × weight scale) is derived
when the model is materialized.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnxq.core.optable import CARRIERS


@dataclass(frozen=True)
class SameScale:
    """The ports of one kernel that share one scale and zero point."""

    op: str
    #: "all": its inputs and its output; "inputs": its inputs only
    ports: str
    #: what the runtime does that needs it
    why: str


SAME_SCALE: dict[str, SameScale] = {
    "Concat": SameScale(
        "Concat", "all", "the runtime copies each input into the output buffer unchanged"
    ),
    "Add": SameScale("Add", "inputs", "the runtime adds two int8 tensors without rescaling either"),
}

#: kernels whose output is read on their input's grid, for every target (the op table's
#: carriers; Pad only with a constant 0, reflect or edge, which onnxq.post.requantize checks)
DERIVED = CARRIERS | {"Pad"}

#: what a target may list in ``shared_scale_ops``
SHAREABLE = frozenset(SAME_SCALE) | DERIVED

#: a port joins a same-scale group only if its grid grows coarser by at most this much for the
#: readers outside the kernel that imposes the group (6.02 dB: one bit of resolution); past it,
#: the edge into the kernel is rescaled (a DequantizeLinear → QuantizeLinear pair) instead
MERGE_BOUND_DB = 6.02
