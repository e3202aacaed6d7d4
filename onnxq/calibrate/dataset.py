"""Calibration data: DatasetManager and its adapters.

A DatasetManager yields *feeds*, ``{input name: np.ndarray}``, each holding a batch the model
accepts. Adapters: an ``.npz`` file (arrays keyed by input name, samples stacked on axis 0), a
folder of ``.npy``/``.npz`` files (one sample each), any Python iterable of feed dicts, and
onnxruntime's ``CalibrationDataReader``. Every feed is checked against the model's inputs: names,
rank, fixed dimensions and dtype, with a message that names the input.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxq.core.errors import DataError
from onnxq.io.text import shown

Feed = dict[str, np.ndarray]


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


def image_files(folder: Path) -> list[Path]:
    """Images below ``folder``, sorted by path."""
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


@dataclass(frozen=True)
class InputSpec:
    """One model input: name, numpy dtype, shape (None for symbolic dimensions)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...] | None
    #: the model's names of its symbolic dimensions ("" where it names none), for messages
    dim_names: tuple[str, ...] | None = None

    @property
    def fixed_batch(self) -> int | None:
        """The batch dimension when it is fixed, else None."""
        if not self.shape:
            return None
        return self.shape[0]


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The model's real inputs (graph inputs that are not initializers)."""
    inits = {i.name for i in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        shape: tuple[int | None, ...] | None = None
        names: tuple[str, ...] | None = None
        if tt.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
            names = tuple(d.dim_param for d in tt.shape.dim)
        specs.append(InputSpec(vi.name, dtype, shape, names))
    return specs


class DatasetManager:
    """Yields feeds for calibration (seed API: ``get_next_batch``, ``num_batches``, ``reset``).

    Subclasses implement :meth:`_raw`, an iterator of unchecked feeds; :meth:`batches` checks each
    against the model's inputs and converts dtypes where that is lossless for floats.
    """

    def __init__(self, inputs: list[InputSpec] | None = None, limit: int | None = None):
        if limit is not None and limit < 1:
            raise DataError(f"the sample limit {limit} must be >= 1")
        self.inputs = inputs
        self.limit = limit
        #: conversions made on the way (float64 → float32, …), one line per input
        self.warnings: list[str] = []
        self._iter: Iterator[Feed] | None = None
        self._peek: Feed | None = None

    def _raw(self) -> Iterator[Mapping[str, Any]]:
        raise NotImplementedError

    def num_batches(self) -> int | None:
        """Number of batches when known in advance."""
        return None

    def most_samples(self) -> int | None:
        """An upper bound on the samples one pass yields, when known without reading them."""
        return None

    def batch_size(self) -> int | None:
        """Samples per batch when fixed."""
        return None

    def bind(self, inputs: list[InputSpec]) -> DatasetManager:
        """Attach the model's input specification (used for checks and batching)."""
        self.inputs = inputs
        return self

    def batches(self) -> Iterator[Feed]:
        """Checked feeds, from the start; at most ``limit`` samples in all.

        A data error names the model's inputs and an ``.npz`` built from them.
        """
        try:
            yield from self._batches()
        except DataError as exc:
            raise with_inputs(exc, self.inputs) from None

    def _batches(self) -> Iterator[Feed]:
        seen = 0
        index = 0
        for raw in self._raw():
            feed = self.check(raw, index)
            index += 1
            n = feed_samples(feed)
            if self.limit is not None and seen + n > self.limit:
                left = self.limit - seen
                if left <= 0 or not self._dynamic_batch():
                    break
                feed = {k: v[:left] for k, v in feed.items()}
                n = left
            yield feed
            seen += n
            if self.limit is not None and seen >= self.limit:
                break
        if index == 0:
            raise DataError(
                f"{self.describe()} holds no samples; give at least one sample for each model input"
            )

    def _dynamic_batch(self) -> bool:
        return not any(s.fixed_batch for s in (self.inputs or []))

    def __iter__(self) -> Iterator[Feed]:
        return self.batches()

    # seed API ---------------------------------------------------------------------------
    def get_next_batch(self) -> Feed:
        """The next feed; raises IndexError when the data is exhausted."""
        if self._iter is None:
            self._iter = self.batches()
        try:
            return next(self._iter)
        except StopIteration:
            raise IndexError("the dataset is exhausted; call reset()") from None

    def is_empty(self) -> bool:
        """True when :meth:`get_next_batch` has nothing more to give."""
        if self._iter is None:
            self._iter = self.batches()
        if self._peek is None:
            try:
                self._peek = next(self._iter)
            except StopIteration:
                return True
            peeked = self._peek
            rest = self._iter

            def chain() -> Iterator[Feed]:
                yield peeked
                yield from rest

            self._iter = chain()
            self._peek = None
        return False

    @property
    def replayable(self) -> bool:
        """Whether :meth:`batches` can be read more than once."""
        return True

    def reset(self) -> None:
        """Start again from the first batch."""
        self._iter = None
        self._peek = None

    def describe(self) -> str:
        """How the source is named in messages."""
        return type(self).__name__

    # checks -----------------------------------------------------------------------------
    def check(self, raw: Mapping[str, Any], index: int) -> Feed:
        """Validate one feed against the model inputs; convert float64 → float32 and the like."""
        if not isinstance(raw, Mapping):
            raise DataError(
                f"{self.describe()}: item {index} is a {type(raw).__name__}, expected a "
                "dict {input name: array}"
            )
        if self.inputs is None:
            return {k: np.asarray(v) for k, v in raw.items()}
        want = {s.name: s for s in self.inputs}
        self.check_names(raw, f"item {index}")
        feed: Feed = {}
        for name, spec in want.items():
            arr = np.asarray(raw[name])
            feed[name] = _conform(arr, spec, f"{self.describe()}: item {index}", self._warn)
        return feed

    def check_names(self, raw: Mapping[str, Any], what: str) -> None:
        """Raise DataError when ``raw``'s keys are not exactly the model's input names."""
        want = {s.name for s in self.inputs or []}
        unknown = sorted(set(raw) - want)
        missing = sorted(want - set(raw))
        if unknown or missing:
            raise with_inputs(
                DataError(f"{self.describe()}: {names_mismatch(what, unknown, missing)}"),
                self.inputs,
            )

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)


class HeldBack(DatasetManager):
    """``inner`` with every ``every``-th batch held back: the passes fit on the rest.

    :meth:`batches` yields the batches the passes fit on; :meth:`held` the ones held back,
    which no statistic, Hessian or correction sees, to judge the candidates on
    (onnxq.passes.choose). The split is by position, the same on every read. ``every`` 0 holds
    nothing back (the candidates are judged on the caller's own data).
    """

    def __init__(self, inner: DatasetManager, every: int):
        super().__init__(inner.inputs, None)
        self.inner, self.every = inner, every
        self.warnings = inner.warnings

    def bind(self, inputs: list[InputSpec]) -> DatasetManager:
        """Attach the model's inputs to the wrapped source as well."""
        self.inner.bind(inputs)
        return super().bind(inputs)

    def _split(self, held: bool) -> Iterator[Feed]:
        for i, feed in enumerate(self.inner.batches()):
            if (self.every > 0 and i % self.every == self.every - 1) == held:
                yield feed

    def batches(self) -> Iterator[Feed]:
        """The batches the passes fit on."""
        return self._split(False)

    def held(self) -> list[Feed]:
        """The batches held back, read again from the source."""
        return list(self._split(True))

    def num_batches(self) -> int | None:
        """Batches fitted on per pass."""
        n = self.inner.num_batches()
        return None if n is None else n - (n // self.every if self.every else 0)

    def most_samples(self) -> int | None:
        """The samples of the source (held-back ones included: an upper bound)."""
        return self.inner.most_samples()

    def batch_size(self) -> int | None:
        """Samples per batch, as the source's."""
        return self.inner.batch_size()

    @property
    def replayable(self) -> bool:
        """As the source."""
        return self.inner.replayable

    def reset(self) -> None:
        """Start again from the first batch."""
        super().reset()
        self.inner.reset()

    def describe(self) -> str:
        """The source's name."""
        return self.inner.describe()


def names_mismatch(what: str, unknown: list[str], missing: list[str]) -> str:
    """``what`` holds arrays named ``unknown`` (no model input) and none for ``missing``."""
    parts = []
    if unknown:
        parts.append(f"{what} has array(s) {shown(str(unknown))} that name no input of the model")
    if missing:
        parts.append(f"{'it' if unknown else what} has no array for input(s) {shown(str(missing))}")
    return ", and ".join(parts)


def inputs_hint(inputs: list[InputSpec] | None) -> str:
    """The model's inputs and an ``.npz`` built from them, for messages and ``inspect``."""
    if not inputs:
        return ""

    def dims(spec: InputSpec) -> str:
        if spec.shape is None:
            return "?"
        names = spec.dim_names or ("",) * len(spec.shape)
        return ",".join(
            str(d) if d is not None and d > 0 else _dim_name(i, names[i])
            for i, d in enumerate(spec.shape)
        )

    listed = ", ".join(f"'{s.name}' {s.dtype}[{dims(s)}]" for s in inputs)
    keys = _savez_arguments([s.name for s in inputs])
    return (
        f"the model's inputs: {listed}; e.g. numpy.savez('calib.npz', {keys}) with each array "
        "of that dtype, samples stacked on a new axis 0 (or, for fixed-size inputs, one array of "
        "exactly that shape per .npz file in a folder)"
    )


def _dim_name(axis: int, name: str) -> str:
    """How the hint shows a symbolic dimension.

    N on axis 0 (the samples), else the model's own name for it when it reads as one
    (``seq_len``; not an exporter's ``unk__315``).
    """
    if axis == 0 or not name.isidentifier() or len(name) > 24 or name.startswith("unk__"):
        return "N"
    return name


def _savez_arguments(names: list[str]) -> str:
    """``numpy.savez`` keyword arguments for ``names``.

    Names that are not Python identifiers (``gpu_0/data_0``) go into one ``**{...}``.
    """
    plain = [f"{n}=samples_{i}" for i, n in enumerate(names) if n.isidentifier()]
    other = [f"{n!r}: samples_{i}" for i, n in enumerate(names) if not n.isidentifier()]
    return ", ".join(plain + ([f"**{{{', '.join(other)}}}"] if other else []))


def with_inputs(exc: DataError, inputs: list[InputSpec] | None) -> DataError:
    """``exc`` with the model's inputs appended (once)."""
    hint = inputs_hint(inputs)
    text = str(exc)
    if not hint or "the model's inputs:" in text:
        return exc
    return type(exc)(f"{text}; {hint}")


def feed_samples(feed: Mapping[str, np.ndarray]) -> int:
    """Samples in a feed: the leading dimension its arrays share.

    1 for scalars, or when the arrays' leading dimensions differ (that axis is no batch then).
    """
    if not feed or not shared_batch(feed):
        return 1
    return int(np.shape(next(iter(feed.values())))[0])


def inner_shapes(feed: Mapping[str, Any]) -> tuple[Any, ...]:
    """Each input's shape past its batch axis (and its rank): feeds that may be joined on it.

    Padded text batches of different lengths differ here and stay apart (padding them to one
    length would change what they compute).
    """
    return tuple(sorted((k, np.shape(v)[1:], np.ndim(v)) for k, v in feed.items()))


def shared_batch(feed: Mapping[str, np.ndarray]) -> bool:
    """Whether every array of ``feed`` has the same leading dimension, so it can be cut there.

    A free leading dimension is not always a batch: silero-vad's LSTM state is [2, 1, 128]
    beside an audio chunk of [1, 512], and cutting both to one row breaks the model.
    """
    sizes = {np.shape(v)[0] if np.ndim(v) else None for v in feed.values()}
    return len(sizes) == 1 and None not in sizes


def dims_text(shape: tuple[int | None, ...]) -> str:
    """A model input's shape as ``[N, 3, 224, 224]`` (N: a dimension of any size)."""
    return "[" + ", ".join("N" if d is None or d <= 0 else str(d) for d in shape) + "]"


def _conform(
    arr: np.ndarray, spec: InputSpec, where: str, warn: Callable[[str], None]
) -> np.ndarray:
    if arr.dtype != spec.dtype:
        arr = _convert(arr, spec, where, warn)
    if spec.shape is not None:
        if arr.ndim != len(spec.shape):
            raise DataError(
                f"{where}: input '{spec.name}' is a batch of shape {list(arr.shape)} "
                f"({arr.ndim} dimensions), the model takes {dims_text(spec.shape)} "
                f"({len(spec.shape)} dimensions)"
            )
        for i, (got, exp) in enumerate(zip(arr.shape, spec.shape)):
            if exp is not None and exp > 0 and got != exp:
                raise DataError(
                    f"{where}: input '{spec.name}' is a batch of shape {list(arr.shape)}, the "
                    f"model takes {dims_text(spec.shape)}: dimension {i} is {got}, the model "
                    f"expects {exp}"
                )
    # np.ascontiguousarray turns a 0-d array (a scalar input such as silero-vad's sr) into 1-d
    return np.ascontiguousarray(arr) if arr.ndim else arr


def _convert(
    arr: np.ndarray, spec: InputSpec, where: str, warn: Callable[[str], None]
) -> np.ndarray:
    """Data of another dtype than the input's: convert what is safe, refuse what is a guess.

    * float → float: converted; narrowing (float64 → float32) says so once;
    * integer or bool → float: refused — uint8 pixels 0..255 for a float input are the most
      common data mistake, and the model's own scaling cannot be guessed;
    * integer → integer: converted when every value fits, else refused;
    * anything else (float → integer, strings, objects): refused.
    """
    got, want = arr.dtype, spec.dtype
    what = f"{where}: input '{spec.name}' holds {got} data, the model expects {want}"
    if np.issubdtype(got, np.floating) and np.issubdtype(want, np.floating):
        if np.finfo(got).bits > np.finfo(want).bits:
            warn(f"input '{spec.name}': {got} calibration data converted to {want}")
        return arr.astype(want)
    if np.issubdtype(want, np.floating) and (np.issubdtype(got, np.integer) or got == np.bool_):
        raise DataError(
            f"{what}; scale your pixels as your model expects (e.g. x.astype(numpy.float32) / "
            "255, then its mean and std) and save float data — onnxq does not guess"
        )
    if np.issubdtype(got, np.integer) and np.issubdtype(want, np.integer):
        info = np.iinfo(want)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise DataError(f"{what} and its values [{arr.min()}, {arr.max()}] do not fit {want}")
        return arr.astype(want)
    raise DataError(f"{what}; save the data as {want}")


class ArrayDataset(DatasetManager):
    """Arrays keyed by input name, fed in batches the model accepts.

    Usually samples are stacked on axis 0 and fed ``batch_size`` at a time: None picks the
    model's fixed batch dimension, or 1 when it is dynamic, so the batch statistics of AverageMax
    match per-sample inference; a trailing partial batch is fed only when the batch dimension is
    dynamic. When every input has a fully fixed shape (e.g. a (2, 3) and a (3, 4) input of one
    MatMul), arrays of exactly those shapes are one sample, and arrays with one more leading
    axis are that many samples.
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray | StoredArray],
        batch_size: int | None = None,
        name: str = "arrays",
        limit: int | None = None,
    ):
        super().__init__(limit=limit)
        self.arrays: dict[str, Any] = {
            k: v if isinstance(v, StoredArray) else np.asarray(v) for k, v in arrays.items()
        }
        self.name = name
        self.requested_batch = batch_size
        if batch_size is not None and batch_size < 1:
            raise DataError(f"batch size {batch_size} must be >= 1")
        if not self.arrays:
            raise DataError(f"{name} holds no arrays; store one array per model input")

    def describe(self) -> str:
        """How the source is named in messages."""
        return self.name

    def _fixed_layout(self) -> str:
        """'one' (arrays are one sample), 'stacked' (on a new axis 0) or '' (usual batches)."""
        specs = self.inputs or []
        if not specs or any(
            s.shape is None or any(d is None or d <= 0 for d in s.shape) for s in specs
        ):
            return ""
        shapes = {s.name: tuple(s.shape or ()) for s in specs}
        if all(self.arrays[k].shape == shapes[k] for k in shapes if k in self.arrays):
            return "one"
        if all(self.arrays[k].shape[1:] == shapes[k] for k in shapes if k in self.arrays):
            return "stacked"
        return ""

    @property
    def count(self) -> int:
        """Samples held (checked: every input the same count, names first)."""
        if self.inputs is not None:
            self.check_names(self.arrays, "arrays")
        layout = self._fixed_layout()
        if layout == "one":
            return 1
        counts = {k: (v.shape[0] if v.ndim else 0) for k, v in self.arrays.items()}
        if len(set(counts.values())) != 1:
            raise DataError(
                f"{self.name}: arrays hold different sample counts {counts}; stack the same "
                "number of samples for every input on axis 0 (inputs of different fixed batch "
                "sizes: give arrays of exactly the input shapes, or a folder of .npz files, one "
                "sample each)"
            )
        return next(iter(counts.values()))

    def most_samples(self) -> int:
        """The samples held (at most ``limit``)."""
        return self.count if self.limit is None else min(self.count, self.limit)

    def batch_size(self) -> int:
        """Samples per feed."""
        if self._fixed_layout():
            return 1
        if self.requested_batch is not None:
            return self.requested_batch
        fixed = [s.fixed_batch for s in (self.inputs or []) if s.fixed_batch]
        return int(fixed[0]) if fixed else 1

    def num_batches(self) -> int:
        """Batches per pass (with ``limit`` samples at most)."""
        bs = self.batch_size()
        count = self.count if self.limit is None else min(self.count, self.limit)
        return -(-count // bs) if self._dynamic_batch() else count // bs

    def _check_stacked(self) -> None:
        """Arrays of samples stacked on axis 0: each sample's shape against its input's.

        Named as the user saved them (``(200, 256)``: 200 samples of [256]), not as the
        first batch cut from them.
        """
        for spec in self.inputs or []:
            arr = self.arrays.get(spec.name)
            if arr is None or spec.shape is None or arr.ndim == 0:
                continue
            want = spec.shape[1:]
            if arr.ndim - 1 != len(want):
                raise DataError(
                    f"{self.name}: array '{spec.name}' has shape {list(arr.shape)}, "
                    f"{arr.shape[0]} samples of {list(arr.shape[1:])}; input '{spec.name}' "
                    f"takes {dims_text(spec.shape)}: save samples of "
                    f"{dims_text(want)} stacked on axis 0"
                )
            for i, (got, exp) in enumerate(zip(arr.shape[1:], want), start=1):
                if exp is not None and exp > 0 and got != exp:
                    raise DataError(
                        f"{self.name}: array '{spec.name}' has shape {list(arr.shape)}, "
                        f"{arr.shape[0]} samples of {list(arr.shape[1:])}; input '{spec.name}' "
                        f"takes {dims_text(spec.shape)}: dimension {i} is {got}, the model "
                        f"expects {exp}"
                    )

    def _raw(self) -> Iterator[Mapping[str, Any]]:
        layout = self._fixed_layout()
        if not layout:
            self._check_stacked()
        count = self.count
        if layout == "one":
            yield {k: np.asarray(v) for k, v in self.arrays.items()}
            return
        if layout == "stacked":
            for i in range(count):
                yield {k: v[i] for k, v in self.arrays.items()}
            return
        bs = self.batch_size()
        fixed = [s.fixed_batch for s in (self.inputs or []) if s.fixed_batch]
        if fixed and bs != fixed[0]:
            raise DataError(
                f"{self.name}: batch size {bs} differs from the model's fixed batch "
                f"dimension {fixed[0]}"
            )
        if fixed and count < bs:
            raise DataError(
                f"{self.name}: {count} sample(s) cannot fill one batch of the "
                f"model's fixed batch size {bs}"
            )
        stop = count if self._dynamic_batch() else count - count % bs
        for start in range(0, stop, bs):
            yield {k: v[start : start + bs] for k, v in self.arrays.items()}

    def _batches(self) -> Iterator[Feed]:
        if self._fixed_layout() and self.limit is not None:  # one sample per feed: count feeds
            for i, feed in enumerate(super()._batches()):
                if i >= self.limit:
                    return
                yield feed
            return
        yield from super()._batches()


#: the largest array a data file may declare (bytes); None: half the memory free right now
MEMBER_LIMIT: int | None = None


def _member_limit() -> int:
    if MEMBER_LIMIT is not None:
        return MEMBER_LIMIT
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return 1 << 34


def check_numpy_file(path: Path) -> None:
    """Refuse an ``.npy``/``.npz`` whose arrays cannot be loaded safely, from headers alone.

    Object arrays (pickles) and arrays larger than :func:`_member_limit` — a compressed
    ``.npz`` of a few KB can declare gigabytes — are refused before any data is read.
    """
    if path.suffix == ".npy":
        try:
            with open(path, "rb") as handle:
                _check_header(handle, path, None, None)
        except (OSError, ValueError, EOFError) as exc:
            raise _unreadable(path, exc) from None
        return
    npz_headers(path)


@dataclass(frozen=True)
class Member:
    """One array of an ``.npz``, from its header: the zip member, dtype, shape and bytes."""

    name: str
    member: str
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    #: stored in Fortran order; the bytes of the member before its array data
    fortran: bool = False
    header: int = 0


def npz_headers(path: Path) -> dict[str, Member]:
    """Every array of an ``.npz`` by name, each header checked, no array data read.

    Every member is checked whatever its name (numpy reads a member without the ``.npy``
    suffix as raw bytes, and a crafted one could declare any size): it must be a numpy array
    header of a plain dtype within :func:`_member_limit`, and the member must hold the bytes
    it declares.
    """
    out: dict[str, Member] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                with archive.open(info) as handle:
                    dtype, shape, nbytes, fortran = _check_header(
                        handle, path, name, info.file_size
                    )
                    header = handle.tell()
                out[name] = Member(name, info.filename, dtype, shape, nbytes, fortran, header)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, RuntimeError) as exc:
        raise _unreadable(path, exc) from None
    return out


def read_npz(
    path: Path, names: Iterable[str], headers: dict[str, Member] | None = None
) -> dict[str, np.ndarray | StoredArray]:
    """The arrays ``names`` of an ``.npz``, its headers checked (:func:`npz_headers`).

    Only those members are read. A member stored uncompressed (``numpy.savez``) in C order
    stays in the file: a :class:`StoredArray` reads the samples each batch needs, so the
    calibration data is never in memory all at once (1,024 MobileNet samples are 315 MB).
    Compressed members (``numpy.savez_compressed``) are read whole and together must fit in
    :func:`_member_limit`.
    """
    headers = npz_headers(path) if headers is None else headers
    wanted = [headers[n] for n in names]
    out: dict[str, np.ndarray | StoredArray] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for m in wanted:
                stored = StoredArray.open(path, archive, m)
                if stored is not None:
                    out[m.name] = stored
            whole = [m for m in wanted if m.name not in out]
            total, limit = sum(m.nbytes for m in whole), _member_limit()
            if total > limit:
                raise DataError(
                    f"calibration data '{shown(str(path))}' holds {total / 2**30:.1f} GiB of "
                    f"compressed arrays for the model's inputs, over the {limit / 2**30:.1f} "
                    "GiB onnxq may load at once (half the free memory); save it with "
                    "numpy.savez (uncompressed: read a batch at a time), or split the samples "
                    "into a folder of .npz files, which onnxq reads one at a time"
                )
            for m in whole:
                with archive.open(m.member) as handle:
                    out[m.name] = np.lib.format.read_array(handle, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, RuntimeError) as exc:
        raise _unreadable(path, exc) from None
    return out


class StoredArray:
    """An array of an uncompressed ``.npz`` member, read from the file slice by slice.

    Supports what :class:`ArrayDataset` asks of its arrays: ``shape``, ``ndim``, ``dtype``,
    an integer or a step-1 slice on axis 0 (a fresh array read from the file) and
    ``numpy.asarray`` (all of it). The file must not change while it is read: its size and
    modification time are checked at every read.
    """

    def __init__(self, path: Path, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
        self.path = path
        self.offset = offset
        self.dtype = dtype
        self.shape = shape
        self.ndim = len(shape)
        stat = os.stat(path)
        self._stamp = (stat.st_size, stat.st_mtime_ns)

    @classmethod
    def open(cls, path: Path, archive: zipfile.ZipFile, member: Member) -> StoredArray | None:
        """The member as a StoredArray, or None when it is compressed or not in C order.

        Its array data starts past the zip's local file header and the numpy header that
        :func:`npz_headers` measured.
        """
        info = archive.getinfo(member.member)
        if info.compress_type != zipfile.ZIP_STORED or not member.shape:
            return None
        if member.fortran and len(member.shape) > 1:
            return None
        with open(path, "rb") as raw:
            raw.seek(info.header_offset)
            local = raw.read(30)  # the local file header: name and extra field lengths last
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            return None
        start = info.header_offset + 30 + int.from_bytes(local[26:28], "little")
        start += int.from_bytes(local[28:30], "little")
        return cls(path, start + member.header, member.dtype, member.shape)

    def _read(self, first: int, count: int) -> np.ndarray:
        stat = os.stat(self.path)
        if (stat.st_size, stat.st_mtime_ns) != self._stamp:
            raise DataError(
                f"calibration data '{shown(str(self.path))}' changed while onnxq was reading "
                "it; leave the file as it is until quantize ends, or give a copy"
            )
        per = math.prod(self.shape[1:])
        with open(self.path, "rb") as raw:
            raw.seek(self.offset + first * per * self.dtype.itemsize)
            data = np.fromfile(raw, self.dtype, count * per)
        if data.size != count * per:
            raise _unreadable(self.path, EOFError("the file ends inside an array"))
        return data.reshape((count, *self.shape[1:]))

    def __getitem__(self, key: int | slice) -> np.ndarray:
        n = self.shape[0]
        if isinstance(key, slice):
            first, stop, step = key.indices(n)
            if step != 1:
                raise IndexError("a StoredArray is sliced with step 1 only")
            return self._read(first, max(0, stop - first))
        index = int(key) + (n if int(key) < 0 else 0)
        if not 0 <= index < n:
            raise IndexError(f"index {key} is out of range for {n} samples")
        return self._read(index, 1)[0]

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._read(0, self.shape[0])
        return out if dtype is None else out.astype(dtype)


def _unreadable(path: Path, exc: BaseException) -> DataError:
    return DataError(
        f"calibration data '{shown(str(path))}' is not a readable numpy file "
        f"({shown(str(exc))}); save it with numpy.savez(path, input_name=array) or numpy.save"
    )


def _check_header(
    handle: Any, path: Path, member: str | None, stored: int | None
) -> tuple[np.dtype, tuple[int, ...], int, bool]:
    fmt = np.lib.format
    where = f"'{shown(str(path))}'" + (f" member '{shown(member)}'" if member else "")
    try:
        version = fmt.read_magic(handle)
    except ValueError:
        raise DataError(
            f"calibration data {where} is not a numpy array (every member of an .npz must be "
            "one); save the file with numpy.savez(path, input_name=array)"
        ) from None
    read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
    shape, fortran, dtype = read(handle, max_header_size=10000)
    if dtype.hasobject:
        raise DataError(
            f"calibration data {where} holds an object array (pickled Python objects), which "
            "onnxq does not load; save plain numeric arrays"
        )
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if stored is not None and stored < nbytes:
        raise DataError(
            f"calibration data {where} is truncated: it declares {nbytes} bytes of "
            f"{dtype} {list(shape)} but holds {stored}; save the file again"
        )
    limit = _member_limit()
    if nbytes > limit:
        raise DataError(
            f"calibration data {where} declares a {dtype} array of shape {list(shape)} "
            f"({nbytes / 2**30:.1f} GiB), over the {limit / 2**30:.1f} GiB onnxq may load "
            "at once (half the free memory); split the samples into a folder of .npz files, "
            "which onnxq reads one at a time"
        )
    return dtype, tuple(shape), nbytes, bool(fortran)


class NpzDataset(ArrayDataset):
    """An ``.npz`` file of arrays keyed by input name, samples stacked on axis 0.

    The names are checked against the model's ``inputs`` from the file's headers first, then
    every member's header; only the inputs' arrays are read.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        batch_size: int | None = None,
        limit: int | None = None,
        inputs: list[InputSpec] | None = None,
    ):
        p = Path(path)
        self.inputs = inputs
        self.name = f"'{shown(str(p))}'"
        try:
            with zipfile.ZipFile(p) as archive:
                listed = [
                    i.filename[:-4] if i.filename.endswith(".npy") else i.filename
                    for i in archive.infolist()
                ]
        except (OSError, zipfile.BadZipFile, ValueError) as exc:
            raise _unreadable(p, exc) from None
        if inputs is not None:
            self.check_names(dict.fromkeys(listed), "the file")
        names = listed if inputs is None else [s.name for s in inputs]
        arrays = read_npz(p, names)
        super().__init__(arrays, batch_size, name=self.name, limit=limit)


class FolderDataset(DatasetManager):
    """A folder of ``.npy`` (single-input models) or ``.npz`` files, one sample each.

    A sample without the batch axis gets one (``(C, H, W)`` → ``(1, C, H, W)``).
    """

    def __init__(self, path: str | os.PathLike[str], limit: int | None = None):
        super().__init__(limit=limit)
        self.path = Path(path)
        self.files = sorted(f for f in self.path.iterdir() if f.suffix in (".npy", ".npz"))
        if not self.files:
            hint = (
                "; it holds images: give --preprocess (e.g. 'resize=256,crop=224')"
                if image_files(self.path)
                else "; put one sample per file there"
            )
            raise DataError(f"folder '{self.path}' holds no .npy or .npz files{hint}")

    def describe(self) -> str:
        """How the source is named in messages."""
        return f"folder '{self.path}'"

    def num_batches(self) -> int:
        """One batch per file."""
        return len(self.files) if self.limit is None else min(len(self.files), self.limit)

    def most_samples(self) -> int | None:
        """The samples of the files, from their headers alone (None: a header is unreadable).

        A file holds one sample, or as many as its leading axis where it has one axis more than
        the input.
        """
        specs = {s.name: s for s in self.inputs or []}
        total = 0
        for f in self.files:
            try:
                if f.suffix == ".npy":
                    with open(f, "rb") as handle:
                        shapes = {"": _check_header(handle, f, None, None)[1]}
                else:
                    shapes = {k: m.shape for k, m in npz_headers(f).items()}
            except DataError:
                return None
            ranks = {k: len(spec.shape) for k, spec in specs.items() if spec.shape is not None}
            if "" in shapes and len(specs) == 1:  # an .npy holds the one input
                shapes = {next(iter(specs)): shapes[""]}
            counts = [
                shape[0] if ranks.get(k) == len(shape) else 1
                for k, shape in shapes.items()
                if shape
            ]
            total += max(counts, default=1)
            if self.limit is not None and total >= self.limit:
                return self.limit
        return total

    def _raw(self) -> Iterator[Mapping[str, Any]]:
        specs = self.inputs or []
        for f in self.files:
            if f.suffix == ".npy":
                check_numpy_file(f)
            try:
                if f.suffix == ".npy":
                    if len(specs) != 1:
                        raise DataError(
                            f"'{f}' is a .npy file but the model has {len(specs)} "
                            "inputs; use .npz files keyed by input name"
                        )
                    sample = {specs[0].name: np.load(f, allow_pickle=False)}
                else:
                    headers = npz_headers(f)
                    if specs:
                        self.check_names(dict.fromkeys(headers), f"'{shown(str(f))}'")
                    wanted = [s.name for s in specs] if specs else headers
                    sample = {  # one sample a file: read whole
                        k: np.asarray(v) for k, v in read_npz(f, wanted, headers).items()
                    }
            except (OSError, ValueError) as exc:
                raise DataError(f"'{f}' cannot be read as a numpy file ({exc})") from None
            yield {k: _add_batch(v, _spec(specs, k)) for k, v in sample.items()}


def _spec(specs: list[InputSpec], name: str) -> InputSpec | None:
    return next((s for s in specs if s.name == name), None)


def _add_batch(arr: np.ndarray, spec: InputSpec | None) -> np.ndarray:
    if spec is not None and spec.shape is not None and arr.ndim == len(spec.shape) - 1:
        return arr[None]
    return arr


class IterableDataset(DatasetManager):
    """Any iterable of feed dicts; a list (or other re-iterable) can be read more than once."""

    def __init__(
        self,
        iterable: Iterable[Mapping[str, Any]] | Callable[[], Iterable[Any]],
        limit: int | None = None,
    ):
        super().__init__(limit=limit)
        self.source = iterable
        self._used = False

    def describe(self) -> str:
        """How the source is named in messages."""
        return "the calibration iterable"

    def num_batches(self) -> int | None:
        """Length when the iterable has one."""
        try:
            n = len(self.source)  # type: ignore[arg-type]
        except TypeError:
            return None
        return n if self.limit is None else min(n, self.limit)

    @property
    def replayable(self) -> bool:
        """A function or a re-iterable, not a one-shot iterator."""
        return callable(self.source) or iter(self.source) is not self.source

    def _raw(self) -> Iterator[Mapping[str, Any]]:
        if callable(self.source):  # a function gives a fresh iterable on every call
            yield from self.source()
            return
        src = self.source
        if iter(src) is src:  # a one-shot iterator
            if self._used:
                raise DataError(
                    "the calibration iterator was already consumed; pass a list or a "
                    "function returning a fresh iterator"
                )
            self._used = True
        yield from src


class ReaderDataset(DatasetManager):
    """onnxruntime's ``CalibrationDataReader`` (``get_next()`` until None; ``rewind()`` if any)."""

    def __init__(self, reader: Any, limit: int | None = None):
        super().__init__(limit=limit)
        self.reader = reader
        self._passes = 0

    def describe(self) -> str:
        """How the source is named in messages."""
        return f"CalibrationDataReader {type(self.reader).__name__}"

    @property
    def replayable(self) -> bool:
        """Only with ``rewind()``."""
        return hasattr(self.reader, "rewind")

    def _raw(self) -> Iterator[Mapping[str, Any]]:
        if self._passes:
            if hasattr(self.reader, "rewind"):
                self.reader.rewind()
            else:
                raise DataError(f"{self.describe()} was already read and has no rewind()")
        self._passes += 1
        while True:
            item = self.reader.get_next()
            if item is None:
                return
            yield item
