"""The dataflow pattern language: the public face of onnxq's matcher and rewriter.

Modelled on TVM's ``relay.dataflow_pattern``, over onnx-graphsurgeon graphs::

    x, w, b = wildcard(), is_constant(), is_constant()
    conv = is_op("Conv")(x, w, b).has_attr({"group": 1})
    pattern = conv.optional(lambda p: is_op("Relu")(p))

Leaves: ``wildcard()``, ``is_constant()``, ``is_input(name)``; ``is_op(op, domain)(args...)``
with ``None`` for an absent optional input and ``[i]`` for output ``i``; predicates
``has_attr``, ``has_dtype``, ``has_shape``, ``has_rank``, ``check``; combinators ``|`` and
``optional``; Add/Mul and other commutative ops match either operand order. Drivers:
``match``, ``match_explain`` (the reason of a failed match), ``find_all``, ``partition`` (the
grouping discipline) and ``rewrite`` (callbacks to a bounded fixed point). Graph queries the
rules need: ``constant_value``, ``producer``, ``node_attr``, ``tensor_dtype``, ``tensor_shape``,
and ``MS_DOMAIN`` (the com.microsoft domain of onnxruntime's QLinear ops).
"""

from onnxq.core.optable import MS_DOMAIN
from onnxq.io.graph import constant_value, producer
from onnxq.match.dfpattern import (
    COMMUTATIVE_OPS,
    AltPattern,
    AttrPattern,
    CallPattern,
    CheckPattern,
    ConstantPattern,
    DFPattern,
    DtypePattern,
    InputPattern,
    Match,
    MatchResult,
    OpPattern,
    RankPattern,
    ShapePattern,
    WildcardPattern,
    has_attr,
    has_dtype,
    has_rank,
    has_shape,
    is_constant,
    is_input,
    is_op,
    match,
    match_explain,
    node_attr,
    tensor_dtype,
    tensor_shape,
    wildcard,
)
from onnxq.match.rewrite import (
    Attempt,
    DFPatternCallback,
    Group,
    Partition,
    RewriteResult,
    find_all,
    partition,
    rewrite,
)

__all__ = [
    "MS_DOMAIN",
    "COMMUTATIVE_OPS",
    "AltPattern",
    "Attempt",
    "AttrPattern",
    "CallPattern",
    "CheckPattern",
    "ConstantPattern",
    "DFPattern",
    "DFPatternCallback",
    "DtypePattern",
    "Group",
    "InputPattern",
    "Match",
    "MatchResult",
    "OpPattern",
    "Partition",
    "RankPattern",
    "RewriteResult",
    "ShapePattern",
    "WildcardPattern",
    "constant_value",
    "find_all",
    "has_attr",
    "has_dtype",
    "has_rank",
    "has_shape",
    "is_constant",
    "is_input",
    "is_op",
    "match",
    "match_explain",
    "node_attr",
    "partition",
    "producer",
    "rewrite",
    "tensor_dtype",
    "tensor_shape",
    "wildcard",
]
