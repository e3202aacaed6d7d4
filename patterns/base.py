"""The shared body of quantizer patterns: weighted ops (Conv, dense) and binary ops (Add, Mul).

Conv and dense differ only in the weight's output-channel axis and the QLinear op they become,
so both derive from :class:`WeightedPattern` and vary :meth:`WeightedPattern.weight_channel_axis`,
:meth:`WeightedPattern.qop_for` and :meth:`WeightedPattern.qop_attrs`. A rule only annotates:
the QOperator lowering writes the op from the record and the op table.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.core.callbacks import CalibrationCallback
from onnxq.core.optable import BY_QOP, CARRIERS
from onnxq.core.specs import Lowering, PatternRecord
from onnxq.pattern import (
    DFPattern,
    Match,
    MatchResult,
    constant_value,
    is_constant,
    is_op,
    node_attr,
    producer,
    tensor_shape,
    wildcard,
)
from onnxq.patterns.rule import QuantizerPattern


def unit_range(dtype: str, symmetric: bool) -> tuple[float, int]:
    """Scale and zero point whose grid holds both 0 and 1.0 exactly, for any activation type.

    Asymmetric: 1 / (qmax − qmin) with zero point qmin (uint8: 1/255, 0; int8: 1/255, −128;
    int16: 1/65535, −32768); symmetric: 1 / qmax with zero point 0 (int8: 1/127).
    """
    info = np.iinfo(np.dtype(dtype))
    lo, hi = int(info.min), int(info.max)
    if symmetric:
        return 1.0 / hi, 0
    return 1.0 / (hi - lo), lo


def _is_zero(t: gs.Tensor) -> bool:
    value = constant_value(t)
    return value is not None and value.size == 1 and float(value.reshape(-1)[0]) == 0.0


def with_relu(core: DFPattern) -> tuple[DFPattern, DFPattern]:
    """``core`` optionally followed by an activation clamping at 0: (pattern, activation).

    The activation folds into the output range (zero point at qmin): Relu, or Clip with min 0
    (Relu6 and the like; the upper bound is kept by calibrating on the clipped output).
    """
    zero = is_constant().check(_is_zero, "Clip's min is not 0")
    upper = is_constant()
    act = (
        is_op("Relu")(core)
        | is_op("Clip")(core, zero, upper)
        | is_op("Clip")(core, zero, None)
        | is_op("Clip")(core).has_attr({"min": 0.0})  # opset < 11: bounds as attributes
    )
    return act | core, act


class WeightedPattern(QuantizerPattern):
    """``op(x, W[, b]) [→ Relu]`` with a constant weight: Q(x) → QLinear op → DQ.

    A rule is data: subclasses set ``op_type`` and ``has_bias``; the constructor builds
    ``self.x``, ``self.w``, ``self.b`` (None without bias), ``self.core`` (the op's call
    pattern), ``self.relu`` and ``self.pattern``. :meth:`build` may be overridden for larger
    subgraphs (MatMul → Add).
    """

    op_type = ""
    #: the QLinear op of the op table (onnxq.core.optable) the group becomes
    qop = ""
    has_bias = False

    def __init__(self, calibration_callback: CalibrationCallback | None = None):
        super().__init__(calibration_callback)
        self.x, self.w = wildcard(), is_constant()
        self.b: DFPattern | None = is_constant() if self.has_bias else None
        self.core: DFPattern = is_op(self.op_type)(self.x, self.w, self.b)
        self.pattern, self.relu = with_relu(self.build())

    def build(self) -> DFPattern:
        """The pattern before the optional Relu (default: the op itself)."""
        return self.core

    def weight_channel_axis(self, node: gs.Node, weight: np.ndarray) -> int:
        """The axis of ``weight`` that indexes output channels (per-channel scales run on it)."""
        raise NotImplementedError

    def qop_for(self, m: Match) -> str:
        """The QLinear op (of the op table) the group becomes."""
        return self.qop

    def bias_value(self, m: Match, node: gs.Node) -> np.ndarray | None:
        """The float bias as a 1-D array of output channels, or None."""
        if self.b is None:
            return None
        return np.asarray(
            m.tensor(self.b).values
            if isinstance(m.tensor(self.b), gs.Constant)
            else _const(m.tensor(self.b)),
            np.float32,
        ).reshape(-1)

    def check(self, m: Match) -> MatchResult:
        """The weight must be float32 and the Relu foldable."""
        res = self.float_output_check(m)
        if not res.ok:
            return res
        if self.relu in m and self.quantizer.config.activation_symmetric:
            return MatchResult.fail(
                "a Relu folds only into an asymmetric output range (zero "
                "point at qmin); activations are symmetric"
            )
        w = _const(m.tensor(self.w))
        if w.dtype != np.float32:
            return MatchResult.fail(
                f"weight '{m.tensor(self.w).name}' is {w.dtype}, expected float32"
            )
        return MatchResult(m)

    def quantize_match(self, m: Match) -> PatternRecord | None:
        """Specs of Q(x), int8 W, int32 b and the (Relu-folded) output; the QLinear op."""
        q = self.quantizer
        node = m.node(self.core)
        weight = m.tensor(self.w)
        xq = q.quantize_input(m.tensor(self.x))
        wq = q.quantize_weight(weight, self.weight_channel_axis(node, _const(weight)))
        bias_value = self.bias_value(m, node)
        bias = q.quantize_bias(node, bias_value, xq, wq) if bias_value is not None else None
        yq = q.quantize_output(m.root)
        qop = self.qop_for(m)
        attrs = tuple(self.qop_attrs(node, BY_QOP[qop]).items())
        lowering = Lowering("qlinear", qop, attrs, bias)
        return self.annotate(m, node, [xq, wq], [yq], lowering, self.relu in m)


def _carries(node: gs.Node | None) -> bool:
    return node is not None and node.op in CARRIERS


def quantized_upstream(cb: QuantizerPattern, t: gs.Tensor) -> bool:
    """``t`` comes from a quantized op, possibly through ops that carry int8 (MaxPool, Split…)."""
    node = producer(t)
    while _carries(node) and not cb.in_group(node):
        assert node is not None
        node = producer(node.inputs[0])
    return cb.in_group(node)


def quantized_downstream(cb: QuantizerPattern, t: gs.Tensor) -> bool:
    """Some quantized op reads ``t``, possibly through ops that carry int8."""
    todo, seen = list(t.outputs), set()
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if cb.in_group(node):
            return True
        if _carries(node):
            todo.extend(u for o in node.outputs for u in o.outputs)
    return False


#: a calibrated output grid replaces an op's fixed one when it is at least this much finer: a
#: range reaching 0.99 gains nothing and loses the exact 1.0 of the fixed grid
FINER = 0.9


class ActivationPattern(QuantizerPattern):
    """``op(a₁, …, aₙ) [→ Relu/Clip]`` on activations only → the int8 op (com.microsoft).

    Such an op pays off only between quantized neighbours: alone it would add a Q/DQ round trip
    for each input and output, so it is left float (with the reason) when no consumer is a
    quantized group. Subclasses set ``op_type``, ``qop`` (an op of the op table, which gives
    its domain and attributes) and ``arity``.
    """

    op_type = ""
    qop = ""
    arity = 1
    fold_relu = True
    #: the output's range is known to be [0, 1] (Sigmoid, Softmax): its widest grid is
    #: :func:`unit_range` of the output's type. A calibrated range inside it gives a finer grid
    #: and wins (sigmoid outputs in [0, 0.3] lost 5 dB on the fixed grid against onnxruntime's
    #: calibrated one)
    fixed_output: bool = False

    def __init__(self, calibration_callback: CalibrationCallback | None = None):
        super().__init__(calibration_callback)
        self.args = [wildcard() for _ in range(self.arity)]
        self.core: DFPattern = is_op(self.op_type)(*self.args)
        if self.fold_relu:
            self.pattern, self.relu = with_relu(self.core)
        else:
            self.pattern, self.relu = self.core, is_op("Relu")(self.core)  # never matched

    def calibrate_pattern(self, calibration_info: Any) -> dict[str, np.ndarray]:
        """The callback's values, the output bounded by the op's known range."""
        values = super().calibrate_pattern(calibration_info)
        if self.fixed_output:
            for qt in calibration_info.outputs:
                scale, zp = unit_range(qt.dtype, qt.symmetric)
                calibrated = values.get(qt.scale)
                if calibrated is not None and 0 < float(np.max(calibrated)) < FINER * scale:
                    continue  # observed outputs span well inside [0, 1]: their finer grid
                values[qt.scale] = np.asarray(scale, np.float32)
                values[qt.zero_point] = np.asarray(zp, np.dtype(qt.dtype))
        return values

    def check(self, m: Match) -> MatchResult:
        """Every operand must be an activation; a folded Relu needs asymmetric outputs."""
        res = self.float_output_check(m)
        if not res.ok:
            return res
        for p in self.args:
            t = m.tensor(p)
            if is_constant_tensor(t):
                return MatchResult.fail(
                    f"operand '{t.name}' is a constant; {self.op_type} is "
                    "quantized only on activations"
                )
        if self.relu in m and self.quantizer.config.activation_symmetric:
            return MatchResult.fail("a Relu folds only into an asymmetric output range")
        return MatchResult(m)

    def quantize_match(self, m: Match) -> PatternRecord | None:
        """Specs of Q(inputs), the int8 op and its output, unless every neighbour stays float."""
        q = self.quantizer
        ins = [m.tensor(p) for p in self.args]
        # an int8 output that only float ops read is dequantized at once: it saves nothing
        # and costs a rounding of the result (x·x of a LayerNorm's variance, say, which a
        # reciprocal square root then amplifies), so the op runs in float on DQ'd inputs
        if not quantized_downstream(self, m.root):
            q.leave_float(
                self,
                m,
                f"no quantized op reads the output of {self.op_type}: an int8 result would "
                "be dequantized at once (a Q/DQ round trip and a rounding for nothing)",
            )
            return None
        node = m.node(self.core)
        qins = [q.quantize_input(t) for t in ins]
        yq = q.quantize_output(m.root)
        attrs = self.qop_attrs(node, BY_QOP[self.qop])
        lowering = Lowering("qlinear", self.qop, tuple(attrs.items()))
        return self.annotate(m, node, qins, [yq], lowering, relu_folded=self.relu in m)


def _const(t: gs.Tensor) -> np.ndarray:
    """The weight's values, read afresh (not kept in the graph: the model holds them)."""
    value = constant_value(t)
    assert value is not None, t.name  # the pattern matched a constant here
    return value


def attrs_without(node: gs.Node, *names: str) -> dict[str, Any]:
    """The node's attributes minus ``names``."""
    return {k: v for k, v in node.attrs.items() if k not in names}


def is_constant_tensor(t: gs.Tensor) -> bool:
    """True for initializers and Constant-node outputs."""
    if isinstance(t, gs.Constant):
        return True
    return bool(t.inputs) and t.inputs[0].op == "Constant"


__all__ = [
    "WeightedPattern",
    "attrs_without",
    "is_constant_tensor",
    "node_attr",
    "tensor_shape",
    "with_relu",
]
