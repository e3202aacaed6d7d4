"""onnxq: a post-training int8 quantizer for ONNX models.

``onnxq.quantize(model, data)`` is the one-call API; ``Quantizer``, ``QuantizerPattern``,
``Calibrator``, ``CalibrationInfo``, ``CalibrationCallback``, ``DatasetManager`` and
``Requantizer`` are the building blocks for advanced use.
"""

from onnxq._version import __version__
from onnxq.annotate.quantizer import Quantizer, QuantizerConfig
from onnxq.annotate.rule import QuantizerPattern
from onnxq.api import QuantizeReport, quantize
from onnxq.calibrate.calibration import Calibrator
from onnxq.calibrate.callbacks import CalibrationCallback, CalibrationInfo, ObserverCallback
from onnxq.calibrate.dataset import DatasetManager
from onnxq.calibrate.sources import as_dataset
from onnxq.errors import OnnxqError
from onnxq.post.requantize import Requantizer

__all__ = [
    "CalibrationCallback",
    "CalibrationInfo",
    "Calibrator",
    "DatasetManager",
    "ObserverCallback",
    "OnnxqError",
    "QuantizeReport",
    "Quantizer",
    "QuantizerConfig",
    "QuantizerPattern",
    "Requantizer",
    "__version__",
    "as_dataset",
    "quantize",
]
