"""What one command reads and writes, checked before any work starts.

Every path a command will write is compared with every path it reads (the model and its
external data files, the calibration data file or folder, ``--config``, ``--target-file``,
``--load-ranges``) and with every other path it writes, after links are resolved (the real
path, and the same inode for hard links). A collision is one :class:`ConfigError` naming both
options; nothing has been written then.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx

from onnxq.core.errors import ConfigError
from onnxq.io.graph import all_graphs
from onnxq.io.text import shown


@dataclass(frozen=True)
class Use:
    """One path of a command: the option that names it, and whether it is a folder it reads."""

    option: str
    path: Path
    folder: bool = False
    #: what of the option's file this is ("external data"), or "" for the file itself
    part: str = ""
    #: a model file whose external data files are reads too (listed only where a write could
    #: land on one: inside the model's folder, where they must be)
    model: bool = False

    @property
    def real(self) -> Path:
        """The path with every link resolved (the file need not exist)."""
        return Path(os.path.realpath(self.path))

    def label(self) -> str:
        """How a message names it: ``--report 'r.json'``."""
        of = f"{self.option}'s {self.part}" if self.part else self.option
        return f"{of} '{shown(str(self.path))}'"


def reads_of(option: str, value: object) -> list[Use]:
    """The uses of a read option's value: a file, a folder, or nothing.

    Nothing for a ``module:function``, arrays or a ModelProto. A model file brings its
    external data files (read from the model's header, without the weights).
    """
    if not isinstance(value, (str, os.PathLike)) or "\0" in os.fspath(value):
        return []  # a NUL in a path: refused by whatever opens it
    path = Path(value)
    if path.is_dir():
        return [Use(option, path, folder=True)]
    if not path.exists():  # module:function, or a file whose absence is refused later
        return []
    return [Use(option, path, model=path.suffix.lower() == ".onnx")]


def external_files(model: Path) -> list[Path]:
    """The external data files a model file names (inside its folder or not); [] if unreadable."""
    try:
        proto = onnx.load(str(model), load_external_data=False)
    except Exception:  # not a model: refused with its own message when it is loaded
        return []
    found = {
        model.parent / location
        for g in all_graphs(proto.graph)
        for t in g.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for location in [next((e.value for e in t.external_data if e.key == "location"), "")]
        if location and "\0" not in location
    }
    return sorted(found)


def _with_external(reads: list[Use], writes: list[Use]) -> list[Use]:
    """``reads`` with the external data files of each model a write could land beside."""
    out = []
    for r in reads:
        out.append(r)
        folder = r.real.parent
        if r.model and any(folder in w.real.parents for w in writes):
            out += [Use(r.option, f, part="external data") for f in external_files(r.path)]
    return out


def writes_of(option: str, value: object, model: bool = False) -> list[Use]:
    """The uses of a write option; a model output also writes ``NAME.data`` past 2 GB."""
    if not isinstance(value, (str, os.PathLike)):
        return []
    if "\0" in os.fspath(value):
        raise ConfigError(
            f"{option} '{shown(os.fspath(value))}' holds a NUL character, which no file name "
            "can; choose another path"
        )
    uses = [Use(option, Path(value))]
    if model:
        uses.append(Use(option, Path(f"{value}.data"), part="external data"))
    return uses


def refuse_collisions(reads: Iterable[Use], writes: Iterable[Use]) -> None:
    """Raise ConfigError when a write lands on a read (or inside a read folder) or another write."""
    writes = list(writes)
    reads = _with_external(list(reads), writes)
    for i, w in enumerate(writes):
        for r in reads:
            if _same(w, r) or (r.folder and r.real in w.real.parents):
                inside = " is inside" if r.folder and not _same(w, r) else " is"
                raise ConfigError(
                    f"{w.label()}{inside} {r.label()}, which onnxq reads; onnxq never "
                    f"overwrites what it reads — choose another {w.option}"
                )
        for other in writes[:i]:
            if _same(w, other):
                raise ConfigError(
                    f"{w.label()} is also {other.label()}; give each output its own path"
                )


def _same(a: Use, b: Use) -> bool:
    if a.real == b.real:
        return True
    try:
        sa, sb = os.stat(a.path), os.stat(b.path)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
