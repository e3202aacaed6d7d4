"""The ``onnxq`` console script: Ctrl-C from the first moment ends with one line, exit 130.

The command-line module imports numpy, onnx and onnxruntime (about a second); a Ctrl-C then
printed a traceback. This module imports nothing heavy until it is inside the guard, and it
records that SIGINT arrived: a Ctrl-C inside a C extension's import surfaces as an ImportError
("initialization failed"), which the command line then reports as the interruption it is.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

INTERRUPTED = "onnxq: interrupted; no output written"

_received: list[int] = []


def _on_sigint(signum: int, frame: Any) -> None:
    _received.append(signum)
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether Ctrl-C reached this process (whatever exception it then surfaced as)."""
    return bool(_received)


def run(argv: list[str] | None = None) -> None:
    """Run the command line on ``argv`` (default: the process's); exit with its code."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        from onnxq.cli import main
    except BaseException as exc:
        if not (interrupted() or isinstance(exc, KeyboardInterrupt)):
            raise
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)
    code = main(argv)
    if code == 130:
        from onnxq.calibrate.streaming import runs_in_flight

        if runs_in_flight():  # leave now: a run still inside onnxruntime is not waited for,
            sys.stdout.flush()  # and the runtime is not torn down under it (which aborts)
            sys.stderr.flush()
            os._exit(code)
    sys.exit(code)
