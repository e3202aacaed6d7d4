"""Loading, saving and editing ONNX graphs.

This is the one module that mutates graphs: patterns and passes describe what they want through
:class:`GraphEditor`, which keeps names unique and deterministic and leaves the graph clean and
topologically sorted after :meth:`GraphEditor.finish`.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import sys
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from onnxq._version import __version__
from onnxq.core.errors import ModelError, OutputError
from onnxq.io import interrupt
from onnxq.io.text import shown

MS_DOMAIN = "com.microsoft"
TWO_GIB = 2**31  # protobuf's limit on one serialized message


# --------------------------------------------------------------------------------------------
# loading and saving


def load_model(
    model: str | os.PathLike[str] | onnx.ModelProto,
    check: bool = True,
    base_dir: str | os.PathLike[str] | None = None,
) -> onnx.ModelProto:
    """Return a private copy of ``model`` (a path or a ModelProto), validated by onnx.checker.

    The caller's object or file is never modified. External data is resolved by one policy:
    relative to the model file's folder, or for a ModelProto to ``base_dir`` (the folder the
    caller names; without it a ModelProto with external data is refused), always inside that
    folder, and left in its file (:data:`FOLDER_KEY`). onnxq's own key is never taken from
    the caller's model: only a value this process wrote is honoured.
    """
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        where = "the given ModelProto"
        _adopt_external(proto, base_dir)
    else:
        path = Path(model)
        where = f"'{path}'"
        if path.is_dir():
            found = sorted(p.name for p in path.glob("*.onnx"))[:5]
            inside = f" (it holds {', '.join(found)})" if found else ""
            raise ModelError(
                f"model {where} is a folder{inside}; pass the path of the .onnx file itself"
            )
        if not path.is_file():
            raise ModelError(f"model file {where} does not exist; pass the path of an .onnx file")
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # protobuf raises several unrelated types
            raise ModelError(
                f"model file {where} is not a readable ONNX model ({type(exc).__name__}: "
                f"{_first_line(exc)}); pass an .onnx file exported by an ONNX exporter"
            ) from None
        if not proto.graph.node and not proto.graph.output:
            raise ModelError(f"model file {where} holds no ONNX graph; pass an .onnx model file")
        _refuse_private_keys(proto, where)
        if _leave_in_file(proto, path.parent, where):
            if check:  # the checker reads the file itself: external data locations included
                _checked(lambda: onnx.checker.check_model(str(path)), where)
            check_sizes(proto, where)
            return proto
    if check:
        check_model(proto, where)
    check_sizes(proto, where)
    return proto


def _adopt_external(proto: onnx.ModelProto, base_dir: str | os.PathLike[str] | None) -> None:
    """A ModelProto's external data resolved against ``base_dir`` (see :func:`load_model`).

    Tensors this process already left in their file keep their folder; any other external
    tensor needs ``base_dir``.
    """
    where = "the given ModelProto"
    for g in all_graphs(proto.graph):
        for t in g.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL or is_file_weight(t):
                continue
            if any(e.key == FOLDER_KEY for e in t.external_data):
                raise ModelError(
                    f"{where}: initializer '{shown(t.name)}' carries onnxq's private "
                    f"external-data key '{FOLDER_KEY}', which onnxq never takes from a "
                    "caller's model; remove it (onnx.load the model file, or give base_dir)"
                )
            if base_dir is None:
                raise ModelError(
                    f"{where}: initializer '{shown(t.name)}' keeps its data in an external "
                    "file and no folder was named for it; pass base_dir= the folder the model "
                    "file is in (or the model's path instead of a ModelProto)"
                )
    if base_dir is not None:
        _leave_in_file(proto, Path(base_dir), where)


def _refuse_private_keys(proto: onnx.ModelProto, where: str) -> None:
    """A model file never carries onnxq's key (onnxq never writes it out)."""
    for g in all_graphs(proto.graph):
        for t in g.initializer:
            if any(e.key == FOLDER_KEY for e in t.external_data):
                raise ModelError(
                    f"model file {where}: initializer '{shown(t.name)}' carries onnxq's "
                    f"private external-data key '{FOLDER_KEY}', which onnxq never reads from a "
                    "file; remove it and re-export the model"
                )


def check_sizes(proto: onnx.ModelProto, where: str) -> None:
    """Every in-memory initializer holds as many values as its dims say (the checker does not)."""
    for g in all_graphs(proto.graph):
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                continue  # checked against its file by _leave_in_file
            want = math.prod(t.dims)
            got = _stored_values(t, want)
            if got is not None and got != want:
                held = f"{got} values" if got >= 0 else "not a whole number of values"
                raise ModelError(
                    f"{_model_label(where)}: initializer '{shown(t.name)}' declares dims "
                    f"{list(t.dims)} ({want} values) but holds {held}; the file is damaged — "
                    "re-export the model"
                )


#: types packed two values to a byte in raw_data
_PACKED = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}


def _stored_values(t: onnx.TensorProto, want: int) -> int | None:
    """How many values ``t`` holds in memory (None: a type this check does not know)."""
    if t.HasField("raw_data"):
        if t.data_type in _PACKED:  # two to a byte: any count that rounds up to its bytes
            return want if len(t.raw_data) == (want + 1) // 2 else len(t.raw_data) * 2
        try:
            size = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        except (KeyError, ValueError, TypeError):
            return None
        if t.data_type == onnx.TensorProto.STRING:
            return None
        count, rest = divmod(len(t.raw_data), size)
        return count if not rest else -1  # -1: not a whole number of values
    try:
        field = onnx.helper.tensor_dtype_to_field(t.data_type)
    except (KeyError, ValueError, TypeError):
        return None
    values = len(getattr(t, field))
    if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
        return values // 2
    if t.data_type in _PACKED:
        return want if values == (want + 1) // 2 else values * 2
    return values


def _leave_in_file(proto: onnx.ModelProto, folder: Path, where: str) -> bool:
    """Mark ``proto``'s external-data tensors to be read from their file when needed.

    Each gets :data:`FOLDER_KEY` (``folder``, the model's), after checks of what onnx.load
    checks when it loads external data: a relative location inside that folder, a file that
    exists and holds the tensor's bytes. False when the model has no external data.
    """
    folder = folder.resolve()
    marked = False
    for g in all_graphs(proto.graph):
        for t in g.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL or is_file_weight(t):
                continue
            info = _external_info(t)
            location = info.get("location", "")
            file = (folder / location.replace("\0", "")).resolve()
            if (
                not location
                or "\0" in location
                or Path(location).is_absolute()
                or folder not in file.parents
            ):
                raise ModelError(
                    f"{_model_label(where)}: initializer '{shown(t.name)}' keeps its data at "
                    f"{shown(location)!r}, which is not a file inside the model's folder; "
                    "re-export the model with its external data beside it"
                )
            if not file.is_file():
                raise ModelError(_missing_data_message(proto, folder, where))
            length = _nbytes(t)
            offset = _external_number(info, "offset", 0, t, where)
            if _external_number(info, "length", length, t, where) != length:
                raise ModelError(
                    f"{_model_label(where)}: initializer '{shown(t.name)}' declares "
                    f"{shown(info['length'])} bytes of external data where its type and shape "
                    f"need {length}; re-export the model"
                )
            if offset + length > file.stat().st_size:
                raise ModelError(
                    f"{_model_label(where)}: initializer '{shown(t.name)}' needs bytes {offset} "
                    f"to {offset + length} of '{shown(location)}', which has "
                    f"{file.stat().st_size}; the external data file is truncated or belongs to "
                    "another export"
                )
            entry = t.external_data.add()
            entry.key, entry.value = FOLDER_KEY, _SECRET + str(folder)
            marked = True
    return marked


def _model_label(where: str) -> str:
    """``model file 'm.onnx'`` for a file, ``the given ModelProto`` for a proto."""
    return where if where.startswith("the ") else f"model file {where}"


def _external_number(
    info: dict[str, str], key: str, default: int, t: onnx.TensorProto, where: str
) -> int:
    """A whole-number field of a tensor's external data entry (offset, length), checked."""
    try:
        value = int(info.get(key, default))
    except ValueError:
        value = -1
    if value < 0:
        raise ModelError(
            f"{_model_label(where)}: initializer '{shown(t.name)}' has external data {key} "
            f"{shown(str(info.get(key)))!r}, not a whole number of bytes; re-export the model"
        )
    return value


def _external_info(t: onnx.TensorProto) -> dict[str, str]:
    """A tensor's external data entry (location, offset, length, ...) as a dict."""
    return {e.key: e.value for e in t.external_data}


def _missing_data_message(proto: onnx.ModelProto, folder: Path, where: str) -> str:
    """The error for external-data files not in the folder, naming every one (bodies too)."""
    wanted = {
        info["location"]
        for g in all_graphs(proto.graph)
        for init in g.initializer
        if init.data_location == onnx.TensorProto.EXTERNAL
        and "location" in (info := _external_info(init))
    }
    missing = sorted(w for w in wanted if not (folder / w).is_file())
    return (
        f"{_model_label(where)} keeps its weights in the external file(s) "
        f"{', '.join(repr(shown(m)) for m in missing)}, which are not beside it in "
        f"'{folder}'; put the .data file(s) next to the model (the exporter wrote them "
        "together)"
    )


def check_model(proto: onnx.ModelProto, where: str = "the model") -> None:
    """Run onnx.checker (full check, size-aware) and raise ModelError with its first line."""
    if proto_size(proto) < CHECK_WEIGHTS_BYTES and not has_file_weights(proto):
        _checked(lambda: onnx.checker.check_model(proto), where)
    else:  # the checker parses a serialized copy (two more copies of the weights, and none
        # can pass 2 GB): check the graph with the weights as typed inputs
        _checked(lambda: onnx.checker.check_model(_weights_as_inputs(proto)), where)


#: models above this size are checked without their weights' bytes (see check_model)
CHECK_WEIGHTS_BYTES = 256 * 2**20


def _checked(check: Any, where: str) -> None:
    try:
        check()
    except onnx.checker.ValidationError as exc:
        raise ModelError(
            f"{where} is rejected by onnx.checker: {_first_line(exc)}; fix or re-export the model"
        ) from None


def _weights_as_inputs(model: onnx.ModelProto, limit: int = 4096) -> onnx.ModelProto:
    """A copy whose large or external initializers are main-graph inputs of their type and shape.

    Those of If/Loop bodies too: a body reads an outer-scope name as it read its own
    initializer (names are unique in the model).
    """

    def small(t: onnx.TensorProto) -> bool:
        return _nbytes(t) <= limit and t.data_location != onnx.TensorProto.EXTERNAL

    def as_input(t: onnx.TensorProto) -> onnx.ValueInfoProto:
        return onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims)

    out = onnx.ModelProto()
    copy_fields(model, out, skip="graph")
    copy_fields(model.graph, out.graph, skip="initializer")
    out.graph.initializer.extend(t for t in model.graph.initializer if small(t))
    out.graph.input.extend(as_input(t) for t in model.graph.initializer if not small(t))
    for body in all_graphs(out.graph)[1:]:  # the copy's bodies: their weights move up
        moved = [t for t in body.initializer if not small(t)]
        if moved:
            keep = [t for t in body.initializer if small(t)]
            del body.initializer[:]
            body.initializer.extend(keep)
            out.graph.input.extend(as_input(t) for t in moved)
    return out


def proto_size(proto: Any) -> int:
    """``proto.ByteSize()`` with its file weights in, or :data:`TWO_GIB` past protobuf's limit.

    protobuf's own ``ByteSize`` raises EncodeError there (upb), so a size test on a large
    model must not call it directly. Weights left in their file (:data:`FOLDER_KEY`) count
    as if they were in the message: the size is the model's, however it is held.
    """
    try:
        size = int(proto.ByteSize())
    except Exception:  # google.protobuf.message.EncodeError: past 2 GB
        return TWO_GIB
    if isinstance(proto, onnx.ModelProto):
        size += sum(_nbytes(t) for g in all_graphs(proto.graph) for t in _file_weights(g))
    return min(size, TWO_GIB)


def weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes of every initializer of ``model`` (its bodies' too), from their dims.

    For the decisions that weigh a model by its weights (how to hand them to onnxruntime,
    whether a collection pays): :func:`proto_size` serializes the whole message to measure it
    (upb's ``ByteSize``; 0.1 s a call on a 70 MB encoder, 16 calls in one quantize).
    """
    return sum(_nbytes(t) for g in all_graphs(model.graph) for t in g.initializer)


def save_model(proto: onnx.ModelProto, path: str | os.PathLike[str]) -> None:
    """Write ``proto`` to ``path`` atomically (temp files in the same folder, then rename).

    Models over 2 GB are written with their initializers as external data beside the file
    (``NAME.data``, renamed into place before the model). Files get the mode the umask gives a
    new file (0644 under umask 022), as any other program's output; a failure (disk full,
    Ctrl-C) leaves no partial output behind.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ModelError(f"output folder '{folder}' does not exist; create it or choose another -o")
    if proto_size(proto) < TWO_GIB:
        write_bytes_atomic(path, serialize(proto))
        return
    try:
        _save_external(proto, path, folder)
    except OSError as exc:
        raise _output_error(path, exc) from None


def save_scratch(proto: onnx.ModelProto, path: str | os.PathLike[str]) -> None:
    """Write ``proto`` into a scratch folder onnxq removes (for a worker or a user's function).

    Not one of the user's outputs: no rename into place, and a Ctrl-C's line does not list it
    (it listed the workers' copy of the float model as written, in a folder already removed).
    Over 2 GB, the initializers go beside it as :func:`save_model` writes them.
    """
    path = Path(path)
    if proto_size(proto) < TWO_GIB:
        path.write_bytes(serialize(proto))
    else:
        write_external(proto, path, path.name + ".data")


def _save_external(proto: onnx.ModelProto, path: Path, folder: Path) -> None:
    data_name = path.name + ".data"
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=folder) as tmp:
        staged = Path(tmp) / path.name
        write_external(proto, staged, data_name)
        files = (Path(tmp) / data_name, staged)  # the weights first, the model that reads them
        for f in files:
            _publish(f)
        with interrupt.held():  # the two renames together, or neither
            for f in files:
                os.replace(f, folder / f.name)
            interrupt.wrote(str(path))


#: external data offsets are multiples of this, so onnxruntime can map the weights
EXTERNAL_ALIGN = 4096


def write_external(proto: onnx.ModelProto, path: Path, data_name: str, limit: int = 1024) -> None:
    """Write ``proto`` to ``path`` with initializers over ``limit`` bytes in ``data_name``.

    One tensor at a time is copied out (onnx.save_model with external data rewrites a whole
    copy of the model: a model's worth of memory at 2 GB); offsets are page-aligned, in graph
    order, so the same model gives the same files.
    """
    stub, held = split_weights(proto, limit)
    stubs = [t for t in stub.graph.initializer if _in_memory(t)]
    offset = 0
    with open(path.parent / data_name, "wb") as data:
        for s, t in zip(stubs, held, strict=True):
            raw = raw_bytes(t)
            pad = -offset % EXTERNAL_ALIGN
            data.write(b"\0" * pad)
            offset += pad
            data.write(raw)
            del s.external_data[:]
            for key, value in (("location", data_name), ("offset", offset), ("length", len(raw))):
                entry = s.external_data.add()
                entry.key, entry.value = key, str(value)
            offset += len(raw)
            del raw
    with open(path, "wb") as f:
        f.write(serialize(stub))


def _in_memory(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == IN_MEMORY for e in t.external_data
    )


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write a text file atomically (temp file in the same folder, then rename)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, with the umask's mode, synced before the rename."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise _output_error(path, exc) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        _publish(Path(tmp))
        with interrupt.held():  # renamed and recorded together
            os.replace(tmp, path)
            interrupt.wrote(str(path))
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        elif not isinstance(exc, OSError):  # renamed into place before a Ctrl-C: whole
            interrupt.wrote(str(path))
        if isinstance(exc, OSError):
            raise _output_error(path, exc) from None
        raise


def _output_error(path: Path, exc: OSError) -> OutputError:
    reason = exc.strerror or type(exc).__name__
    return OutputError(
        f"cannot write '{path}': {reason}; nothing was written there — free disk space, check "
        "the folder's permissions or choose another output path"
    )


def _publish(path: Path) -> None:
    """Give a finished temporary file the mode a new file gets (mkstemp makes it 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def serialize(proto: onnx.ModelProto) -> bytes:
    """Deterministic bytes of ``proto``, with any weights left in their file read in."""
    return with_file_weights(proto).SerializeToString(deterministic=True)


# --------------------------------------------------------------------------------------------
# weights left in the model's own external data file

#: the external-data key onnxq adds to a tensor it leaves in the input model's data file: the
#: folder its location is relative to. A model loaded from a file with external data keeps its
#: weights there (never whole in memory, where onnxruntime's session takes a copy of its own);
#: :func:`tensor_array` and :func:`raw_bytes` read one when it is needed. Such tensors never
#: leave the process: :func:`serialize`, the writers and the sessions read them in.
FOLDER_KEY = "onnxq_folder"
#: the prefix of every :data:`FOLDER_KEY` value this process writes: a value without it (a
#: caller's model carrying the key, to have onnxq read any file) is never honoured
_SECRET = secrets.token_hex(16) + ":"


def is_file_weight(t: onnx.TensorProto) -> bool:
    """Whether ``t`` is left in its model's external data file by this process."""
    return t.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == FOLDER_KEY and e.value.startswith(_SECRET) for e in t.external_data
    )


def _file_weights(g: onnx.GraphProto) -> list[onnx.TensorProto]:
    return [t for t in g.initializer if is_file_weight(t)]


def has_file_weights(model: onnx.ModelProto) -> bool:
    """Whether any initializer of ``model`` (subgraphs included) is left in its file."""
    return any(_file_weights(g) for g in all_graphs(model.graph))


def raw_bytes(t: onnx.TensorProto) -> bytes:
    """``t``'s data as ``raw_data`` holds it (read from the data file for a file weight)."""
    if is_file_weight(t):
        info = _external_info(t)
        path = Path(info[FOLDER_KEY][len(_SECRET) :]) / info["location"]
        length = _nbytes(t)
        with open(path, "rb") as f:
            f.seek(int(info.get("offset", 0)))
            raw = f.read(length)
        if len(raw) != length:
            raise ModelError(
                f"initializer '{t.name}': its external data file '{path}' changed while onnxq "
                "read it (it ends early); keep the model's files unchanged while it runs"
            )
        return raw
    if t.HasField("raw_data"):
        return t.raw_data
    return numpy_helper.to_array(t).tobytes()


def read_in(t: onnx.TensorProto) -> onnx.TensorProto:
    """``t`` itself, or for a file weight a copy with its data in it."""
    if not is_file_weight(t):
        return t
    out = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, raw_data=raw_bytes(t))
    out.data_location = onnx.TensorProto.DEFAULT  # set, as onnx.load sets it on what it reads
    if t.doc_string:
        out.doc_string = t.doc_string
    return out


def add_initializer(graph: onnx.GraphProto, name: str, value: np.ndarray) -> None:
    """Append ``value`` as an initializer of ``graph``, the same bytes as ``from_array``.

    A numeric array is written into the graph's own tensor (``from_array`` then ``CopyFrom``
    held the data three times at once: a large weight's worth more than needed).
    """
    value = np.asarray(value)
    if value.dtype.kind not in "fiub" or value.dtype.byteorder == ">" or value.dtype == np.bool_:
        graph.initializer.add().CopyFrom(numpy_helper.from_array(value, name))
        return
    t = graph.initializer.add()
    t.dims.extend(value.shape)
    t.data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
    t.name = name
    t.raw_data = value.tobytes()


def tensor_array(t: onnx.TensorProto) -> np.ndarray:
    """``numpy_helper.to_array`` for any initializer, file weights included."""
    return numpy_helper.to_array(read_in(t))


def with_file_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` itself, or a copy with every file weight read in (a self-contained model)."""
    if not has_file_weights(model):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)  # cheap: the weights are not in it
    for g in all_graphs(out.graph):
        for t in _file_weights(g):
            t.CopyFrom(read_in(t))
    return out


def all_graphs(g: onnx.GraphProto) -> list[onnx.GraphProto]:
    """``g`` and every graph nested in its nodes' attributes, outermost first."""
    out = [g]
    for body in _subgraphs(g):
        out += all_graphs(body)
    return out


class _FileValues(LazyValues):
    """graphsurgeon's lazy constant values, read from the data file of a file weight.

    The values read last are kept while they fit in :data:`RECENT_BYTES` (all of them
    together): matching and annotating one group ask for its weight several times in a row.
    """

    recent: np.ndarray | None = None

    def load(self) -> np.ndarray:
        if self.recent is None:
            self.recent = tensor_array(self.tensor)
            _RECENT.append(self)
            while len(_RECENT) > 1 and sum(v.nbytes for v in _RECENT) > RECENT_BYTES:
                _RECENT.popleft().recent = None
        return self.recent


#: bytes of file weights read through graphsurgeon that stay in memory (the last ones read)
RECENT_BYTES = 256 * 2**20
_RECENT: deque[_FileValues] = deque()


def forget_recent() -> None:
    """Let go of the file weights kept after their last read."""
    while _RECENT:
        _RECENT.popleft().recent = None


class _FileConstant(gs.Constant):
    """A graphsurgeon Constant whose values stay in the data file: read on each use.

    graphsurgeon's own Constant keeps the values once read, and exports them inline; this
    one exports the file weight as it came unless a pass sets new values.
    """

    @property
    def values(self) -> Any:
        v = self._values
        return v.load() if isinstance(v, _FileValues) else v

    @values.setter
    def values(self, values: Any) -> None:
        self._values = values
        if not isinstance(values, _FileValues):  # new values are written inline
            self.data_location = None

    def copy(self) -> gs.Constant:
        out = super().copy()
        out.__class__ = _FileConstant
        return out


def in_file(tensor: gs.Tensor) -> bool:
    """Whether graphsurgeon ``tensor`` is a file weight whose values no pass has replaced."""
    return isinstance(getattr(tensor, "_values", None), _FileValues)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# --------------------------------------------------------------------------------------------
# conversion


def import_graph(proto: onnx.ModelProto) -> gs.Graph:
    """Import a ModelProto as an onnx-graphsurgeon graph.

    File weights stay in their file: their values are read when a pass asks for them, and
    the export writes them back as they came (graphsurgeon keeps a lazy tensor's proto).
    """
    graph = gs.import_onnx(proto)
    _mark_file_weights(graph, proto)
    return graph


def _mark_file_weights(graph: gs.Graph, proto: onnx.ModelProto) -> None:
    """The constants of ``graph`` that are file weights of ``proto`` read from their file."""
    if not has_file_weights(proto):
        return
    for node in iter_subgraph_nodes(graph):
        for t in node.inputs:
            values = getattr(t, "_values", None)
            if (
                isinstance(values, LazyValues)
                and not isinstance(values, _FileValues)
                and is_file_weight(values.tensor)
            ):
                t._values = _FileValues(values.tensor)
                t.__class__ = _FileConstant


def as_imported(graph: gs.Graph, proto: onnx.ModelProto) -> gs.Graph:
    """``graph`` (``proto`` was exported from it) made what importing ``proto`` would give.

    No second import: ``proto`` may hold more than the export wrote (value_info that shape
    inference added). Each Variable takes its dtype, shape and type from ``proto`` as an
    import reads them (its value_info entries first, then the graph input or output), each
    Constant reads its values from ``proto``'s initializer (no second copy of a folded
    weight), and the graph takes ``proto``'s opsets, producer and IR version. A model with
    bodies (If, Loop, Scan), local functions or sparse initializers, or whose names differ
    from ``graph``'s, is imported instead.
    """
    from onnx_graphsurgeon.importers.onnx_importer import OnnxImporter

    g = proto.graph
    tensors = graph.tensors()
    names = {x for n in g.node for x in (*n.input, *n.output) if x}
    names |= {v.name for v in (*g.input, *g.output)} | {t.name for t in g.initializer}
    if (
        proto.functions
        or g.sparse_initializer
        or any(True for n in g.node for _ in graphs_of(n))
        or set(tensors) != names
    ):
        return import_graph(proto)
    inits = {t.name: t for t in g.initializer}
    entries: dict[str, list[onnx.ValueInfoProto]] = {}
    for vi in g.value_info:
        entries.setdefault(vi.name, []).append(vi)
    for vi in (*g.input, *g.output):
        if vi.name not in inits:
            entries.setdefault(vi.name, [vi])
    for name, t in tensors.items():
        if isinstance(t, gs.Constant):
            init = inits[name]
            t._values = LazyValues(init)
            t.data_location = int(init.data_location) if init.HasField("data_location") else None
            t.__dict__.pop("type", None)  # a Variable made constant keeps it; imports have none
            continue
        seen = [OnnxImporter.import_tensor(vi) for vi in entries.get(name, [])]
        first = seen[0] if seen else gs.Variable(name)
        t.dtype, t.shape, t.type = first.dtype, first.shape, first.type
        for more in seen[1:]:  # a repeated entry fills what the first left open
            t.dtype = t.dtype or more.dtype
            t.shape = t.shape or more.shape
    graph.opset = OnnxImporter.get_opset(proto)
    graph.import_domains = OnnxImporter.get_import_domains(proto)
    graph.producer_name, graph.producer_version = proto.producer_name, proto.producer_version
    graph.ir_version = proto.ir_version
    graph.name, graph.doc_string = g.name, g.doc_string
    _mark_file_weights(graph, proto)
    return graph


def copy_graph(graph: gs.Graph) -> gs.Graph:
    """A copy of ``graph`` to rewrite while ``graph`` stays as it is (weights are shared).

    graphsurgeon's ``Graph.copy`` makes every Variable a tensor: a sequence's type is kept here
    (its value_info was written as a float tensor, which onnxruntime refuses).
    """
    out = graph.copy()
    kinds = {t.name: t.type for t in _variables(graph)}
    for t in _variables(out):
        t.type = kinds.get(t.name, t.type)
    return out


def _variables(graph: gs.Graph) -> Iterator[gs.Variable]:
    """The Variables of ``graph`` and of the bodies nested in it (repeats included)."""
    for node in iter_subgraph_nodes(graph):
        yield from (t for t in (*node.inputs, *node.outputs) if isinstance(t, gs.Variable))
    yield from (t for t in (*graph.inputs, *graph.outputs) if isinstance(t, gs.Variable))


def graphs_of(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    """The bodies a node holds (If branches, Loop/Scan bodies), each with its attribute name."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.name, attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for i, body in enumerate(attr.graphs):
                yield f"{attr.name}[{i}]", body


def names_read(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    """Every tensor name ``nodes`` read from their graph (no empty names).

    A body's reads count where they reach outside it: a name the body defines itself (its
    inputs, initializers and node outputs: a Scan step's ``gx``) is not read from the graph.
    """
    names: set[str] = set()
    for node in nodes:
        names.update(i for i in node.input if i)
        for _, body in graphs_of(node):
            own = {i.name for i in body.input} | {t.name for t in body.initializer}
            own |= {o for n in body.node for o in n.output}
            names |= names_read(body.node) - own
    return names


def set_nodes(graph: onnx.GraphProto, nodes: Iterable[onnx.NodeProto]) -> None:
    """Make ``nodes``, in their order, the node list of ``graph`` (a protobuf graph).

    With :func:`insert_nodes`, the only edits of a protobuf node list outside the
    graphsurgeon editor (:class:`GraphEditor`): passes that work on a ModelProto call these.
    ``nodes`` may be ``graph``'s own nodes (taken before the list is cleared).
    """
    nodes = list(nodes)
    del graph.node[:]
    graph.node.extend(nodes)


def insert_nodes(
    graph: onnx.GraphProto, at: int, nodes: Sequence[onnx.NodeProto], replace: int = 0
) -> None:
    """``nodes`` into ``graph``'s node list at position ``at``, in place of ``replace`` nodes."""
    for _ in range(replace):
        del graph.node[at]
    for offset, node in enumerate(nodes):
        graph.node.insert(at + offset, node)


def _subgraphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    return [body for node in graph.node for _, body in graphs_of(node)]


def hoist_nested_initializers(graph: onnx.GraphProto) -> None:
    """Move initializers of bodies nested two or more levels deep up into their branch body.

    graphsurgeon exports an outer constant into every nested body that reads it (the LSTM
    weights of silero-vad's inner If branches: +1 MB per export). Names are unique model-wide, so
    copies with one name are one tensor: keep a single copy in the main graph or the top-level
    body, which every body nested in it can read.
    """
    top = {t.name for t in graph.initializer}
    for body in _subgraphs(graph):
        held = top | {t.name for t in body.initializer}
        todo = _subgraphs(body)
        while todo:
            inner = todo.pop()
            todo.extend(_subgraphs(inner))
            for t in inner.initializer:
                if t.name not in held:
                    body.initializer.append(t)
                    held.add(t.name)
            del inner.initializer[:]


#: body constants smaller than this are left where they are (shape and index constants)
SHARED_MIN_BYTES = 1024


def share_body_constants(model: onnx.ModelProto, min_bytes: int = SHARED_MIN_BYTES) -> int:
    """Keep one copy of each constant that bodies hold several times; return the bytes saved.

    Folding a body's constant subgraph writes its result into that body: silero-vad's two
    inner If branches each slice and concatenate the same LSTM weights of their enclosing
    branch, so the folded model held them twice per branch (its int8 file 2.7 MB against the
    float model's 2.3 MB). Initializers of bodies (never the main graph's, so a model without
    bodies is untouched) with the same type, shape and bytes, of at least ``min_bytes``, become
    one initializer in the innermost graph enclosing all of them, read from there (ONNX bodies
    read enclosing scopes); the others' readers are renamed to it. Deterministic: graphs and
    initializers are visited in their order, and the first copy's name is kept where it is
    defined nowhere else.
    """
    graphs: list[onnx.GraphProto] = []
    parent: list[int | None] = []

    def walk(g: onnx.GraphProto, up: int | None) -> None:
        me = len(graphs)
        graphs.append(g)
        parent.append(up)
        for body in _subgraphs(g):
            walk(body, me)

    walk(model.graph, None)
    # a graph input or output of that name is not the constant alone: left where it is
    ends = {v.name for g in graphs for v in (*g.input, *g.output)}
    groups: dict[tuple[int, tuple[int, ...], bytes], list[tuple[int, int]]] = {}
    for at, g in enumerate(graphs):
        if parent[at] is None:
            continue
        for k, t in enumerate(g.initializer):
            if is_file_weight(t) or t.name in ends or _nbytes(t) < min_bytes:
                continue
            key = (t.data_type, tuple(t.dims), hashlib.sha256(raw_bytes(t)).digest())
            groups.setdefault(key, []).append((at, k))
    shared = {key: members for key, members in groups.items() if len(members) > 1}
    if not shared:
        return 0
    defined: dict[str, int] = {}
    for g in graphs:
        for name in (
            *(i.name for i in g.input),
            *(t.name for t in g.initializer),
            *(o for n in g.node for o in n.output if o),
        ):
            defined[name] = defined.get(name, 0) + 1

    def chain(at: int | None) -> list[int]:
        """The graphs from the main one down to ``at``."""
        out: list[int] = []
        while at is not None:
            out.append(at)
            at = parent[at]
        return out[::-1]

    saved = 0
    moved: dict[int, list[tuple[int, onnx.TensorProto]]] = {}  # graph -> (index, tensor) to drop
    for members in shared.values():
        chains = [chain(at) for at, _ in members]
        home = 0
        for level in range(min(len(c) for c in chains)):
            if len({c[level] for c in chains}) > 1:
                break
            home = chains[0][level]
        first = graphs[members[0][0]].initializer[members[0][1]]
        name = first.name
        if defined.get(name, 0) > 1:  # the name means something else in another graph
            n = 0
            while f"{first.name}_shared{n}" in defined:
                n += 1
            name = f"{first.name}_shared{n}"
            defined[name] = 1
        kept = onnx.TensorProto()
        kept.CopyFrom(first)
        kept.name = name
        for at, k in members:
            t = graphs[at].initializer[k]
            moved.setdefault(at, []).append((k, t))
            if t.name != name:
                _rename_reads(graphs[at], t.name, name)
        saved += _nbytes(first) * (len(members) - 1)
        graphs[home].initializer.append(kept)
    for at, dropped in moved.items():
        g = graphs[at]
        gone = {t.name for _, t in dropped}
        for k, _ in sorted(dropped, key=lambda d: -d[0]):
            del g.initializer[k]
        kept_info = [v for v in g.value_info if v.name not in gone]
        del g.value_info[:]
        g.value_info.extend(kept_info)
    return saved


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every read of ``old`` in ``graph`` and the bodies nested in it now reads ``new``."""
    for g in all_graphs(graph):
        for node in g.node:
            for k, name in enumerate(node.input):
                if name == old:
                    node.input[k] = new


def tidy(graph: gs.Graph) -> None:
    """Drop what nothing reads and sort the nodes: ``graph`` as :func:`export_model` writes it.

    graphsurgeon's sort recurses once per node of the longest chain (two frames a node): the
    interpreter's limit is raised for it, whatever depth the caller is at (a chain of 100
    Gemm + Relu layers, Q/DQ written between them, passed the default limit of 1,000 inside
    ``onnxq debug``).
    """
    graph.cleanup(remove_unused_graph_inputs=False)
    depth = sum(1 for _ in iter_subgraph_nodes(graph))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 2 * depth + 200)  # above whatever the caller's depth is
    try:
        graph.toposort()
    finally:
        sys.setrecursionlimit(limit)


def export_model(graph: gs.Graph, template: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """Export ``graph`` to a ModelProto with every opset domain it uses imported."""
    tidy(graph)
    opsets: dict[str, int] = {"": int(graph.opset)}
    if template is not None:
        for imp in template.opset_import:
            opsets.setdefault(imp.domain or "", int(imp.version))
            if (imp.domain or "") == "":
                opsets[""] = max(opsets[""], int(graph.opset))
    for node in graph.nodes:
        dom = node.domain or ""
        if dom not in opsets:
            opsets[dom] = 1
    imports = [onnx.helper.make_opsetid(d, v) for d, v in sorted(opsets.items())]
    model = gs.export_onnx(graph, do_type_check=False, opset_imports=imports)
    hoist_nested_initializers(model.graph)
    needed = onnx.helper.find_min_ir_version_for(list(imports), ignore_unknown=True)
    # the lowest IR version the opsets allow: newer IRs are refused by older runtimes
    model.ir_version = max(needed, min(template.ir_version, 8) if template is not None else 8)
    if template is not None:
        model.model_version = template.model_version
        model.doc_string = template.doc_string
        del model.metadata_props[:]
        model.metadata_props.extend(template.metadata_props)
    model.producer_name = "onnxq"
    model.producer_version = __version__
    return model


def skeleton(model: onnx.ModelProto, limit: int = 4096) -> onnx.ModelProto:
    """A copy of ``model`` whose large initializers have no data, for shape inference.

    Main-graph initializers over ``limit`` bytes keep their name, type and dims: shape
    inference reads weight shapes, not weights.

    Each shape-inference call serializes the model and parses it back; on VGG19 (548 MB of
    weights) the full copies were 2 GB of the quantizer's peak memory.
    """
    return split_weights(model, limit)[0]


#: the file name an in-memory weight's stub points to (never opened: its data is handed over)
IN_MEMORY = "onnxq-in-memory"


def split_weights(
    model: onnx.ModelProto, limit: int = 4096
) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """:func:`skeleton` and the main-graph initializers it left without data, in graph order.

    File weights are among them, whatever their size (read them with :func:`tensor_array`).

    The stubs are marked as external data (location :data:`IN_MEMORY`), so onnxruntime can be
    given the weights as arrays (``add_external_initializers``) instead of serialized bytes.
    """
    out = onnx.ModelProto()
    copy_fields(model, out, skip="graph")
    copy_fields(model.graph, out.graph, skip="initializer")
    held = []
    for t in model.graph.initializer:
        if not is_file_weight(t) and (
            _nbytes(t) <= limit or t.data_location == onnx.TensorProto.EXTERNAL
        ):
            out.graph.initializer.append(t)
            continue
        out.graph.initializer.append(_in_memory_stub(t.name, t.data_type, t.dims))
        held.append(t)
    return out, held


def values_apart(
    tensors: Iterable[onnx.TensorProto], limit: int = 4096
) -> tuple[list[onnx.TensorProto], dict[str, np.ndarray]]:
    """Each tensor as it is, or past ``limit`` bytes as an in-memory stub and its value.

    The values (name -> array) are copies: an array read from a tensor (``to_array``) is a
    view that keeps the whole protobuf message it came from alive.
    """
    kept: list[onnx.TensorProto] = []
    values: dict[str, np.ndarray] = {}
    for t in tensors:
        if _nbytes(t) <= limit and not is_file_weight(t):
            kept.append(t)
            continue
        values[t.name] = np.array(tensor_array(t))
        kept.append(_in_memory_stub(t.name, t.data_type, t.dims))
    return kept, values


def in_memory_names(model: onnx.ModelProto) -> list[str]:
    """The main-graph initializers whose data lives elsewhere (:func:`split_weights`)."""
    return [t.name for t in model.graph.initializer if _in_memory(t)]


def _in_memory_stub(name: str, data_type: int, dims: Sequence[int]) -> onnx.TensorProto:
    """A tensor of that type and shape whose data lives elsewhere (location :data:`IN_MEMORY`)."""
    t = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims))
    t.data_location = onnx.TensorProto.EXTERNAL
    entry = t.external_data.add()
    entry.key, entry.value = "location", IN_MEMORY
    return t


def unfilled(name: str, dtype: np.dtype, shape: Sequence[int]) -> onnx.TensorProto:
    """A tensor of ``dtype`` and ``shape`` without data, whose values are written later.

    Marked as external data at :data:`IN_MEMORY` (never opened): reading it fails loudly.
    """
    return _in_memory_stub(name, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)


def _nbytes(t: onnx.TensorProto) -> int:
    """The size of a tensor's data from its dims (ByteSize serializes: 1 s on VGG19)."""
    if t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return 0  # kept inline
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return int(np.prod(t.dims, dtype=np.int64)) * itemsize


def copy_fields(src: Any, dst: Any, skip: str) -> None:
    """Copy every set field of message ``src`` but ``skip`` into ``dst``."""
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        target = getattr(dst, field.name)
        if hasattr(value, "extend"):  # repeated field
            target.extend(value)
        elif hasattr(value, "ListFields"):  # message
            target.CopyFrom(value)
        else:
            setattr(dst, field.name, value)


# --------------------------------------------------------------------------------------------
# queries (read-only helpers)


def producer(tensor: gs.Tensor) -> gs.Node | None:
    """The node producing ``tensor``, or None for graph inputs and constants."""
    return tensor.inputs[0] if getattr(tensor, "inputs", None) else None


def consumers(tensor: gs.Tensor) -> list[gs.Node]:
    """The nodes reading ``tensor``, in graph order."""
    return list(tensor.outputs)


def holds_constant(tensor: gs.Tensor) -> bool:
    """True for an initializer or a Constant node's output (its values are not read)."""
    if isinstance(tensor, gs.Constant):
        return True
    node = producer(tensor)
    return node is not None and node.op == "Constant" and "value" in node.attrs


def constant_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of an initializer or of a Constant node's output, else None.

    A lazily imported initializer is read afresh and not kept in the graph: the ModelProto it
    came from holds it already (VGG19's first dense layer would otherwise be held twice, 411 MB).
    """
    if isinstance(tensor, gs.Constant):
        values = tensor._values
        return np.asarray(values.load() if isinstance(values, LazyValues) else tensor.values)
    node = producer(tensor)
    if node is not None and node.op == "Constant" and "value" in node.attrs:
        value = node.attrs["value"]
        return np.asarray(value.values if isinstance(value, gs.Constant) else value)
    return None


def is_absent(tensor: gs.Tensor | None) -> bool:
    """True for an omitted optional input (ONNX writes it as an empty name)."""
    return tensor is None or (isinstance(tensor, gs.Variable) and tensor.name == "")


def present_inputs(node: gs.Node) -> list[gs.Tensor]:
    """The node's inputs with trailing absent optional inputs dropped."""
    inputs = list(node.inputs)
    while inputs and is_absent(inputs[-1]):
        inputs.pop()
    return inputs


def node_label(node: gs.Node) -> str:
    """How a node is named in messages: its name, or op type and first output."""
    if node.name:
        return f"{node.op} node '{node.name}'"
    out = node.outputs[0].name if node.outputs else "?"
    return f"{node.op} node producing '{out}'"


# --------------------------------------------------------------------------------------------
# editing


class GraphEditor:
    """Make edits to a graph with unique, deterministic names.

    Names are derived from node and tensor names (never from global counters): a clash with an
    existing name gets the smallest free numeric suffix, which depends only on the graph.
    """

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self._names: set[str] = set(graph.tensors().keys())
        self._names.update(n.name for n in graph.nodes if n.name)
        self.modified = False

    def fork(self) -> GraphEditor:
        """An editor of a copy of this graph (:func:`copy_graph`) that avoids the same names.

        Names this editor reserved without a tensor or node of the graph taking them yet
        (placeholders named while annotating) stay reserved in the copy.
        """
        other = GraphEditor(copy_graph(self.graph))
        other._names |= self._names
        return other

    # names ------------------------------------------------------------------------------
    def unique_name(self, base: str) -> str:
        """Return ``base`` or ``base_<k>`` for the smallest k that is not taken, and reserve it."""
        name = base
        k = 1
        while name in self._names:
            name = f"{base}_{k}"
            k += 1
        self._names.add(name)
        return name

    def reserve(self, names: Iterable[str]) -> None:
        """Keep ``names`` from new tensors and nodes (names of the bodies, or outer scopes)."""
        self._names.update(names)

    def names(self) -> frozenset[str]:
        """The names taken so far (the graph's and those reserved)."""
        return frozenset(self._names)

    def free(self, name: str) -> None:
        """Let a new node or tensor take ``name`` again (its holder left the graph)."""
        self._names.discard(name)

    # creation ---------------------------------------------------------------------------
    def constant(self, name: str, value: np.ndarray, exact: bool = False) -> gs.Constant:
        """Create an initializer. With ``exact`` the name must be free (placeholders)."""
        if exact:
            if name in self._names:
                raise ModelError(f"tensor name '{name}' is already used in the graph")
            self._names.add(name)
        else:
            name = self.unique_name(name)
        self.modified = True
        return gs.Constant(name, np.ascontiguousarray(value))

    def variable(
        self, name: str, dtype: Any = None, shape: Sequence[Any] | None = None
    ) -> gs.Variable:
        """Create an intermediate tensor with a unique name."""
        return gs.Variable(self.unique_name(name), dtype=dtype, shape=shape)

    def add_node(
        self,
        op: str,
        inputs: Sequence[gs.Tensor | None],
        outputs: Sequence[gs.Variable],
        name: str,
        attrs: dict[str, Any] | None = None,
        domain: str | None = None,
    ) -> gs.Node:
        """Append a node; ``None`` inputs become absent optional inputs."""
        ins = [t if t is not None else gs.Variable.empty() for t in inputs]
        node = gs.Node(
            op=op,
            name=self.unique_name(name),
            attrs=dict(attrs or {}),
            inputs=ins,
            outputs=list(outputs),
            domain=domain or None,
        )
        self.graph.nodes.append(node)
        self.modified = True
        return node

    # rewiring ---------------------------------------------------------------------------
    def replace_producer(self, root: gs.Variable, new: gs.Variable) -> None:
        """Make ``new``'s producer produce ``root`` instead, so ``root`` keeps its name.

        The old producer of ``root`` is detached and removed by :meth:`finish` once dead.
        """
        node = producer(new)
        if node is None:
            self.redirect(root, new)
            return
        root.inputs.clear()
        idx = node.outputs.index(new)
        node.outputs[idx] = root
        self.modified = True

    def redirect(self, old: gs.Tensor, new: gs.Tensor) -> None:
        """Every consumer of ``old`` (and the graph outputs) reads ``new`` instead."""
        for node in list(old.outputs):
            for i, t in enumerate(node.inputs):
                if t is old:
                    node.inputs[i] = new
        outs = self.graph.outputs
        for i, t in enumerate(outs):
            if t is old:
                if isinstance(new, gs.Variable) and producer(new) is not None:
                    # keep the graph output's name: move the producer's output slot
                    self.replace_producer(old, new)
                else:
                    outs[i] = new
        self.modified = True

    def set_input(self, node: gs.Node, index: int, tensor: gs.Tensor) -> None:
        """Set one input of a node."""
        node.inputs[index] = tensor
        self.modified = True

    def append_input(self, node: gs.Node, tensor: gs.Tensor) -> None:
        """Add an input at the end (an optional input such as a bias)."""
        node.inputs.append(tensor)
        self.modified = True

    def absorb(self, node: gs.Node, follower: gs.Node) -> None:
        """``node → follower → y`` becomes ``node → y``: ``node`` takes over the output."""
        y = follower.outputs[0]
        self.remove_node(follower)
        node.outputs[0] = y
        self.modified = True

    def move_after(self, first: gs.Node, second: gs.Node) -> None:
        """``first → d → second → y`` becomes ``second → y' → first → y``.

        ``first`` reads its data at input 0 and ``second`` reads ``d`` at input 0; ``y'`` takes
        the dtype of ``first``'s input (used to move a DequantizeLinear past a commuting op).
        """
        src = first.inputs[0]
        y = second.outputs[0]
        moved = self.variable(y.name + "_quantized", src.dtype, y.shape)
        second.inputs[0] = src
        second.outputs[0] = moved
        first.inputs[0] = moved
        first.outputs[0] = y
        self.modified = True

    def move_after_split(self, first: gs.Node, split: gs.Node) -> None:
        """``first → d → split → y₁…yₙ`` becomes ``split → y'ᵢ → copy of first → yᵢ``."""
        src = first.inputs[0]
        split.inputs[0] = src
        for i, y in enumerate(list(split.outputs)):
            moved = self.variable(y.name + "_quantized", src.dtype, y.shape)
            split.outputs[i] = moved
            self.add_node(
                first.op,
                [moved, *first.inputs[1:]],
                [y],
                f"{y.name}_{first.op}",
                dict(first.attrs),
                first.domain,
            )
        self.remove_node(first)

    def remove_node(self, node: gs.Node) -> None:
        """Detach a node (its outputs lose their producer)."""
        for out in node.outputs:
            out.inputs.clear()
        node.inputs.clear()
        node.outputs.clear()
        self.modified = True

    def finish(self) -> gs.Graph:
        """Drop dead nodes and tensors and sort topologically (:func:`tidy`)."""
        tidy(self.graph)
        return self.graph


def nodes_in_order(graph: gs.Graph) -> list[gs.Node]:
    """The graph's nodes in topological order (the graph is sorted first)."""
    graph.toposort()
    return list(graph.nodes)


def iter_subgraph_nodes(graph: gs.Graph) -> Iterable[gs.Node]:
    """Every node of ``graph`` and of its subgraphs (If/Loop/Scan bodies)."""
    for node in graph.nodes:
        yield node
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                yield from iter_subgraph_nodes(value)
