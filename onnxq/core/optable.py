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

Attributes go both ways by the table too: :meth:`QOp.qop_attrs` gives the QOperator op's
attributes from its float op's (the lowering and ``convert``), :meth:`QOp.float_attrs` the float
op's from the QOperator op's (the QDQ lowering).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MS_DOMAIN = "com.microsoft"


Attrs = dict[str, Any]


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
    #: the weight triple must hold a constant (QLinearMatMul also multiplies two activations)
    constant_weight: bool = True
    #: the QOperator op's attributes from the float op's and the opset (None: the kept ones)
    to_qop: Callable[[Attrs, int], Attrs] | None = None
    #: the float op's attributes from the QOperator op's (None: the kept ones)
    to_float: Callable[[Attrs], Attrs] | None = None
    #: the output scale is optional: without it the op writes float (QGemm)
    float_output_ok: bool = False
    #: it can compute in int8 and write float, when only float ops read its result
    #: (onnxq.post.float_outputs: QGemm without its output pair, QLinearMatMul as
    #: MatMulIntegerToFloat)
    writes_float: bool = False

    def triple_positions(self, n_inputs: int) -> tuple[int, ...]:
        """Positions of the (tensor, scale, zero point) triples of a node with ``n_inputs``."""
        return tuple(range(2, n_inputs, 3)) if self.variadic else self.triples

    def kept(self, attrs: Attrs) -> Attrs:
        """The attributes both forms share."""
        return {
            k: v
            for k, v in attrs.items()
            if k not in self.drops and (self.keeps is None or k in self.keeps)
        }

    def qop_attrs(self, attrs: Attrs, opset: int) -> Attrs:
        """The QOperator op's attributes, given its float op's and the model's opset."""
        return self.to_qop(attrs, opset) if self.to_qop is not None else self.kept(attrs)

    def float_attrs(self, attrs: Attrs) -> Attrs:
        """The float op's attributes, given the QOperator op's."""
        return self.to_float(attrs) if self.to_float is not None else self.kept(attrs)


def _gemm_to_qgemm(attrs: Attrs, opset: int) -> Attrs:
    """QGemm computes alpha·(A·B + C): alpha and the transposes stay (beta goes into C)."""
    return {
        "alpha": float(attrs.get("alpha", 1.0)),
        "transA": int(attrs.get("transA", 0)),
        "transB": int(attrs.get("transB", 0)),
    }


def _qgemm_to_gemm(attrs: Attrs) -> Attrs:
    """alpha·(A·B + C) is Gemm with beta = alpha."""
    alpha = float(attrs.get("alpha", 1.0))
    trans = {k: int(attrs.get(k, 0)) for k in ("transA", "transB")}
    return {"alpha": alpha, "beta": alpha, **trans}


def _nchw(attrs: Attrs, opset: int) -> Attrs:
    """Pooling attributes on NCHW data."""
    return {**attrs, "channels_last": 0}


def _leaky_relu(attrs: Attrs, opset: int) -> Attrs:
    return {"alpha": float(attrs.get("alpha", 0.01))}


def _softmax(attrs: Attrs, opset: int) -> Attrs:
    """The axis, and the opset whose Softmax semantics apply (they changed at 13)."""
    axis = attrs.get("axis")
    return {"axis": int((-1 if opset >= 13 else 1) if axis is None else axis), "opset": opset}


TABLE: tuple[QOp, ...] = (
    QOp("QLinearConv", "Conv", "", (0, 3), 6, weight=3, weight_axis=0, bias=8, keeps=None),
    QOp(
        "QLinearMatMul",
        "MatMul",
        "",
        (0, 3),
        6,
        weight=3,
        weight_axis=1,
        keeps=(),
        constant_weight=False,
        writes_float=True,
    ),
    QOp(
        "QGemm",
        "Gemm",
        MS_DOMAIN,
        (0, 3),
        7,
        weight=3,
        bias=6,
        keeps=("transA", "transB"),
        to_qop=_gemm_to_qgemm,
        to_float=_qgemm_to_gemm,
        float_output_ok=True,
        writes_float=True,
    ),
    QOp("QLinearAdd", "Add", MS_DOMAIN, (0, 3), 6, keeps=()),
    QOp("QLinearMul", "Mul", MS_DOMAIN, (0, 3), 6, keeps=()),
    QOp("QLinearGlobalAveragePool", "GlobalAveragePool", to_qop=_nchw),
    QOp("QLinearAveragePool", "AveragePool", to_qop=_nchw),
    QOp("QLinearSigmoid", "Sigmoid", keeps=()),
    QOp("QLinearLeakyRelu", "LeakyRelu", keeps=("alpha",), to_qop=_leaky_relu),
    QOp("QLinearSoftmax", "Softmax", keeps=("axis",), to_qop=_softmax),
    QOp("QLinearConcat", "Concat", output=0, variadic=True, keeps=("axis",)),
)

#: the table by QOperator op type
BY_QOP: dict[str, QOp] = {q.qop: q for q in TABLE}

#: the QOperator ops that can write float (:attr:`QOp.writes_float`)
FLOAT_OUTPUT_QOPS = frozenset(q.qop for q in TABLE if q.writes_float)

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

#: carriers whose onnxruntime kernels take 8-bit integers but not int16
BYTE_ONLY = frozenset({"MaxPool", "Resize", "Pad"})

#: float layers onnxruntime quantizes by itself when they read a DequantizeLinear output (per
#: tensor, whatever the model asks: onnxq.post.float_guard; tested: MatMul is not)
SELF_QUANTIZED_BY_RUNTIME = frozenset({"Conv", "ConvTranspose", "Gemm"})
