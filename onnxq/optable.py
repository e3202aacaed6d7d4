"""The one table of quantized ops: per QLinear op, its float op, domain and operand slots.

Every stage that reads or writes a quantized op asks this table instead of keeping its own
list: requantize (which inputs are (tensor, scale, zero point) triples), the QDQ lowering (how
the op un-fuses into DequantizeLinear → float op → QuantizeLinear), ``convert`` (which ops make
a model QOperator) and the rule library's tests (every rule's ``qop`` is here).

Slots are input positions of the QOperator node:

- ``triples``: the (tensor, scale, zero point) operands, in order; ``weight`` is the triple
  holding a constant weight (if any), quantized along ``weight_axis`` of the weight;
- ``output``: the (scale, zero point) pair of the output;
- ``bias``: the int32 bias (scale = input scale · weight scale, zero point 0);
- a variadic op (QLinearConcat) has its output pair first and triples from position 2 on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class QOp:
    """One quantized op of the QOperator format."""

    qop: str
    float_op: str
    domain: str = MS_DOMAIN
    triples: tuple[int, ...] = (0,)
    output: int = 3
    weight: int | None = None
    #: the weight's output-channel axis; None: decided per node (QGemm: by transB)
    weight_axis: int | None = None
    bias: int | None = None
    variadic: bool = False
    #: attributes the float op keeps (None: all but ``channels_last``)
    keeps: tuple[str, ...] | None = None
    #: attributes of the QOperator op that the float op cannot take
    drops: tuple[str, ...] = field(default=("channels_last",))

    def triple_positions(self, n_inputs: int) -> tuple[int, ...]:
        """Positions of the (tensor, scale, zero point) triples of a node with ``n_inputs``."""
        return tuple(range(2, n_inputs, 3)) if self.variadic else self.triples


TABLE: tuple[QOp, ...] = (
    QOp("QLinearConv", "Conv", "", (0, 3), 6, weight=3, weight_axis=0, bias=8, keeps=None),
    QOp("QLinearMatMul", "MatMul", "", (0, 3), 6, weight=3, weight_axis=1, keeps=()),
    QOp("QGemm", "Gemm", MS_DOMAIN, (0, 3), 7, weight=3, bias=6, keeps=("transA", "transB")),
    QOp("QLinearAdd", "Add", MS_DOMAIN, (0, 3), 6, keeps=()),
    QOp("QLinearMul", "Mul", MS_DOMAIN, (0, 3), 6, keeps=()),
    QOp("QLinearGlobalAveragePool", "GlobalAveragePool"),
    QOp("QLinearAveragePool", "AveragePool"),
    QOp("QLinearSigmoid", "Sigmoid", keeps=()),
    QOp("QLinearLeakyRelu", "LeakyRelu", keeps=("alpha",)),
    QOp("QLinearSoftmax", "Softmax", keeps=("axis",)),
    QOp("QLinearConcat", "Concat", output=0, variadic=True, keeps=("axis",)),
)

#: the table by QOperator op type
BY_QOP: dict[str, QOp] = {q.qop: q for q in TABLE}

#: integer ops that also mark a model as quantized (onnxruntime's dynamic quantization)
INTEGER_OPS = frozenset({"MatMulInteger", "ConvInteger"})


def qops(names: Sequence[str] | None = None) -> frozenset[str]:
    """The QOperator op types (of ``names`` float ops, or all)."""
    return frozenset(q.qop for q in TABLE if names is None or q.float_op in names)


#: ops that commute with y = (q - z) * s on their first input (minimum opset for int8 inputs):
#: they only select, move or take the maximum of elements
PASS_THROUGH: dict[str, int] = {
    "MaxPool": 12,
    "Reshape": 5,
    "Flatten": 1,
    "Transpose": 1,
    "Squeeze": 1,
    "Unsqueeze": 1,
    "Slice": 10,
    "Gather": 1,
    "DepthToSpace": 1,
    "SpaceToDepth": 1,
    "Resize": 11,
    "Expand": 8,
    "Tile": 6,
}

#: ops through which int8 data flows unchanged in value (Split has several outputs)
CARRIERS = frozenset(PASS_THROUGH) | {"Split"}
