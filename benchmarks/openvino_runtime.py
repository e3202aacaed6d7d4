"""The same quantized models in two runtimes: onnxruntime CPU and the OpenVINO runtime.

    python -m benchmarks.openvino_runtime [MODEL ...]        # default: nudenet_320n

For each zoo model, the metric of:

* fp32 in onnxruntime and in OpenVINO;
* onnxq QDQ in onnxruntime, and the same file read by OpenVINO's own ONNX frontend;
* onnxq's FakeQuantize output (``--format openvino``) in OpenVINO;
* onnxq's QDQ converted by ``onnxq convert --format openvino``, in OpenVINO;
* onnxruntime.quantization (best per-channel setting) and NNCF, each in both runtimes.

It separates what a quantizer decides from how a runtime executes it: a model that scores well
in onnxruntime and worse in OpenVINO for *every* quantizer points at the runtime's int8
execution, not at onnxq's FakeQuantize export.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import onnx

from benchmarks.zoo import _nncf, _ort, _setup


def _ov(model: onnx.ModelProto | Path) -> Any:
    from onnxq.tools.zoo import openvino_runner

    return openvino_runner(onnx.load(str(model)) if isinstance(model, Path) else model)


def measure(name: str) -> list[tuple[str, str, float]]:
    """(variant, runtime, metric) rows for one zoo model."""
    import onnxq
    from onnxq.lower.convert import convert
    from onnxq.tools.zoo import runner

    _, model, recipe, files = _setup(name)
    src = files["model"]
    feeds = list(recipe.calibration(model.calibration))

    def score(fn: Any) -> float:
        return float(recipe.evaluate(fn, model.evaluation))

    rows = [("fp32", "onnxruntime", score(runner(src))), ("fp32", "openvino", score(_ov(src)))]
    qdq, _ = onnxq.quantize(str(src), feeds, format="qdq", progress=False)
    fq, _ = onnxq.quantize(str(src), feeds, format="openvino", progress=False)
    converted, _ = convert(qdq, "openvino")
    rows += [
        ("onnxq qdq", "onnxruntime", score(runner(qdq))),
        ("onnxq qdq", "openvino", score(_ov(qdq))),
        ("onnxq fakequantize", "openvino", score(_ov(fq))),
        ("onnxq qdq → convert", "openvino", score(_ov(converted))),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for label, build in (
            ("ort-pc", lambda out: _ort(src, feeds, out, best=True)),
            ("nncf", lambda out: _nncf(src, feeds, out, model.kind)),
        ):
            out = Path(tmp) / f"{label}.onnx"
            build(out)
            rows += [
                (label, "onnxruntime", score(runner(out))),
                (label, "openvino", score(_ov(out))),
            ]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["nudenet_320n"])
    args = parser.parse_args()
    for name in args.models:
        rows = measure(name)
        print(f"\n{name}\n| variant | runtime | metric |\n|---|---|---|")
        for variant, runtime, value in rows:
            print(f"| {variant} | {runtime} | {value:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
