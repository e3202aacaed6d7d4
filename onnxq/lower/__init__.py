"""Lowerings into each output format: QDQ, OpenVINO FakeQuantize, and convert between formats."""
