"""Embedding tables: Gather(W, indices) on a constant 2-D table → int8 table, dequantized after.

Weight-only: the table is stored int8 (a quarter of the size) with one scale per embedding
column, and the gathered rows are dequantized (``DequantizeLinear`` along the last axis, which
needs opset 13; older models get one scale for the table). Gathering int8 rows then dequantizing
is exactly dequantizing then gathering, so nothing is lost beyond the table's own rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxq.core.specs import Lowering, PatternRecord
from onnxq.pattern import Match, MatchResult, is_constant, is_op, node_attr, wildcard
from onnxq.patterns.rule import QuantizerPattern


class GatherPattern(QuantizerPattern):
    """Gather(table, indices) with a constant float 2-D table on axis 0."""

    name = "gather-table"

    def __init__(self, calibration_callback: Any = None):
        super().__init__(calibration_callback)
        self.table, self.indices = is_constant(), wildcard()
        self.pattern = is_op("Gather")(self.table, self.indices)

    def check(self, m: Match) -> MatchResult:
        """A float32 2-D table gathered on axis 0."""
        node = m.node(self.pattern)
        table = m.tensor(self.table)
        value = table.values if isinstance(table, gs.Constant) else None
        if value is None or value.ndim != 2 or value.dtype != np.float32:
            return MatchResult.fail(f"table '{table.name}' is not a constant float32 2-D table")
        if int(node_attr(node, "axis") or 0) != 0:
            return MatchResult.fail("only row lookups (axis 0) are quantized")
        return MatchResult(m)

    def quantize_match(self, m: Match) -> PatternRecord | None:
        """Gather(int8 table, indices) → DequantizeLinear(axis=-1)."""
        q = self.quantizer
        node = m.node(self.pattern)
        per_column = q.opset >= 13
        wq = q.quantize_weight(m.tensor(self.table), 1 if per_column else None)
        return self.annotate(m, node, [wq], [], Lowering("table", "Gather"))


# Gather(W, idx) -> DQ(Gather(Wq, idx), s_w, 0, axis=-1)
RULES = [GatherPattern]
