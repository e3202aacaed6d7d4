"""The calibration pass on several local processes (``onnxq quantize --workers N``).

The parent reads the data once and hands each block of consecutive batches to the next worker
in turn, through a bounded queue (a block and two batches waiting per worker, so each has its
next block while the parent deals the others': memory stays flat in the number of samples).
Each worker is a fresh process (``spawn``: no onnxruntime threads copied by ``fork``) that
loads the model once, runs it with ``cores / N`` threads and folds its batches into its own
:class:`~onnxq.calibrate.statistics.Statistics`; only those statistics come back, and the
parent merges them in worker order.

From Python, a script that calibrates with workers must start under
``if __name__ == "__main__":``, as any ``multiprocessing`` program: ``spawn`` imports the
script again in each worker.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import pickle
import queue
import signal
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import onnx

from onnxq.calibrate.dataset import Feed, feed_samples
from onnxq.calibrate.statistics import Statistics, block_size
from onnxq.calibrate.streaming import available_cores, one_blas_thread, run_ahead
from onnxq.core.errors import CalibrationError, OnnxqError
from onnxq.io.graph import save_model

#: batches waiting in each worker's queue beyond a block
QUEUE_BATCHES = 2
#: seconds between checks that the workers are still alive while the parent waits on them
POLL_S = 0.5


def worker_of(index: int, block: int, workers: int) -> int:
    """The worker batch ``index`` goes to: blocks of ``block`` batches dealt in turn."""
    return (index // block) % workers


def inbox_capacity(block: int) -> int:
    """Batches a worker's queue holds: a whole block and :data:`QUEUE_BATCHES` more.

    With two batches only, the parent stalled on the worker whose block it was dealing while
    the others had nothing to do: two workers on two cores ran as slowly as one process.
    """
    return block + QUEUE_BATCHES


def threads_per_worker(workers: int) -> int:
    """Threads of onnxruntime for each of ``workers`` processes (the cores shared out, >= 1)."""
    return max(1, available_cores() // workers)


def observe_in_processes(
    model: onnx.ModelProto,
    names: list[str],
    template: Statistics,
    batches: Iterable[Feed],
    workers: int,
    threads: int | None = None,
) -> Iterator[Statistics]:
    """Each worker's statistics over its share of ``batches`` (``template``: fresh observers).

    Worker ``w`` takes the blocks of consecutive batches ``w``, ``w + N``, ... (a block: see
    :attr:`Statistics.block`, set here from the first batch as one process sets it).
    """
    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    template.block = block_size(feed_samples(first))
    block = template.block
    try:
        blank = pickle.dumps(template)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise CalibrationError(
            f"the calibration observers cannot be sent to worker processes ({exc}); "
            "calibrate in one process (--workers 1)"
        ) from None
    threads = threads or threads_per_worker(workers)
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="onnxq-workers-") as tmp:
        path = Path(tmp) / "float.onnx"
        save_model(model, path)  # initializers beside it when it would pass 2 GB
        inboxes = [ctx.Queue(maxsize=inbox_capacity(block)) for _ in range(workers)]
        outbox = ctx.Queue()
        procs = [
            ctx.Process(
                target=_work,
                args=(str(path), names, blank, inboxes[i], outbox, i, threads),
                daemon=True,
                name=f"onnxq-calibrate-{i}",
            )
            for i in range(workers)
        ]
        results: dict[int, Statistics] = {}
        try:
            with _thread_limits(threads), _ignoring_ctrl_c():
                for p in procs:
                    p.start()
            for index, feeds in enumerate(itertools.chain([first], it)):
                box = inboxes[worker_of(index, block, workers)]
                _put(box, (index, feeds), procs, outbox, results)
            for box in inboxes:
                _put(box, None, procs, outbox, results)
            while len(results) < workers:
                _collect(outbox, procs, results, block=True)
        finally:
            if len(results) < workers:  # stopped early: batches nobody will read stay queued,
                for box in inboxes:  # and this process must not wait to flush them at exit
                    box.cancel_join_thread()
            started = [p for p in procs if p.pid is not None]
            for p in started:
                if p.is_alive() and len(results) < workers:
                    p.terminate()
            for p in started:
                p.join(timeout=10)
    for i in range(workers):
        yield results[i]


@contextlib.contextmanager
def _ignoring_ctrl_c() -> Iterator[None]:
    """Workers started here never see SIGINT, and a Ctrl-C meanwhile is raised once they run.

    A terminal sends Ctrl-C to every process of the group: a worker still importing printed
    its own traceback beside the parent's one line, and a parent interrupted inside
    ``Process.start`` left a half-started worker it could not stop. While the workers start,
    SIGINT is blocked on this thread (the mask is inherited across the spawn's exec, so it stays
    blocked in the workers) and a signal delivered to another thread is only recorded; it is
    raised again, through the handler the caller had, once every worker has started (the
    caller then stops them).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    saved = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if caught:
            signal.raise_signal(signal.SIGINT)


#: environment variables that size the BLAS/OpenMP thread pools numpy uses
_POOL_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def _thread_limits(threads: int) -> Iterator[None]:
    """The workers start with numpy's BLAS pools sized to their share of the cores.

    A worker's Hessians are BLAS products: with the default pool (every core) in each of N
    workers, the pools fought over the cores and two workers ran slower than one process.
    """
    saved = {k: os.environ.get(k) for k in _POOL_VARIABLES}
    os.environ.update({k: str(threads) for k in _POOL_VARIABLES})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _put(
    box: Any, item: Any, procs: list[Any], outbox: Any, results: dict[int, Statistics]
) -> None:
    """Put ``item`` in ``box``, failing clearly if a worker stops while the parent waits."""
    while True:
        try:
            box.put(item, timeout=POLL_S)
            return
        except queue.Full:
            _collect(outbox, procs, results, block=False)


def _collect(outbox: Any, procs: list[Any], results: dict[int, Statistics], block: bool) -> None:
    """Take finished workers' results; raise a worker's error, or a worker's silent death."""
    while True:
        try:
            index, error, stats = outbox.get(timeout=POLL_S if block else 0.001)
        except queue.Empty:
            dead = [p for i, p in enumerate(procs) if not p.is_alive() and i not in results]
            if dead:
                raise CalibrationError(
                    f"calibration worker {procs.index(dead[0])} stopped without a result "
                    f"(exit code {dead[0].exitcode}; out of memory?); retry with fewer "
                    "--workers or without them"
                ) from None
            if block:
                continue
            return
        if error is not None:
            raise CalibrationError(error) from None
        results[index] = stats
        return


def fold_numbered(
    model: onnx.ModelProto,
    names: list[str],
    blank: bytes,
    numbered: Iterable[tuple[int, Feed]],
    threads: int,
) -> Statistics:
    """The blank statistics with every (batch number, feed) folded in (a worker's or a task's).

    onnxruntime runs the next batch while this one is folded, as in one process.
    """
    from onnxq.io.session import make_session

    stats: Statistics = pickle.loads(blank)
    session = make_session(model, threads=threads, expose=names)
    indices: list[int] = []

    def feeds() -> Iterator[Feed]:
        for index, feed in numbered:
            indices.append(index)
            yield feed

    with one_blas_thread():
        ran = run_ahead(session, names, feeds(), indices.__getitem__)
        for n, (feed, outs) in enumerate(ran):
            stats.add(names, outs, feed_samples(feed), indices[n])
    return stats


def _work(
    path: str,
    names: list[str],
    blank: bytes,
    inbox: Any,
    outbox: Any,
    index: int,
    threads: int,
) -> None:  # pragma: no cover - runs in the worker processes (tested through them)
    """One worker: load the model, fold every batch it is handed, send the statistics back."""

    def numbered() -> Iterator[tuple[int, Feed]]:
        while (item := inbox.get()) is not None:
            yield item

    try:
        stats = fold_numbered(onnx.load(path), names, blank, numbered(), threads)
        outbox.put((index, None, stats))
    except OnnxqError as exc:
        outbox.put((index, str(exc), None))
    except BaseException as exc:
        outbox.put((index, f"calibration worker {index} failed: {type(exc).__name__}: {exc}", None))
