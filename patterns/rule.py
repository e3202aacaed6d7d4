"""QuantizerPattern: the base of every rule of the library (``onnxq.patterns``).

A rule annotates: it matches a group of float nodes, asks the Quantizer running it (set as
``rule.quantizer`` before matching) for the spec of each quantized edge, and returns a frozen
:class:`~onnxq.core.specs.PatternRecord` saying what is quantized, with which spec, and
which op of the op table (``onnxq.core.optable``) the group becomes. It writes no node: the
QOperator lowering (``onnxq.lower.qoperator``) writes every group from its record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.core.callbacks import CalibrationCallback, CalibrationInfo
from onnxq.core.optable import QOp
from onnxq.core.specs import Lowering, PatternRecord, QTensor
from onnxq.pattern import DFPatternCallback, Match, MatchResult, tensor_dtype


class QuantizerPattern(DFPatternCallback):
    """A DFPatternCallback that annotates its match as Q → QLinear op → DQ.

    Subclasses set ``self.pattern`` and implement :meth:`quantize_match`, which takes the specs
    of the group's edges from the :class:`Quantizer` (``quantize_input``, ``quantize_weight``,
    ``quantize_bias``, ``quantize_output``) and returns :meth:`annotate`'s record, or None to
    leave the group float. ``calibrate_pattern`` delegates to the CalibrationCallback given at
    construction (or the Calibrator's default).
    """

    #: the op whose inputs and output this rule's group may keep on one scale, when a target
    #: asks for it (``shared_scale_ops``); None: the rule's tensors are calibrated apart
    shares_scale: str | None = None

    #: the Quantizer running this rule (onnxq.annotate.quantizer), set before matching
    quantizer: Any

    def __init__(self, calibration_callback: CalibrationCallback | None = None):
        super().__init__()
        self.calibration_callback = calibration_callback

    def calibrate_pattern(self, calibration_info: CalibrationInfo) -> dict[str, np.ndarray]:
        """Values for this pattern's placeholders: the callback's choice."""
        return calibration_info.callback.calibrate_pattern(calibration_info)

    def in_group(self, node: gs.Node | None) -> bool:
        """``node`` is in a group that is (or will be) quantized: matched, not left float."""
        return super().in_group(node) and (
            node is None or not self.quantizer.is_left_float(node.name)
        )

    def annotate_match(self, m: Match) -> PatternRecord | None:
        """The record of ``m`` under its nodes' per-node settings (None: left float)."""
        with self.quantizer.group([n.name for n in m.nodes]):
            return self.quantize_match(m)

    def quantize_match(self, m: Match) -> PatternRecord | None:
        """Annotate ``m``: the specs of its quantized edges as a record; None leaves it float."""
        raise NotImplementedError

    def qop_attrs(self, node: gs.Node, spec: QOp) -> dict[str, Any]:
        """The attributes of the op ``spec`` that ``node`` becomes (by the op table)."""
        return spec.qop_attrs(dict(node.attrs), self.quantizer.opset)

    def annotate(
        self,
        m: Match,
        node: gs.Node,
        inputs: Sequence[QTensor],
        outputs: Sequence[QTensor],
        lowering: Lowering,
        relu_folded: bool = False,
    ) -> PatternRecord:
        """The frozen record of ``m``: ``node`` is the float op the group is named by."""
        return PatternRecord(
            self,
            self.label(),
            tuple(n.name for n in m.nodes),
            tuple(inputs),
            tuple(outputs),
            node.name,
            m.root.name,
            relu_folded=relu_folded,
            bias=lowering.bias if lowering.kind == "qlinear" else None,
            lowering=lowering,
        )

    def float_output_check(self, m: Match) -> MatchResult:
        """Shared check: the root must be float32 (or of unknown type)."""
        dt = tensor_dtype(m.root)
        if dt is not None and dt != np.float32:
            return MatchResult.fail(f"output '{m.root.name}' is {dt}; onnxq quantizes float32 ops")
        return MatchResult(m)
