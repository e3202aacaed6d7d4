"""Latency of fp32 vs onnxq int8 vs onnxruntime.quantization int8 (QOperator) in one run.

    python -m benchmarks.latency [--runs 300] [--size 64] [--channels 32] [--model PATH]

Without ``--model`` it builds a 5-conv residual CNN (1×3×S×S input, Conv-BN-Relu stem, two
residual blocks, global average pool, dense head) with seeded random weights, plus the bundled
and zoo models. Every variant is measured in onnxruntime CPU with 1 thread and batch 1, median
of ``--runs`` runs after warm-up, the variants interleaved round by round so machine noise hits
them alike, in an order shuffled each round. Prints a table with ratios to fp32 and to
onnxruntime's output.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxq

ROOT = Path(__file__).resolve().parents[1]


def residual_cnn(size: int = 64, ch: int = 32, seed: int = 0) -> onnx.ModelProto:
    """5 convs: stem, two residual blocks of two convs each; BN after the stem; GAP; Gemm."""
    rng = np.random.default_rng(seed)
    inits: dict[str, np.ndarray] = {}

    def conv(name: str, cin: int, cout: int, x: str, y: str, stride: int = 1) -> onnx.NodeProto:
        inits[f"{name}.W"] = rng.normal(0, np.sqrt(2 / (cin * 9)), (cout, cin, 3, 3)).astype(
            np.float32
        )
        inits[f"{name}.B"] = rng.normal(0, 0.05, cout).astype(np.float32)
        return h.make_node(
            "Conv",
            [x, f"{name}.W", f"{name}.B"],
            [y],
            pads=[1, 1, 1, 1],
            strides=[stride, stride],
            name=name,
        )

    inits["bn.scale"] = rng.uniform(0.5, 1.5, ch).astype(np.float32)
    inits["bn.bias"] = rng.normal(0, 0.1, ch).astype(np.float32)
    inits["bn.mean"] = rng.normal(0, 0.1, ch).astype(np.float32)
    inits["bn.var"] = rng.uniform(0.5, 1.5, ch).astype(np.float32)
    inits["fc.W"] = rng.normal(0, 0.1, (10, ch)).astype(np.float32)
    inits["fc.B"] = np.zeros(10, np.float32)
    nodes = [
        conv("stem", 3, ch, "x", "s0", stride=2),
        h.make_node(
            "BatchNormalization",
            ["s0", "bn.scale", "bn.bias", "bn.mean", "bn.var"],
            ["s1"],
            name="bn",
        ),
        h.make_node("Relu", ["s1"], ["a0"], name="relu0"),
    ]
    prev = "a0"
    for b in (1, 2):
        nodes += [
            conv(f"block{b}.conv1", ch, ch, prev, f"b{b}c1"),
            h.make_node("Relu", [f"b{b}c1"], [f"b{b}r1"], name=f"block{b}.relu1"),
            conv(f"block{b}.conv2", ch, ch, f"b{b}r1", f"b{b}c2"),
            h.make_node("Add", [f"b{b}c2", prev], [f"b{b}s"], name=f"block{b}.add"),
            h.make_node("Relu", [f"b{b}s"], [f"b{b}out"], name=f"block{b}.relu2"),
        ]
        prev = f"b{b}out"
    nodes += [
        h.make_node("GlobalAveragePool", [prev], ["gap"], name="gap"),
        h.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        h.make_node("Gemm", ["flat", "fc.W", "fc.B"], ["y"], transB=1, name="fc"),
    ]
    graph = h.make_graph(
        nodes,
        "residual_cnn",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, size, size])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        [nh.from_array(v, k) for k, v in inits.items()],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def ort_qoperator(model_path: Path, calib: np.ndarray, out: Path, per_channel: bool) -> None:
    """onnxruntime.quantization.quantize_static, QOperator format, its defaults otherwise."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    name = onnx.load(str(model_path)).graph.input[0].name

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter([{name: calib[i : i + 1]} for i in range(len(calib))])

        def get_next(self):  # noqa: ANN201
            return next(self.items, None)

    quantize_static(
        str(model_path),
        str(out),
        Reader(),
        quant_format=QuantFormat.QOperator,
        per_channel=per_channel,
    )


def session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def interleaved(
    runs: int, calls: dict[str, Callable[[], object]], warmup: int, seconds: float = 0.0
) -> dict[str, list[float]]:
    """Seconds of each call: ``warmup`` calls each, then rounds of one call each, at least
    ``runs`` of them and until ``seconds`` have passed.

    Each round runs them in an order of its own (shuffled, seeded by the round): in a fixed
    or rotated order one variant always follows fp32's, and it ran a few % slower on MTCNN,
    a bias no number of rounds removes.
    """
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {k: [] for k in calls}
    start, i = time.perf_counter(), 0
    while i < runs or time.perf_counter() - start < seconds:
        for k in random.Random(i).sample(list(calls), len(calls)):
            t = time.perf_counter()
            calls[k]()
            times[k].append(time.perf_counter() - t)
        i += 1
    return times


def measure(paths: dict[str, Path], sample: np.ndarray, runs: int) -> dict[str, float]:
    calls = {}
    for k, p in paths.items():
        s = session(p)
        feed = {s.get_inputs()[0].name: sample}
        calls[k] = partial(s.run, None, feed)
    return {k: float(np.median(v) * 1e3) for k, v in interleaved(runs, calls, 30).items()}


def bench(name: str, model_path: Path, calib: np.ndarray, runs: int, tmp: Path) -> None:
    input_name = onnx.load(str(model_path)).graph.input[0].name
    paths = {"fp32": model_path}
    onnxq_path = tmp / f"{name}.onnxq.onnx"
    t = time.perf_counter()
    onnxq.quantize(str(model_path), {input_name: calib}, output=str(onnxq_path), progress=False)
    t_onnxq = time.perf_counter() - t
    paths["onnxq"] = onnxq_path
    ort_times = {}
    for pc in (False, True):
        key = f"ort{'-pc' if pc else ''}"
        out = tmp / f"{name}.{key}.onnx"
        t = time.perf_counter()
        ort_qoperator(model_path, calib, out, pc)
        ort_times[key] = time.perf_counter() - t
        paths[key] = out
    lat = measure(paths, calib[:1], runs)
    print(f"\n{name}  (input {list(calib.shape[1:])}, 1 thread, batch 1, median of {runs} runs)")
    print(f"  {'variant':<8} {'latency ms':>11} {'vs fp32':>8} {'vs ort':>7} {'size KiB':>9}")
    for k, ms in lat.items():
        size = paths[k].stat().st_size / 1024
        print(f"  {k:<8} {ms:>11.3f} {ms / lat['fp32']:>8.2f} {ms / lat['ort']:>7.2f} {size:>9.1f}")
    print(
        f"  quantization wall time: onnxq {t_onnxq:.2f}s, ort {ort_times['ort']:.2f}s, "
        f"ort per-channel {ort_times['ort-pc']:.2f}s"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--model", type=Path, default=None, help="benchmark this model only")
    ap.add_argument("--calib", type=int, default=32, help="calibration samples")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.model is not None:
            m = onnx.load(str(args.model))
            dims = [d.dim_value or 1 for d in m.graph.input[0].type.tensor_type.shape.dim][1:]
            bench(
                args.model.stem,
                args.model,
                rng.normal(0, 1, (args.calib, *dims)).astype(np.float32),
                args.runs,
                tmp,
            )
            return 0
        cnn = tmp / "residual_cnn.onnx"
        onnx.save(residual_cnn(args.size, args.channels), str(cnn))
        calib = rng.uniform(0, 1, (args.calib, 3, args.size, args.size)).astype(np.float32)
        bench(f"residual_cnn_{args.size}x{args.channels}", cnn, calib, args.runs, tmp)
        from models import datasets

        xtr, _, _, _ = datasets.digits()
        bench(
            "digits_cnn",
            ROOT / "onnxq" / "demo" / "digits_cnn.onnx",
            xtr[: args.calib],
            args.runs,
            tmp,
        )
        bench(
            "digits_mlp",
            ROOT / "models" / "digits_mlp.onnx",
            datasets.nhwc(xtr[: args.calib]),
            args.runs,
            tmp,
        )
        if datasets.fashion_available():
            fx = datasets.fashion()[0][: args.calib]
            bench("fashion_cnn", ROOT / "models" / "fashion_cnn.onnx", fx, args.runs, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
