"""Apply one rule to a small model: what it changes, and the numbers through onnxruntime.

Every per-rule test file (``test_rule_*.py``, one per module of ``onnxq.patterns``) calls
:func:`check_rule`: the model is quantized with the rule (plus the ``context`` rules its
neighbours need, e.g. the Conv rules around an Add) and again without it, so the test sees
exactly which nodes the rule claims, which ops it writes, and that the output still matches the
float model on held-out inputs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from helpers import run

import onnxq


@dataclass
class RuleRun:
    model: onnx.ModelProto
    report: object
    without: onnx.ModelProto
    sqnr_db: float


def sqnr(reference: np.ndarray, test: np.ndarray) -> float:
    noise = float(np.sum((reference.astype(np.float64) - test) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(signal / noise)


def data_for(model: onnx.ModelProto, n: int, seed: int) -> dict[str, np.ndarray]:
    """Standard-normal float inputs (ints in [0, 50) for int64 inputs), ``n`` samples."""
    gen = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        dims = [d.dim_value or 1 for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            out[i.name] = gen.integers(0, 50, (n, *dims[1:])).astype(np.int64)
        else:
            out[i.name] = gen.normal(0, 1, (n, *dims[1:])).astype(np.float32)
    return out


def check_rule(
    model: onnx.ModelProto,
    rule: type,
    claims: set[str],
    writes: dict[str, int],
    context: tuple[type, ...] = (),
    min_sqnr: float = 30.0,
    **options: object,
) -> RuleRun:
    """Quantize with and without ``rule``; assert its claims, its ops and the numbers.

    ``claims``: the nodes the rule must quantize (its decisions name it), none of which is
    quantized without it. ``writes``: ops (``op`` or ``domain:op``) whose count must be exactly
    this in the output with the rule. ``min_sqnr``: the float and quantized outputs on 8
    held-out samples, run in onnxruntime (its exact integer path).
    """
    calib, held_out = data_for(model, 32, 1), data_for(model, 8, 2)
    q, report = onnxq.quantize(
        model, calib, patterns=[rule(), *(c() for c in context)], progress=False, **options
    )
    claimed = {d.node for d in report.decisions if d.quantized and d.pattern == rule.name}
    assert claimed == claims, f"{rule.name} claimed {sorted(claimed)}, expected {sorted(claims)}"
    without, rep0 = onnxq.quantize(
        model, calib, patterns=[c() for c in context] or [], progress=False, **options
    )
    still = {d.node for d in rep0.decisions if d.quantized and d.node in claims}
    assert not still, f"without {rule.name}, {sorted(still)} were quantized anyway"
    counts = Counter(n.op_type for n in q.graph.node)
    counts.update(f"{n.domain}:{n.op_type}" for n in q.graph.node if n.domain)
    for op, n in writes.items():
        assert counts[op] == n, f"{op}: {counts[op]} in the output, expected {n}"
    ref = run(model, held_out)[0]
    got = run(q, held_out, exact=True)[0]
    score = sqnr(ref, got)
    assert score >= min_sqnr, f"SQNR {score:.1f} dB < {min_sqnr} dB"
    return RuleRun(q, report, without, score)
