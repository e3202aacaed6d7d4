"""Image-folder calibration data with a preprocessing spec given as one string.

    resize=256,crop=224,mean=0.485/0.456/0.406,std=0.229/0.224/0.225,layout=nchw,color=rgb

| key | meaning | default |
|---|---|---|
| ``resize`` | shorter side to N pixels (aspect kept), or ``WxH`` exactly | no resize |
| ``crop`` | centre crop to N×N or ``WxH`` | no crop |
| ``scale`` | divide pixel values (0..255) by this first | 255 |
| ``mean``, ``std`` | per channel (``a/b/c``) or one value; ``(x - mean) / std`` | 0 and 1 |
| ``color`` | ``rgb``, ``bgr`` or ``gray`` | ``rgb`` |
| ``layout`` | ``nchw`` or ``nhwc`` | ``nchw`` |

Pillow decodes the images (``pip install pillow``; it is part of the ``test`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onnxq.calibrate.dataset import IMAGE_SUFFIXES, DatasetManager, image_files
from onnxq.core.errors import ConfigError, DataError

KEYS = ("resize", "crop", "scale", "mean", "std", "color", "layout")


@dataclass(frozen=True)
class Preprocess:
    """A parsed, validated preprocessing spec."""

    resize: tuple[int, int] | int | None = None
    crop: tuple[int, int] | None = None
    scale: float = 255.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    color: str = "rgb"
    layout: str = "nchw"

    @staticmethod
    def parse(text: str) -> Preprocess:
        """Parse ``key=value,key=value``; unknown keys or bad values raise ConfigError."""
        fields: dict[str, Any] = {}
        for part in [p.strip() for p in text.split(",") if p.strip()]:
            if "=" not in part:
                raise ConfigError(
                    f"--preprocess item {part!r} is not key=value; valid keys: {', '.join(KEYS)}"
                )
            key, value = (s.strip() for s in part.split("=", 1))
            if key not in KEYS:
                raise ConfigError(
                    f"--preprocess key {key!r} is unknown; valid keys: {', '.join(KEYS)}"
                )
            try:
                fields[key] = _value(key, value)
            except ValueError:
                raise ConfigError(
                    f"--preprocess {key}={value!r} is not valid; e.g. resize=256, "
                    "crop=224, mean=0.485/0.456/0.406, color=rgb, layout=nchw"
                ) from None
        spec = Preprocess(**fields)
        if any(s == 0 for s in spec.std) or spec.scale == 0:
            raise ConfigError("--preprocess std and scale must not be 0")
        return spec

    def apply(self, image: Any) -> np.ndarray:
        """A PIL image → float32 array (C, H, W) or (H, W, C) per ``layout``."""
        from PIL import Image

        img = image.convert("L" if self.color == "gray" else "RGB")
        if isinstance(self.resize, int):
            w, h = img.size
            k = self.resize / min(w, h)
            size = (max(1, round(w * k)), max(1, round(h * k)))
            img = img.resize(size, Image.Resampling.BILINEAR)
        elif self.resize is not None:
            img = img.resize(self.resize, Image.Resampling.BILINEAR)
        if self.crop is not None:
            cw, ch = self.crop
            w, h = img.size
            if cw > w or ch > h:
                raise DataError(
                    f"crop {cw}x{ch} is larger than the resized image {w}x{h}; "
                    "resize to at least the crop size"
                )
            left, top = (w - cw) // 2, (h - ch) // 2
            img = img.crop((left, top, left + cw, top + ch))
        arr = np.asarray(img, np.float32) / self.scale
        if arr.ndim == 2:
            arr = arr[:, :, None]
        if self.color == "bgr":
            arr = arr[:, :, ::-1]
        mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
        arr = ((arr - mean) / std).astype(np.float32)
        if self.layout == "nchw":
            arr = arr.transpose(2, 0, 1)
        return np.ascontiguousarray(arr, np.float32)


def _size(value: str) -> tuple[int, int]:
    if "x" in value:
        w, h = (int(v) for v in value.lower().split("x"))
    else:
        w = h = int(value)
    if w <= 0 or h <= 0:
        raise ValueError(value)
    return w, h


def _value(key: str, value: str) -> Any:
    if key == "resize":
        return int(value) if "x" not in value.lower() else _size(value)
    if key == "crop":
        return _size(value)
    if key == "scale":
        return float(value)
    if key in ("mean", "std"):
        return tuple(float(v) for v in value.split("/"))
    if key == "color" and value in ("rgb", "bgr", "gray"):
        return value
    if key == "layout" and value in ("nchw", "nhwc"):
        return value
    raise ValueError(value)


class ImageFolderDataset(DatasetManager):
    """Images below a folder (recursively, sorted), one sample each, preprocessed by a spec."""

    def __init__(
        self, path: str | os.PathLike[str], spec: Preprocess | str, limit: int | None = None
    ):
        super().__init__(limit=limit)
        self.path = Path(path)
        self.spec = Preprocess.parse(spec) if isinstance(spec, str) else spec
        self.files = image_files(self.path)
        if not self.files:
            raise DataError(f"folder '{self.path}' holds no images ({', '.join(IMAGE_SUFFIXES)})")

    def describe(self) -> str:
        """How the source is named in messages."""
        return f"image folder '{self.path}'"

    def num_batches(self) -> int:
        """One batch per image."""
        return len(self.files) if self.limit is None else min(len(self.files), self.limit)

    def _raw(self) -> Iterator[Mapping[str, Any]]:
        try:
            from PIL import Image, UnidentifiedImageError
        except ImportError:
            raise DataError("image folders need Pillow: pip install pillow") from None
        specs = self.inputs or []
        if len(specs) != 1:
            raise DataError(
                f"{self.describe()}: the model has {len(specs)} inputs; image folders "
                "feed single-input models"
            )
        for f in self.files:
            try:
                with Image.open(f) as img:
                    arr = self.spec.apply(img)
            except (UnidentifiedImageError, OSError) as exc:
                raise DataError(f"image '{f}' cannot be read ({exc})") from None
            yield {specs[0].name: arr[None]}
