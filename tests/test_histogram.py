"""Histogram observers against brute-force numpy references; memory stays bounded."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from onnxq.calibrators import (
    EntropyCallback,
    EntropyObserver,
    Histogram,
    HistogramViewCallback,
    MinMaxObserver,
    MSECallback,
    MSEObserver,
    PercentileCallback,
    PercentileObserver,
)
from onnxq.core.errors import CalibrationError, ConfigError
from onnxq.core.qparams import dequantize, params_from_range, quantize

R = np.random.default_rng(7)


@pytest.fixture(autouse=True)
def _fresh_generator(monkeypatch):
    # every test draws the same data whichever tests a worker ran before it
    monkeypatch.setattr(f"{__name__}.R", np.random.default_rng(7))


def feed(obs, chunks):
    for c in chunks:
        obs.observe(c)
    return obs


def test_histogram_growth_by_doubling_is_exact():
    chunks = [R.normal(0, s, 5000).astype(np.float32) for s in (0.1, 1.0, 30.0)]
    grown = feed(Histogram(256), chunks)
    allv = np.concatenate(chunks)
    direct = np.histogram(allv, bins=256, range=(-grown.half_range, grown.half_range))[0]
    np.testing.assert_array_equal(grown.counts, direct)
    assert grown.total == allv.size and grown.min == allv.min() and grown.max == allv.max()


def test_histogram_counts_small_and_chunked_batches_exactly():
    # a batch is counted into the bins it spans: a few values (a Loop body's iteration) far
    # from the centre, one value, and a batch longer than a scratch chunk all land where
    # counting every bin would put them
    import onnxq.calibrators.histogram as histogram

    chunks = [
        np.float32([5.5, 5.75, 6.0]),
        np.float32([-7.0]),
        R.normal(0, 2, 3 * histogram._CHUNK + 17).astype(np.float32),
        R.uniform(0.5, 0.75, 40).astype(np.float32),
    ]
    hist = feed(Histogram(512), chunks)
    allv = np.concatenate(chunks)
    direct = np.histogram(allv, bins=512, range=(-hist.half_range, hist.half_range))[0]
    np.testing.assert_array_equal(hist.counts, direct)


def test_histogram_counts_leading_zeros():
    h = feed(Histogram(64), [np.zeros(10, np.float32), np.ones(5, np.float32)])
    assert h.total == 15 and h.counts[32] == 10


@pytest.mark.parametrize("p", [99.0, 99.9, 99.99])
def test_percentile_matches_numpy_within_a_bin(p):
    chunks = [R.laplace(0, 1, 20000).astype(np.float32) for _ in range(5)]
    obs = feed(PercentileObserver(p, 2048), chunks)
    lo, hi = obs.compute()
    allv = np.concatenate(chunks)
    width = 2 * obs.half_range / obs.bins
    # within a bin of the samples on either side of the rank (numpy interpolates between them)
    for got, q in ((hi, p), (lo, 100 - p)):
        below = np.percentile(allv, q, method="lower")
        above = np.percentile(allv, q, method="higher")
        assert below - width <= got <= above + width


def _kl_reference(absh, levels):
    """Direct loops, written apart from the observer: the TensorRT-style KL threshold search."""
    best_i, best = None, np.inf
    for i in range(levels, len(absh) + 1):
        p = list(absh[:i])
        p[-1] += sum(absh[i:])
        q = [0.0] * i
        for j in range(levels):
            a, b = int(np.floor(j * i / levels)), int(np.floor((j + 1) * i / levels))
            nonzero = [k for k in range(a, b) if absh[k] > 0]
            if nonzero:
                share = sum(absh[a:b]) / len(nonzero)
                for k in nonzero:
                    q[k] = share
        ps, qs = sum(p), sum(q)
        kl = sum(
            (pk / ps) * np.log((pk / ps) / max(qk / qs, 1e-12)) for pk, qk in zip(p, q) if pk > 0
        )
        if kl < best:
            best_i, best = i, kl
    return best_i


def test_entropy_threshold_matches_reference_search():
    x = np.abs(R.standard_t(3, 40000)).astype(np.float32)  # heavy tail, one-sided
    obs = EntropyObserver(bins=256)
    feed(obs, [x])
    half = obs.bins // 2
    absh = (obs.counts[half:] + obs.counts[:half][::-1]).astype(float)
    absh[0] -= obs.exact_zeros
    levels = 32
    expect = _kl_reference(list(absh), levels) * obs.half_range / half
    assert obs.threshold(levels) == pytest.approx(expect)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the empty candidates were log(0) and NaN
@pytest.mark.parametrize(
    "values, counts, expect",
    [
        # saturated sigmoid outputs: zeros, ones, a few in between
        ([0.0, 1.0, -0.3], [1000, 500, 20], (-0.3, 1.0)),
        # a two-valued output (found by the property tests: 0.25 dB, the +1e-3 mode clipped)
        ([-1.455e-3, 7.2e-4], [100, 200], (-1.455e-3, 7.2e-4)),
    ],
)
def test_entropy_keeps_every_spike_of_near_discrete_data(values, counts, expect):
    x = np.repeat(np.array(values, np.float32), counts)
    for dtype, symmetric in (("uint8", False), ("int8", True)):
        lo, hi = feed(EntropyObserver(), [x]).compute(dtype, symmetric)
        assert (lo, hi) == pytest.approx(expect, rel=1e-3)


def test_entropy_on_gaussian_clips_tails_but_keeps_bulk():
    x = R.normal(0, 1, 200000).astype(np.float32)
    lo, hi = feed(EntropyObserver(), [x]).compute("int8")
    assert 2.5 < hi < x.max() and x.min() <= lo < -2.5


def test_entropy_differs_from_minmax_on_skewed_data():
    chunks = [np.maximum(R.lognormal(0, 1.2, 20000) - 1, 0).astype(np.float32) for _ in range(5)]
    e_lo, e_hi = feed(EntropyObserver(), chunks).compute("uint8")
    m_lo, m_hi = feed(MinMaxObserver(), chunks).compute()
    assert e_lo == m_lo == 0.0 and e_hi < 0.7 * m_hi


@pytest.mark.parametrize("dtype, symmetric", [("uint8", False), ("int8", True), ("int8", False)])
def test_mse_errors_of_the_whole_grid_match_one_range_at_a_time(dtype, symmetric):
    x = np.concatenate([R.normal(-1, 2, 30000), R.normal(5, 0.3, 3000)]).astype(np.float32)
    obs = feed(MSEObserver(bins=512, grid=40), [x])
    lo, hi = obs.alphas * obs.min, obs.alphas * obs.max
    c = obs.centers()
    for i in (0, 7, 39):  # the bin centres quantized by the real kernel formula
        qp = params_from_range(lo[i], hi[i], dtype, symmetric)
        # dequantized in float64 as errors() does: dequantize()'s float32 result rounds each
        # small difference c - dq by up to 1e-6 of itself, the sum with it
        scale, zp = float(qp.scale), float(qp.zero_point)
        ref = np.sum(obs.counts * (c - (quantize(c, qp).astype(np.float64) - zp) * scale) ** 2)
        got = obs.errors(lo, hi, dtype, symmetric)[i]
        assert got == pytest.approx(ref, rel=1e-9)


def test_mse_finds_the_error_minimum_of_a_known_distribution():
    x = R.laplace(0, 1, 100000).astype(np.float32)
    obs = feed(MSEObserver(bins=4096, grid=50), [x])
    lo, hi = obs.compute("uint8")

    def sample_mse(a):
        qp = params_from_range(a * x.min(), a * x.max(), "uint8")
        return float(np.mean((dequantize(quantize(x, qp), qp) - x) ** 2))

    errors = {a: sample_mse(a) for a in obs.alphas}
    best = min(errors, key=errors.get)
    chosen = hi / x.max()
    assert errors[min(obs.alphas, key=lambda a: abs(a - chosen))] <= 1.05 * errors[best]
    assert chosen < 0.95  # clipping pays off on a Laplacian
    assert sample_mse(chosen) < sample_mse(1.0)


def test_histogram_memory_is_independent_of_samples():
    obs = EntropyObserver()
    before = obs.nbytes()
    for _ in range(300):
        obs.observe(R.normal(0, 3, 4096).astype(np.float32))
    assert obs.nbytes() == before == 2048 * 8 + 40


def test_bad_options():
    with pytest.raises(ConfigError, match="--bins"):
        Histogram(63)
    with pytest.raises(ConfigError, match="--percentile"):
        PercentileObserver(20.0)


def test_a_large_tensor_is_sampled_row_by_row_whatever_the_batching():
    """Past SAMPLE_FROM × SAMPLE_VALUES values a sample, a prime stride keeps at least
    SAMPLE_VALUES of each sample's values, the same ones in any batching; extremes stay exact."""
    from onnxq.calibrators import histogram

    x = R.laplace(0, 1, (6, 64, 80, 80)).astype(np.float32)
    per_row = x[0].size
    stride = histogram._stride(per_row)
    assert stride >= histogram.SAMPLE_FROM and per_row // stride >= histogram.SAMPLE_VALUES
    assert all(stride % d for d in range(2, stride))
    whole, one_by_one, pairs = MSEObserver(), MSEObserver(), MSEObserver()
    whole.observe(x)
    for i in range(6):
        one_by_one.observe(x[i : i + 1])
    for i in range(0, 6, 2):
        pairs.observe(x[i : i + 2])
    for other in (one_by_one, pairs):
        np.testing.assert_array_equal(whole.counts, other.counts)
    assert whole.total == 6 * -(-per_row // stride)
    assert (whole.min, whole.max) == (x.min(), x.max())
    small = MSEObserver()
    small.observe(x[:, :16])  # 102,400 values a sample: all counted
    assert small.total == x[:, :16].size


def test_mse_ranges_from_the_sample_match_those_from_every_value(monkeypatch):
    from onnxq.calibrators import histogram

    # the error is flat near its minimum: the sampled range may sit 10% away from the full
    # one (seeds 0 and 3 of 8) and cost under 4% more error; it is judged by that error, on
    # every value
    x = np.abs(np.random.default_rng(3).laplace(0, 1, (32, 400_000))).astype(np.float32) * 3.0
    sampled = feed(MSEObserver(), [x])
    monkeypatch.setattr(histogram, "SAMPLE_FROM", 10**9)
    histogram._stride.cache_clear()
    try:
        full = feed(MSEObserver(), [x])
    finally:
        histogram._stride.cache_clear()
    assert full.total == x.size and sampled.total < x.size // 10

    def error(lo_hi):
        qp = params_from_range(*lo_hi, "uint8")
        return float(np.mean((dequantize(quantize(x, qp), qp) - x) ** 2))

    assert error(sampled.compute()) <= 1.05 * error(full.compute())
    assert error(sampled.compute()) < 0.7 * error((0.0, float(x.max())))  # and it clips


@pytest.mark.parametrize("make", [EntropyObserver, PercentileObserver])
def test_the_tail_methods_count_every_value(make):
    """Entropy and Percentile read the far tail, which a sample would thin out."""
    x = R.laplace(0, 1, (2, 300_000)).astype(np.float32)
    assert feed(make(), [x]).total == x.size


@pytest.mark.parametrize(
    ("method", "make"),
    [
        (PercentileCallback(99.9), lambda: PercentileObserver(99.9)),
        (EntropyCallback(), EntropyObserver),
    ],
)
def test_a_method_read_from_the_mse_histogram_is_the_method_itself(method, make):
    # the recipe choice reads Percentile and Entropy from the default stream's MSE histograms:
    # on values nothing samples, the very ranges of the methods' own streams
    chunks = [R.laplace(0, s, (4, 2000)).astype(np.float32) for s in (0.5, 2.0, 1.0)]
    mse, own = feed(MSEObserver(), chunks), feed(make(), chunks)
    info = SimpleNamespace(observer=lambda tensor: mse)
    view = HistogramViewCallback(MSECallback(), method)
    read = view.observed(info, SimpleNamespace(tensor="t"))
    for dtype in ("uint8", "int8"):
        assert read.compute(dtype) == own.compute(dtype)
    assert read.counts is mse.counts and view.observer_key == MSECallback().observer_key
    assert read.compute() != mse.compute()  # another method's answer, not the MSE range


def test_a_histogram_of_other_bins_is_not_read_as_another():
    info = SimpleNamespace(observer=lambda tensor: feed(MSEObserver(256), [R.normal(size=100)]))
    view = HistogramViewCallback(MSECallback(256), EntropyCallback(512))
    with pytest.raises(CalibrationError, match="histogram of 256 bins.*same --bins"):
        view.observed(info, SimpleNamespace(tensor="t"))
