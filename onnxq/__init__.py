"""onnxq: a post-training int8 quantizer for ONNX models.

``onnxq.quantize(model, data)`` is the one-call API; ``Quantizer``, ``QuantizerPattern``,
``Calibrator``, ``CalibrationInfo``, ``CalibrationCallback``, ``DatasetManager`` and
``Requantizer`` are the building blocks for advanced use.

The names are imported when first used (PEP 562): ``import onnxq`` alone costs nothing, so the
command-line tool answers Ctrl-C from its first moment (onnxq._entry).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from onnxq._version import __version__

if TYPE_CHECKING:
    from onnxq.annotate.quantizer import Quantizer, QuantizerConfig
    from onnxq.api import QuantizeReport, quantize
    from onnxq.calibrate.calibration import Calibrator
    from onnxq.calibrate.dataset import DatasetManager
    from onnxq.calibrate.sources import as_dataset
    from onnxq.core.callbacks import CalibrationCallback, CalibrationInfo, ObserverCallback
    from onnxq.core.errors import OnnxqError
    from onnxq.options import Options
    from onnxq.patterns.rule import QuantizerPattern
    from onnxq.post.requantize import Requantizer

#: each public name and the module that defines it
_WHERE = {
    "CalibrationCallback": "onnxq.core.callbacks",
    "CalibrationInfo": "onnxq.core.callbacks",
    "Calibrator": "onnxq.calibrate.calibration",
    "DatasetManager": "onnxq.calibrate.dataset",
    "ObserverCallback": "onnxq.core.callbacks",
    "OnnxqError": "onnxq.core.errors",
    "Options": "onnxq.options",
    "QuantizeReport": "onnxq.api",
    "Quantizer": "onnxq.annotate.quantizer",
    "QuantizerConfig": "onnxq.annotate.quantizer",
    "QuantizerPattern": "onnxq.patterns.rule",
    "Requantizer": "onnxq.post.requantize",
    "as_dataset": "onnxq.calibrate.sources",
    "quantize": "onnxq.api",
}

__all__ = [
    "CalibrationCallback",
    "CalibrationInfo",
    "Calibrator",
    "DatasetManager",
    "ObserverCallback",
    "OnnxqError",
    "Options",
    "QuantizeReport",
    "Quantizer",
    "QuantizerConfig",
    "QuantizerPattern",
    "Requantizer",
    "__version__",
    "as_dataset",
    "quantize",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'onnxq' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
