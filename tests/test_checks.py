"""After quantizing: a low output SQNR names the layer to look at; slower int8 is flagged."""

from __future__ import annotations

import itertools
import json

import numpy as np
from helpers import DIGITS_CNN, make_model, rng, run
from onnx import helper as h

import onnxq
from onnxq.cli import main
from onnxq.simulate import checks
from onnxq.simulate.checks import Latency

CNN = DIGITS_CNN


def _chain():
    g = rng(4)
    nodes = [
        h.make_node("Conv", ["x", "W1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["a"], ["ar"], name="relu1"),
        h.make_node("Conv", ["ar", "W2"], ["b"], name="conv2", pads=[1, 1, 1, 1]),
        h.make_node("Conv", ["b", "W3"], ["y"], name="conv3", pads=[1, 1, 1, 1]),
    ]
    inits = {
        k: g.normal(0, 0.3, (4, c, 3, 3)).astype(np.float32)
        for k, c in (("W1", 3), ("W2", 4), ("W3", 4))
    }
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)
    return model, {"x": g.normal(0, 1, (16, 3, 8, 8)).astype(np.float32)}


def test_a_broken_layer_is_named_in_the_warning(tmp_path):
    model, data = _chain()
    _, report = onnxq.quantize(model, data, progress=False)
    assert not [w for w in report.warnings if "SQNR" in w]  # a healthy model: nothing said
    # clip conv2's output range to a sliver: the output falls far below the floor
    ranges = tmp_path / "r.json"
    onnxq.quantize(model, data, progress=False, save_ranges=ranges)
    table = json.loads(ranges.read_text())
    table["tensors"]["b"] = [-0.01, 0.01]
    ranges.write_text(json.dumps(table))
    _, report = onnxq.quantize(model, data, progress=False, load_ranges=ranges)
    low = [w for w in report.warnings if "SQNR against fp32" in w]
    assert len(low) == 1 and "output 'y'" in low[0]
    assert "first jumps at node 'conv2'" in low[0] and "try exclude=['conv2']" in low[0]


def test_a_search_too_large_to_hand_out_at_once_runs_in_groups(tmp_path, monkeypatch):
    """Tensors of one sample past the bound are compared a group at a time, in graph order,
    until a group holds a layer below the floor: the layer and its drop are those of the
    search that hands every tensor out at once."""
    model, data = _chain()
    ranges = tmp_path / "r.json"
    q, _ = onnxq.quantize(model, data, progress=False, save_ranges=ranges)
    table = json.loads(ranges.read_text())
    table["tensors"]["b"] = [-0.01, 0.01]
    ranges.write_text(json.dumps(table))
    q, _ = onnxq.quantize(model, data, progress=False, load_ranges=ranges)
    feed = {"x": data["x"][:1]}
    whole = checks.first_below_floor(model, q, feed)
    # x, a, ar, b, y: 768, 1024, 1024, 1024, 1024 bytes, each counted twice
    assert [len(g) for g in checks.search_groups(model, feed)] == [5]
    monkeypatch.setattr(checks, "LAYER_SEARCH_RUN_BYTES", 4096)
    assert checks.search_groups(model, feed) == [["x", "a"], ["ar", "b"], ["y"]]
    seen = []
    real = checks.compare
    monkeypatch.setattr(
        checks, "compare", lambda *a, names=None: seen.append(names) or real(*a, names=names)
    )
    grouped = checks.first_below_floor(model, q, feed)
    assert seen == [["x", "a"], ["ar", "b"]]  # the group holding conv2 ends the search
    assert whole is not None and grouped is not None and grouped.node == whole.node == "conv2"
    assert grouped.drop_db == whole.drop_db and grouped.sqnr_db == whole.sqnr_db


def test_latency_warning_only_when_int8_is_slower():
    assert Latency(1.0, 1.4, 50).warning().startswith("the int8 model runs 1.40× slower")
    assert Latency(1.0, 1.02, 50).warning() == ""
    assert Latency(1.0, 0.5, 50).warning() == ""
    assert Latency(0.008, 0.010, 50).warning() == ""  # 1.25x, but 2 us: timer noise


def test_cli_flags_a_slower_model_with_the_measured_ratio(tmp_path, capsys, monkeypatch):
    calib = tmp_path / "c.npz"
    np.savez(calib, input=rng(0).uniform(0, 1, (8, 1, 28, 28)).astype(np.float32))
    monkeypatch.setattr(checks, "latency", lambda *a, **k: Latency(0.10, 0.16, 9))
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(CNN), "-o", str(out), "--data", str(calib)]) == 0
    text = capsys.readouterr().out
    assert "speed: int8 takes 1.60× fp32's time per batch (0.160 vs 0.100 ms" in text
    assert "warning: the int8 model runs 1.60× slower than fp32 here" in text
    assert (
        main(["quantize", str(CNN), "-o", str(out), "--data", str(calib), "--no-latency-check"])
        == 0
    )
    assert "speed:" not in capsys.readouterr().out


def test_latency_is_measured_for_real():
    model, data = _chain()
    q, _ = onnxq.quantize(model, data, progress=False)
    lat = checks.latency(model, q, {"x": data["x"][:1]}, seconds=0.05)
    assert lat.runs >= 5 and lat.fp32_ms > 0 and lat.int8_ms > 0


def _timed_sessions(monkeypatch, fp32_ms, int8_ms):
    """Sessions whose runs take the given times on a fake clock (no real waiting).

    A time may be a list: the runs take its times in turn.
    """
    clock = [0.0]

    class Session:
        def __init__(self, ms):
            self.ms = itertools.cycle(ms if isinstance(ms, list) else [ms])

        def run(self, names, feed):
            clock[0] += next(self.ms) / 1e3

    made = iter([Session(fp32_ms), Session(int8_ms)])
    monkeypatch.setattr(checks, "make_session", lambda model, threads: next(made))
    monkeypatch.setattr(checks.time, "perf_counter", lambda: clock[0])
    return clock


def test_latency_stops_early_only_when_the_verdict_is_clear(monkeypatch):
    # int8 at a quarter of fp32's time: clear after LATENCY_MIN_SECONDS (0.1 s of 2.5 ms pairs)
    clock = _timed_sessions(monkeypatch, 2.0, 0.5)
    lat = checks.latency(None, None, {}, seconds=0.3)
    assert lat.ratio == 0.25 and lat.runs == 40
    assert clock[0] < 0.2
    # int8 as fast as fp32 on every pair: below the warning's 1.05 every time, settled by the
    # sign test as soon as the minimum time is spent
    _timed_sessions(monkeypatch, 1.0, 1.0)
    lat = checks.latency(None, None, {}, seconds=0.3)
    assert lat.ratio == 1.0 and lat.runs == 50
    # int8 on either side of the warning pair by pair: never settled, timed the whole 2 × 0.3 s
    _timed_sessions(monkeypatch, 1.0, [0.9, 1.1])
    lat = checks.latency(None, None, {}, seconds=0.3)
    assert lat.runs == 300 and not lat.warning()
    # int8 at twice fp32's time: clearly slower, early too, and warned about
    _timed_sessions(monkeypatch, 1.0, 2.0)
    lat = checks.latency(None, None, {}, seconds=0.3)
    assert lat.runs < 50 and lat.warning().startswith("the int8 model runs 2.00× slower")


def test_the_layer_search_runs_on_one_sample_where_the_batch_is_free():
    # it exposes every tensor of both models: a batch of 8 OCR lines was 1.3 GB of outputs
    from onnxq.calibrate.dataset import InputSpec

    x = np.zeros((8, 3, 4, 4), np.float32)
    free = [InputSpec("x", np.dtype(np.float32), (None, 3, 4, 4))]
    fixed = [InputSpec("x", np.dtype(np.float32), (8, 3, 4, 4))]
    assert checks._first_sample({"x": x}, free)["x"].shape == (1, 3, 4, 4)
    assert checks._first_sample({"x": x}, fixed)["x"].shape == (8, 3, 4, 4)


def test_a_leading_axis_that_is_no_batch_is_not_cut():
    """silero-vad's If branch reads an audio chunk [1, 512] and an LSTM state [2, 1, 128],
    every dimension free: cutting both to one row fed the branch a [1, 1, 128] state and its
    Gather failed, so the branch stayed float (the zoo bar of 8 int8 nodes failed)."""
    from onnxq.calibrate.dataset import InputSpec, feed_samples
    from onnxq.simulate.sensitivity import rebatch

    feed = {"input": np.zeros((1, 512), np.float32), "state": np.zeros((2, 1, 128), np.float32)}
    specs = [
        InputSpec("input", np.dtype(np.float32), (None, None)),
        InputSpec("state", np.dtype(np.float32), (None, None, None)),
    ]
    assert feed_samples(feed) == 1
    assert feed_samples({"x": np.zeros((4, 2)), "y": np.zeros((4,))}) == 4
    cut = checks._first_sample(feed, specs)
    assert {k: v.shape for k, v in cut.items()} == {"input": (1, 512), "state": (2, 1, 128)}
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", [n], [f"{n}_out"]) for n in ("input", "state")],
        "g",
        [
            helper.make_tensor_value_info("input", TensorProto.FLOAT, ["a", "b"]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, ["c", "d", "e"]),
        ],
        [
            helper.make_tensor_value_info(f"{n}_out", TensorProto.FLOAT, None)
            for n in ("input", "state")
        ],
    )
    merged = rebatch(helper.make_model(graph), [feed, dict(feed)], size=16)
    assert [{k: v.shape for k, v in f.items()} for f in merged] == [
        {"input": (1, 512), "state": (2, 1, 128)}
    ] * 2


def test_padded_text_batches_of_different_lengths_are_joined_only_with_their_own_length():
    """onnxq debug on the padded-batch MiniLM failed in its ranking: batches of 54 and 35 tokens
    were concatenated along the batch axis ("all the input array dimensions ... must match")."""
    from onnx import TensorProto, helper

    from onnxq.simulate.sensitivity import rebatch

    graph = helper.make_graph(
        [helper.make_node("Identity", ["ids"], ["out"])],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "tokens"])],
        [helper.make_tensor_value_info("out", TensorProto.INT64, None)],
    )

    def feed(rows: int, tokens: int, value: int) -> dict[str, np.ndarray]:
        return {"ids": np.full((rows, tokens), value, np.int64)}

    feeds = [feed(2, 54, 1), feed(2, 54, 2), feed(2, 35, 3), feed(2, 54, 4), feed(2, 54, 5)]
    merged = rebatch(helper.make_model(graph), feeds, size=4)
    assert [f["ids"].shape for f in merged] == [(4, 54), (2, 35), (4, 54)]
    # every sample is there once, in order, unpadded
    rows = np.concatenate([f["ids"][:, 0] for f in merged])
    assert rows.tolist() == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_a_tensorrt_model_is_checked_without_this_cpus_clipping():
    """TensorRT's integer math does not clip: the check must not report onnxruntime's U8S8
    clipping on a CPU without VNNI as the model's error (it did: 7.2 dB on the digits CNN)."""
    from models import datasets

    x, _, _, _ = datasets.digits()
    _, report = onnxq.quantize(str(CNN), {"input": x[:32]}, target="tensorrt", progress=False)
    assert not [w for w in report.warnings if "SQNR" in w], report.warnings


def test_runtime_warnings_tell_a_runtime_fault_from_quantization_noise():
    """RapidOCR's softmax output is 13.1 dB in OpenVINO and 13.8 dB fake-quantized: below the
    floor, but not OpenVINO's doing (the first message blamed OpenVINO)."""
    from onnx import ModelProto, TensorProto, helper

    def shifted(offset: float) -> ModelProto:
        graph = helper.make_graph(
            [helper.make_node("Add", ["x", "c"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
            [helper.make_tensor("c", TensorProto.FLOAT, [], [offset])],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    class Runtime:  # a target runtime that adds its own offset
        def __init__(self, offset: float) -> None:
            self.offset = offset

        def run(self, names, feed):
            return [feed["x"] + self.offset]

    feeds = [{"x": np.ones((4, 8), np.float32)}]
    fp32 = shifted(0.0)
    # fake-quantized at 40 dB (offset 0.01), the runtime at 14 dB: the runtime's fault
    fault = checks.runtime_warnings("OpenVINO", fp32, shifted(0.01), Runtime(0.2), feeds)
    assert len(fault) == 1 and "computes this model apart" in fault[0] and "40.0 dB" in fault[0]
    # both at 14 dB: the quantization's
    noise = checks.runtime_warnings("OpenVINO", fp32, shifted(0.2), Runtime(0.2), feeds)
    assert len(noise) == 1 and "below the 15 dB floor" in noise[0] and "apart" not in noise[0]
    # a runtime that rounds a little differently: no warning
    assert not checks.runtime_warnings("OpenVINO", fp32, shifted(0.01), Runtime(0.012), feeds)


def test_int16_matmuls_that_onnxruntime_runs_in_8_bits_are_named():
    # onnxruntime fuses DequantizeLinear(int8 W) -> Gemm into MatMulNBits, which by default
    # quantizes the (int16) activation to int8 on the fly; on an input with one column 1,000x
    # wider than the rest, that is 1.6 dB of output SQNR where the model's arithmetic gives 36
    import onnxruntime as ort
    from test_fallback import _fragile_mlp

    model, data = _fragile_mlp()
    kw = dict(progress=False, batch_size=16, rounding="nearest", format="qdq")
    q, report = onnxq.quantize(model, data, activation_dtype="int16", **kw)
    named = [w for w in report.warnings if "MatMulNBits" in w]
    assert len(named) == 1, report.warnings
    gemms = [n.name for n in q.graph.node if n.op_type == "Gemm"]  # as the written model names them
    assert "3 MatMul/Gemm node(s)" in named[0] and all(f"'{n}'" in named[0] for n in gemms)
    assert checks.NBITS_ACCURACY in named[0]
    # the advice is right: with the option the model computes what it holds
    x = data["x"][:128]
    ref = run(model, {"x": x})[0]

    def sqnr(config):
        opts = ort.SessionOptions()
        for key, value in config.items():
            opts.add_session_config_entry(key, value)
        s = ort.InferenceSession(q.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        out = s.run(None, {"x": x})[0]
        return 10 * np.log10(np.sum(ref**2) / np.sum((ref - out) ** 2))

    assert sqnr({}) < 10 and sqnr({checks.NBITS_ACCURACY: "0"}) > 30
    # 8-bit activations: nothing is fused that way, nothing is said
    _, report8 = onnxq.quantize(model, data, **kw)
    assert not [w for w in report8.warnings if "MatMulNBits" in w]
