"""A progress bar for any step that may take a while: shown on a terminal after two seconds."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")

#: seconds a step runs before its bar appears (a quick step prints nothing)
DELAY_S = 2.0


def progress(
    it: Iterable[T], total: int | None, desc: str, enabled: bool | None = None
) -> Iterable[T]:
    """``it`` with a bar on stderr.

    ``enabled`` None: on a terminal, once the step has run :data:`DELAY_S`; True: at once.
    """
    delay = DELAY_S if enabled is None else 0.0
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return it
    from tqdm import tqdm

    bar: Any = tqdm(it, total=total, desc=desc, unit="batch", leave=False, delay=delay)
    return bar
