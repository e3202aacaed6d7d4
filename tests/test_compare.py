"""onnxq compare: per output and per layer agreement between float and quantized models."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN

import onnxq
from onnxq.calibrate.dataset import model_inputs
from onnxq.calibrate.sources import as_dataset
from onnxq.cli import main
from onnxq.simulate.compare import compare

X = np.random.default_rng(4).uniform(0, 1, (32, 1, 28, 28)).astype(np.float32)
CNN = DIGITS_CNN


def test_identical_models_compare_perfectly():
    model = onnx.load(str(CNN))
    res = compare(model, model, as_dataset({"input": X[:4]}, model_inputs(model)))
    assert res.samples == 4 and res.outputs[0].sqnr_db == math.inf
    assert all(s.cosine == pytest.approx(1.0) for s in res.layers)


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_quantized_layers_are_matched_and_ordered_worst_first(fmt):
    fp32 = onnx.load(str(CNN))
    q, _ = onnxq.quantize(fp32, {"input": X}, format=fmt, progress=False)
    res = compare(fp32, q, as_dataset({"input": X}, model_inputs(fp32)))
    names = [s.name for s in res.layers]
    assert {"r1", "r2", "r3"} <= set(names)
    drops = [s.drop_db for s in res.layers]
    assert drops == sorted(drops, reverse=True)
    assert res.outputs[0].sqnr_db > 25 and res.outputs[0].cosine > 0.999


def test_a_badly_calibrated_layer_is_reported_first():
    from onnxq.calibrators import MinMaxCallback

    class Squash(MinMaxCallback):
        """MinMax, except tensor r2 squeezed into a tenth of its range."""

        def activation_range(self, info, qt):
            lo, hi = super().activation_range(info, qt)
            return (lo, hi / 10) if qt.tensor == "r2" else (lo, hi)

    fp32 = onnx.load(str(CNN))
    q, _ = onnxq.quantize(fp32, {"input": X}, callback=Squash(), progress=False)
    res = compare(fp32, q, as_dataset({"input": X}, model_inputs(fp32)))
    assert res.layers[0].name == "r2"  # the culprit, though r3 downstream has a lower SQNR
    assert res.layers[0].drop_db > 10 + max(s.drop_db for s in res.layers[1:])


def test_cli_compare_json_and_html(tmp_path, capsys):
    data = tmp_path / "d.npz"
    np.savez(data, input=X)
    q = tmp_path / "q.onnx"
    assert main(["quantize", str(CNN), "-o", str(q), "--data", str(data), "--quiet"]) == 0
    capsys.readouterr()
    report = tmp_path / "r.html"
    assert (
        main(
            [
                "compare",
                str(CNN),
                str(q),
                "--data",
                str(data),
                "--samples",
                "8",
                "--json",
                "--report",
                str(report),
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["samples"] == 8 and doc["outputs"][0]["name"] == "logits"
    text = report.read_text()
    assert "<svg" in text and "r2" in text
    assert main(["compare", str(CNN), str(q), "--data", str(tmp_path / "none.npz")]) == 2


def test_cli_compare_refuses_a_pair_that_reads_other_inputs(tmp_path, capsys):
    # a quantized model of another float model: onnxruntime's "Required inputs are missing"
    # came out as a calibration-data error naming batch 0

    data = tmp_path / "d.npz"
    np.savez(data, input=X)
    q = tmp_path / "q.onnx"
    assert main(["quantize", str(CNN), "-o", str(q), "--data", str(data), "--quiet"]) == 0
    other = onnx.load(str(CNN))
    renamed = "pixels"
    for node in other.graph.node:
        node.input[:] = [renamed if x == "input" else x for x in node.input]
    other.graph.input[0].name = renamed
    path = tmp_path / "other.onnx"
    onnx.save(other, str(path))
    capsys.readouterr()
    assert main(["compare", str(path), str(q), "--data", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'pixels'" in err and "'input'" in err
    assert "give that pair" in err


def test_a_peer_qdq_model_without_value_info_compares(tmp_path, capsys):
    # onnxruntime's quantize_static writes no value_info: the exposed QuantizeLinear outputs
    # were declared float, and onnxruntime refused the model ("Type Error ... tensor(int8)")
    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([{"input": X[i : i + 1]} for i in range(8)])

        def get_next(self):
            return next(self.items, None)

    peer = tmp_path / "peer.onnx"
    quantize_static(str(CNN), str(peer), Reader())
    g = onnx.load(str(peer)).graph
    typed = {vi.name for vi in g.value_info}
    assert not typed & {n.output[0] for n in g.node if n.op_type == "QuantizeLinear"}
    np.savez(tmp_path / "x.npz", input=X[:8])
    assert main(["compare", str(CNN), str(peer), "--data", str(tmp_path / "x.npz"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["outputs"][0]["sqnr_db"] > 30
    # onnxruntime drops the Relu after each Conv (its Q clips) and the Conv writes the Relu's
    # tensor name: compared before the Q, the pre-Relu values scored 1-4 dB
    relus = [layer for layer in res["layers"] if layer["op"] == "Relu"]
    assert len(relus) == 3 and min(layer["sqnr_db"] for layer in relus) > 30


def test_the_streamed_sums_are_the_float64_sums():
    """Rows summed in float32, then in float64: within 1e-6 of a float64 sum, on values that
    span ten orders of magnitude and a length that is no multiple of the row."""
    from onnxq.simulate.compare import TensorStats

    g = np.random.default_rng(3)
    f = (g.standard_normal(123_457) * 10.0 ** g.uniform(-5, 5, 123_457)).astype(np.float32)
    q = (f + g.standard_normal(f.size).astype(np.float32) * 1e-3).astype(np.float32)
    st = TensorStats("t", False, 0)
    st.add(f[:50_000], q[:50_000])
    st.add(f[50_000:], q[50_000:])
    f64, q64 = f.astype(np.float64), q.astype(np.float64)
    for got, want in ((st.ff, f64 @ f64), (st.qq, q64 @ q64), (st.fq, f64 @ q64)):
        assert abs(got - want) <= 1e-6 * abs(want)
    assert abs(st.ee - (f64 - q64) @ (f64 - q64)) <= 1e-5 * st.ee
    assert st.count == f.size
    for n in (5, 3 * 4096, 4096 + 1):  # shorter than a row, whole rows, one value past them
        part = TensorStats("t", False, 0)
        part.add(f[:n], q[:n])
        assert abs(part.ff - f64[:n] @ f64[:n]) <= 1e-6 * (f64[:n] @ f64[:n])
        assert abs(part.ee - (f64[:n] - q64[:n]) @ (f64[:n] - q64[:n])) <= 1e-5 * part.ee


def test_values_the_float_model_computes_as_nan_are_left_out():
    """fp32's own NaN/Inf are nothing to compare with; an int8 NaN where fp32 is finite is the
    worst error (before, one NaN made the tensor's every figure NaN)."""
    from onnxq.simulate.compare import TensorStats

    f = np.linspace(-1, 1, 1000).astype(np.float32)
    q = f + np.float32(0.01)
    f_nan = f.copy()
    f_nan[::10] = np.nan
    f_nan[5] = np.inf
    clean, holed = TensorStats("t", False, 0), TensorStats("t", False, 0)
    known = np.isfinite(f_nan)
    clean.add(f[known], q[known])
    holed.add(f_nan, q)
    assert holed.float_nonfinite == 101 and holed.count == 1000
    assert holed.sqnr_db == pytest.approx(clean.sqnr_db, abs=1e-4)
    assert holed.cosine == pytest.approx(clean.cosine, abs=1e-7)
    broken = TensorStats("t", False, 0)
    q_nan = q.copy()
    q_nan[3] = np.nan
    broken.add(f, q_nan)
    assert broken.sqnr_db == -np.inf


def test_tensors_too_large_to_hand_out_at_once_are_compared_in_groups(monkeypatch):
    """Past the bound for one sample, each group of tensors streams the data on its own: the
    figures (and the drops, linked across groups) are those of one stream of every tensor."""
    import onnxq.simulate.compare as cmp

    fp32 = onnx.load(str(CNN))
    q, _ = onnxq.quantize(fp32, {"input": X}, progress=False)
    data = as_dataset({"input": X}, model_inputs(fp32), batch_size=8)
    whole = compare(fp32, q, data)
    streams = []
    real = cmp._stream
    monkeypatch.setattr(cmp, "GROUP_BYTES", 40_000)
    monkeypatch.setattr(cmp, "_stream", lambda *a: streams.append(a[3]) or real(*a))
    data.reset()
    grouped = compare(fp32, q, data)
    assert (
        len(streams) > 2
        and sum(len(g) for g in streams) == len(whole.layers) + len(whole.outputs) + 1
    )  # the graph input is compared too
    assert grouped.samples == whole.samples == 32
    key = [(s.name, s.order) for s in whole.layers]
    assert [(s.name, s.order) for s in grouped.layers] == key
    for a, b in zip(whole.layers + whole.outputs, grouped.layers + grouped.outputs, strict=True):
        assert (a.sqnr_db, a.drop_db, a.cosine) == (b.sqnr_db, b.drop_db, b.cosine)


def test_a_large_batch_runs_in_parts_with_the_same_sums(monkeypatch):
    """Both models run the next part while this one is folded; parts sum as one batch."""
    import onnxq.simulate.compare as cmp

    fp32 = onnx.load(str(CNN))
    q, _ = onnxq.quantize(fp32, {"input": X}, progress=False)
    whole = compare(fp32, q, as_dataset({"input": X}, model_inputs(fp32), batch_size=32))
    runs: list[int] = []
    real = cmp._Both.run

    def counted(self, names, feeds):
        runs.append(len(feeds["input"]))
        return real(self, names, feeds)

    monkeypatch.setattr(cmp._Both, "run", counted)
    monkeypatch.setattr(cmp, "RUN_BYTES", 1 << 20)  # a few samples' tensors
    split = compare(fp32, q, as_dataset({"input": X}, model_inputs(fp32), batch_size=32))
    # the first sample measured once, then run as the first part; the rest in parts
    assert runs[:2] == [1, 1] and len(runs) > 3 and sum(runs[1:]) == 32
    assert split.samples == whole.samples == 32
    by_name = {s.name: s for s in split.layers + split.outputs}
    assert len(by_name) == len(whole.layers + whole.outputs)
    for a in whole.layers + whole.outputs:
        assert a.sqnr_db == pytest.approx(by_name[a.name].sqnr_db, rel=1e-5)
