"""The shared vocabulary every stage speaks.

Errors, the op table, records, quantization parameters and the calibration callback
protocol. Imports nothing else of onnxq.
"""
