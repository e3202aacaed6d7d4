"""A transformer-like model whose weights pass 2 GB, built here, and onnxq run on it.

    python -m benchmarks.big_model build DIR [--hidden 2048] [--blocks 17]   # 2.28 GB of weights
    python -m benchmarks.big_model run DIR [--methods minmax mse ...] [--samples 4]

``build`` writes ``DIR/big.onnx`` with its weights as external data in ``DIR/big.onnx.data``,
one tensor at a time (the builder never holds the weights at once). Each block is a
transformer MLP: ``x + W2·relu(W1·x + b1) + b2`` then LayerNormalization, ``W1`` hidden × 4·hidden.

``run`` quantizes it with each method in its own process (``onnxq quantize``, calibration data
of seeded normal tokens of shape [1, 8, hidden]) and prints, per method, the wall time, the
peak RSS (the child's ``ru_maxrss``) as a multiple of the weight bytes, and whether the output
(saved with external data) loads in onnxruntime and follows the float model (cosine of the
outputs on new tokens).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 17


def build(folder: Path, hidden: int, blocks: int, seed: int = 0) -> Path:
    """Write the model and its external data; returns the model path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "big.onnx"
    data_name = path.name + ".data"
    rng = np.random.default_rng(seed)
    inits: list[TensorProto] = []
    nodes = []
    offset = 0
    with open(folder / data_name, "wb") as data:

        def weight(name: str, shape: tuple[int, ...], scale: float) -> str:
            nonlocal offset
            arr = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
            raw = arr.tobytes()
            data.write(raw)
            t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", offset), ("length", len(raw))):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            offset += len(raw)
            inits.append(t)
            return name

        x = "x"
        for b in range(blocks):
            w1 = weight(f"b{b}.w1", (hidden, 4 * hidden), hidden**-0.5)
            b1 = weight(f"b{b}.b1", (4 * hidden,), 0.02)
            w2 = weight(f"b{b}.w2", (4 * hidden, hidden), (4 * hidden) ** -0.5)
            b2 = weight(f"b{b}.b2", (hidden,), 0.02)
            gamma = weight(f"b{b}.gamma", (hidden,), 0.1)
            beta = weight(f"b{b}.beta", (hidden,), 0.02)
            p = f"b{b}."
            nodes += [
                helper.make_node("MatMul", [x, w1], [p + "h1"], name=p + "fc1"),
                helper.make_node("Add", [p + "h1", b1], [p + "h1b"], name=p + "fc1_bias"),
                helper.make_node("Relu", [p + "h1b"], [p + "act"], name=p + "relu"),
                helper.make_node("MatMul", [p + "act", w2], [p + "h2"], name=p + "fc2"),
                helper.make_node("Add", [p + "h2", b2], [p + "h2b"], name=p + "fc2_bias"),
                helper.make_node("Add", [x, p + "h2b"], [p + "res"], name=p + "residual"),
                helper.make_node(
                    "LayerNormalization",
                    [p + "res", gamma, beta],
                    [p + "out"],
                    name=p + "norm",
                    axis=-1,
                ),
            ]
            x = p + "out"
    graph = helper.make_graph(
        nodes,
        "big_transformer_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", hidden])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", "tokens", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.save(model, str(path))  # the graph only: the weights are already in the data file
    onnx.checker.check_model(str(path))
    return path


def weight_bytes(path: Path) -> int:
    """Bytes of the model's external data."""
    return (path.parent / (path.name + ".data")).stat().st_size


def _tokens(hidden: int, samples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((samples, 8, hidden)).astype(np.float32)


def run(folder: Path, methods: list[str], samples: int) -> list[dict]:
    """Quantize with each method in a child process; the figures of each run."""
    path = folder / "big.onnx"
    hidden = onnx.load(str(path), load_external_data=False).graph.input[0]
    hidden_size = hidden.type.tensor_type.shape.dim[2].dim_value
    data = folder / "calib.npz"
    np.savez(data, x=_tokens(hidden_size, samples, 1))
    rows = []
    for method in methods:
        out = folder / f"big.{method}.int8.onnx"
        start = time.perf_counter()
        rss = folder / f"{method}.rss"
        cmd = [
            sys.executable,
            __file__,
            "child",
            str(rss),
            "quantize",
            str(path),
            "--data",
            str(data),
            "--method",
            method,
            "--batch-size",
            "1",
            "-o",
            str(out),
            "--no-latency-check",
            "--quiet",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        peak = int(rss.read_text()) if rss.exists() else 0
        row = {
            "method": method,
            "rc": done.returncode,
            "seconds": round(seconds, 1),
            "peak_rss_gib": round(peak / 2**30, 2),
            "peak_over_weights": round(peak / weight_bytes(path), 2),
        }
        if done.returncode != 0:
            row["error"] = done.stderr.strip().splitlines()[-1:]
        else:
            row["cosine"] = round(_agreement(path, out, hidden_size), 4)
            row["output_gib"] = round(
                sum(f.stat().st_size for f in folder.glob(out.name + "*")) / 2**30, 2
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _agreement(float_path: Path, int8_path: Path, hidden: int) -> float:
    """Mean cosine of int8 and float outputs on new tokens (both loaded from their files)."""
    import onnxruntime as ort

    x = _tokens(hidden, 2, 7)
    outs = []
    for p in (float_path, int8_path):
        sess = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
        outs.append(sess.run(None, {"x": x})[0].reshape(-1, hidden))
        del sess
    f, q = outs
    cos = (f * q).sum(1) / (np.linalg.norm(f, axis=1) * np.linalg.norm(q, axis=1) + 1e-12)
    return float(cos.mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("folder", type=Path)
    b.add_argument("--hidden", type=int, default=2048)
    b.add_argument("--blocks", type=int, default=17)
    r = sub.add_parser("run")
    r.add_argument("folder", type=Path)
    r.add_argument(
        "--methods", nargs="+", default=["minmax", "average-max", "percentile", "entropy", "mse"]
    )
    r.add_argument("--samples", type=int, default=4)
    c = sub.add_parser("child")  # one onnxq CLI call that writes its own peak RSS
    c.add_argument("rss", type=Path)
    c.add_argument("argv", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.command == "child":
        from onnxq.cli import main as cli

        try:
            return cli(args.argv)
        finally:
            args.rss.write_text(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    if args.command == "build":
        path = build(args.folder, args.hidden, args.blocks)
        print(f"{path}: {weight_bytes(path) / 2**30:.2f} GiB of weights")
        return 0
    rows = run(args.folder, args.methods, args.samples)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
