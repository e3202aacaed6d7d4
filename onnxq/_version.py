"""The package version (one place; onnxq/__init__ and the model writer read it)."""

__version__ = "0.1.0"
