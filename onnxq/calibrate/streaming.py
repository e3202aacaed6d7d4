"""Running an onnxruntime session over calibration batches, on the cores it should have.

* :func:`run_ahead`: each batch's outputs while the next batch already runs on a thread;
* :func:`run_checked`: one run, onnxruntime's failures turned into one clear error;
* :func:`available_cores` and :func:`one_blas_thread`: the thread budget of the pass.

Shared by the one-process pass (onnxq.calibrate.calibration), the worker processes
(onnxq.calibrate.shards) and the Ray tasks (onnxq.calibrate.cluster).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from onnxq.errors import CalibrationError


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the BLAS of numpy on one thread while the statistics are folded.

    The pass already keeps the cores busy (onnxruntime on the next batch, this thread on the
    statistics); a BLAS pool of every core on top (the Hessians' products) oversubscribed them:
    MobileNetV2's calibrate step took 9.9 s at 512 samples with it, 7.2 s without.
    """
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


def run_ahead(
    session: Any,
    names: list[str],
    batches: Iterable[dict[str, np.ndarray]],
    number: Callable[[int], int] | None = None,
) -> Iterator[tuple[dict[str, np.ndarray], list[np.ndarray]]]:
    """Each batch with ``names`` computed, the next batch already running.

    onnxruntime releases the GIL while it runs, so the caller's numpy work on one batch
    (observers, Hessians) overlaps the inference of the next: one batch in flight, so at most
    two batches' outputs are alive. The caller still sees the batches in order (deterministic).
    The run is a daemon thread: Ctrl-C in the caller exits at once, not after the batch.
    ``number`` maps the position of a batch to the number an error names (a worker's share).
    """
    name = number or (lambda i: i)
    it = iter(batches)
    current = next(it, None)
    if current is None:
        return
    job = _Run(session, names, current, name(0))
    for index, upcoming in enumerate(it, start=1):
        outs = job.result()
        job = _Run(session, names, upcoming, name(index))
        yield current, outs
        current = upcoming
    yield current, job.result()


class _Run:
    """One :func:`run_checked` call on a daemon thread."""

    def __init__(self, session: Any, names: list[str], feeds: Mapping[str, Any], index: int):
        self._outs: list[np.ndarray] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._work, args=(session, names, feeds, index), daemon=True
        )
        self._thread.start()

    def _work(self, session: Any, names: list[str], feeds: Mapping[str, Any], index: int) -> None:
        try:
            self._outs = run_checked(session, names, feeds, index)
        except BaseException as exc:  # handed to the caller's thread
            self._error = exc

    def result(self) -> list[np.ndarray]:
        """The outputs (the thread's exception raised here)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._outs


def run_checked(
    session: Any, names: list[str], feeds: Mapping[str, np.ndarray], index: int
) -> list[np.ndarray]:
    """``session.run`` with onnxruntime's failures turned into one clear CalibrationError."""
    try:
        return session.run(names, dict(feeds))
    except Exception as exc:  # onnxruntime raises its own exception types
        text = str(exc).strip().splitlines()
        detail = text[0] if text else type(exc).__name__
        shapes = {k: list(np.shape(v)) for k, v in feeds.items()}
        raise CalibrationError(
            f"onnxruntime failed to run the model on calibration batch "
            f"{index} (input shapes {shapes}): {detail}; check that the "
            f"calibration data has the shapes and values the model expects{_batch_hint(session)}"
        ) from None


def _batch_hint(session: Any) -> str:
    """A hint for models that declare a dynamic batch yet run at one batch size only."""
    try:
        dynamic = any(i.shape and not isinstance(i.shape[0], int) for i in session.get_inputs())
    except Exception:  # not an onnxruntime session
        return ""
    if not dynamic:
        return ""
    return (
        "; the model declares a dynamic batch: if it runs at one batch size only, pass "
        "--batch-size N (batch_size=N from Python) to feed N samples per run"
    )
