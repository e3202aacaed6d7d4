"""onnxq: a post-training int8 quantizer for ONNX models.

``onnxq.quantize(model, data)`` is the one-call API; ``Quantizer``, ``QuantizerPattern``,
``Calibrator``, ``CalibrationInfo``, ``CalibrationCallback``, ``DatasetManager`` and
``Requantizer`` are the building blocks for advanced use.
"""

__version__ = "0.1.0"

from onnxq.annotate.quantizer import Quantizer, QuantizerConfig, QuantizerPattern  # noqa: E402
from onnxq.api import QuantizeReport, quantize  # noqa: E402
from onnxq.calibrate.calibration import (  # noqa: E402
    CalibrationCallback,
    CalibrationInfo,
    Calibrator,
    ObserverCallback,
)
from onnxq.calibrate.dataset import DatasetManager, as_dataset  # noqa: E402
from onnxq.errors import OnnxqError  # noqa: E402
from onnxq.post.requantize import Requantizer  # noqa: E402

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
