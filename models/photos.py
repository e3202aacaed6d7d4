"""Real photographs for the image models of the zoo, from packages (no network).

The colour and grey photographs scikit-image ships in its wheel (``skimage/data``) and the two
scikit-learn ships (``load_sample_images``). They are split by photograph, never by crop: even
positions of the sorted list feed calibration, odd ones evaluation, so the two sets never
share a picture. Each set is turned into as many samples as asked by random crops (a scale of
the short side, a position, a mirror), with a fixed seed per set.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

#: skimage/data files that are photographs of the world (not textures of one tone, test
#: charts or microscopy, whose statistics no ImageNet model was trained on)
SKIMAGE_PHOTOS = (
    "astronaut.png",
    "camera.png",
    "chelsea.png",
    "coffee.png",
    "hubble_deep_field.jpg",
    "moon.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "page.png",
    "rocket.jpg",
    "text.png",
    "brick.png",
    "grass.png",
    "gravel.png",
    "coins.png",
    "clock_motion.png",
)


@functools.cache
def photos() -> tuple[np.ndarray, ...]:
    """Every photograph as an RGB uint8 array (H, W, 3), in a fixed order."""
    import skimage
    from PIL import Image
    from sklearn.datasets import load_sample_images

    folder = Path(skimage.__file__).parent / "data"
    out = []
    for name in SKIMAGE_PHOTOS:
        img = Image.open(folder / name).convert("RGB")
        out.append(np.asarray(img))
    out.extend(np.asarray(img, np.uint8) for img in load_sample_images().images)
    return tuple(out)


def split(part: str) -> tuple[np.ndarray, ...]:
    """The photographs of ``part``: "calibration" (even positions) or "evaluation" (odd)."""
    start = {"calibration": 0, "evaluation": 1}[part]
    return photos()[start::2]


def crops(part: str, n: int, size: int, seed: int = 0) -> np.ndarray:
    """``n`` random square crops of ``part``'s photographs, resized to ``size``: (n, size, size, 3).

    A crop takes 40–100% of the photograph's short side at a random position, mirrored half of
    the time, resized with bilinear filtering.
    """
    from PIL import Image

    rng = np.random.default_rng(seed + (0 if part == "calibration" else 7919))
    images = split(part)
    out = np.empty((n, size, size, 3), np.uint8)
    for i in range(n):
        img = images[int(rng.integers(len(images)))]
        h, w = img.shape[:2]
        side = int(min(h, w) * rng.uniform(0.4, 1.0))
        y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        crop = Image.fromarray(img[y : y + side, x : x + side])
        crop = crop.resize((size, size), Image.Resampling.BILINEAR)
        arr = np.asarray(crop)
        out[i] = arr[:, ::-1] if rng.random() < 0.5 else arr
    return out


def normalized(
    images: np.ndarray,
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406),
    std: tuple[float, float, float] = (0.229, 0.224, 0.225),
) -> np.ndarray:
    """uint8 NHWC images as float32 NCHW, scaled to [0, 1] then normalized per channel."""
    x = images.astype(np.float32) / 255.0
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
