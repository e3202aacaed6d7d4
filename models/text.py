"""Real English sentences for the text models of the zoo, and a WordPiece tokenizer (no network).

The sentences are the documentation of Python's own standard library: the docstrings of a fixed
list of modules and of their public classes and functions, split into sentences of 6 to 60
words (examples, tables and non-ASCII text left out, duplicates dropped). Even positions feed
calibration, odd ones evaluation, so the two sets never share a sentence.

The tokenizer is BERT's: lower case, accents stripped, split on whitespace and punctuation, then
the longest vocabulary piece first (``##`` marks a piece inside a word). The vocabulary is a
file the manifest fetches and pins by sha256 (a plain list, one piece per line, or a Python
module holding that list in one string constant).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import numpy as np

#: modules whose documentation gives the sentences (fixed, so every machine reads the same)
MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email", "fractions", "functools", "heapq", "http.client", "inspect",
    "itertools", "json", "logging", "mailbox", "os", "pathlib", "pickle", "queue", "random",
    "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "time", "unittest", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip


def _docstrings() -> Iterator[str]:
    for name in MODULES:
        module = importlib.import_module(name)
        yield inspect.getdoc(module) or ""
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", "") != module.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield inspect.getdoc(obj) or ""


@functools.cache
def sentences() -> tuple[str, ...]:
    """Every sentence, in a fixed order."""
    out: dict[str, None] = {}
    for doc in _docstrings():
        for para in re.split(r"\n\s*\n", doc):
            if re.search(r"^\s*(>>>|\.\.\.|[-=*]{3})", para, re.M):
                continue  # an example or a table
            text = " ".join(para.split())
            for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
                words = len(sentence.split())
                if 6 <= words <= 60 and sentence.isascii() and sentence[0].isupper():
                    out.setdefault(sentence)
    return tuple(out)


def split(part: str) -> tuple[str, ...]:
    """The sentences of ``part``: "calibration" (even positions) or "evaluation" (odd)."""
    start = {"calibration": 0, "evaluation": 1}[part]
    return sentences()[start::2]


def read_vocabulary(path: Path) -> list[str]:
    """The pieces of a vocabulary file: one per line, or one triple-quoted string of a module.

    A module's string is read as written, not evaluated: a piece that is a lone backslash
    would otherwise join its line to the next and shift every later id.
    """
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        quoted = re.findall(r'"""(.*?)"""', text, re.S)
        if len(quoted) != 1:
            raise ValueError(f"{path}: expected one triple-quoted string holding the vocabulary")
        text = quoted[0]
    return text.split("\n")


class WordPiece:
    """BERT's uncased tokenizer over a vocabulary (``[CLS]``, ``[SEP]``, ``[UNK]``, ``[PAD]``)."""

    def __init__(self, pieces: list[str], max_word: int = 100):
        self.ids = {p: i for i, p in enumerate(pieces) if p or i == 0}
        self.max_word = max_word
        for special in ("[CLS]", "[SEP]", "[UNK]", "[PAD]"):
            if special not in self.ids:
                raise ValueError(f"the vocabulary has no {special}")

    @staticmethod
    def _words(text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        words: list[str] = []
        for chunk in text.split():
            words.extend(w for w in re.split(r"([^\w]|_)", chunk) if w)
        return words

    def _pieces(self, word: str) -> list[int]:
        if len(word) > self.max_word:
            return [self.ids["[UNK]"]]
        out, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.ids:
                    out.append(self.ids[piece])
                    start = end
                    break
            else:
                return [self.ids["[UNK]"]]
        return out

    def encode(self, text: str, max_len: int = 128) -> list[int]:
        """``[CLS]`` pieces ``[SEP]``, at most ``max_len`` ids."""
        ids = [p for w in self._words(text) for p in self._pieces(w)][: max_len - 2]
        return [self.ids["[CLS]"], *ids, self.ids["[SEP]"]]

    def batch(self, texts: list[str], max_len: int = 128) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask (int64 [N, longest]), padding after each sentence."""
        rows = [self.encode(t, max_len) for t in texts]
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.ids["[PAD]"], np.int64)
        mask = np.zeros((len(rows), width), np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return ids, mask
