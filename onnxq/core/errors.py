"""Errors raised by onnxq.

Every message names the node or tensor involved, says what was found and what was expected, and
suggests a fix. The CLI prints ``str(error)`` on one line and exits with code 2.
"""

from __future__ import annotations


class OnnxqError(Exception):
    """Base class of every error onnxq raises on bad input or an impossible request."""

    exit_code = 2


class ModelError(OnnxqError):
    """The model file cannot be read, is not ONNX, or is rejected by onnx.checker."""


class PatternError(OnnxqError):
    """A pattern or rewrite callback is malformed (a programming error in a pattern)."""


class QuantizationError(OnnxqError):
    """A node cannot be quantized as requested."""


class CalibrationError(OnnxqError):
    """Calibration data or a calibration callback is unusable."""


class DataError(CalibrationError):
    """A calibration data source is missing, empty, or does not match the model's inputs."""


class ConfigError(OnnxqError):
    """A command-line option or configuration value is invalid."""


class OutputError(OnnxqError):
    """An output file cannot be written (disk full, no permission); nothing partial is left."""
