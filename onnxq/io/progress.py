"""A progress bar for any step that may take a while: shown on a terminal after two seconds."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

#: seconds a step runs before its bar appears (a quick step prints nothing)
DELAY_S = 2.0


def progress(
    it: Iterable[T],
    total: int | None,
    desc: str,
    enabled: bool | None = None,
    unit: str = "batch",
    label: Callable[[T], str] | None = None,
) -> Iterable[T]:
    """``it`` with a bar on stderr.

    ``enabled`` None: on a terminal, once the step has run :data:`DELAY_S`; True: at once.
    ``label``: what the bar shows beside it for the item under way (a pass's name).
    """
    bar = _bar(enabled, iterable=it, total=total, desc=desc, unit=unit)
    if bar is None:
        return it
    return bar if label is None else _labelled(bar, label)


def _bar(enabled: bool | None, **kwargs: Any) -> Any:
    """A tqdm bar on stderr as :func:`progress` describes ``enabled``; None when off."""
    if not (sys.stderr.isatty() if enabled is None else enabled):
        return None
    from tqdm import tqdm

    return tqdm(leave=False, delay=DELAY_S if enabled is None else 0.0, **kwargs)


def _labelled(bar: Any, label: Callable[[T], str]) -> Iterator[T]:
    for item in bar:
        bar.set_postfix_str(label(item), refresh=False)
        yield item


class Ticker:
    """A bar for steps that are not one loop (a choice's candidates): :meth:`start` each step.

    Shown as :func:`progress` shows its bars; a no-op when off.
    """

    def __init__(self, total: int | None, desc: str, enabled: bool | None, unit: str):
        self._bar = _bar(enabled, total=total, desc=desc, unit=unit)
        self._started = False

    def start(self, label: str) -> None:
        """A new step, named ``label`` (the step before it counted as done)."""
        if self._bar is None:
            return
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_postfix_str(label)

    def close(self) -> None:
        """The last step done; the bar goes."""
        if self._bar is not None:
            if self._started:
                self._bar.update(1)
            self._bar.close()
