"""Ctrl-C, however it surfaces: the one line onnxq prints, and whether SIGINT arrived.

A Ctrl-C inside a C extension's import surfaces as an ImportError ("initialization failed"),
inside a run as another error: the console script records the signal itself
(:func:`install`), and the command line reports what follows as the interruption it is.
Imports nothing heavy: the console script installs it before numpy and onnxruntime load.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

INTERRUPTED = "onnxq: interrupted; no output written"

_received: list[int] = []
#: files this process wrote whole (renamed into place) before a Ctrl-C could reach it
_written: list[str] = []


def _on_sigint(signum: int, frame: Any) -> None:
    _received.append(signum)
    raise KeyboardInterrupt


def install() -> None:
    """Record SIGINT before raising KeyboardInterrupt (where Python's own handler is set)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def interrupted() -> bool:
    """Whether Ctrl-C reached this process (whatever exception it then surfaced as)."""
    return bool(_received)


def new_command() -> None:
    """Forget the files written so far: a command starts (one process may run many)."""
    _written.clear()


def wrote(path: str) -> None:
    """Record that ``path`` was written whole (onnxq.io.graph's atomic writes call it)."""
    _written.append(path)


def message() -> str:
    """The one line for a Ctrl-C: :data:`INTERRUPTED`, or which files were already complete.

    A Ctrl-C can land after the output was renamed into place and before the command ends
    (printing its summary): the file is then whole, and the line says so.
    """
    if not _written:
        return INTERRUPTED
    names = ", ".join(f"'{p}'" for p in dict.fromkeys(_written))
    return f"onnxq: interrupted after writing {names} (complete); nothing else was written"


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Ctrl-C held back until the block ends (then raised as usual), on POSIX's main thread.

    For renames that only make sense together: a model over 2 GB and its ``.data`` file are
    renamed into place one after the other, and a Ctrl-C between the two left an earlier
    model at that path reading the new weights. Elsewhere the block runs unguarded.
    """
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    mask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        mask(signal.SIG_UNBLOCK, {signal.SIGINT})
