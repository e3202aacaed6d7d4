"""Running an onnxruntime session over calibration batches, on the cores it should have.

* :func:`run_ahead`: each batch's outputs while the next batches already run on threads;
* :func:`run_checked`: one run, onnxruntime's failures turned into one clear error;
* :func:`available_cores` and :func:`one_blas_thread`: the thread budget of the pass.

Shared by the one-process pass (onnxq.calibrate.calibration), the worker processes
(onnxq.calibrate.shards) and the Ray tasks (onnxq.calibrate.cluster).
"""

from __future__ import annotations

import ast
import atexit
import collections
import contextlib
import math
import operator
import queue
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from fractions import Fraction
from typing import Any

import numpy as np
import onnx

from onnxq.calibrate.dataset import feed_samples
from onnxq.core.errors import CalibrationError
from onnxq.io.cores import affinity


def available_cores() -> int:
    """Cores this process may run on."""
    return len(affinity())


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


#: the outputs of one batch above which no second run goes ahead (``depth`` 2): the outputs
#: of one more batch are alive while it runs
AHEAD_BYTES = 64 << 20


def batch_bytes(
    model: onnx.ModelProto, names: Iterable[str], feeds: Mapping[str, Any]
) -> int | None:
    """Bytes the tensors ``names`` take for the batch ``feeds``, from the model's recorded shapes.

    Symbolic dimensions take the sizes they have in ``feeds`` (by the graph inputs' dim
    names), and so do the expressions of them that onnxruntime's symbolic shape inference
    records (``floor(W/2 - 1/2) + 1``: :func:`dim_size`); a first axis named otherwise (shape
    inference names a batch axis anew after a Reshape: ``unk__1``) is taken as the batch. None
    when a tensor's type or another dimension is not known that way. An estimate for sizing
    the pass, not a check.
    """
    g = model.graph
    sizes: dict[str, int] = {}
    for vi in g.input:
        value = feeds.get(vi.name)
        if value is None:
            continue
        for dim, size in zip(vi.type.tensor_type.shape.dim, np.shape(value), strict=False):
            if dim.dim_param:
                sizes[dim.dim_param] = int(size)
    infos = {vi.name: vi for vi in [*g.input, *g.value_info, *g.output]}
    total = 0
    for name in names:
        vi = infos.get(name)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            return None
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).itemsize
        except (KeyError, TypeError, ValueError):
            return None
        count = 1
        for axis, dim in enumerate(vi.type.tensor_type.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                count *= dim.dim_value
            elif dim.dim_param in sizes:
                count *= sizes[dim.dim_param]
            elif (size := dim_size(dim.dim_param, sizes)) is not None:
                count *= size
            elif axis == 0 and dim.dim_param:
                count *= feed_samples(feeds)
            else:
                return None
        total += count * itemsize
    return total


_DIM_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "floor": math.floor,
    "ceiling": math.ceil,
    "ceil": math.ceil,
    "Max": max,
    "Min": min,
    "max": max,
    "min": min,
}
_DIM_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def dim_size(expression: str, sizes: Mapping[str, int]) -> int | None:
    """The size a dimension written as an expression of named dimensions takes, or None.

    onnxruntime's symbolic shape inference (which exporters such as PaddleOCR's run) records
    the width after two stride-2 convolutions as ``floor(floor(W/2 - 1/2)/2) + 1``. The names
    in ``sizes`` (``DynamicDimension.1`` included) are put in, and the rest is evaluated as
    exact fractions: integers, ``+ - * / // %``, ``floor``, ``ceiling``, ``Max`` and ``Min``;
    anything else (another name, a call, a power) gives None, as does a result that is not a
    positive integer.
    """
    if not expression or not sizes:
        return None
    names = sorted(sizes, key=len, reverse=True)
    pattern = "|".join(re.escape(n) for n in names)
    text = re.sub(
        rf"(?<![\w.])(?:{pattern})(?![\w.])", lambda m: f"({sizes[m.group(0)]})", expression
    )
    try:
        value = _evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, RecursionError):
        return None
    if value is None or value.denominator != 1 or value <= 0:
        return None
    return int(value)


def _evaluate(node: ast.AST) -> Fraction | None:
    """An expression tree of :func:`dim_size` evaluated exactly (None: not one it allows)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _evaluate(node.operand)
        return None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
    if isinstance(node, ast.BinOp) and type(node.op) in _DIM_OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if left is None or right is None:
            return None
        return Fraction(_DIM_OPERATORS[type(node.op)](left, right))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _DIM_FUNCTIONS
        and not node.keywords
        and node.args
    ):
        args = [_evaluate(a) for a in node.args]
        if any(a is None for a in args):
            return None
        return Fraction(_DIM_FUNCTIONS[node.func.id](*args))
    return None


def outputs_bytes(outs: Iterable[Any]) -> int:
    """Bytes of one run's outputs (the measure :data:`AHEAD_BYTES` bounds)."""
    return sum(int(getattr(o, "nbytes", 0)) for o in outs)


def run_ahead(
    session: Any,
    names: list[str],
    batches: Iterable[dict[str, np.ndarray]],
    number: Callable[[int], int] | None = None,
    depth: int = 1,
) -> Iterator[tuple[dict[str, np.ndarray], list[np.ndarray]]]:
    """Each batch with ``names`` computed, the next ``depth`` batches already running.

    onnxruntime releases the GIL while it runs, so the caller's numpy work on one batch
    (observers, Hessians) overlaps the inference of the next ones: ``depth`` batches in flight,
    so at most ``depth + 1`` batches' outputs are alive (a second run goes ahead only while a
    batch's outputs are at most :data:`AHEAD_BYTES`). The caller still sees the batches in
    order (deterministic). The runs happen on ``depth`` daemon threads kept for the whole
    pass, stopped and joined when it ends (an error included); after Ctrl-C the runs in flight
    are not waited for (they finish on their own; the console script then leaves without
    waiting, :mod:`onnxq._entry`). ``number`` maps the position of a batch to the number an
    error names (a worker's share).
    """
    name = number or (lambda i: i)
    it = iter(batches)
    upcoming = next(it, None)  # pulled while the runs go: loading overlaps inference
    runners: list[_Runner] = []
    free: list[_Runner] = []
    pending: collections.deque[tuple[dict[str, np.ndarray], _Runner]] = collections.deque()
    index = 0
    interrupted = False

    def fill() -> None:
        nonlocal upcoming, index
        while free and upcoming is not None:
            runner = free.pop()
            runner.submit(upcoming, name(index))
            pending.append((upcoming, runner))
            index += 1
            upcoming = next(it, None)

    try:
        if upcoming is not None:
            runners.append(_Runner(session, names))
            free.append(runners[0])
        fill()
        while pending:
            done, runner = pending.popleft()
            outs = runner.result()
            free.append(runner)
            small = outputs_bytes(outs) <= AHEAD_BYTES
            if len(runners) < depth and upcoming is not None and small:
                runners.append(_Runner(session, names))
                free.append(runners[-1])
            fill()
            yield done, outs
    except KeyboardInterrupt:  # the runs in flight end on their own; not waited for here
        interrupted = True
        raise
    finally:
        for runner in runners:
            runner.stop()
        if not interrupted:
            for runner in runners:
                runner.join()


class _Runner:
    """A daemon thread running :func:`run_checked` on the feeds it is handed, one at a time.

    A runner is stopped and joined when its pass ends, on an error or Ctrl-C too: a run still
    inside onnxruntime when the interpreter exits aborts the process (``terminate called
    without an active exception``, exit 134). Runners a pass did not close (its generator not
    yet collected) are joined at exit (:func:`_join_all`).
    """

    def __init__(self, session: Any, names: list[str]):
        self._inbox: queue.SimpleQueue[tuple[Mapping[str, Any], int] | None] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[list[np.ndarray], BaseException | None]] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._work, args=(session, names), daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _work(self, session: Any, names: list[str]) -> None:
        while (job := self._inbox.get()) is not None:
            feeds, index = job
            try:
                self._outbox.put((run_checked(session, names, feeds, index), None))
            except BaseException as exc:  # handed to the caller's thread
                self._outbox.put(([], exc))

    def submit(self, feeds: Mapping[str, Any], index: int) -> None:
        """Start the run of one batch (the previous one's result must have been taken)."""
        self._inbox.put((feeds, index))

    def result(self) -> list[np.ndarray]:
        """The outputs of the batch submitted last (its exception raised here)."""
        outs, error = self._outbox.get()
        if error is not None:
            raise error
        return outs

    def stop(self) -> None:
        """End the thread once its current run (if any) is done."""
        self._inbox.put(None)

    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def join(self) -> None:
        """Wait for the thread to end (its current run finishes); Ctrl-C meanwhile waits too.

        A KeyboardInterrupt that arrives while waiting is raised once the run is done.
        """
        interrupted = False
        while self._thread.is_alive():
            try:
                self._thread.join()
            except KeyboardInterrupt:
                interrupted = True
        _LIVE.discard(self)
        if interrupted:
            raise KeyboardInterrupt


#: runners whose threads may still be running
_LIVE: weakref.WeakSet[_Runner] = weakref.WeakSet()


def runs_in_flight() -> bool:
    """Whether a runner's thread may still be inside onnxruntime (after Ctrl-C)."""
    return any(r.alive() for r in list(_LIVE))


@atexit.register
def _join_all() -> None:
    """Stop and join every runner still alive before the interpreter tears down onnxruntime."""
    live = list(_LIVE)
    for runner in live:
        runner.stop()
    for runner in live:
        with contextlib.suppress(KeyboardInterrupt):
            runner.join()


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
