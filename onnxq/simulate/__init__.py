"""Simulation of a quantized model in float, and what is measured on it.

The emulation, sensitivity ranking, checks, comparisons and loss parts: used by passes and
by the user tools.
"""
