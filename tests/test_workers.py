"""Mergeable statistics and ``--workers N``: shards merge into what one pass gathers.

Each observer is checked against a single-pass reference by splitting a stream of batches
into shards (in blocks, in random assignments), merging, and comparing exactly; the CLI is run
with 1 and 2 workers on the demo CNN and the output models compared byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import pickle

import numpy as np
import pytest

import onnxq
from onnxq.calibrate.statistics import Statistics, block_size
from onnxq.calibrators import (
    AverageMaxObserver,
    EntropyObserver,
    Histogram,
    MinMaxObserver,
    MSEObserver,
    PercentileObserver,
)
from onnxq.cli import main
from onnxq.core.errors import CalibrationError
from onnxq.solve.rounding import ConvShape, HessianObserver
from onnxq.solve.sums import PairSum

R = np.random.default_rng(11)


def _stream(n: int = 14) -> list[np.ndarray]:
    """Batches of different sizes and scales, with the awkward values a grid has edges at."""
    out = [
        (R.standard_normal(int(R.integers(1, 4000))) * s).astype(np.float32)
        for s in R.choice([1e-3, 0.25, 3.0, 80.0], n)
    ]
    out.insert(3, np.array([4.0, -4.0, 1.0, 0.0, -0.0, 2.0**-20], np.float32))
    out.insert(0, np.zeros(7, np.float32))  # zeros before any range
    return out


def _split(batches: list[np.ndarray], shards: int, seed: int) -> list[list[np.ndarray]]:
    owner = np.random.default_rng(seed).integers(0, shards, len(batches))
    return [[b for b, o in zip(batches, owner) if o == s] for s in range(shards)]


@pytest.mark.parametrize(
    "make",
    [
        MinMaxObserver,
        AverageMaxObserver,
        Histogram,
        PercentileObserver,
        EntropyObserver,
        MSEObserver,
    ],
    ids=lambda c: c.__name__,
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_observers_merge_into_the_single_pass_result(make, seed):
    batches = _stream()
    one = make()
    for b in batches:
        one.observe(b)
    shards = []
    for part in _split(batches, 3, seed):
        obs = make()
        for b in part:
            obs.observe(b)
        shards.append(pickle.loads(pickle.dumps(obs)))  # as a worker sends it back
    merged = shards[2]
    merged.merge(shards[1])
    merged.merge(shards[0])
    for dtype, symmetric in (("uint8", False), ("int8", True)):
        assert merged.compute(dtype, symmetric) == one.compute(dtype, symmetric)
    if isinstance(one, Histogram):
        np.testing.assert_array_equal(merged.counts, one.counts)
        assert (merged.half_range, merged.total, merged.exact_zeros) == (
            one.half_range,
            one.total,
            one.exact_zeros,
        )


def test_a_histogram_does_not_depend_on_the_order_of_its_batches():
    batches = _stream(20)
    a, b = Histogram(), Histogram()
    for x in batches:
        a.observe(x)
    for i in R.permutation(len(batches)):
        b.observe(batches[i])
    np.testing.assert_array_equal(a.counts, b.counts)
    top = max(-a.min, a.max)  # the grid: the power of two above the largest magnitude
    assert a.half_range == b.half_range == 2.0 ** (np.floor(np.log2(top)) + 1)


def test_average_max_with_momentum_refuses_to_merge():
    a, b = AverageMaxObserver(0.1), AverageMaxObserver(0.1)
    a.observe(np.ones(3, np.float32))
    with pytest.raises(CalibrationError, match="momentum.*--workers 1"):
        a.merge(b)


def test_pair_sums_do_not_depend_on_the_order_of_their_terms():
    terms = [R.standard_normal((5, 7)) * 10.0 ** R.integers(-8, 9) for _ in range(200)]
    forward, backward, halves = PairSum(), PairSum(), [PairSum(), PairSum()]
    for t in terms:
        forward.add(t)
    for t in reversed(terms):
        backward.add(t)
    for i, t in enumerate(terms):
        halves[i % 2].add(t)
    halves[1].merge(halves[0])
    np.testing.assert_array_equal(forward.value(), backward.value())
    np.testing.assert_array_equal(forward.value(), halves[1].value())
    np.testing.assert_allclose(forward.value(), np.sum(terms, axis=0), rtol=1e-12, atol=1e-3)


def test_a_pair_sum_keeps_an_owned_first_term_and_copies_a_lent_one():
    lent, owned = np.ones(3), np.ones(3)
    a, b = PairSum(), PairSum()
    a.add(lent)
    b.add(owned, own=True)
    a.add(np.ones(3))
    lent[:] = 7.0  # the caller's array changes after it was added: the sum does not
    np.testing.assert_array_equal(a.value(), [2.0, 2.0, 2.0])
    assert b.hi is owned
    frozen = np.ones(3)
    frozen.setflags(write=False)  # read-only (from Ray's object store): copied, not kept
    c = PairSum()
    c.add(frozen, own=True)
    c.add(np.ones(3))
    np.testing.assert_array_equal(c.value(), [2.0, 2.0, 2.0])


def test_a_pair_sum_of_one_term_holds_no_second_array_and_gives_the_same_bits():
    # lo is made with the second term: a Hessian gathered in one block was two float64 arrays
    term = np.array([[-0.0, 1.5], [2.0**-60, -3.0]])
    one = PairSum()
    one.add(term.copy(), own=True)
    assert one.lo is None
    np.testing.assert_array_equal(one.value(), term + np.zeros_like(term))
    assert not np.signbit(one.value()[0, 0])  # as hi + zeros made it
    # merged either way round with a sum of several terms: the same as adding one by one
    many = [R.standard_normal((2, 2)) * 10.0 ** R.integers(-8, 9) for _ in range(5)]
    whole = PairSum()
    for t in [term, *many]:
        whole.add(t)
    for first_single in (True, False):
        a, b = PairSum(), PairSum()
        a.add(term)
        for t in many:
            b.add(t)
        merged, other = (a, b) if first_single else (b, a)
        merged.merge(other)
        np.testing.assert_allclose(merged.value(), whole.value(), rtol=1e-15)
    empty = PairSum()
    empty.merge(b)
    np.testing.assert_array_equal(empty.value(), b.value())


def test_a_hessian_multiplies_its_last_rows_when_they_arrive():
    # not held until the Hessian is taken: every layer's buffer was alive to the end
    obs = HessianObserver(None, groups=1, inputs=4, batches=3)
    x = R.standard_normal((2, 5, 4)).astype(np.float32)
    for i in range(3):
        obs.observe(x, index=i, block=0)
        assert bool(obs._pending) == (i < 2)
    assert obs.rows == 30


@pytest.mark.parametrize("conv", [None, ConvShape((3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 4)])
def test_a_hessian_split_by_blocks_is_the_one_pass_hessian(conv):
    shape = (3, 4, 12, 12) if conv is not None else (3, 10, 24)
    batches = [R.standard_normal(shape).astype(np.float32) for _ in range(13)]
    groups, k = (4, 9) if conv is not None else (1, 24)
    block = 2

    def make() -> HessianObserver:
        return HessianObserver(conv, groups, k, batches=len(batches))

    one = make()
    for i, x in enumerate(batches):
        one.observe(x, index=i, block=i // block)
    shards = [make(), make()]
    for i, x in enumerate(batches):  # blocks dealt in turn, as the parent deals them
        shards[(i // block) % 2].observe(x, index=i, block=i // block)
    shards[1].merge(shards[0])
    np.testing.assert_array_equal(shards[1].hessian(), one.hessian())
    assert shards[1].rows == one.rows


def test_the_hessians_buffer_rows_within_a_bound_and_shards_still_sum_alike(monkeypatch):
    # each layer buffered up to 4 MiB of rows for one product: 115 MiB on a ResNet-50
    import onnxq.calibrate.statistics as stats_module

    budget = 3 * 8 * 64 * 4  # bytes: three layers' rows of 8 samples
    monkeypatch.setattr(stats_module, "PENDING_BYTES", budget)
    names = [f"t{i}" for i in range(6)]
    batches = [[R.standard_normal((8, 64)).astype(np.float32) for _ in names] for _ in range(12)]

    block = 3  # 4 blocks of batches, dealt to two shards in turn

    def make() -> Statistics:
        taps = {n: [HessianObserver(None, 1, 64, batches=len(batches))] for n in names}
        return Statistics({n: [MinMaxObserver()] for n in names}, taps=taps, block=block)

    one, shards = make(), [make(), make()]
    for i, outs in enumerate(batches):
        one.add(names, outs, 8, i)
        assert sum(t[0].pending_bytes for t in one.taps.values()) <= budget
        shards[(i // block) % 2].add(names, outs, 8, i)
    shards[1].merge(shards[0])
    for name in names:
        hessian = one.taps[name][0].hessian()
        np.testing.assert_array_equal(shards[1].taps[name][0].hessian(), hessian)
        unbounded = HessianObserver(None, 1, 64, batches=len(batches))
        for i, outs in enumerate(batches):
            unbounded.observe(outs[names.index(name)], index=i, block=i // block)
        np.testing.assert_allclose(hessian, unbounded.hessian(), rtol=1e-5, atol=1e-6)


def test_statistics_merge_counts_and_channel_sums():
    def make() -> Statistics:
        return Statistics({"t": [MinMaxObserver()]}, channel_axes={"t": 1})

    batches = [R.standard_normal((2, 3, 5)).astype(np.float32) for _ in range(9)]
    batches[4][0, 0, 0] = np.nan
    one, shards = make(), [make(), make()]
    for i, x in enumerate(batches):
        one.add(["t"], [x], 2, i)
        shards[i % 2].add(["t"], [x], 2, i)
    shards[0].merge(shards[1])
    assert (shards[0].batches, shards[0].samples, shards[0].nonfinite) == (9, 18, {"t": 1})
    a, b = one.channel_totals()["t"], shards[0].channel_totals()["t"]
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1]
    assert block_size(1) == 128 and block_size(64) == 2 and block_size(512) == 1


def test_statistics_can_let_each_output_go_once_folded():
    """The calibrate pass hands its batch over: each tensor is let go of once observed (the
    next batch's outputs fill beside it), with the same statistics as a batch kept whole."""
    import weakref

    names = ["a", "b"]
    batches = [[R.standard_normal((2, 3, 4)).astype(np.float32) for _ in names] for _ in range(3)]

    def make() -> Statistics:
        return Statistics({n: [MinMaxObserver()] for n in names}, channel_axes={"a": 1})

    kept, released = make(), make()
    for i, outs in enumerate(batches):
        kept.add(names, outs, 2, i)
        assert all(o is not None for o in outs)
        handed = list(outs)
        gone = [weakref.ref(o) for o in handed]
        released.add(names, handed, 2, i, release=True)
        assert handed == [None, None]
        del handed
    outs = None
    batches.clear()
    assert [r() for r in gone] == [None, None]
    for name in names:
        assert vars(kept.observers[name][0]) == vars(released.observers[name][0])
    np.testing.assert_array_equal(kept.channel_totals()["a"][0], released.channel_totals()["a"][0])


@pytest.mark.parametrize(("samples", "workers"), [(1, 2), (16, 2), (64, 3), (512, 2)])
def test_every_worker_gets_its_first_block_before_any_batch_is_taken(samples, workers):
    """The parent deals blocks in turn into bounded queues; no worker may wait on another's.

    With room for two batches, the parent blocked on worker 0's queue for the rest of block 0
    while worker 1 had nothing: two workers ran as slowly as one.
    """
    import queue

    from onnxq.calibrate.shards import inbox_capacity, worker_of

    block = block_size(samples)
    inboxes = [queue.Queue(maxsize=inbox_capacity(block)) for _ in range(workers)]
    for index in range(block * workers):  # nobody takes anything meanwhile
        inboxes[worker_of(index, block, workers)].put_nowait(index)  # raises queue.Full
    assert [box.qsize() for box in inboxes] == [block] * workers


def _digits(tmp_path):
    from onnxq.demo import demo_files

    path, arrays = demo_files()
    data = tmp_path / "calib.npz"
    np.savez(data, input=arrays["calib"])
    return path, data


def _quantize(path, data, out, *extra) -> int:
    return main(
        [
            "quantize",
            str(path),
            "--data",
            str(data),
            "-o",
            str(out),
            "--quiet",
            "--no-latency-check",
            "--batch-size",
            "8",
            *extra,
        ]
    )


@pytest.mark.parametrize("method", ["minmax", "average-max", "mse", "entropy"])
def test_two_workers_write_the_model_one_process_writes(tmp_path, method):
    path, data = _digits(tmp_path)
    digests, ranges = [], []
    for workers in (1, 2):
        out, table = tmp_path / f"w{workers}.onnx", tmp_path / f"w{workers}.json"
        rc = _quantize(
            path,
            data,
            out,
            "--method",
            method,
            "--workers",
            str(workers),
            "--save-ranges",
            str(table),
        )
        assert rc == 0
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
        ranges.append(json.loads(table.read_text())["tensors"])
    assert ranges[0] == ranges[1]
    assert digests[0] == digests[1]


def test_bad_worker_counts_are_refused(tmp_path, capsys):
    path, data = _digits(tmp_path)
    with pytest.raises(SystemExit) as info:
        _quantize(path, data, tmp_path / "x.onnx", "--workers", "two")
    assert info.value.code == 2
    assert _quantize(path, data, tmp_path / "x.onnx", "--workers", "0") == 2
    assert "--workers 0 must be a whole number >= 1" in capsys.readouterr().err
    assert _quantize(path, data, tmp_path / "x.onnx", "--threads", "-1") == 2
    assert "--threads -1 must be a whole number >= 1" in capsys.readouterr().err
    with pytest.raises(Exception, match="workers=0 must be a whole number"):
        onnxq.quantize(str(path), np.load(data)["input"], workers=0)
    assert not (tmp_path / "x.onnx").exists()


def test_a_batch_a_worker_cannot_run_is_reported_by_the_parent(tmp_path):
    """Reshape to [2, 4] runs on one sample of 8 values, not on a batch of 3: the worker's
    onnxruntime error comes back as the one-process error, naming the batch."""
    from helpers import make_model
    from onnx import helper as oh

    w = R.standard_normal((4, 4)).astype(np.float32)
    model = make_model(
        [oh.make_node("Reshape", ["x", "shape"], ["r"]), oh.make_node("MatMul", ["r", "w"], ["y"])],
        [("x", ["N", 8])],
        [("y", None)],
        {"shape": np.array([2, 4], np.int64), "w": w},
    )
    x = R.standard_normal((6, 8)).astype(np.float32)
    with pytest.raises(CalibrationError, match=r"calibration batch \d+ \(input shapes"):
        onnxq.quantize(model, {"x": x}, batch_size=3, workers=2, progress=False)


def test_a_worker_that_dies_is_named_with_its_exit_code_and_nothing_is_left_running():
    """A worker gone without a word (killed, out of memory) is one error naming it; the
    threads dealing batches end, and the workers started are all reaped."""
    import threading

    from helpers import DyingObserver, make_model
    from onnx import helper as oh

    from onnxq.calibrate.shards import observe_in_processes

    model = make_model([oh.make_node("Relu", ["x"], ["y"])], [("x", ["N", 4])], [("y", None)])
    batches = [{"x": np.ones((1, 4), np.float32)} for _ in range(300)]
    template = Statistics({"y": [DyingObserver()]})
    with pytest.raises(CalibrationError, match=r"worker \d stopped without a result \(exit code 7"):
        list(observe_in_processes(model, ["y"], template, batches, workers=2))
    assert not [t for t in threading.enumerate() if t.name == "onnxq-deal"]
    import multiprocessing

    assert not multiprocessing.active_children()


def test_a_worker_runs_in_a_session_of_its_own_and_ends_quietly_when_the_parent_goes(capfd):
    """A terminal's Ctrl-C goes to its foreground group: a worker there printed a traceback
    while importing. A worker whose parent closed its pipe ends with nothing printed."""
    import os

    from onnxq.calibrate.shards import _Link, _start

    link = _Link(4)
    worker = _start(link, threads=1)
    try:
        assert os.getsid(worker.pid) == worker.pid != os.getsid(0)
    finally:
        link.close()  # before anything was sent: the worker reads the end of its pipe
    assert worker.wait(timeout=60) == 0
    assert capfd.readouterr().err == ""


def test_an_observer_without_merge_is_refused_by_name():
    class Plain:
        def observe(self, x):
            pass

    a = Statistics({"t": [Plain()]})
    with pytest.raises(CalibrationError, match="tensor 't'.*--workers 1"):
        a.merge(Statistics({"t": [Plain()]}))


def _folder(tmp_path, count: int = 48):
    """The demo's calibration images, one .npz per sample (a folder every task can read)."""
    from onnxq.demo import demo_files

    path, arrays = demo_files()
    folder = tmp_path / "samples"
    folder.mkdir()
    for i, x in enumerate(arrays["calib"][:count]):
        np.savez(folder / f"{i:03d}.npz", input=x)
    return path, folder


@pytest.mark.slow
def test_ray_on_a_local_cluster_it_starts_writes_the_one_process_model(tmp_path, capsys):
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'onnxq[ray]'")
    path, folder = _folder(tmp_path)
    outs = {}
    # --ray fits on every sample (no held-back recipe choice): so does --recipe fixed
    one = ["--workers", "1", "--recipe", "fixed"]
    for name, extra in (("one", one), ("ray", ["--ray", "--workers", "2"])):
        outs[name] = tmp_path / f"{name}.onnx"
        rc = main(
            [
                "quantize",
                str(path),
                "--data",
                str(folder),
                "-o",
                str(outs[name]),
                "--quiet",
                "--no-latency-check",
                "--method",
                "mse",
                *extra,
            ]
        )
        assert rc == 0
    assert outs["one"].read_bytes() == outs["ray"].read_bytes()
    assert not ray.is_initialized()  # the local cluster onnxq started is stopped
    bad = ["quantize", str(path), "--data", str(folder), "--ray", "127.0.0.1:1"]
    assert main([*bad, "-o", str(tmp_path / "x.onnx")]) == 2
    assert "--ray 127.0.0.1:1: nothing answers there" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.slow
def test_ray_tasks_open_a_shard_function_and_errors_are_clear(tmp_path, capsys):
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'onnxq[ray]'")
    from onnxq.demo import demo_files

    path, arrays = demo_files()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        tables = {}
        # --ray fits on every sample (no held-back recipe choice): so does recipe="fixed"
        for name, kw in (("one", {"recipe": "fixed"}), ("ray", {"ray": "", "workers": 2})):
            tables[name] = tmp_path / f"{name}.json"
            onnxq.quantize(
                str(path),
                "onnxq.demo:calibration_shard",
                method="minmax",
                save_ranges=tables[name],
                progress=False,
                **kw,
            )
        one, by_ray = (json.loads(tables[n].read_text())["tensors"] for n in ("one", "ray"))
        assert one == by_ray  # every range; the batches differ, so the Hessians may
        with pytest.raises(Exception, match="--ray needs calibration data every task can open"):
            onnxq.quantize(str(path), {"input": arrays["calib"]}, ray="", progress=False)
        rc = main(
            [
                "quantize",
                str(path),
                "--data",
                "onnxq.demo:demo_files",
                "--ray",
                "-o",
                str(tmp_path / "x.onnx"),
            ]
        )
        assert rc == 2
        assert "must take the parameters shard and shards" in capsys.readouterr().err
    finally:
        ray.shutdown()
