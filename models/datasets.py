"""Datasets of the model zoo, from packages on the machine (no network).

* digits: scikit-learn's bundled 8×8 digits, upsampled to the 28×28 MNIST shape (each pixel
  becomes a 3×3 block, padded by 2), values in [0, 1]; a fixed split of 1,437 train / 360 test.
* fashion-mnist: Debian's ``dataset-fashion-mnist`` (60k train / 10k test idx files).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
HERE = Path(__file__).resolve().parent


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test); x as float32 (N, 1, 28, 28) in [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = d.images.astype(np.float32) / 16.0
    big = np.kron(images, np.ones((3, 3), np.float32))
    big = np.pad(big, ((0, 0), (2, 2), (2, 2)))[:, None]
    order = np.random.default_rng(0).permutation(len(big))
    train, test = order[:1437], order[1437:]
    return big[train], d.target[train], big[test], d.target[test]


def _idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_available() -> bool:
    """True when the Debian package's files are present."""
    return (FASHION_DIR / "t10k-images-idx3-ubyte.gz").is_file()


def fashion() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test); x as float32 (N, 1, 28, 28) in [0, 1]."""
    if not fashion_available():
        raise FileNotFoundError(f"{FASHION_DIR} is missing: apt-get install dataset-fashion-mnist")
    xs = [_idx(FASHION_DIR / f"{s}-images-idx3-ubyte.gz") for s in ("train", "t10k")]
    ys = [_idx(FASHION_DIR / f"{s}-labels-idx1-ubyte.gz") for s in ("train", "t10k")]
    xtr, xte = ((x.astype(np.float32) / 255.0)[:, None] for x in xs)
    return xtr, ys[0].astype(np.int64), xte, ys[1].astype(np.int64)


def nhwc(x: np.ndarray) -> np.ndarray:
    """(N, 1, 28, 28) → (N, 28, 28, 1), the input layout of the MLP (TVM RFC E12)."""
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1))
