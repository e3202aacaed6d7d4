"""The calibration-method library (pure numpy observers plus their callbacks)."""

from __future__ import annotations

from onnxq.calibration import CalibrationCallback
from onnxq.calibrators.average_max import AverageMaxCallback, AverageMaxObserver
from onnxq.calibrators.minmax import MinMaxCallback, MinMaxObserver
from onnxq.errors import ConfigError

METHODS = {
    "minmax": MinMaxCallback,
    "average-max": AverageMaxCallback,
}

__all__ = [
    "METHODS",
    "AverageMaxCallback",
    "AverageMaxObserver",
    "MinMaxCallback",
    "MinMaxObserver",
    "method_callback",
]


def method_callback(method: str) -> CalibrationCallback:
    """The callback of a named method (``minmax``, ``average-max``)."""
    try:
        return METHODS[method]()
    except KeyError:
        raise ConfigError(
            f"calibration method {method!r} is unknown; choose one of {', '.join(METHODS)}"
        ) from None
