"""Peak memory of the current process, measured so that a child does not inherit its parent's.

``getrusage(RUSAGE_SELF).ru_maxrss`` is carried over ``fork`` and kept across ``execve`` on
Linux: a process spawned by a parent that has grown to 1.5 GB reports 1.5 GB as its own peak
however little it uses (a 0.2 s quantization of the 100 KB fashion CNN, spawned by the
scoreboard after it had timed EfficientNet-Lite1, reported 1,568 MiB). ``VmHWM`` in
``/proc/self/status`` is the high-water mark of this process's own address space, which starts
afresh at ``execve``.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (VmHWM; ru_maxrss where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
