"""Passes on the quantized graph: requantize, If branches, int4 weights."""
