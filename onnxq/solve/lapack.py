"""numpy's own LAPACK Cholesky, called in place.

``numpy.linalg.cholesky`` copies its input into a column-major buffer, factors the buffer
(LAPACK ``dpotrf``, lower) and copies the factor out into a new array: three K × K arrays
alive at once beside the caller's. Optimized rounding factors one Hessian per layer, and for
a layer of 2,304 inputs each is 42 MB (a ResNet-class layer of 4,608 inputs: 170 MB).
:func:`cholesky_in_place` calls the same ``dpotrf`` of the same library (the OpenBLAS numpy
loaded, found through threadpoolctl) on the caller's array, so the factor is the same bits
with no second or third array. Where that routine cannot be found, or a probe does not give
numpy's bits, :func:`cholesky_in_place` is not available and the caller uses numpy's.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

#: rows of the factor moved at a time from the column-major result into row order
_ROWS = 256

#: numpy's OpenBLAS with 64-bit integers (numpy 2 wheels), then other builds: (symbol, int)
_SYMBOLS = (
    ("scipy_dpotrf_64_", ctypes.c_int64),
    ("dpotrf_64_", ctypes.c_int64),
)

Potrf = Callable[[np.ndarray], int]


@functools.cache
def _potrf() -> Potrf | None:
    """The ``dpotrf`` of numpy's OpenBLAS (lower) on a C-contiguous float64 K × K array, or None."""
    try:
        from threadpoolctl import ThreadpoolController

        libs = ThreadpoolController().select(internal_api="openblas").lib_controllers
    except Exception:  # threadpoolctl cannot inspect this process: numpy's path
        return None
    for lib in libs:
        try:
            dll = ctypes.CDLL(lib.filepath)
        except OSError:
            continue
        for symbol, integer in _SYMBOLS:
            routine = getattr(dll, symbol, None)
            if routine is None:
                continue
            routine.restype = None
            call = _caller(routine, integer)
            if _probe(call):
                return call
    return None


def _caller(routine: Any, integer: type) -> Potrf:
    uplo = ctypes.c_char(b"L")

    def call(a: np.ndarray) -> int:
        n = integer(a.shape[0])
        info = integer(0)
        # column-major ``L``: the C-order array of a symmetric matrix is its column-major one
        routine(
            ctypes.byref(uplo),
            ctypes.byref(n),
            a.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
            ctypes.byref(n),
            ctypes.byref(info),
            ctypes.c_size_t(1),  # the length of ``uplo`` where the routine is Fortran's
        )
        return int(info.value)

    return call


def _probe(call: Potrf) -> bool:
    """Whether ``call`` gives numpy's factor bit for bit (sizes below and above its blocks)."""
    rng = np.random.default_rng(0)
    for k in (5, 97, 300):
        x = rng.standard_normal((k, 2 * k))
        h = x @ x.T
        h = (h + h.T) / 2  # exactly symmetric, as the Hessians are
        want = np.linalg.cholesky(h)
        got = h.copy()
        try:
            if call(got) != 0:
                return False
        except Exception:  # a routine that does not take these arguments
            return False
        _to_row_order(got)
        if not np.array_equal(got, want):
            return False
    return True


def available() -> bool:
    """Whether :func:`cholesky_in_place` can run in this process."""
    return _potrf() is not None


def cholesky_in_place(a: np.ndarray) -> None:
    """``a`` (G, K, K), symmetric positive definite, becomes its lower Cholesky factors.

    The same bits as ``numpy.linalg.cholesky(a)`` (zeros above the diagonal), written over
    ``a``: C-contiguous, writeable float64. Raises ``numpy.linalg.LinAlgError`` for a matrix
    that is not positive definite, as numpy does (``a`` is then partly overwritten).
    """
    call = _potrf()
    if call is None:
        raise RuntimeError("numpy's dpotrf was not found: use numpy.linalg.cholesky")
    if a.dtype != np.float64 or not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError("cholesky_in_place needs a C-contiguous writeable float64 array")
    for m in a:
        if call(m) != 0:
            raise np.linalg.LinAlgError("Matrix is not positive definite")
        _to_row_order(m)


def _to_row_order(m: np.ndarray) -> None:
    """The column-major factor in ``m`` (its upper triangle in C order) moved to the lower.

    ``dpotrf`` leaves the input's values in the other triangle: they are overwritten by the
    factor's rows, then the upper triangle is zeroed, a block of rows at a time (one block's
    copy spare).
    """
    k = m.shape[0]
    for start in range(0, k, _ROWS):
        stop = min(start + _ROWS, k)
        m[start:stop, :start] = m[:start, start:stop].T
        m[:start, start:stop] = 0.0
        block = m[start:stop, start:stop]
        block[...] = np.tril(block.T)
