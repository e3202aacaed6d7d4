"""Graph I/O: loading, saving, the one graph editor, onnxruntime sessions and the host probe."""
