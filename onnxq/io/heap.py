"""The C heap under numpy and onnxruntime: one glibc arena for the command line, trims.

Calibration hands tensors across threads: onnxruntime allocates every observed tensor on the
thread that runs the session, the statistics thread folds it and the main thread frees it.
glibc gives each thread that contends for the heap an arena of its own (up to eight per
core) and keeps freed blocks in the arena they came from, so each arena grows to its own
peak and the process holds the sum. With one arena every thread reuses the same free blocks:
the default ``onnxq quantize`` of OriNet (320 px, 32 samples) peaked at 560 MB with the
default arenas and at 465 MB with one, YOLOv8n at 320 px at 744 and 667 MB, in the same time
and with the same output bytes (the heap decides where arrays live, never their values).

Only the ``onnxq`` command sets it (:func:`one_arena`, before any thread starts): a library
does not change the allocator of its caller's process. In your own process,
``MALLOC_ARENA_MAX=1`` in the environment does the same.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: glibc's mallopt parameter for the most arenas (malloc.h)
M_ARENA_MAX = -8


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 (musl and other C libraries have no mallopt)
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def one_arena() -> bool:
    """Give this process one glibc heap arena, unless ``MALLOC_ARENA_MAX`` says otherwise.

    Call it before threads start (arenas are made as threads first contend). Returns whether
    it was set; a no-op (False) outside glibc or when the environment chose.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, 1) == 1)


def trim_heap() -> None:
    """Hand the heap pages glibc holds free back to the system (a no-op elsewhere).

    Milliseconds: the pass manager calls it after every pass, once the pass's own arrays are
    gone (a pass that trims inside still holds its locals then: the sequential bias
    correction left 814 MB resident on EfficientNet-Lite1 where 351 MB were in use).
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
