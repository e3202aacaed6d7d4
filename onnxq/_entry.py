"""The ``onnxq`` console script: Ctrl-C from the first moment ends with one line, exit 130.

The command-line module imports numpy, onnx and onnxruntime (about a second); a Ctrl-C then
printed a traceback. This module imports nothing heavy until it is inside the guard, and it
records that SIGINT arrived (onnxq.io.interrupt).
"""

from __future__ import annotations

import os
import sys

from onnxq.io.interrupt import install, interrupted, message, new_command


def run(argv: list[str] | None = None) -> None:
    """Run the command line on ``argv`` (default: the process's); exit with its code."""
    install()
    new_command()
    try:
        from onnxq.cli import main
    except BaseException as exc:
        if not (interrupted() or isinstance(exc, KeyboardInterrupt)):
            raise
        print(message(), file=sys.stderr)
        sys.exit(130)
    code = main(argv)
    if code == 130:
        from onnxq.calibrate.streaming import runs_in_flight

        if runs_in_flight():  # leave now: a run still inside onnxruntime is not waited for,
            sys.stdout.flush()  # and the runtime is not torn down under it (which aborts)
            sys.stderr.flush()
            os._exit(code)
    sys.exit(code)
