"""``as_dataset``: whatever the user gave as calibration data, as a DatasetManager."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from onnxq.calibrate.dataset import (
    ArrayDataset,
    DatasetManager,
    FolderDataset,
    InputSpec,
    IterableDataset,
    NpzDataset,
    ReaderDataset,
)
from onnxq.calibrate.images import ImageFolderDataset
from onnxq.core.errors import DataError
from onnxq.io.loader import is_reference, load_object


def as_dataset(
    data: Any,
    inputs: list[InputSpec],
    batch_size: int | None = None,
    limit: int | None = None,
    preprocess: str | None = None,
) -> DatasetManager:
    """Wrap ``data`` for a model.

    ``data``: a DatasetManager; an ``.npz`` path; a folder of ``.npy``/``.npz`` samples, or of
    images when ``preprocess`` is given; ``"module:function"`` naming a function that returns any
    of these, an iterable of feeds or a CalibrationDataReader; a dict of arrays; an iterable of
    feed dicts; an onnxruntime CalibrationDataReader.
    """
    if data is None:
        raise DataError(
            "no calibration data given; pass --data FILE.npz, a folder of .npy/.npz "
            "files, or an iterable of feed dicts"
        )
    if isinstance(data, str) and is_reference(data):
        fn = load_object(data, "--data")
        try:
            produced = fn() if callable(fn) else fn
        except Exception as exc:  # the user's function failed
            raise DataError(f"--data {data!r} raised {type(exc).__name__}: {exc}") from None
        if isinstance(produced, str):
            raise DataError(f"--data {data!r} returned a string; return arrays, feeds or a reader")
        return as_dataset(produced, inputs, batch_size, limit, preprocess)
    if preprocess is not None and not (isinstance(data, str | os.PathLike) and Path(data).is_dir()):
        raise DataError("--preprocess applies to a folder of images given with --data")
    if isinstance(data, DatasetManager):
        ds = data
    elif isinstance(data, str | os.PathLike):
        p = Path(data)
        if p.is_dir() and preprocess is not None:
            ds = ImageFolderDataset(p, preprocess, limit=limit)
        elif p.is_dir():
            ds = FolderDataset(p, limit=limit)
        elif p.is_file():
            ds = NpzDataset(p, batch_size, limit=limit, inputs=inputs)
        else:
            raise DataError(f"calibration data '{p}' does not exist; pass an .npz file or a folder")
    elif isinstance(data, Mapping) and all(isinstance(v, np.ndarray) for v in data.values()):
        ds = ArrayDataset(data, batch_size, limit=limit)
    elif hasattr(data, "get_next"):
        ds = ReaderDataset(data, limit=limit)
    elif isinstance(data, Iterable) or callable(data):
        ds = IterableDataset(data, limit=limit)
    else:
        raise DataError(
            f"calibration data of type {type(data).__name__} is not supported; pass a "
            "path, a dict of arrays, an iterable of feed dicts or a "
            "CalibrationDataReader"
        )
    return ds.bind(inputs)
