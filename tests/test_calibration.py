"""Observers, callbacks, CalibrationInfo and the data adapters."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import make_model, rng, run
from onnx import helper as h

import onnxq
from onnxq.annotate.quantizer import Quantizer
from onnxq.calibrate.calibration import Calibrator
from onnxq.calibrate.dataset import ArrayDataset, FolderDataset, IterableDataset, model_inputs
from onnxq.calibrate.sources import as_dataset
from onnxq.calibrators import AverageMaxObserver, MinMaxCallback, MinMaxObserver
from onnxq.core.callbacks import CalibrationCallback
from onnxq.core.errors import CalibrationError, DataError
from onnxq.core.qparams import QParams, dequantize, params_from_range, quantize, weight_params

R = rng(1)


def conv_model(fixed_batch=None):
    w = R.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)
    return make_model(
        [
            h.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
            h.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        [("x", [fixed_batch or "N", 3, 6, 6])],
        [("y", None)],
        {"W": w, "B": np.zeros(4, np.float32)},
    )


# qparams ------------------------------------------------------------------------------------


def test_range_always_contains_zero_and_zero_is_exact():
    qp = params_from_range(2.0, 5.0, "uint8")
    assert qp.zero_point == 0  # rmin widened to 0
    qp = params_from_range(-5.0, -1.0, "uint8")
    assert qp.zero_point == 255
    for lo, hi in [(-1.3, 2.7), (0.1, 9.0), (-3.0, -0.2)]:
        qp = params_from_range(lo, hi, "uint8")
        assert dequantize(quantize(np.zeros(1, np.float32), qp), qp)[0] == 0.0


def test_scale_is_never_zero_for_constant_tensors():
    qp = params_from_range(0.0, 0.0, "uint8")
    assert qp.scale > 0 and np.isfinite(qp.scale)
    wp = weight_params(np.zeros((3, 4), np.float32), axis=0)
    assert np.all(wp.scale > 0)


def test_nan_range_is_an_error_not_a_scale():
    with pytest.raises(CalibrationError, match="NaN or Inf"):
        params_from_range(np.nan, 1.0)


def test_qparams_validates():
    with pytest.raises(CalibrationError):
        QParams(np.float32(0.0), np.uint8(0))
    with pytest.raises(CalibrationError):
        QParams(np.float32(-1.0), np.uint8(0))


def test_weight_params_symmetric_per_channel():
    w = np.array([[1.0, -2.3], [0.5, 0.3]], np.float32)
    qp = weight_params(w, axis=0)
    np.testing.assert_allclose(qp.scale, [2.3 / 127, 0.5 / 127], rtol=1e-6)
    assert np.all(qp.zero_point == 0) and qp.zero_point.dtype == np.int8
    assert quantize(w, qp)[0, 1] == -127


@pytest.mark.parametrize("bits", [8, 4])
def test_weights_on_a_coarse_grid_keep_it_exactly(bits):
    # YOLOv8's distribution-focal-loss Conv: weights 0..15; a ternary channel; a trained one
    top = 2 ** (bits - 1) - 1
    w = np.zeros((3, 16), np.float32)
    w[0] = np.arange(16) if bits == 8 else np.arange(16) % 6
    w[1] = 0.37 * rng(1).integers(-1, 2, 16)
    w[2] = rng(2).normal(0, 1, 16)
    qp = weight_params(w, axis=0, bits=bits)
    back = dequantize(quantize(w, qp), qp)
    np.testing.assert_array_equal(back[:2], w[:2])
    assert np.max(np.abs(quantize(w, qp)[:2])) <= top
    # the finest exact grid: 0..15 at 1/8 (0..120), not at 1 (0..15); the trained row as before
    assert qp.scale[0] == (np.float32(1 / 8) if bits == 8 else np.float32(1.0))
    assert qp.scale[2] == weight_params(w[2:], axis=0, bits=bits).scale[0]
    np.testing.assert_allclose(qp.scale[2], np.abs(w[2]).max() / top, rtol=1e-6)


def test_a_conv_with_integer_weights_is_written_with_them_exactly():
    # bins 0..15 forwards and backwards: on max|W|/127 the 1 of both channels was 0.945
    bins = np.stack([np.arange(16), np.arange(16)[::-1]]).astype(np.float32)[:, :, None, None]
    nodes = [h.make_node("Conv", ["x", "W"], ["y"], "bins")]
    model = make_model(nodes, [("x", ["N", 16, 4, 8])], [("y", None)], {"W": bins})
    x = rng(5).normal(0, 2, (64, 16, 4, 8)).astype(np.float32)
    q, _ = onnxq.quantize(model, {"x": x}, progress=False, rounding="nearest")
    conv = next(n for n in q.graph.node if n.op_type == "QLinearConv")
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in q.graph.initializer}
    w_q, w_s = inits[conv.input[3]], inits[conv.input[4]]
    np.testing.assert_array_equal(w_q.astype(np.float32) * w_s.reshape(-1, 1, 1, 1), bins)
    y_s, x_s = float(inits[conv.input[6]]), float(inits[conv.input[1]])
    # onnxruntime's result: the output's rounding and the input's, nothing from the weights
    err = np.abs(run(q, {"x": x[:8]})[0] - run(model, {"x": x[:8]})[0])
    assert err.max() <= y_s / 2 + 0.5 * x_s * bins.sum(axis=1).max() + 1e-4


# observers ----------------------------------------------------------------------------------


def test_minmax_observer_matches_numpy():
    obs = MinMaxObserver()
    chunks = [R.normal(0, s, 100).astype(np.float32) for s in (1, 3, 0.5)]
    for c in chunks:
        obs.observe(c)
    lo, hi = obs.compute()
    allv = np.concatenate(chunks)
    assert lo == allv.min() and hi == allv.max()


def test_average_max_observer_is_mean_of_batch_extrema():
    obs = AverageMaxObserver()
    chunks = [R.normal(0, s, 50).astype(np.float32) for s in (1, 2, 4, 8)]
    for c in chunks:
        obs.observe(c)
    lo, hi = obs.compute()
    assert np.isclose(lo, np.mean([c.min() for c in chunks]))
    assert np.isclose(hi, np.mean([c.max() for c in chunks]))
    mm = MinMaxObserver()
    for c in chunks:
        mm.observe(c)
    assert hi < mm.compute()[1]  # differs from MinMax on spread data


def test_minmax_streams_over_many_samples():
    model = conv_model()
    quantizer = Quantizer(model)

    def many():
        for i in range(2000):
            yield {"x": np.full((1, 3, 6, 6), (i % 7) - 3, np.float32)}

    cal = Calibrator(
        quantizer,
        as_dataset(many(), model_inputs(quantizer.float_model)),
        MinMaxCallback(),
        progress=False,
    )
    values = cal.calibrate()
    assert cal.report.samples == 2000 and cal.report.batches == 2000
    assert float(values["x_scale"]) == pytest.approx(6 / 255, rel=1e-6)


@pytest.mark.parametrize("method", ["minmax", "average-max", "percentile", "entropy", "mse"])
def test_retained_statistics_do_not_grow_with_samples(method):
    from onnxq.calibrators import method_callback

    model = conv_model()

    def calibrate(n):
        quantizer = Quantizer(model)

        def many():
            rng = np.random.default_rng(0)
            for i in range(n):
                yield {"x": rng.normal(0, 1 + i % 5, (1, 3, 6, 6)).astype(np.float32)}

        cal = Calibrator(
            quantizer,
            as_dataset(many(), model_inputs(quantizer.float_model)),
            method_callback(method),
            progress=False,
        )
        cal.calibrate()
        assert cal.report.samples == n and cal.report.batches == n
        return cal.report

    few, many = calibrate(10), calibrate(2000)
    assert many.observer_bytes == few.observer_bytes  # nothing grows with the data
    assert many.observer_bytes <= many.tensors_observed * (2048 * 8 + 64)


def test_recalibrating_reuses_each_weights_parameters(monkeypatch):
    # the recipe choice recalibrates once per range candidate: a weight's parameters do not
    # depend on the activation ranges, so they are computed once and handed out as copies
    import onnxq.core.callbacks as callbacks

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return weight_params(*args, **kwargs)

    monkeypatch.setattr(callbacks, "weight_params", counted)
    quantizer = Quantizer(conv_model())
    feeds = [{"x": R.normal(0, 1, (1, 3, 6, 6)).astype(np.float32)} for _ in range(4)]
    cal = Calibrator(
        quantizer, as_dataset(feeds, model_inputs(quantizer.float_model)), progress=False
    )
    first = cal.calibrate()
    first["W_scale"][:] = 0  # a caller's edit of the values reaches no later calibration
    again = cal.recalibrate(MinMaxCallback())
    assert calls == [(4, 3, 3, 3)]
    expected = weight_params(quantizer.float_value("W"), 0, "int8").scale
    np.testing.assert_array_equal(again["W_scale"], expected)


def test_nonfinite_calibration_values_are_reported_and_ignored():
    model = conv_model()
    x = R.normal(0, 1, (4, 3, 6, 6)).astype(np.float32)
    x[0, 0, 0, 0] = np.nan
    q, report = onnxq.quantize(model, {"x": x}, progress=False)
    assert report.calibration.nonfinite["x"] == 1
    assert np.isfinite(report.values["x_scale"])
    assert "NaN/Inf" in report.summary()


# callbacks and CalibrationInfo --------------------------------------------------------------


class FixedCallback(CalibrationCallback):
    """Every activation in [0, 8] (uint8), weights per tensor; records what info exposes."""

    def __init__(self):
        self.seen = []

    def calibrate_pattern(self, calibration_info):
        info = calibration_info
        feeds = {"x": np.ones((1, 3, 6, 6), np.float32)}
        x, w = info.get_unquantized_layer_inputs(feeds)
        (y,) = info.get_unquantized_layer_outputs(feeds)
        self.seen.append((x.shape, w.shape, y.shape))
        values = {}
        for (scale, zp), qt in zip(
            info.input_scale_zps + info.output_scale_zps, info.inputs + info.outputs
        ):
            if qt.role == "weight":
                qp = weight_params(info.constant(qt.tensor), qt.axis)
                values[scale], values[zp] = qp.scale, qp.zero_point
            else:
                values[scale], values[zp] = np.float32(8 / 255), np.uint8(0)
        return values


def test_custom_callback_and_layer_values():
    cb = FixedCallback()
    q, report = onnxq.quantize(
        conv_model(),
        {"x": R.normal(0, 1, (2, 3, 6, 6)).astype(np.float32)},
        callback=cb,
        progress=False,
    )
    assert cb.seen == [((1, 3, 6, 6), (4, 3, 3, 3), (1, 4, 4, 4))]
    assert report.values["x_scale"] == pytest.approx(8 / 255)


def test_quantized_layer_values_track_calibration():
    model = conv_model()
    quantizer = Quantizer(model)
    data = {"x": R.normal(0, 1, (8, 3, 6, 6)).astype(np.float32)}
    cal = Calibrator(
        quantizer, as_dataset(data, model_inputs(quantizer.float_model)), progress=False
    )
    cal.calibrate()
    from onnxq.core.callbacks import CalibrationInfo

    info = CalibrationInfo(cal, quantizer.records[0])
    feeds = {"x": data["x"][:1]}
    xq, wq = info.get_quantized_layer_inputs(feeds)
    assert xq.dtype == np.uint8 and wq.dtype == np.int8
    (yq,) = info.get_quantized_layer_outputs(feeds)
    (yf,) = info.get_unquantized_layer_outputs(feeds)
    assert np.abs(yq - yf).max() < 3 * float(cal.values["y_scale"])


def test_callback_returning_bad_scale_is_rejected():
    class Bad(CalibrationCallback):
        def calibrate_pattern(self, calibration_info):
            return {calibration_info.input_scale_zps[0][0]: np.float32(0.0)}

    with pytest.raises(CalibrationError, match="finite and > 0"):
        onnxq.quantize(
            conv_model(), {"x": np.ones((1, 3, 6, 6), np.float32)}, callback=Bad(), progress=False
        )


def test_callback_with_wrong_shape_is_rejected():
    class Wrong(FixedCallback):
        def calibrate_pattern(self, calibration_info):
            values = super().calibrate_pattern(calibration_info)
            values["W_scale"] = np.float32(0.1)  # per-channel placeholder of 4 values
            return values

    with pytest.raises(CalibrationError, match=r"expected \[4\] \(per channel\)"):
        onnxq.quantize(
            conv_model(), {"x": np.ones((1, 3, 6, 6), np.float32)}, callback=Wrong(), progress=False
        )


def test_callback_leaving_placeholders_unset_is_rejected():
    class Lazy(CalibrationCallback):
        def calibrate_pattern(self, calibration_info):
            return {}

    with pytest.raises(CalibrationError, match="without a value"):
        onnxq.quantize(
            conv_model(), {"x": np.ones((1, 3, 6, 6), np.float32)}, callback=Lazy(), progress=False
        )


# data adapters ------------------------------------------------------------------------------


def test_npz_batches_follow_fixed_batch_of_model(tmp_path):
    model = conv_model(fixed_batch=1)
    path = tmp_path / "calib.npz"
    np.savez(path, x=R.normal(0, 1, (5, 3, 6, 6)).astype(np.float64))  # float64 is converted
    ds = as_dataset(str(path), model_inputs(model))
    feeds = list(ds)
    assert len(feeds) == 5 and all(f["x"].shape == (1, 3, 6, 6) for f in feeds)
    assert feeds[0]["x"].dtype == np.float32


@pytest.mark.parametrize(
    "save", ["savez", "savez_compressed", "fortran"], ids=["stored", "compressed", "fortran"]
)
def test_npz_samples_are_read_a_batch_at_a_time_where_the_file_allows(tmp_path, save):
    """An uncompressed C-order member stays in the file (1,024 MobileNet samples held 315 MB
    from the start of the run); compressed or Fortran-order members are read whole. The feeds
    are the same either way."""
    from onnxq.calibrate.dataset import NpzDataset, StoredArray

    x = R.normal(0, 1, (7, 3, 6, 6)).astype(np.float32)
    path = tmp_path / "calib.npz"
    if save == "fortran":
        np.savez(path, x=np.asfortranarray(x))
    else:
        getattr(np, save)(path, x=x)
    inputs = model_inputs(conv_model())
    ds = NpzDataset(path, batch_size=3, inputs=inputs).bind(inputs)
    assert isinstance(ds.arrays["x"], StoredArray) == (save == "savez")
    feeds = [f["x"] for f in ds]
    assert [f.shape[0] for f in feeds] == [3, 3, 1]
    np.testing.assert_array_equal(np.concatenate(feeds), x)
    if save == "savez":
        stored = ds.arrays["x"]
        np.testing.assert_array_equal(stored[-1], x[-1])
        np.testing.assert_array_equal(np.asarray(stored), x)


def test_an_npz_changed_while_it_is_read_is_named(tmp_path):
    from onnxq.calibrate.dataset import NpzDataset

    path = tmp_path / "calib.npz"
    np.savez(path, x=np.zeros((4, 3, 6, 6), np.float32))
    inputs = model_inputs(conv_model())
    ds = NpzDataset(path, batch_size=2, inputs=inputs).bind(inputs)
    batches = iter(ds)
    next(batches)
    np.savez(path, x=np.ones((6, 3, 6, 6), np.float32))  # rewritten in place
    with pytest.raises(DataError, match="calib.npz' changed while onnxq was reading it"):
        next(batches)


def test_array_batches_for_dynamic_batch():
    ds = ArrayDataset({"x": np.zeros((10, 3, 6, 6), np.float32)}, batch_size=4).bind(
        model_inputs(conv_model())
    )
    assert [f["x"].shape[0] for f in ds] == [4, 4, 2] and ds.num_batches() == 3


def test_folder_of_npy_adds_batch_axis(tmp_path):
    for i in range(3):
        np.save(tmp_path / f"{i}.npy", np.full((3, 6, 6), i, np.float32))
    ds = FolderDataset(tmp_path).bind(model_inputs(conv_model()))
    assert [f["x"].shape for f in ds] == [(1, 3, 6, 6)] * 3


def test_iterable_and_seed_api():
    items = [{"x": np.zeros((1, 3, 6, 6), np.float32)} for _ in range(2)]
    ds = IterableDataset(items).bind(model_inputs(conv_model()))
    assert not ds.is_empty()
    ds.get_next_batch()
    ds.get_next_batch()
    assert ds.is_empty()
    with pytest.raises(IndexError):
        ds.get_next_batch()
    ds.reset()
    assert ds.get_next_batch()["x"].shape == (1, 3, 6, 6)


def test_onnxruntime_calibration_data_reader():
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(
                [{"x": R.normal(0, 1, (1, 3, 6, 6)).astype(np.float32)} for _ in range(4)]
            )

        def get_next(self):
            return next(self.it, None)

    model = conv_model()
    q, report = onnxq.quantize(model, Reader(), progress=False)
    assert report.calibration.samples == 4
    run(q, {"x": np.zeros((1, 3, 6, 6), np.float32)})


@pytest.mark.parametrize(
    "feed, message",
    [
        (
            {"image": np.zeros((1, 3, 6, 6), np.float32)},
            "array(s) ['image'] that name no input of the model",
        ),
        ({"x": np.zeros((1, 3, 7, 6), np.float32)}, "dimension 2 is 7, the model expects 6"),
        ({"x": np.zeros((3, 6, 6), np.float32)}, "(3 dimensions), the model takes [N, 3, 6, 6] (4"),
        ({"x": np.zeros((1, 3, 6, 6), np.complex64)}, "'x' holds complex64 data"),
    ],
)
def test_bad_feeds_name_the_input(feed, message):
    with pytest.raises(
        DataError,
        match=message.replace("[", r"\[")
        .replace("]", r"\]")
        .replace("(", r"\(")
        .replace(")", r"\)"),
    ):
        onnxq.quantize(conv_model(), [feed], progress=False)


def test_empty_data_is_an_error():
    with pytest.raises(DataError, match="no samples"):
        onnxq.quantize(conv_model(), [], progress=False)
    with pytest.raises(DataError, match="no calibration data"):
        onnxq.quantize(conv_model(), None, progress=False)


def test_runtime_failure_on_calibration_data_is_a_clear_error():
    # dynamic spatial dims, but the Reshape needs exactly 3*6*6 values per sample
    nodes = [
        h.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        h.make_node("Reshape", ["c", "shape"], ["y"], name="flat"),
    ]
    model = make_model(
        nodes,
        [("x", ["N", 3, "H", "W"])],
        [("y", [1, 144])],
        {
            "W": R.normal(0, 1, (4, 3, 3, 3)).astype(np.float32),
            "shape": np.array([1, 144], np.int64),
        },
    )
    bad = [{"x": np.zeros((1, 3, 5, 5), np.float32)}]
    with pytest.raises(CalibrationError, match=r"calibration batch 0 \(input shapes"):
        onnxq.quantize(model, bad, progress=False)


def test_scalar_input_stays_a_scalar():
    # np.ascontiguousarray makes 0-d arrays 1-d; a rank-0 input (silero-vad's sr) must stay 0-d
    from onnxq.calibrate.dataset import model_inputs
    from onnxq.calibrate.sources import as_dataset

    model = make_model(
        [onnx.helper.make_node("Mul", ["x", "k"], ["y"])],
        [("x", ["N", 4]), ("k", [])],
        [("y", None)],
    )
    feeds = [{"x": np.ones((2, 4), np.float32), "k": np.array(3.0, np.float32)}]
    batch = next(as_dataset(feeds, model_inputs(model), None, None, None).batches())
    assert batch["k"].shape == () and batch["x"].flags["C_CONTIGUOUS"]


# saturation bounds ----------------------------------------------------------------------------


def _gate(op: str, gain: float, **attrs) -> onnx.ModelProto:
    """Conv → ``op``: a squeeze-excitation or attention gate with conv outputs of ±10·gain."""
    w = rng(7).normal(0, gain, (8, 4, 3, 3)).astype(np.float32)
    return make_model(
        [
            h.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            h.make_node(op, ["c"], ["y"], name="gate", **attrs),
        ],
        [("x", ["N", 4, 8, 8])],
        [("y", None)],
        {"W": w},
    )


def test_saturation_bounds_cover_only_tensors_read_by_saturating_ops():
    from onnxq.calibrate.calibration import saturation_bounds

    six = h.make_node("Constant", [], ["six"], value=h.make_tensor("v", 1, [], [6.0]))
    then = h.make_graph(
        [h.make_node("Identity", ["k"], ["o"])],
        "then",
        [],
        [h.make_tensor_value_info("o", 1, [1, 4])],
    )
    m = make_model(
        [
            six,
            h.make_node("Sigmoid", ["x"], ["s"]),
            h.make_node("HardSigmoid", ["s"], ["hs"], alpha=0.25, beta=0.5),
            h.make_node("Tanh", ["x"], ["t"]),
            h.make_node("Sigmoid", ["t"], ["u"]),
            h.make_node("LeakyRelu", ["t"], ["r"]),  # t has a non-saturating reader: no bound
            h.make_node("Add", ["hs", "u"], ["a"]),
            h.make_node("Clip", ["a", "", "six"], ["c"]),
            h.make_node("Relu", ["c"], ["y"]),
            h.make_node("HardSwish", ["r"], ["z"]),
            h.make_node("Relu", ["z"], ["k"]),  # k is also read inside the If below
            h.make_node("ReduceMax", ["k"], ["m"], keepdims=0),
            h.make_node("Greater", ["m", "six"], ["cond"]),
            h.make_node("If", ["cond"], ["w"], then_branch=then, else_branch=then),
        ],
        [("x", [1, 4])],
        [("y", None), ("w", [1, 4]), ("r", None)],
        opset=14,
    )
    bounds = saturation_bounds(m)
    # r: a graph output; k: read by the If; s, r: HardSigmoid and HardSwish are left out
    assert set(bounds) == {"x", "a", "c", "z"}  # z: read by a Relu
    assert bounds["a"] == (-np.inf, 6.0) and bounds["c"] == (0.0, np.inf)
    # x feeds Sigmoid (±7.6) and Tanh (±3.8): the union
    assert bounds["x"][0] == pytest.approx(-np.log(2039)) and bounds["x"][1] > 7.6
    lo, hi = bounds["x"]
    y = 1 / (1 + np.exp(-np.array([lo, hi])))
    assert y[0] < 1 / 255 / 2 and y[1] > 1 - 1 / 255 / 2  # clipped inputs keep their codes


def test_an_unfolded_clip_bounds_the_symmetric_range_before_it(monkeypatch):
    # TensorRT keeps Conv -> Q -> DQ -> Clip(0, 6): the symmetric int8 range of a Conv whose
    # outputs reach ±100 was 0.8 per step, the Clip's live range [0, 6] eight codes; bounded
    # it is [-6, 6] (measured: 33.4 -> 35.7 dB here, where the input's own rounding dominates;
    # 10.2 -> 17.9 dB on the graph hypothesis found)
    w = rng(13).normal(0, 3, (4, 3, 3, 3)).astype(np.float32)
    model = make_model(
        [
            h.make_node("Conv", ["x", "W"], ["c"], name="conv"),
            h.make_node("Clip", ["c", "lo", "hi"], ["y"], name="clip"),
        ],
        [("x", ["N", 3, 6, 6])],
        [("y", None)],
        {"W": w, "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)},
    )
    data = {"x": rng(14).standard_normal((16, 3, 6, 6)).astype(np.float32)}
    ref = run(model, data)[0]

    def sqnr(q):
        got = run(q, data, exact=True)[0]
        return 10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2))

    q, report = onnxq.quantize(model, data, target="tensorrt", progress=False)
    assert float(report.values["c_scale"]) == pytest.approx(6 / 127, rel=1e-2)
    monkeypatch.setattr(Calibrator, "saturation_bound", lambda self, tensor: None)
    unbounded, _ = onnxq.quantize(model, data, target="tensorrt", progress=False)
    assert sqnr(q) >= sqnr(unbounded) + 2.0


@pytest.mark.parametrize("op", ["Sigmoid", "Tanh"])
def test_inputs_of_saturating_gates_get_a_finer_grid(op, monkeypatch):
    # conv outputs span about ±30: without the bound the gate's live region [-7.6, 7.6] has a
    # quarter of the codes; measured 1.5-2 dB better on held-out data through onnxruntime
    model = _gate(op, 1.0)
    calib = {"x": rng(8).standard_normal((64, 4, 8, 8)).astype(np.float32)}
    test = {"x": rng(9).standard_normal((64, 4, 8, 8)).astype(np.float32)}
    ref = run(model, test)[0]

    def sqnr(q):
        got = run(q, test)[0]
        return 10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2))

    bounded, _ = onnxq.quantize(model, calib, progress=False)
    monkeypatch.setattr(Calibrator, "saturation_bound", lambda self, tensor: None)
    unbounded, _ = onnxq.quantize(model, calib, progress=False)
    assert sqnr(bounded) >= sqnr(unbounded) + 1.0
    assert sqnr(bounded) >= 30.0


def test_run_ahead_keeps_the_batch_order_and_names_a_failing_batch():
    import threading

    from onnxq.calibrate.streaming import run_ahead

    seen_threads = set()

    class Session:
        def run(self, names, feeds):
            seen_threads.add(threading.get_ident())
            if feeds["x"][0] == 3:
                raise RuntimeError("bad shape")
            return [feeds["x"] * 2]

    batches = [{"x": np.array([i])} for i in range(3)]
    got = [(f["x"][0], int(o[0][0])) for f, o in run_ahead(Session(), ["y"], batches)]
    assert got == [(0, 0), (1, 2), (2, 4)]
    assert threading.get_ident() not in seen_threads  # inference ran beside the caller
    with pytest.raises(CalibrationError, match="calibration batch 3 "):
        list(run_ahead(Session(), ["y"], [*batches, {"x": np.array([3])}]))
    assert list(run_ahead(Session(), ["y"], [])) == []


def test_run_ahead_depth_two_runs_two_batches_at_once_in_order():
    import threading

    from onnxq.calibrate import streaming
    from onnxq.calibrate.streaming import run_ahead

    both = threading.Barrier(2, timeout=10)  # broken (an error) unless two runs overlap

    class Session:
        def run(self, names, feeds):
            if feeds["x"][0] in (1, 2):  # the first batch runs alone (its size decides)
                both.wait()
            return [feeds["x"] * 2]

    batches = [{"x": np.array([i])} for i in range(5)]
    got = [(int(f["x"][0]), int(o[0][0])) for f, o in run_ahead(Session(), ["y"], batches, depth=2)]
    assert got == [(i, 2 * i) for i in range(5)]

    threads = set()

    class Big:  # outputs past AHEAD_BYTES: no second run goes ahead, one thread runs all
        def run(self, names, feeds):
            threads.add(threading.get_ident())
            return [np.zeros(streaming.AHEAD_BYTES // 4 + 1, np.float32)]

    assert len(list(run_ahead(Big(), ["y"], batches, depth=2))) == 5
    assert len(threads) == 1

    class Failing:  # batch 3 fails while batch 4 runs beside it: named, after 0-2 in order
        def run(self, names, feeds):
            if feeds["x"][0] == 3:
                raise RuntimeError("bad shape")
            return [feeds["x"] * 2]

    seen = []
    with pytest.raises(CalibrationError, match="calibration batch 3 "):
        for f, _ in run_ahead(Failing(), ["y"], batches, depth=2):
            seen.append(int(f["x"][0]))
    assert seen == [0, 1, 2]


def _count_runs_in_flight(monkeypatch, delay: float) -> list[int]:
    """The calibrate pass's sessions count their runs at once (each taking ``delay`` s more);
    returns the peak, filled in as the pass runs."""
    import threading

    from onnxq.calibrate import calibration
    from onnxq.io import session as sessions

    peak, live, lock = [0], [0], threading.Lock()
    opened = sessions.make_session

    class Counting:  # the pass's session, counting the runs at once
        def __init__(self, inner):
            self.inner = inner

        def run(self, names, feeds):
            with lock:
                live[0] += 1
                peak[0] = max(peak[0], live[0])
            try:
                threading.Event().wait(delay)
                return self.inner.run(names, feeds)
            finally:
                with lock:
                    live[0] -= 1

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(calibration, "make_session", lambda *a, **k: Counting(opened(*a, **k)))
    return peak


@pytest.mark.parametrize("threads, runs", [(None, 2), (1, 1), (2, 2), (8, 2)])
def test_explicit_threads_bound_the_runs_in_flight_and_change_no_byte(monkeypatch, threads, runs):
    """``--threads 1`` is one onnxruntime run of one thread at a time (one worker's size)."""
    from onnxq.calibrate import calibration

    # each run long enough that a second run would overlap
    peak = _count_runs_in_flight(monkeypatch, 0.02)
    batches = [{"x": R.normal(0, 1, (2, 3, 6, 6)).astype(np.float32)} for _ in range(8)]
    kwargs = {"rounding": "nearest", "bias_correction": "none", "progress": False}
    float_model = conv_model()
    model, _ = onnxq.quantize(float_model, batches, threads=threads, **kwargs)
    assert calibration.stream_depth(threads) == runs
    assert peak[0] <= runs
    if runs == 1:
        assert peak[0] == 1
    monkeypatch.undo()
    reference, _ = onnxq.quantize(float_model, batches, **kwargs)
    assert model.SerializeToString() == reference.SerializeToString()


@pytest.mark.parametrize("slow", ["run", "fold"])
def test_a_second_run_goes_ahead_only_while_the_runs_are_the_slower_side(monkeypatch, slow):
    """Folding slower than running (measured on the first batch): one run in flight, since a
    second would only wait holding one more batch's outputs; the same bytes either way."""
    import threading

    from onnxq.calibrate import calibration, statistics

    peak = _count_runs_in_flight(monkeypatch, 0.03 if slow == "run" else 0.0)
    folding = statistics.Statistics.add

    def fold_slowly(self, *args, **kwargs):
        if slow == "fold":
            threading.Event().wait(0.03)
        return folding(self, *args, **kwargs)

    monkeypatch.setattr(statistics.Statistics, "add", fold_slowly)
    monkeypatch.setattr(calibration, "available_cores", lambda: 2)
    batches = [{"x": R.normal(0, 1, (2, 3, 6, 6)).astype(np.float32)} for _ in range(8)]
    kwargs = {"rounding": "nearest", "bias_correction": "none", "progress": False}
    float_model = conv_model()
    model, _ = onnxq.quantize(float_model, batches, **kwargs)
    assert peak[0] == (2 if slow == "run" else 1)
    monkeypatch.undo()
    reference, _ = onnxq.quantize(float_model, batches, **kwargs)
    assert model.SerializeToString() == reference.SerializeToString()


def test_batch_bytes_reads_the_recorded_shapes_with_the_feeds_sizes():
    from onnxq.calibrate.streaming import batch_bytes

    model = make_model(
        [h.make_node("Relu", ["x"], ["r"]), h.make_node("Flatten", ["r"], ["y"], axis=1)],
        [("x", ["N", 3, "S"])],
        [("y", None)],
    )
    feeds = {"x": np.zeros((4, 3, 10), np.float32)}
    model.graph.value_info.append(
        h.make_tensor_value_info("r", onnx.TensorProto.FLOAT, ["N", 3, "S"])
    )
    assert batch_bytes(model, ["x", "r"], feeds) == 2 * 4 * 3 * 10 * 4
    # a batch axis named anew (shape inference after a Reshape) is the batch
    renamed = h.make_tensor_value_info("u", onnx.TensorProto.FLOAT, ["unk__1", 30])
    model.graph.value_info.append(renamed)
    assert batch_bytes(model, ["u"], feeds) == 4 * 30 * 4
    unknown = h.make_tensor_value_info("v", onnx.TensorProto.FLOAT, [4, "unk__2"])
    model.graph.value_info.append(unknown)
    assert batch_bytes(model, ["u", "v"], feeds) is None  # an inner axis it cannot size
    assert batch_bytes(model, ["nowhere"], feeds) is None
    # onnxruntime's symbolic shape inference writes expressions of the input's dimensions
    halved = h.make_tensor_value_info("w", onnx.TensorProto.FLOAT, ["N", 3, "floor(S/2 - 1/2) + 1"])
    model.graph.value_info.append(halved)
    assert batch_bytes(model, ["w"], feeds) == 4 * 3 * 5 * 4


@pytest.mark.parametrize(
    ("expression", "size"),
    [
        ("floor(floor(floor(DynamicDimension.1/2 - 1/2)/2)/2 - 1/2) + 1", 40),
        ("floor(floor(DynamicDimension.1/2 - 1/2)/2) + 1", 80),
        ("2*N + 1", 9),
        ("DynamicDimension.0*DynamicDimension.1", 1280),
        ("Max(N, 7) - Min(N, 2)", 5),
        ("ceiling(N/3)", 2),
        ("N // 3 + N % 3", 2),
        ("N/3", None),  # not a whole number
        ("N - 4", None),  # not positive
        ("unk__1 + N", None),  # a name it has no size for
        ("N**2", None),  # an operator it does not allow
        ("__import__('os').getpid()", None),
        ("N.real", None),
        ("floor(N", None),
    ],
)
def test_dim_size_evaluates_the_shape_expressions_of_symbolic_inference(expression, size):
    from onnxq.calibrate.streaming import dim_size

    sizes = {"N": 4, "DynamicDimension.0": 4, "DynamicDimension.1": 320}
    assert dim_size(expression, sizes) == size


@pytest.mark.parametrize("large", [False, True])
def test_a_pass_of_one_run_at_a_time_gives_onnxruntime_every_core(monkeypatch, large):
    """Outputs too large for a second run in flight: the one run gets the folding core too."""
    from onnxq.calibrate import calibration, streaming

    cores = streaming.available_cores()
    threads: list[int] = []
    opened = calibration.make_session

    def spy(model, threads_=0, **kwargs):
        threads.append(kwargs.get("threads", threads_))
        return opened(model, **kwargs)

    monkeypatch.setattr(calibration, "make_session", lambda m, **kw: spy(m, **kw))
    if large:  # every batch's outputs over the bound
        monkeypatch.setattr(calibration, "AHEAD_BYTES", 16)
        monkeypatch.setattr(streaming, "AHEAD_BYTES", 16)
    batches = [{"x": R.normal(0, 1, (2, 3, 6, 6)).astype(np.float32)} for _ in range(3)]
    float_model = conv_model()
    kwargs = {"rounding": "nearest", "bias_correction": "none", "progress": False}
    model, _ = onnxq.quantize(float_model, batches, **kwargs)
    assert threads[0] == (cores if large else max(1, cores - 1))
    monkeypatch.undo()
    reference, _ = onnxq.quantize(float_model, batches, **kwargs)
    assert model.SerializeToString() == reference.SerializeToString()


@pytest.mark.parametrize("known", [True, False])
@pytest.mark.parametrize("slow", ["run", "fold"])
def test_one_run_at_a_time_keeps_every_core_only_while_folding_is_not_slower(
    monkeypatch, slow, known
):
    """The first batch is run, then folded; when the folding took longer the pass goes on with
    the cores but one (the folding thread is its critical path), else on every core; same bytes.

    ``known``: the outputs' size is known from the model's shapes, so the pass starts on every
    core; else it starts on the cores but one and learns the size from the first batch."""
    import time as _time

    from onnxq.calibrate import calibration, statistics, streaming

    cores = streaming.available_cores()
    opened: list[tuple[int, bool]] = []
    make = calibration.make_session

    def spy(model, **kwargs):
        opened.append((kwargs.get("threads", 0), kwargs.get("spin", True)))
        return make(model, **kwargs)

    def slow_run(session, names, feeds, index, _run=calibration.run_checked):
        _time.sleep(0.2)
        return _run(session, names, feeds, index)

    def slow_fold(self, *args, _add=statistics.Statistics.add, **kwargs):
        _time.sleep(0.2)
        return _add(self, *args, **kwargs)

    monkeypatch.setattr(calibration, "make_session", spy)
    monkeypatch.setattr(calibration, "AHEAD_BYTES", 16)
    monkeypatch.setattr(streaming, "AHEAD_BYTES", 16)
    if not known:
        monkeypatch.setattr(calibration, "batch_bytes", lambda *_: None)
    if slow == "run":
        monkeypatch.setattr(calibration, "run_checked", slow_run)
    else:
        monkeypatch.setattr(statistics.Statistics, "add", slow_fold)
    batches = [{"x": R.normal(0, 1, (2, 3, 6, 6)).astype(np.float32)} for _ in range(3)]
    float_model = conv_model()
    kwargs = {"rounding": "nearest", "bias_correction": "none", "progress": False}
    model, report = onnxq.quantize(float_model, batches, **kwargs)
    assert report.calibration.samples == 6
    lone, spare = (cores, False), (max(1, cores - 1), True)  # a lone pool does not spin
    assert opened[0] == (lone if known else spare)
    if cores > 1:  # every core for the rest of the pass unless the folding was slower
        if known:
            assert (spare in opened) == (slow == "fold")
        else:
            assert (lone in opened) == (slow == "run")
    monkeypatch.undo()
    reference, _ = onnxq.quantize(float_model, batches, **kwargs)
    assert model.SerializeToString() == reference.SerializeToString()


def test_a_folder_counts_its_samples_from_the_headers(tmp_path):
    from onnxq.calibrate.dataset import FolderDataset, InputSpec

    spec = InputSpec("x", np.dtype(np.float32), (None, 3))
    for i in range(3):  # 2, 1 (no batch axis) and 2 samples
        arr = np.zeros((2, 3) if i != 1 else (3,), np.float32)
        np.savez(tmp_path / f"{i}.npz", x=arr)
    folder = FolderDataset(tmp_path).bind([spec])
    assert folder.most_samples() == 5
    assert FolderDataset(tmp_path, limit=3).bind([spec]).most_samples() == 3
    (tmp_path / "3.npz").write_bytes(b"not a zip")
    assert FolderDataset(tmp_path).bind([spec]).most_samples() is None
