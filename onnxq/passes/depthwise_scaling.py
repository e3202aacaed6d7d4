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

``depthwise_scaling``: ``on`` rewrites where it pays, ``off`` leaves the model alone, ``auto``
(the default) decides on the held-back batches of the recipe choice (:class:`DepthwiseTrial`):
on PP-OCRv5's detector the rewrite raised the text-mask IoU from 87.1 to 92.2%, but on PP-OCR
recognisers the sequential bias correction (the CNN default) moved the rescaled model away from
fp32 (PP-OCRv4's: CER 0.86 → 3.55%): docs/ablation.md. With weights per tensor it is refused
(the filters could not absorb ``1/s``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any, Protocol

import numpy as np
import onnx

from onnxq.io.graph import tensor_array
from onnxq.passes.defaults import choosing
from onnxq.passes.manager import Pass, PassRecord, PassResult, State, run_nested
from onnxq.passes.stream import float_batches, open_dataset
from onnxq.prepare.depthwise_scaling import candidates, constants, filter_energy, rewrite, uses_of
from onnxq.simulate.checks import SQNR_FLOOR_DB
from onnxq.simulate.emulate import emulate
from onnxq.simulate.heldback import beats, gain, sqnr
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


#: why the trial is not run where nothing is held back
NOT_JUDGED = "the recipe is not chosen on held-back batches, which would judge it"


class Fitter(Protocol):
    """What fits one recipe on a calibrated state (onnxq.passes.choose.Choose)."""

    def fit(self, state: State) -> Any:
        """Solve, round and correct ``state`` for its options."""
        ...


class DepthwiseTrial:
    """``depthwise_scaling`` auto: the model quantized unscaled and rescaled, the better kept.

    Runs ``core`` (annotate, calibrate, choose) on the model as it is. Where some depthwise
    input can take a factor, the recipe is chosen on held-back batches and the data can be read
    again, it then rescales a copy of the float model (:class:`DepthwiseScaling`), annotates
    and calibrates it, fits the recipe the choice kept (``fitter``) and scores both on the
    held-back batches (output SQNR of the emulation, per sample). The rescaled model is kept
    only when it scores above the unscaled one by more than the noise (twice the standard error
    of the paired difference): a rewrite that helps a detector's layers can hurt through the
    sequential bias correction (PP-OCR recognisers), and only the whole model's outputs on
    samples nothing was fitted on tell. Costs one more calibration, fit and scoring (about
    doubling the quantize time), so it is tried only where the recipe chosen scores below
    :data:`~onnxq.simulate.checks.SQNR_FLOOR_DB` on the held-back batches, the floor below which
    the check after quantizing warns about the model's accuracy (on the zoo, every model above
    it on which the trial ran kept the unscaled model). Leaves the state of the model kept,
    ``options.depthwise_scaling`` set to what was decided (so the fallback's and the branches'
    quantizations follow it) and the trial in ``state.choice["depthwise_scaling"]``.
    """

    name = "depthwise-scaling"

    def __init__(self, scaling: Pass, core: Sequence[Pass], fitter: Fitter):
        self.scaling, self.core, self.fitter = scaling, list(core), fitter

    def run(self, state: State) -> PassResult:
        """Run the core; try the rescaled model where it can be judged; keep the better."""
        o = state.options
        found = candidates(state.float_model, o.kept_float(state.float_model))
        if found and o.per_channel and (state.data is not None or state.dataset is not None):
            open_dataset(state)  # split or not: whether the trial can be judged is known now
        why = self._why_not(state, found)
        # the float model as annotation will find it, copied only for a trial that will run
        spare = None if why else _fork(state)
        run_nested(state, self.core)
        if not why and not state.held_back:  # the choice found nothing to hold back
            why = NOT_JUDGED
        if not why:
            rows = {r["recipe"]: r for r in state.choice.get("candidates", [])}
            level = rows.get(state.choice.get("chosen"), {}).get("sqnr_db")
            if level is not None and level >= SQNR_FLOOR_DB:
                why = (
                    f"{level:.1f} dB output SQNR on the held-back batches, above the "
                    f"{SQNR_FLOOR_DB:g} dB floor: not tried"
                )
        # decided off unless the trial below keeps the rescaled model
        state.options = replace(state.options, depthwise_scaling="off")
        if why or spare is None:
            return PassResult(f"off (auto: {why})")
        start = time.perf_counter()
        trial = self._rescaled(state, spare)
        if trial is None:
            return PassResult("off (auto: no depthwise input gained from a factor)")
        held = [feed for feed, _ in state.held_back]
        refs = [ref for _, ref in state.held_back]
        kept = sqnr(emulate(state, float_branches=False), held, refs)
        scored = sqnr(emulate(trial, float_branches=False), held, refs)
        mean, noise = gain(scored, kept)
        won = beats(scored, kept)
        rescaled = sum(1 for v in trial.depthwise_scaling.values() if v["folded_into"])
        summary = {
            "rescaled_inputs": rescaled,
            "recipe": state.options.recipe,
            "sqnr_db": round(float(np.mean(scored)), 3),
            "unscaled_sqnr_db": round(float(np.mean(kept)), 3),
            "vs_unscaled_db": round(mean, 3),
            "noise_db": round(noise, 3),
            "kept": won,
            "seconds": round(time.perf_counter() - start, 3),
        }
        words = f"{mean:+.2f} dB output SQNR (noise ±{noise:.2f}) on the held-back batches"
        state.records.extend(
            PassRecord(f"{r.name} (rescaled)", r.seconds, r.changed) for r in trial.records
        )
        if won:
            _adopt(state, trial)
        choice = dict(state.choice)
        choice["depthwise_scaling"] = summary
        state.choice = choice
        state.options = replace(state.options, depthwise_scaling="on" if won else "off")
        if won:
            return PassResult(f"on (auto: {rescaled} inputs rescaled, {words})")
        state.depthwise_scaling = {}
        return PassResult(f"off (auto: rescaling {rescaled} inputs scored {words})")

    @staticmethod
    def _why_not(state: State, found: list[Any]) -> str:
        """Why the rescaled model is not tried ('' when it is), before the core runs."""
        if not found:
            return "no depthwise input whose scale can be folded upstream"
        if not state.options.per_channel:
            return "weights per tensor: the filters cannot take 1/s"
        if not choosing(state):  # data read once only is never held back either
            return NOT_JUDGED
        return ""

    def _rescaled(self, state: State, spare: State) -> State | None:
        """The rescaled model annotated, calibrated and fitted with the recipe chosen."""
        spare.options = replace(state.options, depthwise_scaling="on")
        spare.dataset, spare.held_back, spare.choice = state.dataset, state.held_back, {}
        spare.data_reads = state.data_reads  # its reads are the call's too
        first = len(state.data_reads)
        run_nested(spare, [self.scaling])
        if not any(v["folded_into"] for v in spare.depthwise_scaling.values()):
            return None
        run_nested(spare, self.core[:-1])  # annotate and calibrate; the recipe is chosen
        self.fitter.fit(spare)
        for read in state.data_reads[first:]:
            read["pass"] += " (depthwise scaling trial)"
        return spare


def _fork(state: State) -> State:
    """A copy of ``state`` before annotation, with its own float model and containers."""
    spare = state.fork()
    model = onnx.ModelProto()
    model.CopyFrom(state.float_model)
    spare.float_model = model
    spare.records = []
    return spare


def _adopt(state: State, trial: State) -> None:
    """Leave the rescaled model's results on ``state`` (its records and reads as they are)."""
    records, choice, reads = state.records, state.choice, state.data_reads
    for f in fields(State):
        setattr(state, f.name, getattr(trial, f.name))
    state.records, state.choice, state.data_reads = records, choice, reads
