"""Solving: constraint propagation and quantization parameters."""
