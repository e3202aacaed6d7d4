"""Calibration tables: the activation range of every tensor, as JSON keyed by tensor name.

    {"format": "onnxq-ranges", "version": 1, "method": "entropy",
     "tensors": {"input": [0.0, 1.0], "conv1_out": [0.0, 6.2], ...},
     "channel_means": {"conv1_out": [0.3, 1.2, ...], ...},
     "float_rewrites": ["equalization"]}

Calibrate once with ``--save-ranges``; try formats and options in seconds with
``--load-ranges`` (no data pass). Weights are always re-derived from the model; bias correction
reads the per-channel input means the table keeps (``channel_means``, when it ran).
``float_rewrites`` names the passes that rewrote the float model from the calibration data
before it was calibrated (cross-layer equalization, SmoothQuant): a run without that data
cannot redo them, so such a table is refused by ``--load-ranges`` rather than applied to
tensors whose values it does not describe.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from onnxq.core.errors import ConfigError
from onnxq.io.graph import write_text_atomic

FORMAT = "onnxq-ranges"


def write_ranges(
    path: str | os.PathLike[str],
    ranges: Mapping[str, tuple[float, float]],
    method: str,
    channel_means: Mapping[str, Any] | None = None,
    float_rewrites: list[str] | None = None,
) -> None:
    """Write the table atomically, tensors sorted by name (deterministic)."""
    doc: dict[str, Any] = {
        "format": FORMAT,
        "version": 1,
        "method": method,
        "tensors": {k: [float(lo), float(hi)] for k, (lo, hi) in sorted(ranges.items())},
    }
    if channel_means:
        doc["channel_means"] = {
            k: [float(v) for v in np.asarray(m, np.float64).reshape(-1)]
            for k, m in sorted(channel_means.items())
        }
    if float_rewrites:
        doc["float_rewrites"] = sorted(float_rewrites)
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")


def read_channel_means(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The per-channel input means a table keeps (empty when it has none)."""
    with open(path, encoding="utf-8") as handle:
        doc = json.load(handle)
    means = doc.get("channel_means", {}) if isinstance(doc, dict) else {}
    out = {}
    for name, values in means.items():
        if not isinstance(values, list) or not all(
            isinstance(v, int | float) and math.isfinite(v) for v in values
        ):
            raise ConfigError(
                f"range table '{path}': channel_means of '{name}' must be a list of finite numbers"
            )
        out[name] = np.asarray(values, np.float64)
    return out


def read_ranges(path: str | os.PathLike[str]) -> dict[str, tuple[float, float]]:
    """Read and validate a table written by :func:`write_ranges`."""
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except FileNotFoundError:
        raise ConfigError(
            f"range table '{path}' does not exist; write one with --save-ranges"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"range table '{path}' is not readable JSON ({exc})") from None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != FORMAT
        or not isinstance(doc.get("tensors"), dict)
    ):
        raise ConfigError(
            f"'{path}' is not an onnxq range table (expected format {FORMAT!r} "
            "and a 'tensors' object); write one with --save-ranges"
        )
    out = {}
    for name, pair in doc["tensors"].items():
        ok = (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(v, int | float) and math.isfinite(v) for v in pair)
            and pair[0] <= pair[1]
        )
        if not ok:
            raise ConfigError(
                f"range table '{path}': tensor '{name}' has {pair!r}, expected "
                "[min, max] with finite min <= max"
            )
        out[name] = (float(pair[0]), float(pair[1]))
    rewrites = doc.get("float_rewrites", [])
    if rewrites:
        flags = " ".join(f"--{r} off" for r in rewrites)
        raise ConfigError(
            f"range table '{path}' was saved from the model as {' and '.join(rewrites)} "
            "rewrote it with scales from the calibration data, which --load-ranges cannot "
            f"redo; save the table again with {flags}, or quantize with --data"
        )
    return out
