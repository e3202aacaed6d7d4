"""Train the zoo's small models with PyTorch and write them as ONNX built with onnx.helper.

    pip install torch==2.13.0 scikit-learn onnx
    python -m models.train all          # or digits-mlp | digits-cnn | fashion-cnn |
                                        #    digits-gru-loop | fashion-lstm-scan

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


# -------------------------------------------------------------------------------------------
# recurrent classifiers reading an image row by row, their time inside a Loop or a Scan:
# the forms converters give recurrent layers they do not map to ONNX's GRU/LSTM ops (tf2onnx
# turns a while-loop into a Loop that gathers step i; a scan over a sequence becomes a Scan)


class RowRNN(nn.Module):
    """A GRU or LSTM over the 28 rows of a 28×28 image, then a linear layer on its last state."""

    def __init__(self, cell: str, hidden: int) -> None:
        super().__init__()
        self.rnn = (nn.GRU if cell == "gru" else nn.LSTM)(28, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x[:, 0])
        return self.fc(out[:, -1])


def _rnn_weights(net: RowRNN, gates: int) -> dict[str, np.ndarray]:
    """The input and hidden weights as (in, gates·H) MatMul operands, the two biases summed
    where the cell allows it (an LSTM's; a GRU's candidate gate keeps its hidden bias apart)."""
    r = net.rnn
    wi, wh = arr(r.weight_ih_l0).T.copy(), arr(r.weight_hh_l0).T.copy()
    bi, bh = arr(r.bias_ih_l0), arr(r.bias_hh_l0)
    out = {
        "rnn.Wi": wi,
        "rnn.Wh": wh,
        "fc.W": arr(net.fc.weight).T.copy(),
        "fc.B": arr(net.fc.bias),
    }
    if gates == 4:
        out["rnn.B"] = bi + bh
    else:
        out["rnn.Bi"], out["rnn.Bh"] = bi, bh
    return out


def _zeros_state(hidden: int, name: str) -> list[onnx.NodeProto]:
    """Nodes making a (N, hidden) zero state from the image's batch size."""
    return [
        h.make_node("Shape", ["image"], [f"{name}_shape"], name=f"{name}/shape"),
        h.make_node("Gather", [f"{name}_shape", "first"], [f"{name}_n"], axis=0, name=f"{name}/n"),
        h.make_node(
            "Concat", [f"{name}_n", "hidden"], [f"{name}_dims"], axis=0, name=f"{name}/dims"
        ),
        h.make_node(
            "ConstantOfShape",
            [f"{name}_dims"],
            [name],
            value=nh.from_array(np.zeros(1, np.float32)),
            name=f"{name}/zeros",
        ),
    ]


def _head(state: str) -> list[onnx.NodeProto]:
    return [
        h.make_node("MatMul", [state, "fc.W"], ["fc_mm"], name="fc/MatMul"),
        h.make_node("Add", ["fc_mm", "fc.B"], ["logits"], name="fc/Add"),
    ]


def _save_rnn(name: str, nodes: list, inits: dict, net: RowRNN, sample: np.ndarray) -> None:
    """A row RNN's graph: image (N, 1, 28, 28) in, logits (N, 10) out, checked against ``net``."""
    f = TensorProto.FLOAT
    save(
        nodes,
        inits,
        h.make_tensor_value_info("image", f, ["N", 1, 28, 28]),
        h.make_tensor_value_info("logits", f, ["N", 10]),
        HERE / f"{name}.onnx",
        name,
        (net, sample),
    )


def _train_rnn(cell: str, data: str, hidden: int, epochs: int) -> tuple[RowRNN, np.ndarray]:
    xtr, ytr, xte, yte = datasets.digits() if data == "digits" else datasets.fashion()
    torch.manual_seed(0)
    net = RowRNN(cell, hidden)
    fit(net, xtr, ytr, epochs=epochs, lr=2e-3, batch=64 if data == "digits" else 128)
    print(f"  {data} {cell.upper()} test accuracy {accuracy(net, xte, yte):.4f}")
    return net, xte[:16]


def digits_gru_loop() -> None:
    """GRU(128) on digits as a Loop: step i gathers row i of the image (a tf2onnx-style loop)."""
    hidden = 128
    net, sample = _train_rnn("gru", "digits", hidden, epochs=30)
    inits = _rnn_weights(net, 3)
    inits["hidden"] = np.array([hidden], np.int64)
    inits["first"] = np.array([0], np.int64)
    inits["steps"] = np.array(28, np.int64)
    f = TensorProto.FLOAT
    body_nodes = [
        h.make_node("Gather", ["rows", "i"], ["x_t"], axis=1, name="gru/row"),
        h.make_node("MatMul", ["x_t", "rnn.Wi"], ["gx0"], name="gru/input_MatMul"),
        h.make_node("Add", ["gx0", "rnn.Bi"], ["gx"], name="gru/input_bias"),
        h.make_node("MatMul", ["h_in", "rnn.Wh"], ["gh0"], name="gru/hidden_MatMul"),
        h.make_node("Add", ["gh0", "rnn.Bh"], ["gh"], name="gru/hidden_bias"),
        h.make_node("Split", ["gx", "thirds"], ["xr", "xz", "xn"], axis=1, name="gru/split_x"),
        h.make_node("Split", ["gh", "thirds"], ["hr", "hz", "hn"], axis=1, name="gru/split_h"),
        h.make_node("Add", ["xr", "hr"], ["r0"], name="gru/r_add"),
        h.make_node("Sigmoid", ["r0"], ["r"], name="gru/r"),
        h.make_node("Add", ["xz", "hz"], ["z0"], name="gru/z_add"),
        h.make_node("Sigmoid", ["z0"], ["z"], name="gru/z"),
        h.make_node("Mul", ["r", "hn"], ["rn"], name="gru/reset"),
        h.make_node("Add", ["xn", "rn"], ["n0"], name="gru/n_add"),
        h.make_node("Tanh", ["n0"], ["n"], name="gru/n"),
        h.make_node("Sub", ["h_in", "n"], ["d"], name="gru/delta"),
        h.make_node("Mul", ["z", "d"], ["zd"], name="gru/keep"),
        h.make_node("Add", ["n", "zd"], ["h_out"], name="gru/h"),
        h.make_node("Identity", ["cond_in"], ["cond_out"], name="gru/cond"),
    ]
    inits["thirds"] = np.array([hidden] * 3, np.int64)
    body = h.make_graph(
        body_nodes,
        "gru_step",
        [
            h.make_tensor_value_info("i", TensorProto.INT64, []),
            h.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            h.make_tensor_value_info("h_in", f, ["N", hidden]),
        ],
        [
            h.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            h.make_tensor_value_info("h_out", f, ["N", hidden]),
        ],
    )
    nodes = [
        h.make_node("Squeeze", ["image", "channel"], ["rows"], name="rows"),
        *_zeros_state(hidden, "h0"),
        h.make_node("Loop", ["steps", "", "h0"], ["h_last"], body=body, name="gru/loop"),
        *_head("h_last"),
    ]
    inits["channel"] = np.array([1], np.int64)
    _save_rnn("digits_gru_loop", nodes, inits, net, sample)


def fashion_lstm_scan() -> None:
    """LSTM(128) on Fashion-MNIST as a Scan over the image's rows (axis 1)."""
    hidden = 128
    net, sample = _train_rnn("lstm", "fashion", hidden, epochs=4)
    inits = _rnn_weights(net, 4)
    inits["hidden"] = np.array([hidden], np.int64)
    inits["first"] = np.array([0], np.int64)
    inits["channel"] = np.array([1], np.int64)
    inits["quarters"] = np.array([hidden] * 4, np.int64)
    f = TensorProto.FLOAT
    body_nodes = [
        h.make_node("MatMul", ["x_t", "rnn.Wi"], ["gx"], name="lstm/input_MatMul"),
        h.make_node("MatMul", ["h_in", "rnn.Wh"], ["gh"], name="lstm/hidden_MatMul"),
        h.make_node("Add", ["gx", "gh"], ["g0"], name="lstm/gates_add"),
        h.make_node("Add", ["g0", "rnn.B"], ["g"], name="lstm/gates_bias"),
        h.make_node(
            "Split", ["g", "quarters"], ["gi", "gf", "gg", "go"], axis=1, name="lstm/split"
        ),
        h.make_node("Sigmoid", ["gi"], ["ig"], name="lstm/input_gate"),
        h.make_node("Sigmoid", ["gf"], ["fg"], name="lstm/forget_gate"),
        h.make_node("Tanh", ["gg"], ["cand"], name="lstm/candidate"),
        h.make_node("Sigmoid", ["go"], ["og"], name="lstm/output_gate"),
        h.make_node("Mul", ["fg", "c_in"], ["kept"], name="lstm/forget"),
        h.make_node("Mul", ["ig", "cand"], ["new"], name="lstm/write"),
        h.make_node("Add", ["kept", "new"], ["c_out"], name="lstm/c"),
        h.make_node("Tanh", ["c_out"], ["ct"], name="lstm/c_tanh"),
        h.make_node("Mul", ["og", "ct"], ["h_out"], name="lstm/h"),
    ]
    body = h.make_graph(
        body_nodes,
        "lstm_step",
        [
            h.make_tensor_value_info("h_in", f, ["N", hidden]),
            h.make_tensor_value_info("c_in", f, ["N", hidden]),
            h.make_tensor_value_info("x_t", f, ["N", 28]),
        ],
        [
            h.make_tensor_value_info("h_out", f, ["N", hidden]),
            h.make_tensor_value_info("c_out", f, ["N", hidden]),
        ],
    )
    nodes = [
        h.make_node("Squeeze", ["image", "channel"], ["rows"], name="rows"),
        *_zeros_state(hidden, "h0"),
        *_zeros_state(hidden, "c0"),
        h.make_node(
            "Scan",
            ["h0", "c0", "rows"],
            ["h_last", "c_last"],
            body=body,
            num_scan_inputs=1,
            scan_input_axes=[1],
            name="lstm/scan",
        ),
        *_head("h_last"),
    ]
    _save_rnn("fashion_lstm_scan", nodes, inits, net, sample)


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
        "digits-gru-loop": digits_gru_loop,
        "fashion-lstm-scan": fashion_lstm_scan,
        "demo": demo_data,
    }
    for name, job in jobs.items():
        if which in (name, "all"):
            print(name, flush=True)
            job()
