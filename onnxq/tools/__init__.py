"""Tools around quantization: compare, the model zoo, accuracy and latency checks."""
