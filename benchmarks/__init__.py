"""Benchmarks: onnxq against onnxruntime.quantization and NNCF.

Run each as ``python -m benchmarks.NAME`` from the checkout.
"""
