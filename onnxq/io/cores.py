"""How many of this process's cores other processes leave it, read from the kernel's counters.

OpenBLAS keeps one thread per core and its threads wait for each other by spinning: on a
machine where another job holds one of two cores, optimized rounding's factorizations took
4.5 s with two BLAS threads and 2.7 s with one (2.3-2.7 s with two on a quiet machine). The
work that would be run on every core asks :class:`CoreShare` first.

Linux only: the busy time of the cores in this process's affinity set (``/proc/stat``) minus
this process's own CPU time (``os.times``), over the wall time between two readings. Elsewhere,
or where the counters cannot be read, every core counts as free.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: wall seconds between two readings below which the last answer stands (the kernel counts
#: busy time in ticks of 10 ms)
MIN_INTERVAL = 0.05

#: /proc/stat fields after the cpu name: user nice system idle iowait irq softirq steal ...
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def affinity() -> frozenset[int]:
    """The cores this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def physical_cores(cores: frozenset[int], root: str = "/sys/devices/system/cpu") -> int:
    """How many physical cores ``cores`` are on (hyper-threads of one core count once)."""
    siblings = set()
    for cpu in cores:
        try:
            with open(f"{root}/cpu{cpu}/topology/thread_siblings_list") as f:
                siblings.add(f.read().strip())
        except OSError:
            siblings.add(str(cpu))
    return max(1, len(siblings))


def busy_seconds(cores: frozenset[int], path: str = "/proc/stat") -> float | None:
    """Seconds the ``cores`` have been busy since boot (any process, steal time included)."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            if int(name[3:]) not in cores:
                continue
            values = rest.split()
            ticks += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
        except ValueError:
            return None
    try:
        hz = os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return None
    return ticks / hz


def own_seconds() -> float:
    """CPU seconds this process (all its threads) has used."""
    t = os.times()
    return t.user + t.system


class CoreShare:
    """The cores other processes leave free, from the interval since the last reading.

    :meth:`free` is cheap (one read of ``/proc/stat``) and needs no pause: until
    :data:`MIN_INTERVAL` has passed since the first reading it answers every core.
    """

    def __init__(
        self,
        cores: frozenset[int] | None = None,
        busy: Callable[[frozenset[int]], float | None] = busy_seconds,
        own: Callable[[], float] = own_seconds,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cores = affinity() if cores is None else cores
        self._busy, self._own, self._clock = busy, own, clock
        self._last = self._reading()
        self._free = len(self.cores)

    def _reading(self) -> tuple[float, float | None, float]:
        return self._clock(), self._busy(self.cores), self._own()

    def others(self, now: tuple[float, float | None, float]) -> float | None:
        """Cores the other processes used between the last reading and ``now``."""
        (t0, b0, o0), (t1, b1, o1) = self._last, now
        if b0 is None or b1 is None or t1 - t0 <= 0:
            return None
        return max(0.0, ((b1 - b0) - (o1 - o0)) / (t1 - t0))

    def threads(self) -> int:
        """Threads for a runtime's pool: 0 (its own choice) unless others hold some cores.

        Then the free cores, at most one a physical core (onnxruntime's own choice).
        """
        free = self.free()
        if free >= len(self.cores):
            return 0
        return min(free, physical_cores(self.cores))

    def free(self) -> int:
        """Cores to run on now: the affinity set less what others used, at least one."""
        now = self._reading()
        if now[0] - self._last[0] < MIN_INTERVAL:
            return self._free
        others = self.others(now)
        self._last = now
        if others is not None:
            self._free = max(1, min(len(self.cores), int(len(self.cores) - others + 0.5)))
        return self._free
