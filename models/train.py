"""Train the zoo's small models with PyTorch and write them as ONNX built with onnx.helper.

    pip install torch==2.13.0 scikit-learn onnx
    python -m models.train all          # or digits-mlp | digits-cnn | fashion-cnn

The graphs are written node by node (no exporter), so the files are reproducible from the
trained weights and use opset 13. Seeds are fixed; results vary only with the torch build.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh
from torch import nn

from models import datasets

HERE = Path(__file__).resolve().parent
#: the digits CNN is the demo model: its one copy ships inside the package
DEMO = HERE.parent / "onnxq" / "demo"
OPSET = 13


def fit(
    model: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int, lr: float, batch: int = 64
) -> None:
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    gen = torch.Generator().manual_seed(0)
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(xt), generator=gen)
        total = 0.0
        for i in range(0, len(xt), batch):
            idx = perm[i : i + batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
            total += float(loss) * len(idx)
        print(f"  epoch {epoch + 1}/{epochs}: loss {total / len(xt):.4f}", flush=True)
    model.eval()


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(1).numpy()
    return float((pred == y).mean())


def arr(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().astype(np.float32)


def save(nodes, inits, inp, out, path: Path, name: str, check=None) -> None:
    graph = h.make_graph(nodes, name, [inp], [out], [nh.from_array(v, k) for k, v in inits.items()])
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", OPSET)], producer_name="onnxq-models"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    if check is not None:  # (torch module, sample input): the ONNX graph must compute the same
        import onnxruntime as ort

        net, x = check
        got = ort.InferenceSession(model.SerializeToString()).run(None, {inp.name: x})[0]
        with torch.no_grad():
            want = net(torch.from_numpy(x)).numpy()
        if name == "digits_mlp":
            want = torch.softmax(torch.from_numpy(want), -1).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    onnx.save(model, str(path))
    print(f"  wrote {path} ({path.stat().st_size // 1024} KiB)")


# -------------------------------------------------------------------------------------------
# digits MLP, the MNIST graph of the TVM RFC (E12): flatten → dense → relu → dense → softmax


def digits_mlp() -> None:
    xtr, ytr, xte, yte = datasets.digits()
    xtr, xte = datasets.nhwc(xtr), datasets.nhwc(xte)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    fit(net, xtr, ytr, epochs=30, lr=1e-3)
    print(f"  digits MLP test accuracy {accuracy(net, xte, yte):.4f}")
    l1, l2 = net[1], net[3]
    inits = {
        "dense/kernel:0": arr(l1.weight).T.copy(),
        "dense/bias:0": arr(l1.bias),
        "dense_1/kernel:0": arr(l2.weight).T.copy(),
        "dense_1/bias:0": arr(l2.bias),
    }
    nodes = [
        h.make_node("Flatten", ["flatten_input"], ["flat"], axis=1, name="flatten"),
        h.make_node("MatMul", ["flat", "dense/kernel:0"], ["d0"], name="dense/MatMul"),
        h.make_node("Add", ["d0", "dense/bias:0"], ["d0b"], name="dense/BiasAdd"),
        h.make_node("Relu", ["d0b"], ["r0"], name="dense/Relu"),
        h.make_node("MatMul", ["r0", "dense_1/kernel:0"], ["d1"], name="dense_1/MatMul"),
        h.make_node("Add", ["d1", "dense_1/bias:0"], ["logits"], name="dense_1/BiasAdd"),
        h.make_node("Softmax", ["logits"], ["probabilities"], axis=-1, name="softmax"),
    ]
    save(
        nodes,
        inits,
        h.make_tensor_value_info("flatten_input", TensorProto.FLOAT, ["N", 28, 28, 1]),
        h.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 10]),
        HERE / "digits_mlp.onnx",
        "digits_mlp",
        (net, xte[:16]),
    )


# -------------------------------------------------------------------------------------------
# digits CNN (the demo model): conv → relu → conv → relu → pool → conv → relu → pool → Gemm


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.c3 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.c1(x))
        x = nn.functional.max_pool2d(torch.relu(self.c2(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.c3(x)), 2)
        return self.fc(x.flatten(1))


def digits_cnn(path: Path | None = None) -> None:
    xtr, ytr, xte, yte = datasets.digits()
    torch.manual_seed(0)
    net = DigitsCNN()
    fit(net, xtr, ytr, epochs=20, lr=2e-3)
    print(f"  digits CNN test accuracy {accuracy(net, xte, yte):.4f}")
    inits = {
        f"conv{i}.{k}": arr(getattr(getattr(net, f"c{i}"), a))
        for i in range(1, 4)
        for k, a in (("W", "weight"), ("B", "bias"))
    }
    inits.update({"fc.W": arr(net.fc.weight), "fc.B": arr(net.fc.bias)})
    pads = [1, 1, 1, 1]
    nodes = [
        h.make_node("Conv", ["input", "conv1.W", "conv1.B"], ["c1"], pads=pads, name="conv1"),
        h.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        h.make_node("Conv", ["r1", "conv2.W", "conv2.B"], ["c2"], pads=pads, name="conv2"),
        h.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        h.make_node("MaxPool", ["r2"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
        h.make_node("Conv", ["p1", "conv3.W", "conv3.B"], ["c3"], pads=pads, name="conv3"),
        h.make_node("Relu", ["c3"], ["r3"], name="relu3"),
        h.make_node("MaxPool", ["r3"], ["p2"], kernel_shape=[2, 2], strides=[2, 2], name="pool2"),
        h.make_node("Flatten", ["p2"], ["flat"], axis=1, name="flatten"),
        h.make_node("Gemm", ["flat", "fc.W", "fc.B"], ["logits"], transB=1, name="fc"),
    ]
    save(
        nodes,
        inits,
        h.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 28, 28]),
        h.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10]),
        path or DEMO / "digits_cnn.onnx",
        "digits_cnn",
        (net, xte[:16]),
    )


# -------------------------------------------------------------------------------------------
# Fashion-MNIST residual CNN: conv1 → conv2 → conv3 + skip → relu → pool → conv4 → pool → dense


class FashionCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.c3 = nn.Conv2d(16, 16, 3, padding=1)
        self.c4 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r1 = torch.relu(self.c1(x))
        r2 = torch.relu(self.c2(r1))
        a = torch.relu(self.c3(r2) + r1)
        p1 = nn.functional.max_pool2d(a, 2)
        p2 = nn.functional.max_pool2d(torch.relu(self.c4(p1)), 2)
        return self.fc(p2.flatten(1))


def fashion_cnn() -> None:
    xtr, ytr, xte, yte = datasets.fashion()
    torch.manual_seed(0)
    net = FashionCNN()
    fit(net, xtr, ytr, epochs=3, lr=2e-3, batch=128)
    print(f"  fashion CNN test accuracy {accuracy(net, xte, yte):.4f}")
    inits = {
        f"conv{i}.{k}": arr(getattr(getattr(net, f"c{i}"), a))
        for i in range(1, 5)
        for k, a in (("W", "weight"), ("B", "bias"))
    }
    inits["fc.W"] = arr(net.fc.weight).T.copy()
    inits["fc.B"] = arr(net.fc.bias)
    pads = [1, 1, 1, 1]

    def conv(i: int, x: str, y: str) -> onnx.NodeProto:
        return h.make_node("Conv", [x, f"conv{i}.W", f"conv{i}.B"], [y], pads=pads, name=f"conv{i}")

    nodes = [
        conv(1, "image", "c1"),
        h.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        conv(2, "r1", "c2"),
        h.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        conv(3, "r2", "c3"),
        h.make_node("Add", ["c3", "r1"], ["s"], name="residual"),
        h.make_node("Relu", ["s"], ["a"], name="relu3"),
        h.make_node("MaxPool", ["a"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
        conv(4, "p1", "c4"),
        h.make_node("Relu", ["c4"], ["r4"], name="relu4"),
        h.make_node("MaxPool", ["r4"], ["p2"], kernel_shape=[2, 2], strides=[2, 2], name="pool2"),
        h.make_node("Flatten", ["p2"], ["flat"], axis=1, name="flatten"),
        h.make_node("MatMul", ["flat", "fc.W"], ["mm"], name="fc/MatMul"),
        h.make_node("Add", ["mm", "fc.B"], ["logits"], name="fc/Add"),
    ]
    save(
        nodes,
        inits,
        h.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 28, 28]),
        h.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10]),
        HERE / "fashion_cnn.onnx",
        "fashion_cnn",
        (net, xte[:16]),
    )


def demo_data() -> None:
    """The demo's bundled data: digits calibration (200 train) and test (360) as uint8 0..16."""
    xtr, _, xte, yte = datasets.digits()
    out = HERE.parent / "onnxq" / "demo" / "digits.npz"
    np.savez_compressed(
        out,
        calib=np.round(xtr[:200] * 16).astype(np.uint8),
        test=np.round(xte * 16).astype(np.uint8),
        labels=yte.astype(np.uint8),
    )
    print(f"  wrote {out}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    jobs = {
        "digits-mlp": digits_mlp,
        "digits-cnn": digits_cnn,
        "fashion-cnn": fashion_cnn,
        "demo": demo_data,
    }
    for name, job in jobs.items():
        if which in (name, "all"):
            print(name, flush=True)
            job()
