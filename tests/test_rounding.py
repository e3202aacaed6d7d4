"""Optimized weight rounding: the solver against numpy, the patches against onnxruntime, and the
pass end to end (the error it reports drops, the model it writes is closer to fp32)."""

import numpy as np
import onnx
import pytest
from helpers import make_model, rng, run
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxq
from onnxq.core.errors import ConfigError
from onnxq.io.openvino import openvino_compile
from onnxq.solve.rounding import (
    ConvShape,
    Grid,
    HessianObserver,
    add_upper,
    conv_patches,
    gptq,
    output_error,
    round_weight,
    symmetric,
    upper_factor_of_inverse,
)


def _correlated(r, rows, k):
    """Rows whose inputs are strongly correlated (what makes rounding errors add up)."""
    mix = r.normal(0, 1, (k, k)) * 0.3 + np.eye(k)
    return r.normal(0, 1, (rows, k)) @ mix + r.normal(0.5, 0.2, k)


def _grid(w, bits=7):
    qmax = 2 ** (bits - 1) - 1
    s = np.abs(w).max(axis=2) / qmax
    return Grid(s, np.zeros_like(s), -qmax, qmax)


@pytest.mark.parametrize("groups,rows_per_group,k", [(1, 24, 40), (6, 2, 9)])
def test_rounding_lowers_the_output_error_on_the_data_it_measures(groups, rows_per_group, k):
    r = rng(1)
    x = np.stack([_correlated(r, 3000, k) for _ in range(groups)], axis=1)  # (n, G, K)
    hess = np.einsum("ngk,ngl->gkl", x, x) / len(x)
    w = r.normal(0, 0.4, (groups, rows_per_group, k))
    grid = _grid(w)
    result = round_weight(w, hess, grid)
    nearest = grid.round(w)

    # the error it reports is the mean squared output error, relative to the output's power
    def measured(q):
        out = np.einsum("ngk,gmk->ngm", x, w)
        err = np.einsum("ngk,gmk->ngm", x, grid.value(q) - w)
        return float((err**2).sum() / (out**2).sum())

    assert np.isclose(result.error_nearest, measured(nearest), rtol=1e-6)
    assert np.isclose(result.error, measured(result.q), rtol=1e-6)
    assert result.error < 0.8 * result.error_nearest  # correlated inputs: a clear gain
    # per row never worse than nearest, and always on the 7-bit grid
    per_row = output_error(w, grid.value(result.q), hess)
    assert np.all(per_row <= output_error(w, grid.value(nearest), hess) + 1e-12)
    assert result.q.min() >= -63 and result.q.max() <= 63
    assert np.array_equal(result.q, np.round(result.q))


def test_gptq_with_uncorrelated_inputs_is_nearest_rounding():
    """With H diagonal no error can be moved anywhere: every weight rounds to nearest."""
    r = rng(2)
    w = r.normal(0, 1, (1, 5, 12))
    hess = np.diag(r.uniform(0.5, 2, 12))[None]
    grid = _grid(w)
    assert np.array_equal(gptq(w, hess, grid), grid.round(w))


def test_dead_inputs_keep_nearest_rounding_and_no_nan():
    r = rng(3)
    x = _correlated(r, 500, 10)
    x[:, [2, 7]] = 0.0  # two inputs that never fire
    hess = (x.T @ x / len(x))[None]
    w = r.normal(0, 1, (1, 4, 10))
    grid = _grid(w)
    q = gptq(w, hess, grid)
    assert np.all(np.isfinite(q))
    assert np.array_equal(q[..., [2, 7]], grid.round(w)[..., [2, 7]])


def _conv_model(c, m, group, kernel, strides, dilations, pads, weight):
    node = h.make_node(
        "Conv", ["x", "W"], ["y"], kernel_shape=list(kernel), strides=list(strides),
        dilations=list(dilations), pads=list(pads), group=group,
    )  # fmt: skip
    spatial = ["H"] * len(kernel)
    return make_model([node], [("x", ["N", c, *spatial])], [("y", None)], {"W": weight})


@pytest.mark.parametrize(
    "c,m,group,kernel,strides,dilations,pads",
    [
        (4, 6, 2, (3, 3), (2, 1), (1, 2), (1, 0, 2, 1)),
        (8, 8, 8, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
        (3, 5, 1, (3,), (2,), (1,), (1, 1)),
    ],
    ids=["grouped-strided-dilated", "depthwise", "conv1d"],
)
def test_patches_times_the_weight_is_what_onnxruntime_computes(
    c, m, group, kernel, strides, dilations, pads
):
    r = rng(4)
    x = r.normal(0, 1, (2, c, *([9] * len(kernel)))).astype(np.float32)
    w = r.normal(0, 1, (m, c // group, *kernel)).astype(np.float32)
    y = run(_conv_model(c, m, group, kernel, strides, dilations, pads, w), {"x": x})[0]
    patches = conv_patches(x, ConvShape(kernel, strides, dilations, pads, group), cap=10**6)
    out = np.einsum("gkr,gmk->rgm", patches, w.reshape(group, m // group, -1))
    ref = np.moveaxis(y, 1, -1).reshape(-1, m)
    np.testing.assert_allclose(out.reshape(len(ref), m), ref, atol=1e-4)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize(
    "kernel,strides,dilations,size",
    [
        ((3, 3), (2, 2), (1, 1), (9, 10)),
        ((4, 1), (3, 1), (1, 1), (10, 7)),
        ((3, 2), (1, 2), (1, 1), (8, 9)),
    ],
)
def test_same_pads_follow_each_input_size_as_onnxruntime_pads(
    auto_pad, kernel, strides, dilations, size
):
    """TF-exported Convs write auto_pad SAME (afis' LEADER: 65 of 78): the pads depend on the
    input's size (odd totals put the odd one at the end or the beginning); as onnxruntime
    computes them, for sizes that divide by the stride and sizes that do not (onnxruntime
    refuses SAME with dilations)."""
    r = rng(6)
    x = r.normal(0, 1, (2, 4, *size)).astype(np.float32)
    w = r.normal(0, 1, (5, 4, *kernel)).astype(np.float32)
    node = h.make_node(
        "Conv", ["x", "W"], ["y"], kernel_shape=list(kernel), strides=list(strides),
        dilations=list(dilations), auto_pad=auto_pad,
    )  # fmt: skip
    y = run(make_model([node], [("x", ["N", 4, "H", "W"])], [("y", None)], {"W": w}), {"x": x})[0]
    conv = ConvShape(kernel, strides, dilations, (0,) * 4, 1, auto_pad)
    patches = conv_patches(x, conv, cap=10**6)
    out = np.einsum("gkr,gmk->rgm", patches, w.reshape(1, 5, -1))
    np.testing.assert_allclose(out.reshape(-1, 5), np.moveaxis(y, 1, -1).reshape(-1, 5), atol=1e-4)
    sparse = conv_patches(x, conv, cap=8)  # the gather path reads the same pads
    grid = patches.reshape(1, patches.shape[1], 2, *y.shape[2:])
    assert sparse.shape[2] < patches.shape[2] and np.isin(sparse, grid).all()


@pytest.mark.parametrize(
    "kernel, strides, dilations, pads, group, size",
    [
        ((1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 1, (40, 40)),  # MobileNetV2's 1x1 layers
        ((3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 6, (37, 41)),  # depthwise, padded
        ((3, 3), (2, 2), (1, 1), (0, 1, 2, 0), 2, (40, 33)),  # uneven pads, strided
        ((3, 2), (1, 2), (2, 1), (1, 0, 1, 1), 1, (30, 35)),  # dilated
        ((3,), (2,), (1,), (1, 1), 3, (90,)),  # 1-D
    ],
)
def test_sparse_patches_are_the_dense_patches_at_the_spread_positions(
    kernel, strides, dilations, pads, group, size
):
    # a cap that keeps few positions takes the gather path; it must hold the same values in
    # the same order as every position's patches cut down to those positions (sign of zero)
    from onnxq.solve.rounding import spread_positions

    x = rng(11).normal(0, 1, (1, 6, *size)).astype(np.float32)
    conv = ConvShape(kernel, strides, dilations, pads, group)
    full = conv_patches(x, conv, cap=10**9)
    cap = max(1, full.shape[2] // 30)
    want = full[:, :, spread_positions(full.shape[2], cap)]
    sparse = conv_patches(x, conv, cap=cap)
    assert sparse.shape == want.shape == (group, full.shape[1], cap)
    np.testing.assert_array_equal(sparse, want)
    assert not np.signbit(sparse[sparse == 0]).any()


def test_a_batch_gives_its_share_of_rows_not_a_coarser_grid():
    """A regular grid of every s-th position each way kept a quarter of a layer's positions
    where its share was just under all of them (83 of 100 at 10 x 10: 25 rows), and the
    layer was then left unrounded for too few rows. Every share is kept exactly, spread over
    the map, whichever way the patches are cut."""
    from onnxq.solve.rounding import spread_positions

    for kernel, pads in [((3, 3), (1, 1, 1, 1)), ((1, 1), (0, 0, 0, 0))]:
        conv = ConvShape(kernel, (1, 1), (1, 1), pads, 1)
        x = rng(14).normal(0, 1, (1, 8, 10, 10)).astype(np.float32)
        full = conv_patches(x, conv, cap=100)
        for cap in (99, 83, 51, 50, 26, 7, 1):
            got = conv_patches(x, conv, cap=cap)
            assert got.shape[2] == cap
            cols = {tuple(col) for col in full[0].T}
            assert all(tuple(col) in cols for col in got[0].T)  # real windows, none twice
            assert len({tuple(col) for col in got[0].T}) == cap
    # more samples than rows: a row from each of every other sample
    conv = ConvShape((3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1)
    x = rng(15).normal(0, 1, (10, 2, 6, 6)).astype(np.float32)
    assert conv_patches(x, conv, cap=5).shape[2] == 5
    # the positions reach across the map, not its first rows
    at = np.unravel_index(spread_positions(100, 25), (10, 10))
    assert set(at[0]) == set(range(10)) and len(set(at[1])) >= 4


@pytest.mark.parametrize(
    "c, group, kernel, strides, pads, size, n, cap",
    [
        (12, 12, (5, 5), (1, 1), (2, 2, 2, 2), (8, 8), 1, 7),  # depthwise, 4 positions kept
        (6, 6, (3, 3), (2, 2), (1, 1, 1, 1), (15, 15), 3, 20),  # strided, samples skipped
        (8, 1, (3, 3), (1, 1), (1, 1, 1, 1), (5, 5), 1, 10**6),  # every one of 25 positions
        (8, 1, (1, 1), (1, 1), (0, 0, 0, 0), (8, 8), 1, 10**6),  # 1x1: the input itself
        (8, 2, (1, 1), (2, 2), (0, 0, 0, 0), (15, 15), 2, 10**6),  # 1x1 strided, grouped
        (4, 1, (3,), (1,), (1, 1), (40,), 2, 10**6),  # 1-D, 40 positions a sample
    ],
)
def test_gathered_and_pointwise_patches_are_the_windows_copy_in_its_layout(
    c, group, kernel, strides, pads, size, n, cap
):
    """The quicker ways conv_patches takes for few positions and for 1x1 kernels give the
    windows' values in the windows' memory layout: the Hessian's float32 product takes its
    bits from the layout too, so a change of way must not move a rounding decision."""
    from onnxq.solve.rounding import _window_patches

    x = rng(12).normal(0, 1, (n, c, *size)).astype(np.float32)
    conv = ConvShape(kernel, strides, (1,) * len(kernel), pads, group)
    out = tuple(
        (size[i] + pads[i] + pads[len(size) + i] - kernel[i]) // strides[i] + 1
        for i in range(len(size))
    )
    positions = int(np.prod(out))
    every = 1 if n * positions <= cap else max(1, -(-n // cap))
    kept = positions if n * positions <= cap else min(positions, -(-cap // len(x[::every])))
    got = conv_patches(x, conv, cap)
    want = _window_patches(x[::every], conv, out, kept)
    np.testing.assert_array_equal(got, want)
    assert got.strides == want.strides


def test_hessian_observer_is_the_mean_outer_product_over_batches():
    r = rng(5)
    batches = [r.normal(0, 1, (3, 7, 5)).astype(np.float32) for _ in range(4)]  # dense input
    obs = HessianObserver(None, groups=1, inputs=5)
    for b in batches:
        obs.observe(b)
    rows = np.concatenate([b.reshape(-1, 5) for b in batches]).astype(np.float64)
    np.testing.assert_allclose(obs.hessian()[0], rows.T @ rows / len(rows), rtol=1e-5)
    assert obs.rows == len(rows)


def test_hessian_observer_sums_a_block_once_whatever_its_products(monkeypatch):
    """Products within a block are summed in float64 and reach the order-independent sum once."""
    import onnxq.solve.rounding as rounding
    from onnxq.solve.sums import PairSum

    monkeypatch.setattr(rounding, "FLUSH_ROWS", 10)  # a product every batch or two
    added = []
    real_add = PairSum.add

    def counted(self, term, own=False):
        added.append(1)
        real_add(self, term, own)

    monkeypatch.setattr(PairSum, "add", counted)
    r = rng(9)
    batches = [r.normal(0, 1, (2, 3, 6)).astype(np.float32) for _ in range(6)]  # 6 rows each
    obs = HessianObserver(None, groups=1, inputs=6)
    for i, b in enumerate(batches):
        obs.observe(b, index=i, block=i // 4)  # blocks of 4 and 2 batches
    rows = np.concatenate([b.reshape(-1, 6) for b in batches]).astype(np.float64)
    np.testing.assert_allclose(obs.hessian()[0], rows.T @ rows / len(rows), rtol=1e-6)
    assert obs.rows == len(rows)
    assert len(added) == 2  # one per block


def _observed(batches, worker=None, conv=None, groups=1, k=6):
    obs = HessianObserver(conv, groups=groups, inputs=k)
    obs.worker = worker
    for i, b in enumerate(batches):
        obs.observe(b, index=i, block=i // 3)
    return obs


@pytest.mark.parametrize("dense", [True, False])
def test_products_on_the_worker_thread_give_the_same_bits(monkeypatch, dense):
    """The calibrate pass multiplies on a thread of its own: the same Hessians, bit for bit."""
    import onnxq.solve.rounding as rounding

    monkeypatch.setattr(rounding, "FLUSH_ROWS", 40)  # several products a block
    r = rng(12)
    if dense:
        batches = [r.normal(0, 3, (5, 4, 24)).astype(np.float32) for _ in range(9)]
        args = {"k": 24}
    else:
        conv = ConvShape((3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 2)
        batches = [r.normal(0, 3, (2, 4, 9, 9)).astype(np.float32) for _ in range(9)]
        args = {"conv": conv, "groups": 2, "k": 18}
    inline = _observed(batches, **args)
    worker = rounding.Products(max_bytes=1)  # every job waits for the one before it
    beside = _observed(batches, worker, **args)
    beside._wait()
    beside.worker = None
    worker.close()
    assert beside.rows == inline.rows > 0
    assert beside.hessian().tobytes() == inline.hessian().tobytes()


def test_products_beside_lets_the_caller_go_on_and_finishes_every_product():
    """Inside the context the products run on the worker; leaving it, every one is done."""
    import threading

    import onnxq.solve.rounding as rounding

    r = rng(13)
    batches = [r.normal(0, 1, (64, 6)).astype(np.float32) for _ in range(6)]
    threads = set()
    real = HessianObserver._multiply

    def recorded(self, pending):
        threads.add(threading.current_thread().name)
        real(self, pending)

    obs = HessianObserver(None, groups=1, inputs=6)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HessianObserver, "_multiply", recorded)
        with rounding.products_beside([obs, object()]):  # other taps are left alone
            assert obs.worker is not None
            for i, b in enumerate(batches):
                obs.observe(b, index=i)
        assert obs.worker is None and not obs._jobs
    assert threads and all(t.startswith("onnxq-hessians") for t in threads)
    rows = np.concatenate(batches).astype(np.float64)
    np.testing.assert_allclose(obs.hessian()[0], rows.T @ rows / len(rows), rtol=1e-5)


def test_an_error_in_a_product_on_the_worker_reaches_the_caller(monkeypatch):
    import onnxq.solve.rounding as rounding

    def broken(self, pending):
        raise MemoryError("no room for the product")

    monkeypatch.setattr(HessianObserver, "_multiply", broken)
    obs = HessianObserver(None, groups=1, inputs=4)
    with pytest.raises(MemoryError, match="no room"):
        with rounding.products_beside([obs]):
            obs.observe(np.ones((8, 4), np.float32), index=0)
            obs.multiply()
    assert obs.worker is None


def test_products_wait_past_their_byte_bound():
    """A job is handed in only once the jobs before it hold less than the bound."""
    import threading

    import onnxq.solve.rounding as rounding

    release, order = threading.Event(), []
    worker = rounding.Products(max_bytes=100)
    worker.submit(lambda: (release.wait(5), order.append("first")), 80)
    threading.Timer(0.2, release.set).start()
    worker.submit(lambda: order.append("second"), 40)  # 120 > 100: waits for the first
    assert order == ["first"]
    worker.close()
    assert order == ["first", "second"]


def test_a_hessian_with_nothing_queued_multiplies_on_the_caller_while_the_worker_is_behind():
    """Rather than wait for the worker, the caller multiplies a Hessian that has no job there."""
    import threading

    import onnxq.solve.rounding as rounding

    release = threading.Event()
    worker = rounding.Products(max_bytes=1)
    worker.submit(lambda: release.wait(5), 1)  # another Hessian's product, still running
    obs = HessianObserver(None, groups=1, inputs=4)
    obs.worker = worker
    for index in range(2):  # one block
        obs.observe(np.ones((8, 4), np.float32), index=index, block=0)
        obs.multiply()
        assert obs.rows == 8 * (index + 1) and not obs._jobs  # before the worker is free
    assert not release.is_set()
    release.set()
    obs.worker = None
    worker.close()


def test_a_hessian_observer_pickles_with_its_products_done():
    """A shard's observer goes back to the parent by pickle: products finished, no thread."""
    import pickle

    import onnxq.solve.rounding as rounding

    r = rng(14)
    worker = rounding.Products()
    obs = _observed([r.normal(0, 1, (30, 6)).astype(np.float32) for _ in range(4)], worker)
    obs.multiply()
    back = pickle.loads(pickle.dumps(obs))
    assert back.worker is None and not back._jobs and back.rows == 120
    obs._wait()
    obs.worker = None
    worker.close()
    assert back.hessian().tobytes() == obs.hessian().tobytes()


@pytest.mark.parametrize("groups,k", [(1, 300), (1, 64), (1, 65), (7, 9), (3, 130)])
def test_upper_factor_of_inverse_is_the_cholesky_factor_of_the_inverse(groups, k):
    r = rng(10)
    x = r.normal(0, 1, (groups, k, 2 * k)) + r.normal(0, 1, (groups, k, 1))
    hess = x @ np.swapaxes(x, 1, 2) / (2 * k) + 0.01 * np.eye(k)
    u = upper_factor_of_inverse(hess)
    assert np.array_equal(u, np.triu(u)) and np.all(np.diagonal(u, axis1=1, axis2=2) > 0)
    np.testing.assert_allclose(np.swapaxes(u, 1, 2) @ u, np.linalg.inv(hess), rtol=1e-7, atol=1e-9)
    # the unique factor with a positive diagonal: what factoring the inverse itself gives
    reference = np.swapaxes(np.linalg.cholesky(np.linalg.inv(hess)), 1, 2)
    np.testing.assert_allclose(u, reference, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("groups,k", [(1, 1), (2, 9), (1, 64), (1, 65), (3, 131)])
def test_the_factor_built_in_place_has_the_bits_of_the_copies(groups, k):
    # the inverse is written over the Cholesky factor and reversed in place (less memory):
    # the same values, bit for bit, as the inverse in a new array reversed into a copy
    from onnxq.solve import rounding

    r = rng(11)
    x = r.normal(0, 1, (groups, k, 2 * k + 1))
    hess = x @ np.swapaxes(x, 1, 2) / (2 * k) + 0.01 * np.eye(k)
    lower = np.linalg.cholesky(hess[:, ::-1, ::-1])
    copies = np.ascontiguousarray(rounding._lower_inverse(lower)[:, ::-1, ::-1])
    factor = upper_factor_of_inverse(hess.copy())
    assert factor.flags.c_contiguous and factor.tobytes() == copies.tobytes()
    a = r.normal(0, 1, (groups, k, k))
    reversed_copy = a[:, ::-1, ::-1].copy()
    rounding._reverse_in_place(a)
    assert a.tobytes() == reversed_copy.tobytes()


@pytest.mark.parametrize("groups,k", [(1, 1), (1, 255), (1, 256), (1, 600), (2, 385)])
def test_the_cholesky_in_place_is_numpy_s_bit_for_bit(groups, k):
    # numpy's own dpotrf on the caller's array, the factor moved to row order by blocks (256
    # rows): the bits of numpy.linalg.cholesky, with zeros above the diagonal
    from onnxq.solve import lapack

    if not lapack.available():
        pytest.skip("numpy's dpotrf is not reachable in this build: numpy's path is used")
    r = rng(12)
    x = r.normal(0, 1, (groups, k, 2 * k + 3))
    hess = x @ np.swapaxes(x, 1, 2) / (2 * k) + 0.01 * np.eye(k)
    want = np.linalg.cholesky(hess)
    got = hess.copy()
    lapack.cholesky_in_place(got)
    assert got.tobytes() == want.tobytes()
    bad = -np.eye(3)[None].copy()
    with pytest.raises(np.linalg.LinAlgError):
        lapack.cholesky_in_place(bad)
    with pytest.raises(ValueError, match="C-contiguous"):
        lapack.cholesky_in_place(np.eye(4)[None, ::-1, ::-1])


@pytest.mark.parametrize("k", [383, 384, 700])
def test_a_hessian_handed_over_is_factored_in_place_to_the_same_bits(k):
    # at IN_PLACE_INPUTS and up the factor is written over the Hessian handed over (no copy
    # beside it); below, and for an array the caller keeps, numpy factors a copy: same bits
    from onnxq.solve import rounding

    r = rng(13)
    x = r.normal(0, 1, (1, k, 2 * k))
    hess = x @ np.swapaxes(x, 1, 2) / (2 * k) + 0.01 * np.eye(k)
    kept = upper_factor_of_inverse(hess)
    assert not np.shares_memory(kept, hess)
    handed = hess.copy()
    factor = upper_factor_of_inverse(handed, own=True)
    assert factor.tobytes() == kept.tobytes()
    in_place = k >= rounding.IN_PLACE_INPUTS and rounding.lapack_available()
    assert np.shares_memory(factor, handed) == in_place


def _small_cnn():
    """Conv → Relu → depthwise Conv → Relu → pointwise Conv → pool → Gemm, correlated inputs."""
    r = rng(6)
    nodes = [
        h.make_node("Conv", ["x", "W1", "B1"], ["a"], name="conv", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["a"], ["a1"], name="relu1"),
        h.make_node("Conv", ["a1", "W2", "B2"], ["b"], name="dw", group=16, pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["b"], ["b1"], name="relu2"),
        h.make_node("Conv", ["b1", "W3", "B3"], ["c"], name="pw"),
        h.make_node("GlobalAveragePool", ["c"], ["p"], name="pool"),
        h.make_node("Flatten", ["p"], ["f"], name="flat"),
        h.make_node("Gemm", ["f", "W4", "B4"], ["y"], name="fc", transB=1),
    ]
    inits = {
        "W1": r.normal(0, 0.3, (16, 4, 3, 3)), "B1": r.normal(0, 0.1, 16),
        "W2": r.normal(0, 0.5, (16, 1, 3, 3)), "B2": r.normal(0, 0.1, 16),
        "W3": r.normal(0, 0.3, (8, 16, 1, 1)), "B3": r.normal(0, 0.1, 8),
        "W4": r.normal(0, 0.5, (5, 8)), "B4": r.normal(0, 0.1, 5),
    }  # fmt: skip
    inits = {k: v.astype(np.float32) for k, v in inits.items()}
    model = make_model(nodes, [("x", ["N", 4, 10, 10])], [("y", None)], inits)

    def data(seed, n):
        g = rng(seed)
        base = g.normal(0, 1, (n, 1, 10, 10))  # one shared component: channels correlate
        return {"x": (base + 0.5 * g.normal(0, 1, (n, 4, 10, 10))).astype(np.float32)}

    return model, data(7, 96), data(8, 64)


@pytest.fixture(scope="module")
def cnn_runs():
    model, calib, held_out = _small_cnn()
    kw = dict(progress=False, weight_bits=7, method="minmax", bias_correction="none")
    out = {}
    for fmt in ("qoperator", "qdq", "openvino"):
        for rounding in ("nearest", "optimized"):
            out[fmt, rounding] = onnxq.quantize(model, calib, format=fmt, rounding=rounding, **kw)
    return model, calib, held_out, out


def test_optimized_rounding_brings_the_model_closer_to_fp32(cnn_runs):
    model, _, held_out, out = cnn_runs
    ref = run(model, held_out)[0]

    def err(q):
        return float(np.mean((run(q, held_out)[0] - ref) ** 2))

    for fmt in ("qoperator", "qdq"):
        nearest, optimized = out[fmt, "nearest"][0], out[fmt, "optimized"][0]
        assert err(optimized) < 0.8 * err(nearest), fmt
    report = out["qoperator", "optimized"][1]
    assert set(report.rounding) == {"conv", "dw", "pw", "fc"}
    for layer, entry in report.rounding.items():
        if "skipped" in entry:  # the Gemm sees 96 rows for 8 inputs: rounded too
            pytest.fail(f"{layer}: {entry['skipped']}")
        assert entry["sqnr_db"] >= entry["sqnr_nearest_db"], layer
    assert "layers rounded for least output error" in report.algorithms["rounding"]
    assert report.to_dict()["rounding"] == report.rounding
    assert out["qoperator", "nearest"][1].rounding == {}


def test_weights_stay_on_the_seven_bit_grid_in_every_format(cnn_runs):
    _, _, _, out = cnn_runs
    q = out["qoperator", "optimized"][0]
    weights = [
        nh.to_array(i) for i in q.graph.initializer if i.name.endswith("_quantized")
        and nh.to_array(i).dtype == np.int8
    ]  # fmt: skip
    assert weights and all(np.abs(w).max() <= 63 for w in weights)


def test_openvino_form_holds_the_same_rounded_weights(cnn_runs):
    """The FakeQuantize form is rebuilt from the float model: it must write the rounded weights."""
    _, _, _, out = cnn_runs
    qop = {i.name: nh.to_array(i) for i in out["qoperator", "optimized"][0].graph.initializer}
    fq = {i.name: nh.to_array(i) for i in out["openvino", "optimized"][0].graph.initializer}
    nearest_fq = {i.name: nh.to_array(i) for i in out["openvino", "nearest"][0].graph.initializer}
    for name in ("W1", "W2", "W3", "W4"):
        scale = qop[f"{name}_scale"].reshape(-1, *[1] * (qop[f"{name}_quantized"].ndim - 1))
        rounded = qop[f"{name}_quantized"].astype(np.float64) * scale
        np.testing.assert_allclose(fq[name], rounded, rtol=1e-6, atol=1e-9)
        assert not np.allclose(fq[name], nearest_fq[name])  # not the original weights


def test_openvino_runs_the_rounded_model_like_onnxruntime(cnn_runs):
    pytest.importorskip("openvino", reason="needs the OpenVINO runtime: pip install openvino")
    model, _, held_out, out = cnn_runs
    fq = out["openvino", "optimized"][0]
    got = openvino_compile(fq)(held_out)[0]
    ref = run(model, held_out)[0]
    qdq = run(out["qdq", "optimized"][0], held_out)[0]
    # the same grid and weights: OpenVINO and onnxruntime agree far better than int8 and fp32
    assert np.mean((got - qdq) ** 2) < 0.25 * np.mean((qdq - ref) ** 2)


def test_deterministic(cnn_runs):
    model, calib, _, out = cnn_runs
    again, _ = onnxq.quantize(
        model, calib, progress=False, weight_bits=7, method="minmax", bias_correction="none",
        rounding="optimized",
    )  # fmt: skip
    first = out["qoperator", "optimized"][0]
    assert again.SerializeToString() == first.SerializeToString()


def test_the_calibrate_pass_multiplies_beside_the_folding_thread_and_keeps_the_bytes(monkeypatch):
    """Two cores: the Hessians' products run on their own thread; ``threads=1``: on the caller.

    The model written is the same either way.
    """
    import threading

    import onnxq.calibrate.calibration as calibration

    model, calib, _ = _small_cnn()
    monkeypatch.setattr(calibration, "available_cores", lambda: 2)
    seen: list[str] = []
    real = HessianObserver._multiply

    def recorded(self, pending):
        seen.append(threading.current_thread().name)
        real(self, pending)

    monkeypatch.setattr(HessianObserver, "_multiply", recorded)
    kw = dict(progress=False, method="minmax", bias_correction="none", recipe="fixed")
    beside, _ = onnxq.quantize(model, calib, **kw)
    on_worker = [t for t in seen if t.startswith("onnxq-hessians")]
    seen.clear()
    alone, _ = onnxq.quantize(model, calib, threads=1, **kw)
    assert on_worker and not [t for t in seen if t.startswith("onnxq-hessians")]
    assert beside.SerializeToString() == alone.SerializeToString()


def test_auto_rounds_a_cnn_and_the_skips_say_why():
    model, calib, _ = _small_cnn()
    # W3 read by a second Conv too: a shared weight keeps nearest rounding
    extra = h.make_node("Conv", ["b1", "W3"], ["c2"], name="pw2")
    model.graph.node.insert(5, extra)
    model.graph.output.append(
        h.make_tensor_value_info("c2", onnx.TensorProto.FLOAT, ["N", 8, 10, 10])
    )
    _, report = onnxq.quantize(model, {"x": calib["x"][:2]}, progress=False)
    assert report.model_kind == "cnn"
    assert "shared by 2 nodes" in report.rounding["pw"]["skipped"]
    # two samples: the Gemm has 2 rows for 8 inputs, too few to fit anything
    assert "2 calibration rows for 8 weight inputs" in report.rounding["fc"]["skipped"]
    assert "sqnr_db" in report.rounding["dw"]


def test_off_for_other_kinds_with_loaded_ranges_and_a_bad_value(tmp_path):
    model, calib, _ = _small_cnn()
    _, report = onnxq.quantize(model, calib, progress=False, model_kind="other")
    assert report.algorithms["rounding"] == "off (auto, other model)"
    table = tmp_path / "ranges.json"
    onnxq.quantize(model, calib, progress=False, save_ranges=table)
    _, report = onnxq.quantize(model, None, progress=False, load_ranges=table)
    assert report.algorithms["rounding"].startswith("off (ranges loaded")
    with pytest.raises(ConfigError, match="rounding='adaround'"):
        onnxq.quantize(model, calib, progress=False, rounding="adaround")


def test_cli_takes_the_flag(tmp_path):
    from onnxq.cli import main

    model, calib, _ = _small_cnn()
    src, npz, out, rep = (tmp_path / n for n in ("m.onnx", "c.npz", "q.onnx", "r.json"))
    onnx.save(model, str(src))
    np.savez(npz, x=calib["x"])
    args = ["quantize", str(src), "--data", str(npz), "-o", str(out), "--quiet"]
    assert main([*args, "--rounding", "optimized", "--report", str(rep)]) == 0
    assert "dw" in __import__("json").loads(rep.read_text())["rounding"]
    with pytest.raises(SystemExit) as info:
        main([*args, "--rounding", "best"])
    assert info.value.code == 2


def test_hessian_rows_are_bounded_and_spread_over_the_batches():
    from onnxq.solve.rounding import total_rows

    big = 2048  # a 2048-input dense layer: the budget allows few rows per batch
    obs = HessianObserver(None, groups=1, inputs=big, batches=40)
    # every batch gives the same share (the total rounded up to a multiple of the batches)
    assert obs.per_batch == -(-total_rows(1, big) // 40) and obs.total == obs.per_batch * 40
    x = rng(9).normal(0, 1, (16, 64, big)).astype(np.float32)  # 1024 rows a batch
    for _ in range(40):
        obs.observe(x)
    assert obs.hessian() is not None
    assert obs.rows == obs.total and obs.per_batch < 1024  # every batch gave its share
    conv = ConvShape((3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1)
    patches = conv_patches(rng(10).normal(0, 1, (2, 4, 40, 40)), conv, cap=200)
    assert 100 <= patches.shape[2] <= 260  # a grid of positions near the cap, both samples


def test_batches_of_unknown_number_give_rows_until_the_layer_has_its_total():
    # 288 inputs (32 channels, 3 × 3) at 14 × 14: 196 rows a sample. One batch of 8 known to be
    # the only one, or 8 batches of one sample from a source of unknown length: the same rows
    # (every position of every sample), the same Hessian. Counted as row_cap() rows a batch,
    # a source of single samples stopped after 13 (2,548 rows of the 53,248 it wanted).
    conv = ConvShape((3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1)
    x = rng(13).normal(0, 1, (8, 32, 14, 14)).astype(np.float32)
    known = HessianObserver(conv, groups=1, inputs=288, batches=1)
    known.observe(x, index=0, block=0)
    unknown = HessianObserver(conv, groups=1, inputs=288)
    for i in range(8):
        unknown.observe(x[i : i + 1], index=i, block=0)
    np.testing.assert_allclose(unknown.hessian(), known.hessian(), rtol=1e-6)
    assert unknown.rows == known.rows == 8 * 196
    few = HessianObserver(conv, groups=1, inputs=288)  # still stops once it has its total
    for i in range(few.total // 196 + 20):
        few.observe(x[i % 8 : i % 8 + 1], index=i, block=i)
    assert few.hessian() is not None
    assert few.total <= few.rows < few.total + 196


@pytest.mark.parametrize("source", ["arrays", "folder"])
def test_a_hessian_too_few_rows_could_fill_is_never_gathered(tmp_path, monkeypatch, source):
    """A 0.9 MB CNN with an 8,192-input classifier took 3.3 GB: the classifier's Hessian was
    accumulated from 200 rows, then dropped. The rows a layer can get are bounded before."""
    import onnxq.passes.rounding as rounding_pass

    made = []
    real = rounding_pass.HessianObserver

    def counting(conv, groups, k, batches=None):
        made.append(k)
        return real(conv, groups, k, batches)

    monkeypatch.setattr(rounding_pass, "HessianObserver", counting)
    model, calib, _ = _small_cnn()
    data = {"x": calib["x"][:3]}
    if source == "folder":
        folder = tmp_path / "samples"
        folder.mkdir()
        for i in range(3):
            np.save(folder / f"{i}.npy", data["x"][i])
        data = str(folder)
    _, report = onnxq.quantize(model, data, progress=False)
    assert report.rounding["fc"]["skipped"].startswith("at most 3 calibration rows for 8")
    assert 8 not in made and made  # the convolutions' Hessians, not the Gemm's
    assert "sqnr_db" in report.rounding["dw"]


def test_a_layer_whose_hessian_overflows_keeps_nearest_rounding():
    """One calibration value of 3e38: the products of a layer's inputs overflow float64's
    float32 products; that layer keeps nearest rounding, with why, and nothing else fails."""
    model, calib, _ = _small_cnn()
    x = calib["x"][:8].copy()
    x[3, 0, 0, 0] = 3e38
    _, report = onnxq.quantize(model, {"x": x}, progress=False, rounding="optimized")
    skipped = [v["skipped"] for v in report.rounding.values() if "skipped" in v]
    assert any("too large for their products" in why for why in skipped), report.rounding


@pytest.mark.parametrize(("groups", "k"), [(1, 1), (1, 7), (3, 130)])
def test_a_hessian_keeps_its_upper_triangle_and_gives_back_the_whole_matrix(groups, k):
    # half the memory while calibrating: the upper triangle of x xᵀ is summed, the lower
    # one mirrored when the Hessian is taken; the same bits as the whole product
    x = rng(12).normal(0, 1, (groups, k, 50)).astype(np.float32)
    whole = np.matmul(x, np.swapaxes(x, 1, 2)).astype(np.float64)
    packed = add_upper(whole, None)
    assert packed.shape == (groups, k * (k + 1) // 2)
    np.testing.assert_array_equal(symmetric(packed, k), whole)
    obs = HessianObserver(None, groups=1, inputs=k, batches=1)
    obs.observe(np.swapaxes(x[0], 0, 1)[None], index=0)
    assert obs._block_sum is None or obs._block_sum.shape == (1, k * (k + 1) // 2)
    np.testing.assert_array_equal(obs.hessian(), whole[:1] / 50)
