"""The calibration pass on several local processes (``onnxq quantize --workers N``).

The parent reads the data once and hands each block of consecutive batches to the next worker
in turn, through a bounded queue (a block and two batches waiting per worker, so each has its
next block while the parent deals the others': memory stays flat in the number of samples).
Each worker is a fresh Python process (no onnxruntime threads copied by ``fork``) that loads
the model once, runs it with ``cores / N`` threads and folds its batches into its own
:class:`~onnxq.calibrate.statistics.Statistics`; only those statistics come back, and the
parent merges them in worker order.

The workers run in a session of their own, so a terminal's Ctrl-C reaches the parent only
(which stops them); batches and statistics travel through two pipes per worker.

From Python, a script that calibrates with workers must start under
``if __name__ == "__main__":``, as any ``multiprocessing`` program: each worker imports the
script again (as ``__mp_main__``) before it reads the observers, which may be defined there.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from multiprocessing import connection, spawn
from pathlib import Path
from typing import Any

import onnx

from onnxq.calibrate.dataset import Feed, feed_samples
from onnxq.calibrate.statistics import Statistics, block_size
from onnxq.calibrate.streaming import available_cores, one_blas_thread, run_ahead
from onnxq.core.errors import CalibrationError, OnnxqError
from onnxq.io.graph import save_scratch

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
    with tempfile.TemporaryDirectory(prefix="onnxq-workers-") as tmp:
        path = Path(tmp) / "float.onnx"
        save_scratch(model, path)  # initializers beside it when it would pass 2 GB
        links = [_Link(inbox_capacity(block) + 2) for _ in range(workers)]
        procs: list[subprocess.Popen[bytes]] = []
        results: dict[int, Statistics] = {}
        try:
            with _ignoring_ctrl_c():
                for link in links:
                    procs.append(_start(link, threads))
            for i, link in enumerate(links):
                link.started(
                    _preparation(f"onnxq-calibrate-{i}"), (str(path), names, blank, i, threads)
                )
            for index, feeds in enumerate(itertools.chain([first], it)):
                link = links[worker_of(index, block, workers)]
                _put(link, (index, feeds), procs, links, results)
            for link in links:
                _put(link, None, procs, links, results)
            while len(results) < workers:
                _collect(links, procs, results, block=True)
        finally:
            for p in procs:
                if p.poll() is None and len(results) < workers:
                    p.terminate()  # stopped early: batches nobody will read are dropped
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
            for link in links:
                link.close()
    for i in range(workers):
        yield results[i]


#: environment variables that size the BLAS/OpenMP thread pools numpy uses
_POOL_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _start(link: _Link, threads: int) -> subprocess.Popen[bytes]:
    """One worker, reading from ``link``'s pipes, in a session of its own.

    A terminal sends Ctrl-C to every process of its foreground group: a worker there printed
    its own traceback while it imported, beside the parent's one line. Its BLAS pools are
    sized to its share of the cores (with every core in each of N workers, the pools fought
    over them and two workers ran slower than one process).
    """
    env = dict(os.environ)
    env.update({k: str(threads) for k in _POOL_VARIABLES})
    # this process's import path first: the worker runs this onnxq, wherever it came from
    code = f"import sys; sys.path[:] = {[p for p in sys.path if p]!r}; "
    code += "from onnxq.calibrate.shards import _serve; "
    code += f"_serve({link.worker_in.fileno()}, {link.worker_out.fileno()})"
    return subprocess.Popen(
        [spawn.get_executable(), "-c", code],
        pass_fds=(link.worker_in.fileno(), link.worker_out.fileno()),
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )


def _preparation(name: str) -> dict[str, Any]:
    """What a worker needs to import as this process did (``sys.path``, the main script)."""
    data = spawn.get_preparation_data(name)
    data.pop("authkey", None)  # for multiprocessing's own connections; none are made
    return data


class _Link:
    """One worker's two one-way pipes, and the thread that sends what is dealt to it.

    The parent puts batches in a bounded queue of this process and goes on dealing; the thread
    pickles them into the pipe as the worker reads. (``multiprocessing.Queue`` carries named
    semaphores, and Python's resource tracker then reported one left by a Ctrl-C in two
    warnings of its own, beside onnxq's one line.)
    """

    def __init__(self, capacity: int) -> None:
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self.worker_in, self._send = connection.Pipe(duplex=False)
        self.results, self.worker_out = connection.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._feed, daemon=True, name="onnxq-deal")
        self._closed = False
        #: why the thread could not send (the parent raises it)
        self.error: str | None = None

    def started(self, preparation: Any, task: Any) -> None:
        """The worker holds its ends now: close them here (so a dead worker reads as one).

        It reads first how to import (``preparation``), then what to run (``task``).
        """
        self.worker_in.close()
        self.worker_out.close()
        self.inbox.put(preparation)
        self.inbox.put(task)
        self._thread.start()

    def _feed(self) -> None:
        while not self._closed:
            try:
                item = self.inbox.get(timeout=POLL_S)
            except queue.Empty:
                continue
            try:
                self._send.send(item)
            except (OSError, ValueError):  # the worker is gone, or the link was closed
                return
            except Exception as exc:  # the worker waits on: ends when the pipe closes
                self.error = f"{type(exc).__name__}: {exc}"
                self._send.close()
                return
            if item is None:  # the last: the worker sends its statistics back now
                return

    def close(self) -> None:
        """Stop the sending thread (a worker stopped early leaves its batches unsent).

        The queue's lock is not taken here: a Ctrl-C can leave it held by the interrupted
        put. The thread sees the flag within :data:`POLL_S`, or fails to send to the stopped
        worker; a thread that cannot is a daemon, not waited for longer.
        """
        self._closed = True
        if self._thread.is_alive():
            self._thread.join(timeout=2 * POLL_S)
        for end in (self._send, self.results, self.worker_in, self.worker_out):
            end.close()


@contextlib.contextmanager
def _ignoring_ctrl_c() -> Iterator[None]:
    """A Ctrl-C while the workers start is raised once they all have (the caller stops them).

    A parent interrupted between starting a worker and holding its handle could not stop it.
    While they start, SIGINT is blocked on this thread and a signal delivered to another
    thread is only recorded; it is raised again, through the handler the caller had, once
    every worker has started.
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


def _put(
    link: _Link,
    item: Any,
    procs: list[subprocess.Popen[bytes]],
    links: list[_Link],
    results: dict[int, Statistics],
) -> None:
    """Deal ``item`` to ``link``'s worker, failing clearly if a worker stops meanwhile."""
    while True:
        try:
            link.inbox.put(item, timeout=POLL_S)
            return
        except queue.Full:
            _collect(links, procs, results, block=False)


def _collect(
    links: list[_Link],
    procs: list[subprocess.Popen[bytes]],
    results: dict[int, Statistics],
    block: bool,
) -> None:
    """Take finished workers' results; raise a worker's error, or a worker's silent death."""
    while True:
        waiting = {link.results: i for i, link in enumerate(links) if i not in results}
        for ready in connection.wait(list(waiting), timeout=POLL_S if block else 0):
            i = waiting[ready]  # type: ignore[index]
            try:
                index, error, stats = links[i].results.recv()
            except EOFError:  # ended without a word: its exit code says why
                raise _stopped(procs, i) from None
            if error is not None:
                raise CalibrationError(error) from None
            results[index] = stats
            return
        for i, p in enumerate(procs):
            if links[i].error is not None:
                raise CalibrationError(
                    f"batches cannot be sent to calibration worker {i} "
                    f"({links[i].error}); calibrate in one process (--workers 1)"
                )
            if i not in results and p.poll() is not None:
                raise _stopped(procs, i)
        if not block:
            return


def _stopped(procs: list[subprocess.Popen[bytes]], i: int) -> CalibrationError:
    """The error for worker ``i``, which ended without sending its statistics."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        procs[i].wait(timeout=5)
    return CalibrationError(
        f"calibration worker {i} stopped without a result (exit code {procs[i].returncode}; "
        "out of memory?); retry with fewer --workers or without them"
    )


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
            stats.add(names, outs, feed_samples(feed), indices[n], release=True)
    return stats


def _serve(inbox_fd: int, results_fd: int) -> None:  # pragma: no cover - runs in the workers
    """One worker: fold every batch it is handed and send the statistics back.

    It first imports as the parent did (its first message), then reads the model's path and
    the blank observers; a parent gone (its pipe closed) ends it quietly.
    """
    inbox = connection.Connection(inbox_fd, writable=False)
    results = connection.Connection(results_fd, readable=False)

    def numbered() -> Iterator[tuple[int, Feed]]:
        while (item := inbox.recv()) is not None:
            yield item

    reply: tuple[int, str | None, Statistics | None]
    try:
        spawn.prepare(inbox.recv())
        path, names, blank, index, threads = inbox.recv()
        try:
            reply = (index, None, fold_numbered(onnx.load(path), names, blank, numbered(), threads))
        except OnnxqError as exc:
            reply = (index, str(exc), None)
        except EOFError:  # the parent went away mid-stream
            return
        except BaseException as exc:
            reply = (index, f"calibration worker {index} failed: {type(exc).__name__}: {exc}", None)
        results.send(reply)
    except (EOFError, BrokenPipeError):
        return
