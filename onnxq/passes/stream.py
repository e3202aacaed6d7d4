"""Stream the calibration data through the float model before annotation.

SmoothQuant, cross-layer equalization and depthwise scaling read inner tensors of the float
model before the calibrate pass does, onnxruntime one run ahead of their statistics (as in the
calibrate pass), at onnxruntime's default threads. The first of them opens
``state.dataset``; a source that can be read once only (an iterator, a reader without rewind)
is kept as the batches read, so every later pass, calibration included, reads the same samples
again.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx

from onnxq.calibrate.dataset import model_inputs
from onnxq.calibrate.sources import as_dataset
from onnxq.calibrate.streaming import run_ahead
from onnxq.io.session import make_session
from onnxq.passes.manager import State


def float_batches(
    state: State, model: onnx.ModelProto, tensors: list[str]
) -> Iterator[dict[str, np.ndarray]]:
    """Per calibration batch: ``tensors`` of ``model`` (float), by name."""
    o = state.options
    ds = state.dataset
    if ds is None:
        ds = as_dataset(state.data, model_inputs(model), o.batch_size, o.samples, o.preprocess)
        state.dataset = ds
    else:
        ds.reset()
    kept: list[dict[str, np.ndarray]] | None = None if ds.replayable else []
    session = make_session(model, expose=tensors)
    # onnxruntime runs the next batch on a thread of its own while the caller folds this one
    # (in order: the statistics are the same as one run after another)
    for feed, values in run_ahead(session, tensors, ds.batches()):
        if kept is not None:
            kept.append(feed)
        yield {t: np.asarray(v) for t, v in zip(tensors, values, strict=True)}
    if kept is not None:  # a one-shot source: later passes read the kept batches
        state.dataset = as_dataset(kept, model_inputs(model))
    else:
        ds.reset()
