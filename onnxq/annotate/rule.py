"""QuantizerPattern: the base of every rule of the library (``onnxq.patterns``).

A rule is a DFPatternCallback whose callback rewrites its match through the Quantizer running
it (set as ``rule.quantizer`` before matching) and records what it did as a
:class:`~onnxq.annotate.specs.PatternRecord`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.annotate.specs import PatternRecord, QTensor
from onnxq.calibrate.callbacks import CalibrationCallback, CalibrationInfo
from onnxq.match.dfpattern import Match, MatchResult, tensor_dtype
from onnxq.match.rewrite import DFPatternCallback


class QuantizerPattern(DFPatternCallback):
    """A DFPatternCallback that rewrites its match into Q → QLinear op → DQ.

    Subclasses set ``self.pattern`` and implement :meth:`quantize_match`, which builds the
    quantized op with the helpers of :class:`Quantizer` and returns the float tensor replacing
    the match's root (normally a DequantizeLinear output). ``calibrate_pattern`` delegates to the
    CalibrationCallback given at construction (or the Calibrator's default).
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

    def callback(self, pre: gs.Tensor, post: gs.Tensor, node_map: dict) -> gs.Tensor | None:
        """Rewrite the current match (``self.match``) through :meth:`quantize_match`."""
        with self.quantizer.group([n.name for n in self.match.nodes]):
            return self.quantize_match(self.match)

    def quantize_match(self, m: Match) -> gs.Tensor | None:
        """Build the quantized replacement of ``m``; None leaves it float."""
        raise NotImplementedError

    def record_match(
        self,
        m: Match,
        inputs: list[QTensor],
        outputs: list[QTensor],
        qnode: gs.Node,
        relu_folded: bool = False,
        bias: str | None = None,
    ) -> None:
        """Register the rewritten group of ``m`` with the Quantizer (calibration, reports)."""
        self.quantizer.record(
            PatternRecord(
                self,
                self.label(),
                [n.name for n in m.nodes],
                inputs,
                outputs,
                qnode.name,
                relu_folded=relu_folded,
                bias=bias,
            )
        )

    def float_output_check(self, m: Match) -> MatchResult:
        """Shared check: the root must be float32 (or of unknown type)."""
        dt = tensor_dtype(m.root)
        if dt is not None and dt != np.float32:
            return MatchResult.fail(f"output '{m.root.name}' is {dt}; onnxq quantizes float32 ops")
        return MatchResult(m)
