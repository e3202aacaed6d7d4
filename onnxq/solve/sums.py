"""Sums whose value does not depend on the order of their terms (in practice).

Calibration statistics are sums over batches: per-channel input sums (bias correction) and
``x xᵀ`` (optimized rounding's Hessians). When the batches are split over processes the terms
arrive in another order, and a plain float64 sum changes in its last bits, which can move a
rounding decision. :class:`PairSum` carries each sum as ``hi + lo`` (Knuth's TwoSum keeps the
rounding error of every addition in ``lo``): about 106 bits, so the float64 it returns is the
same for any order of the terms unless the exact sum lies within ~2⁻¹⁰⁰ of a rounding boundary.
"""

from __future__ import annotations

import numpy as np


class PairSum:
    """A float64 array sum kept as ``hi + lo`` (see the module doc).

    ``lo`` is made with the second term: a sum of one term (a Hessian gathered in one block of
    batches) is its term, without an array of zeros beside it.
    """

    def __init__(self) -> None:
        self.hi: np.ndarray | None = None
        self.lo: np.ndarray | None = None

    def add(self, term: np.ndarray, own: bool = False) -> None:
        """Add ``term`` (any shape the sum has; the first term sets it).

        ``own``: the caller hands ``term`` over (a float64 array nobody else reads), so the
        first term is kept rather than copied.
        """
        term = np.asarray(term, np.float64)
        if self.hi is None:
            self.hi = term if own and term.flags.writeable else term.copy()
            return
        if self.lo is None:
            self.lo = np.zeros_like(self.hi)
        elif not self.lo.flags.writeable:  # a sum that came back from another process (Ray's
            self.lo = self.lo.copy()  # object store) may hold read-only arrays
        # lo += (hi - (total - virtual)) + (term - virtual), in two scratch arrays: the same
        # operations in the same order as written out, so the same bits (a Hessian of 2304
        # inputs is 42 MB an array; the written-out form made six of them per batch)
        total = self.hi + term
        virtual = np.subtract(total, self.hi)
        scratch = np.subtract(total, virtual)
        np.subtract(self.hi, scratch, out=scratch)
        np.subtract(term, virtual, out=virtual)
        scratch += virtual
        self.lo += scratch
        self.hi = total

    def merge(self, other: PairSum) -> None:
        """Add another sum (a shard's) to this one."""
        if other.hi is None:
            return
        self.add(other.hi)
        if other.lo is not None:
            self.lo = other.lo.copy() if self.lo is None else self.lo + other.lo

    @property
    def empty(self) -> bool:
        """No term added yet."""
        return self.hi is None

    def value(self) -> np.ndarray:
        """The sum, rounded once to float64."""
        if self.hi is None:
            raise ValueError("an empty PairSum has no value")
        # ``hi + 0.0`` as ``hi + zeros``: the same bits (a -0.0 becomes 0.0 either way)
        return self.hi + (self.lo if self.lo is not None else 0.0)
