"""Calibration: the calibrator, datasets, image folders, range tables.

The calibration methods themselves are the library ``onnxq.calibrators``.
"""
