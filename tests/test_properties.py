"""Property-based graphs: random DAGs of the ops onnxq quantizes, against onnxruntime's quantizer.

hypothesis draws a graph (convolutions of every kind, dense layers of rank 2 to 4, elementwise
ops with constants and broadcasting, activations, pools, Concat, Reshape/Flatten/Transpose,
Resize, Softmax, BatchNormalization; opsets 13 to 21; dead channels, huge and tiny weights).
Each graph is quantized with the defaults, ``--format qdq`` and ``--target tensorrt`` and must
pass ``onnx.checker`` (full check), run in onnxruntime, give the same bytes on a rerun and stay
within :data:`MARGIN_DB` of onnxruntime's own quantizer (``quantize_static`` with its defaults)
on held-out inputs, or above :data:`ENOUGH_DB` where both are near lossless.

Failures print the drawn graph (``note``) and hypothesis' reproduction blob; runs are
derandomized, so CI and a laptop draw the same graphs. Every failure found is kept below as a
named regression test.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import numpy as np
import onnx
from helpers import examples, run
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxq
from onnxq.io.graph import serialize
from onnxq.io.hostcheck import u8s8_saturates

#: onnxq's default may trail onnxruntime's quantizer by at most this much (dB) ... (the widest
#: gaps found: the ill-conditioned Conv -> Sigmoid graphs below, 3-4 dB on 400 samples)
MARGIN_DB = 6.0
#: ... unless both exceed this SQNR (dB), where a few dB are noise of no consequence
ENOUGH_DB = 35.0
#: every quantized output must reach this (dB) whatever the peer does
FLOOR_DB = 12.0

SETTINGS = {"default": {}, "qdq": {"format": "qdq"}, "tensorrt": {"target": "tensorrt"}}
EXAMPLES = int(os.environ.get("ONNXQ_PROPERTY_EXAMPLES", examples(6, 30)))


# --------------------------------------------------------------------------------------------
# the graph builder


@dataclass
class Builder:
    opset: int
    seed: int
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    log: list = field(default_factory=list)

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)
        self.count = 0

    def name(self, kind: str) -> str:
        self.count += 1
        return f"{kind}{self.count}"

    def const(self, value: np.ndarray, kind: str = "c") -> str:
        n = self.name(kind)
        self.inits.append(nh.from_array(np.asarray(value), n))
        return n

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(h.make_node(op, inputs, [out], name=out + "_node", **attrs))
        self.log.append(f"{op}{attrs or ''}")
        return out

    def weights(self, shape, magnitude: float, dead: int) -> np.ndarray:
        w = (self.rng.standard_normal(shape) * magnitude).astype(np.float32)
        w[:dead] = 0.0  # dead output channels (pruned, or BN-folded with gamma 0)
        return w


def _conv(b: Builder, x: str, c: int, hw: int, d) -> tuple[str, int, int]:
    k = d(st.sampled_from([1, 3, 5]))
    dil = d(st.sampled_from([1, 2])) if hw >= 5 else 1
    stride = d(st.sampled_from([1, 2]))
    reach = dil * (k - 1) + 1
    pad = d(st.integers(0, (reach - 1) // 2 + 1)) if k > 1 else 0
    if hw + 2 * pad < reach:
        pad = (reach - hw + 1) // 2
    kind = d(st.sampled_from(["full", "depthwise", "grouped"]))
    if kind == "depthwise":
        group, out = c, c * d(st.sampled_from([1, 2]))
    elif kind == "grouped" and c % 2 == 0:
        group, out = 2, 2 * d(st.integers(1, 4))
    else:
        group, out = 1, d(st.integers(1, 8))
    magnitude = d(st.sampled_from([1e-3, 0.3, 1.0, 30.0]))
    w = b.weights((out, c // group, k, k), magnitude, d(st.integers(0, min(2, out - 1))))
    inputs = [x, b.const(w, "w")]
    if d(st.booleans()):
        inputs.append(b.const(b.rng.standard_normal(out).astype(np.float32), "b"))
    y = b.node(
        "Conv",
        inputs,
        kernel_shape=[k, k],
        strides=[stride, stride],
        pads=[pad] * 4,
        dilations=[dil, dil],
        group=group,
    )
    new_hw = (hw + 2 * pad - reach) // stride + 1
    return y, out, new_hw


def _activation(b: Builder, x: str, d) -> str:
    kind = d(st.sampled_from(["Relu", "Clip", "Sigmoid", "LeakyRelu", "none"]))
    if kind == "Clip":
        return b.node("Clip", [x, b.const(np.float32(0)), b.const(np.float32(6))])
    if kind == "LeakyRelu":
        return b.node("LeakyRelu", [x], alpha=0.1)
    if kind == "none":
        return x
    return b.node(kind, [x])


def _batchnorm(b: Builder, x: str, c: int) -> str:
    gamma = b.rng.uniform(0.5, 2, c).astype(np.float32)
    gamma[0] = 1e-6  # a nearly dead channel with a bias (the int32 accumulator case)
    args = [
        gamma,
        b.rng.standard_normal(c).astype(np.float32),
        (b.rng.standard_normal(c) * 0.1).astype(np.float32),
        b.rng.uniform(0.5, 2, c).astype(np.float32),
    ]
    return b.node("BatchNormalization", [x, *[b.const(a) for a in args]])


@st.composite
def graphs(draw) -> tuple[onnx.ModelProto, tuple[int, ...], str]:
    """A random model, its input shape and a description of what was drawn."""

    def d(strategy):
        return draw(strategy)

    opset = d(st.sampled_from([13, 15, 17, 19, 21]))
    b = Builder(opset, d(st.integers(0, 2**16)))
    c, hw = d(st.integers(1, 6)), d(st.integers(4, 12))
    shape = (2, c, hw, hw)
    x = "x"
    for _ in range(d(st.integers(1, 5))):
        step = d(st.sampled_from(["conv", "conv", "bn", "pool", "add", "mul", "concat", "resize"]))
        if step == "conv":
            x, c, hw = _conv(b, x, c, hw, d)
            x = _activation(b, x, d)
        elif step == "bn":
            x = _batchnorm(b, x, c)
        elif step == "pool" and hw >= 2:
            op = d(st.sampled_from(["MaxPool", "AveragePool"]))
            x = b.node(op, [x], kernel_shape=[2, 2], strides=[2, 2])
            hw //= 2
        elif step == "add" or step == "mul":
            op = "Add" if step == "add" else "Mul"
            if d(st.booleans()):  # a broadcast constant, per channel or scalar
                cshape = d(st.sampled_from([(c, 1, 1), (1,), (1, c, 1, 1)]))
                value = b.rng.uniform(0.5, 2, cshape).astype(np.float32)
                x = b.node(op, [x, b.const(value)])
            else:  # two branches of the DAG joined
                other = b.node("Relu", [x])
                x = b.node(op, [x, other])
        elif step == "concat":
            side, side_c, side_hw = _conv_1x1(b, x, c, hw, d)
            x = b.node("Concat", [x, side], axis=1)
            c += side_c
        elif step == "resize" and hw <= 8:
            scales = b.const(np.array([1, 1, 2, 2], np.float32))
            x = b.node("Resize", [x, "", scales], mode="nearest")
            hw *= 2
    tail = d(st.sampled_from(["dense", "gap", "conv_out", "transpose"]))
    if tail == "dense":
        x, feats = _dense_tail(b, x, c * hw * hw, d)
    elif tail == "gap":
        x = b.node("GlobalAveragePool", [x])
        x = b.node("Flatten", [x], axis=1)
        x, feats = _dense_tail(b, x, c, d)
    elif tail == "transpose":
        x = b.node("Transpose", [x], perm=[0, 2, 3, 1])
        w = b.weights((c, d(st.integers(1, 8))), 1.0, 0)
        x = b.node("MatMul", [x, b.const(w, "w")])  # a rank-4 MatMul on channels-last
    if d(st.booleans()) and tail in ("dense", "gap"):
        x = b.node("Softmax", [x], axis=-1)
    model = _finish(b, x, shape)
    note(f"opset {opset}, input {shape}: " + " -> ".join(b.log))
    return model, shape, " -> ".join(b.log)


def _conv_1x1(b: Builder, x: str, c: int, hw: int, d) -> tuple[str, int, int]:
    out = d(st.integers(1, 4))
    w = b.weights((out, c, 1, 1), 1.0, 0)
    return b.node("Conv", [x, b.const(w, "w")]), out, hw


def _dense_tail(b: Builder, x: str, feats: int, d) -> tuple[str, int]:
    if len(b.log) == 0 or not b.log[-1].startswith("Flatten"):
        x = b.node("Flatten", [x], axis=1)
    kind = d(st.sampled_from(["gemm", "matmul", "matmul3"]))
    out = d(st.integers(2, 10))
    magnitude = d(st.sampled_from([1e-3, 0.1, 1.0, 100.0]))
    if kind == "gemm":
        trans = d(st.booleans())
        w = b.weights((out, feats) if trans else (feats, out), magnitude, 0)
        bias = b.const(b.rng.standard_normal(out).astype(np.float32))
        return b.node("Gemm", [x, b.const(w, "w"), bias], transB=int(trans)), out
    if kind == "matmul":
        return b.node("MatMul", [x, b.const(b.weights((feats, out), magnitude, 0), "w")]), out
    # rank 3: (N, F) -> (N, 1, F) -> MatMul -> (N, out)
    x = b.node("Reshape", [x, b.const(np.array([0, 1, feats], np.int64))])
    x = b.node("MatMul", [x, b.const(b.weights((feats, out), magnitude, 0), "w")])
    return b.node("Reshape", [x, b.const(np.array([0, out], np.int64))]), out


def _finish(b: Builder, y: str, shape: tuple[int, ...]) -> onnx.ModelProto:
    graph = h.make_graph(
        b.nodes,
        "random",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *shape[1:]])],
        [h.make_tensor_value_info(y, TensorProto.FLOAT, None)],
        b.inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", b.opset)])
    model.ir_version = 8 if b.opset < 21 else 10
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    model.graph.output[0].CopyFrom(inferred.graph.output[0])
    if not model.graph.output[0].type.tensor_type.HasField("shape"):  # e.g. Resize by sizes
        dims = run(model, _data(shape, 0, 1)[0])[0].shape
        model.graph.output[0].CopyFrom(
            h.make_tensor_value_info(y, TensorProto.FLOAT, ["N", *dims[1:]])
        )
    onnx.checker.check_model(model, full_check=True)
    return model


# --------------------------------------------------------------------------------------------
# the properties


def _data(shape: tuple[int, ...], seed: int, batches: int) -> list[dict[str, np.ndarray]]:
    r = np.random.default_rng(seed)
    return [{"x": r.standard_normal(shape).astype(np.float32)} for _ in range(batches)]


def _sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    noise = float(np.sum((ref - got) ** 2))
    signal = float(np.sum(ref**2))
    if noise == 0:
        return float("inf")
    return 10 * np.log10(max(signal, 1e-30) / noise)


def _score(fp32: onnx.ModelProto, model: onnx.ModelProto, test: list[dict], exact=False) -> float:
    ref = np.concatenate([run(fp32, feed)[0].ravel() for feed in test])
    got = np.concatenate([run(model, feed, exact=exact)[0].ravel() for feed in test])
    return _sqnr_db(ref, got)


def _ort_quantized(model: onnx.ModelProto, calib: list[dict], tmp: str) -> onnx.ModelProto:
    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(calib)

        def get_next(self):
            return next(self.items, None)

    src, dst = os.path.join(tmp, "fp32.onnx"), os.path.join(tmp, "ort.onnx")
    onnx.save(model, src)
    quantize_static(src, dst, Reader(), reduce_range=u8s8_saturates())
    return onnx.load(dst)


def check_properties(
    model: onnx.ModelProto, shape: tuple[int, ...], tmp: str, test_batches: int = 16
) -> dict:
    """Quantize ``model`` three ways and return the figures the properties are asserted on."""
    calib, test = _data(shape, 1, 8), _data(shape, 2, test_batches)
    scores = {}
    for setting, kwargs in SETTINGS.items():
        q, _ = onnxq.quantize(model, calib, progress=False, **kwargs)
        onnx.checker.check_model(q, full_check=True)
        again, _ = onnxq.quantize(model, calib, progress=False, **kwargs)
        assert serialize(again) == serialize(q), f"{setting}: a rerun gave other bytes"
        scores[setting] = _score(model, q, test, exact=setting == "tensorrt")
    scores["onnxruntime"] = _score(model, _ort_quantized(model, calib, tmp), test)
    return scores


def assert_properties(scores: dict) -> None:
    peer, ours = scores["onnxruntime"], scores["default"]
    if peer >= FLOOR_DB:  # else held-out outputs lie outside anything calibration saw
        for setting in ("default", "qdq", "tensorrt"):
            assert scores[setting] >= FLOOR_DB, f"{setting}: {scores[setting]:.1f} dB"
    assert ours >= peer - MARGIN_DB or min(ours, peer) >= ENOUGH_DB, (
        f"onnxq {ours:.1f} dB against onnxruntime's {peer:.1f} dB"
    )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(graphs())
def test_random_graphs_quantize_as_well_as_onnxruntime(tmp_path_factory, drawn):
    model, shape, _ = drawn
    tmp = str(tmp_path_factory.mktemp("ort"))
    scores = check_properties(model, shape, tmp)
    note(f"SQNR dB: {scores}")
    assert_properties(scores)


# --------------------------------------------------------------------------------------------
# graphs hypothesis found, kept as named regressions (tests/data, a few KB each)

DATA = os.path.join(os.path.dirname(__file__), "data")


def _saved(name: str, test_batches: int = 16) -> tuple[onnx.ModelProto, dict]:
    model = onnx.load(os.path.join(DATA, name))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    shape = (2, *(d.dim_value for d in dims[1:]))
    with tempfile.TemporaryDirectory() as tmp:
        return model, check_properties(model, shape, tmp, test_batches)


def test_held_out_outputs_outside_the_calibrated_range_are_not_clipped_at_a_float_output():
    # Conv (weights ~70) -> Sigmoid saturates: the output is nearly discrete, and its 16
    # calibration samples never reach the positive values the held-out ones do. Both quantizers
    # scored 2.7 dB while the last MatMul/Gemm rounded its result to the calibrated grid; only
    # float ops read that result, so onnxq now writes it in float (onnxq.post.float_outputs)
    # and nothing clips it: 36 dB. onnxruntime's quantizer still clips it
    _, scores = _saved("random_outside_calibration.onnx")
    assert scores["default"] >= FLOOR_DB > scores["onnxruntime"]
    assert_properties(scores)


def test_open_gap_against_onnxruntime_on_a_saturated_sigmoid_branch():
    # Open, and of the same ill-conditioned kind as the graph below (Conv with weights ~70 ->
    # Sigmoid). On 8 held-out samples: onnxq 33.8 dB, onnxruntime 39.2. Measured causes then:
    # 7-bit weights on this CPU without VNNI (36.7 dB with 8-bit weights in onnxruntime's exact
    # mode), and the 1x1 Conv after Concat(sigmoid, conv) whose uint8 range the negative conv
    # half widens (37.9 dB with that Conv left float). Since the Conv's range is cut to the
    # Sigmoid's live region [-7.6, 7.6] the Sigmoid itself is as good (23.4 against 23.9 dB on
    # 200 batches) but the Conv after it lost 4 dB: with rounding noise of ±9 at the Sigmoid's
    # input, the coarse ±600 grid that snapped small values to 0 happened to do better. Scored
    # on 400 samples: onnxq 22.9 dB, onnxruntime 25.8
    _, scores = _saved("random_concat_gap.onnx", test_batches=200)
    assert_properties(scores)
    assert scores["default"] >= 22.5  # no worse than when it was measured


def test_dead_channels_keep_their_bias_on_a_fine_grid():
    # Conv (zero weights in two channels) after a coarse Relu: the dead channels' weight scale
    # 1.0 put their bias on a grid of 0.79 (24.2 dB against onnxruntime's 32.5; per-tensor
    # weights 36.8). Their scale is now chosen for the bias (onnxq.core.qparams.fit_dead_channels)
    _, scores = _saved("random_dead_channel_bias.onnx")
    assert_properties(scores)
    assert scores["default"] >= 35.0 and scores["tensorrt"] >= 35.0


def test_an_unfolded_clip_bounds_the_range_of_the_conv_before_it():
    # TensorRT's Conv -> Q -> DQ -> Clip(0, 6): the Conv's symmetric range covered ±1000 and
    # the Clip's [0, 6] had a few codes (10.2 dB, under the floor where onnxruntime's quantizer
    # made 13.3). The range is now cut to the Clip's bounds (Calibrator.saturation_bound)
    _, scores = _saved("random_unfolded_clip.onnx")
    assert_properties(scores)
    assert scores["tensorrt"] >= 17.0


def test_an_ill_conditioned_sigmoid_graph_is_scored_on_enough_data():
    # Conv (weights ~70, a dead channel) -> Sigmoid -> ... -> MatMul with weights ~2e-3: the
    # input's own rounding moves the Conv output by ±5 around the Sigmoid's live region, so
    # the score is a lottery of which samples land there: on 16 held-out samples onnxq made
    # 10.7 dB where onnxruntime's quantizer made 33.0, on the next 16 both 13.1, and int8
    # MinMax per-tensor activations in onnxq 26 dB. On 400 held-out samples the quantizers
    # agree within the margin (measured 17.4 against 21.4 dB)
    _, scores = _saved("random_ill_conditioned_sigmoid.onnx", test_batches=200)
    assert_properties(scores)
