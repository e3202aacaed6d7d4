"""Annotation: the Quantizer, its config and targets (the rule library is onnxq.patterns)."""
