"""Depthwise scaling: equal int8 resolution for every channel a depthwise convolution reads.

Needs ``state.float_model`` and ``state.data``; runs before annotation, on the float model,
which stays exactly equivalent in float. An input qualifies when a depthwise convolution
(``group`` = input channels, constant weights) is its only reader and the factor ``s`` per
channel can be folded upstream without adding a node: the walk from the input goes up through
Identity, Relu, LeakyRelu and Add/Sub of a constant (whose constant takes ``s``) to a Mul or Div
by a constant, a BatchNormalization or a Conv with constant weights, which takes ``s`` (each
tensor on the way read by the next node alone). PP-LCNet's learnable affine blocks (PP-OCR's
detectors and recognisers) are such a walk: HardSwish → Mul(a) → Add(b) → depthwise Conv.

The calibration data is streamed once for the per-channel ranges of the inputs; ``s`` comes
from ``onnxq.solve.depthwise_scaling``, and an input is rewritten when the int8 noise its
convolution sees drops by at least ``MIN_GAIN_DB``. The convolution's filters take ``1/s``.
Leaves ``state.float_model`` (rewritten), ``state.dataset`` and ``state.depthwise_scaling``
(per convolution: the input, where ``s`` went, the spreads and the gain), which the report
lists.

``depthwise_scaling``: ``on`` rewrites where it pays, ``off`` (the default) leaves the model
alone. It is not a default: on PP-OCRv5's detector it raised the text-mask IoU from 85.6 to
92.8%, but on PP-OCRv4's recogniser, whose int8 outputs it brought closer to fp32 with every
other bias correction (18.3 against 15.4 dB SQNR with the fast one), the sequential bias
correction (the CNN default) then moved it away (14.8 dB, CER 0.96 → 3.4%): docs/ablation.md.
With weights per tensor it is refused (the filters could not absorb ``1/s``).
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxq.io.graph import tensor_array
from onnxq.passes.manager import PassResult, State
from onnxq.passes.stream import float_batches
from onnxq.prepare.depthwise_scaling import candidates, constants, filter_energy, rewrite, uses_of
from onnxq.solve.depthwise_scaling import MIN_GAIN_DB, choose


class DepthwiseScaling:
    """Scale depthwise inputs per channel where the int8 noise drops."""

    name = "depthwise-scaling"

    def run(self, state: State) -> PassResult:
        """Collect the inputs' channel ranges, choose the factors, rewrite the float model."""
        o = state.options
        if not o.per_channel:
            return PassResult("off (weights per tensor: the filters cannot take 1/s)")
        if state.data is None and state.dataset is None:
            return PassResult("off (no calibration data)")
        model = state.float_model
        found = candidates(model, o.kept_float(model))
        if not found:
            return PassResult("no depthwise input whose scale can be folded upstream")
        tensors = sorted({c.tensor for c in found})
        lo, hi = _ranges(state, model, tensors)
        inits = constants(model)
        uses = uses_of(model)
        applied = []
        for c in found:
            if c.tensor not in lo:
                continue
            weight = tensor_array(inits[c.conv.input[1]]).astype(np.float64)
            energy = filter_energy(weight, lo[c.tensor].size)
            choice = choose(lo[c.tensor], hi[c.tensor], energy)
            apply = choice.gain_db >= MIN_GAIN_DB
            state.depthwise_scaling[c.conv.name] = {
                "input": c.tensor,
                "folded_into": c.into if apply else "",
                "spread_before": round(choice.spread_before, 3),
                "spread_after": round(choice.spread_after if apply else choice.spread_before, 3),
                "gain_db": round(choice.gain_db, 2) if apply else 0.0,
            }
            if apply:
                state.float_graph = None  # rewritten: annotation prepares the model again
                rewrite(model, c, choice.scales, inits, uses)
                applied.append(choice.gain_db)
        if not applied:
            return PassResult(f"0 of {len(found)} depthwise inputs rescaled (none gained)")
        return PassResult(
            f"{len(applied)} of {len(found)} depthwise inputs rescaled (int8 noise the "
            f"convolution sees -{float(np.median(applied)):.1f} dB median, "
            f"-{min(applied):.1f} to -{max(applied):.1f} dB)"
        )


def _ranges(
    state: State, model: onnx.ModelProto, tensors: list[str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-channel (axis 1) minimum and maximum of each tensor over the calibration data."""
    lo: dict[str, np.ndarray] = {}
    hi: dict[str, np.ndarray] = {}
    for values in float_batches(
        state,
        model,
        tensors,
        "depthwise-scaling",
        "per-channel ranges of depthwise inputs before rescaling; calibration reads the "
        "rescaled model",
    ):
        for t in tensors:
            v = values[t]
            if v.ndim < 3 or not np.issubdtype(v.dtype, np.floating) or v.size == 0:
                continue
            axes = (0, *range(2, v.ndim))
            a, b = v.min(axis=axes).astype(np.float64), v.max(axis=axes).astype(np.float64)
            lo[t] = np.minimum(lo[t], a) if t in lo else a
            hi[t] = np.maximum(hi[t], b) if t in hi else b
    return lo, hi
