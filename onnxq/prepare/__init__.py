"""Float-graph passes before annotation: opset, shape inference, folding, fusions."""
