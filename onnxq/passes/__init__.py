"""The quantization pipeline: one pass per module, run in order over one state.

``onnxq.api.quantize`` builds the list (:func:`onnxq.passes.pipeline.build`) from the resolved
options and runs it with :func:`onnxq.passes.manager.run_passes`. docs/passes.md says how to
add one.
"""
