"""Text from the user's files made safe to print: control characters escaped, length bounded.

Node names, tensor names and option values come from files onnxq did not write. Printed raw,
an ESC or BEL byte drives the terminal and a newline forges a line; echoed whole, a 50 MB option
value is a 50 MB error line. :func:`shown` is applied to such a value where a message names it,
:func:`one_line` to every line the command-line tool prints on stderr.
"""

from __future__ import annotations

import io
import unicodedata
from typing import TextIO

#: characters of an echoed value kept (its head and its tail)
VALUE_LIMIT = 300
#: characters of one printed message line kept
LINE_LIMIT = 2000

_SAFE = {"\t"}


def _escape(ch: str) -> str:
    if ch in _SAFE:
        return ch
    cat = unicodedata.category(ch)
    if cat in ("Cc", "Zl", "Zp") or (cat == "Cf" and ch not in "\u200d\u200c"):
        code = ord(ch)
        special = {"\n": "\\n", "\r": "\\r"}
        if ch in special:
            return special[ch]
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    return ch


def escaped(text: str) -> str:
    """``text`` with control, format and line-separator characters written as escapes."""
    if text.isprintable() and "\t" not in text:
        return text
    return "".join(_escape(ch) for ch in text)


def cut(text: str, limit: int) -> str:
    """``text`` whole if it fits in ``limit`` characters, else its head and tail around a mark."""
    if len(text) <= limit:
        return text
    keep = max(limit - 40, 20)
    head, tail = keep * 2 // 3, keep - keep * 2 // 3
    return f"{text[:head]} …[{len(text) - head - tail:,} characters left out]… {text[-tail:]}"


def shown(text: str, limit: int = VALUE_LIMIT) -> str:
    """A value from the user's input as a message shows it: escaped, at most ``limit`` long."""
    return cut(escaped(text), limit)


def one_line(message: str, limit: int = LINE_LIMIT) -> str:
    """A whole message as one printable line of at most ``limit`` characters."""
    return cut(escaped(message), limit)


def terminal(text: str) -> str:
    """``text`` with control characters escaped, its line breaks and tabs kept."""
    if text.isprintable():
        return text
    return "\n".join(escaped(line) for line in text.split("\n"))


class TerminalWriter(io.TextIOBase):
    """A text stream that writes :func:`terminal` text to another (the command's stdout)."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        """Write ``text`` escaped; returns the length given, as a stream does."""
        self._stream.write(terminal(text))
        return len(text)

    def flush(self) -> None:
        """Flush the stream written to."""
        self._stream.flush()

    def isatty(self) -> bool:
        """Whether the stream written to is an open terminal."""
        return not self.closed and self._stream.isatty()

    @property
    def closed(self) -> bool:
        """Whether the stream written to is closed (a library may keep this writer past it)."""
        return bool(getattr(self._stream, "closed", False))
