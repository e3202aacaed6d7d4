"""Stream the calibration data through the float model before annotation.

SmoothQuant, cross-layer equalization and depthwise scaling read inner tensors of the float
model before the calibrate pass does, onnxruntime one run ahead of their statistics (as in the
calibrate pass), at onnxruntime's default threads. :func:`open_dataset` is the one place
the data is opened (and split for the held-back recipe choice), by whichever pass reads it
first; a source that can be read once only (an iterator, a reader without rewind)
is kept as the batches read, so every later pass, calibration included, reads the same samples
again.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx

from onnxq.calibrate.dataset import DatasetManager, HeldBack, model_inputs
from onnxq.calibrate.sources import as_dataset
from onnxq.calibrate.streaming import run_ahead
from onnxq.calibrators import DEFAULT_METHOD
from onnxq.io.session import make_session
from onnxq.options import QuantizeOptions, spell
from onnxq.passes.manager import State, record_read

#: with the recipe chosen on held-back data, every HOLD_EVERY-th calibration batch is held back
HOLD_EVERY = 8
#: held-back batches the choice needs (fewer: auto's picks, fitted on every batch)
MIN_HELD = 4
#: with many batches the spacing widens so that about this many are held back (each is
#: scored once per candidate; the rest are fitted on)
MAX_HELD = 16


def open_dataset(state: State) -> DatasetManager:
    """``state.dataset``, opened on first use: the one place the calibration data is opened.

    With ``recipe`` auto and enough batches, it holds back every :data:`HOLD_EVERY`-th batch
    (every n/:data:`MAX_HELD`-th of n batches past 128; onnxq.calibrate.dataset.HeldBack):
    every pass fits on the rest, and the recipe is chosen on those (onnxq.passes.choose).
    Scored by the caller's metric (on data of its own), nothing is held back: every candidate
    fits on every batch. Otherwise ``state.choice`` says why not.
    """
    if state.dataset is not None:
        return state.dataset
    o = state.options
    inputs = model_inputs(state.float_model)
    ds = as_dataset(state.data, inputs, o.batch_size, o.samples, o.preprocess)
    why = _no_hold_back(o, ds)
    if why:
        state.choice = {"skipped": why}
    else:
        every = (
            0
            if o.choice_metric is not None
            else max(HOLD_EVERY, (ds.num_batches() or 0) // MAX_HELD)
        )
        ds = HeldBack(ds, every)
    state.dataset = ds
    return ds


def _no_hold_back(o: QuantizeOptions, ds: DatasetManager) -> str:
    """Why the recipe is not chosen on held-back batches ('' when it is)."""
    if o.recipe != "auto":
        return f"pinned by {spell('recipe', o.cli, o.recipe)}"
    if o.method != DEFAULT_METHOD and o.rounding != "auto" and o.bias_correction != "auto":
        return "one candidate: the method, rounding and bias correction are all set"
    # a callback or a loaded range table sets the ranges; Ray tasks read their own data; the
    # search's time is not budgeted yet
    for name in ("callback", "load_ranges", "ray", "budget"):
        if getattr(o, name) is not None:
            return f"{spell(name, o.cli)} given"
    if not ds.replayable:
        return "the data can be read once only"
    n = ds.num_batches()
    if n is None:
        return "the number of calibration batches is not known before reading them"
    if n < HOLD_EVERY * MIN_HELD and o.choice_metric is None:
        return (
            f"{n} calibration batches, fewer than the {HOLD_EVERY * MIN_HELD} that hold back "
            f"{MIN_HELD}; auto's picks were fitted on every batch"
        )
    return ""


def float_batches(
    state: State, model: onnx.ModelProto, tensors: list[str], reader: str, why: str
) -> Iterator[dict[str, np.ndarray]]:
    """Per calibration batch: ``tensors`` of ``model`` (float), by name.

    ``reader`` (the pass) and ``why`` (what it needs that the calibrate pass's stream cannot
    give it) go to the report's list of data reads.
    """
    ds = open_dataset(state)
    ds.reset()
    kept: list[dict[str, np.ndarray]] | None = None if ds.replayable else []
    session = make_session(model, expose=tensors)
    # onnxruntime runs the next batch on a thread of its own while the caller folds this one
    # (in order: the statistics are the same as one run after another)
    read = 0
    for feed, values in run_ahead(session, tensors, ds.batches()):
        if kept is not None:
            kept.append(feed)
        read += 1
        yield {t: np.asarray(v) for t, v in zip(tensors, values, strict=True)}
    record_read(state, reader, read, why)
    if kept is not None:  # a one-shot source: later passes read the kept batches
        state.dataset = as_dataset(kept, model_inputs(model))
    else:
        ds.reset()
