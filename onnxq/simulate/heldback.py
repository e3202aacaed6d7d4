"""Scores on held-back batches: how close a candidate's outputs are to fp32, and when two differ.

A candidate quantization is scored by its emulation (onnxq.simulate.emulate, every switch on:
QDQ arithmetic in float, biases on their int32 grids) on calibration batches it was not
fitted on. Per sample the score is the output SQNR in dB, ``-10·log10(‖q − f‖² / ‖f‖²)``
with each float output normalised by its own energy and the ratios averaged over the outputs,
so a sample counts the same whatever the scale of the model's outputs. (Per batch instead
where some output does not hold the batch on its first axis.)

Two candidates are compared sample by sample (the same samples): the mean of the per-sample
differences against its **noise**, twice the standard error of that mean (``2·s/√n``, ``s`` the
sample standard deviation of the differences). A difference within the noise is one the
held-back samples cannot tell from chance at about 95%.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from onnxq.calibrate.dataset import feed_samples
from onnxq.io.session import make_session
from onnxq.simulate.emulate import Emulation

#: SQNR given to a batch the candidate reproduces exactly (dB); its negative is the floor (a
#: NaN or ±Inf where fp32 is finite)
EXACT_DB = 120.0


def references(
    model: onnx.ModelProto, held: Sequence[dict[str, Any]]
) -> list[dict[str, np.ndarray]]:
    """The float outputs of ``model`` on each held-back batch, by output name."""
    session = make_session(model)
    names = [o.name for o in session.get_outputs()]
    return [
        dict(zip(names, (np.asarray(v) for v in session.run(names, feed)), strict=True))
        for feed in held
    ]


def sqnr(
    emulation: Emulation, held: Sequence[dict[str, Any]], refs: Sequence[dict[str, np.ndarray]]
) -> np.ndarray:
    """Output SQNR (dB) of ``emulation`` (every switch on) against ``refs``, per held-back sample.

    Run as written: onnxruntime's QDQ fusions would re-quantize its float weights.
    """
    model, weights = emulation.resolved_apart()
    session = make_session(model, as_written=True, weights=weights)
    del model, weights
    names = [o.name for o in session.get_outputs()]
    out: list[np.ndarray] = []
    for feed, ref in zip(held, refs, strict=True):
        got = session.run(names, feed)
        pairs = [
            (np.asarray(g, np.float64), np.asarray(ref[name], np.float64))
            for name, g in zip(names, got, strict=True)
            if np.issubdtype(ref[name].dtype, np.floating) and ref[name].size
        ]
        n = feed_samples(feed)
        # per sample where every output holds the batch on its first axis, else per batch
        axis = n > 1 and all(r.ndim and r.shape[0] == n for _, r in pairs)
        rows = n if axis else 1
        errors = np.zeros(rows)
        for g, r in pairs:
            g2, r2 = g.reshape(rows, -1), r.reshape(rows, -1)
            # where fp32 itself is NaN or ±Inf there is nothing to compare with: left out;
            # a non-finite int8 value where fp32 is finite is the worst error there is
            known = np.isfinite(r2)
            with np.errstate(invalid="ignore", over="ignore"):
                diff = np.where(known, g2 - r2, 0.0)
                noise = np.sum(diff**2, axis=1)
            noise[~np.isfinite(noise)] = np.inf
            signal = np.sum(np.where(known, r2, 0.0) ** 2, axis=1)
            errors += noise / np.maximum(signal, 1e-30) / len(pairs)
        exact = errors <= 10 ** (-EXACT_DB / 10)
        with np.errstate(divide="ignore"):
            db = -10 * np.log10(np.maximum(errors, 1e-300))
        out.append(np.clip(np.where(exact, EXACT_DB, db), -EXACT_DB, EXACT_DB))
    return np.concatenate(out) if out else np.empty(0)


def gain(candidate: np.ndarray, incumbent: np.ndarray) -> tuple[float, float]:
    """(mean per-sample gain of ``candidate`` over ``incumbent`` in dB, its noise in dB).

    The noise is twice the standard error of the mean of the paired differences (infinite
    with a single sample: then nothing is above it).
    """
    d = np.asarray(candidate, np.float64) - np.asarray(incumbent, np.float64)
    if d.size < 2:
        return float(d.mean()) if d.size else 0.0, float("inf")
    return float(d.mean()), float(2 * d.std(ddof=1) / np.sqrt(d.size))


def beats(candidate: np.ndarray, incumbent: np.ndarray) -> bool:
    """Whether ``candidate`` scores above ``incumbent`` by more than the noise."""
    mean, noise = gain(candidate, incumbent)
    return mean > noise
