"""The pieces behind "no abort": run-ahead threads, Ctrl-C's record, workers started deaf to it.

tests/test_abort.py checks the whole process from outside; these check each piece in-process.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxq.calibrate import streaming
from onnxq.calibrate.shards import _ignoring_ctrl_c
from onnxq.core.errors import ModelError
from onnxq.io import interrupt
from onnxq.io.graph import check_sizes


class _SlowSession:
    """A session whose run takes a while, or raises what it is told to."""

    def __init__(self, seconds: float = 0.05, raises: BaseException | None = None):
        self.seconds, self.raises = seconds, raises

    def run(self, names, feeds):
        time.sleep(self.seconds)
        if self.raises is not None:
            raise self.raises
        return [np.zeros(2, np.float32) for _ in names]


def _feeds(n):
    return ({"x": np.full(2, i, np.float32)} for i in range(n))


def test_the_runners_are_joined_when_the_consumer_fails():
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="the consumer"):
        for i, _ in enumerate(streaming.run_ahead(_SlowSession(), ["y"], _feeds(10), depth=2)):
            if i == 2:
                raise RuntimeError("the consumer failed")
    assert threading.active_count() == before  # no thread left inside a run
    assert not streaming.runs_in_flight()


def test_after_ctrl_c_the_runs_in_flight_are_left_to_end_and_joined_at_exit():
    session = _SlowSession(raises=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        for _ in streaming.run_ahead(session, ["y"], _feeds(4)):
            pass
    streaming._join_all()  # what the interpreter runs at exit
    assert not streaming.runs_in_flight()


def test_a_ctrl_c_while_joining_waits_for_the_run_then_is_raised(monkeypatch):
    runner = streaming._Runner(_SlowSession(seconds=0.2), ["y"])
    runner.submit({"x": np.zeros(2, np.float32)}, 0)
    runner.stop()
    real = runner._thread.join
    calls = []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner._thread, "join", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        runner.join()
    assert not runner.alive() and len(calls) == 2


def test_a_ctrl_c_is_recorded_whatever_it_surfaces_as(monkeypatch):
    monkeypatch.setattr(interrupt, "_received", [])
    assert not interrupt.interrupted()
    with pytest.raises(KeyboardInterrupt):
        interrupt._on_sigint(signal.SIGINT, None)
    assert interrupt.interrupted()
    saved = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupt.install()
        assert signal.getsignal(signal.SIGINT) is interrupt._on_sigint
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job: left as it is
        interrupt.install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)


def test_the_console_script_exits_with_the_command_s_code(capsys):
    from onnxq._entry import run

    with pytest.raises(SystemExit) as done:
        run(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("onnxq ")


def test_a_ctrl_c_while_workers_start_is_raised_once_they_run():
    saved = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt):
            with _ignoring_ctrl_c():
                signal.raise_signal(signal.SIGINT)  # recorded, not raised, while they start
                started = True
        assert started
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    finally:
        signal.signal(signal.SIGINT, saved)


@pytest.mark.parametrize(
    ("make", "dims", "message"),
    [
        (
            lambda: onnx.helper.make_tensor("t", onnx.TensorProto.FLOAT, [2], [1.0, 2.0]),
            [3],
            "holds 2 values",
        ),
        (
            lambda: onnx.helper.make_tensor("t", onnx.TensorProto.FLOAT16, [3], [1, 2, 3]),
            [2],
            "holds 3 values",
        ),
        (
            lambda: onnx.helper.make_tensor("t", onnx.TensorProto.INT4, [2], [1, 2]),
            [5],
            "holds 2 values",
        ),
        (
            lambda: onnx.TensorProto(
                name="t", data_type=onnx.TensorProto.FLOAT, dims=[2], raw_data=b"\0" * 7
            ),
            [2],
            "not a whole number of values",
        ),
    ],
)
def test_dims_that_disagree_with_any_kind_of_data_are_named(make, dims, message):
    t = make()
    del t.dims[:]
    t.dims.extend(dims)
    graph = onnx.helper.make_graph([], "g", [], [], [t])
    with pytest.raises(ModelError, match=message):
        check_sizes(onnx.helper.make_model(graph), "'m.onnx'")


@pytest.mark.parametrize(
    "tensor",
    [
        onnx.helper.make_tensor("t", onnx.TensorProto.INT4, [3], [1, -2, 3]),
        onnx.helper.make_tensor("t", onnx.TensorProto.INT4, [3], b"\x12\x03", raw=True),
        onnx.helper.make_tensor("t", onnx.TensorProto.COMPLEX64, [2], [1 + 2j, 3 - 1j]),
        onnx.helper.make_tensor("t", onnx.TensorProto.STRING, [2], [b"a", b"b"]),
        onnx.helper.make_tensor("t", onnx.TensorProto.BOOL, [2], [True, False]),
    ],
)
def test_well_formed_tensors_of_every_kind_pass(tensor):
    graph = onnx.helper.make_graph([], "g", [], [], [tensor])
    check_sizes(onnx.helper.make_model(graph), "'m.onnx'")


def test_a_ctrl_c_while_the_command_line_imports_is_one_line(monkeypatch, capsys):
    import sys
    import types

    from onnxq import _entry

    class Interrupting(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "onnxq.cli", Interrupting("onnxq.cli"))
    with pytest.raises(SystemExit) as done:
        _entry.run(["--version"])
    assert done.value.code == 130 and capsys.readouterr().err.strip() == interrupt.INTERRUPTED


def test_after_ctrl_c_with_a_run_in_flight_the_script_leaves_at_once(monkeypatch):
    import sys
    import types

    from onnxq import _entry

    cli = types.ModuleType("onnxq.cli")
    cli.main = lambda argv: 130
    monkeypatch.setitem(sys.modules, "onnxq.cli", cli)
    monkeypatch.setattr(streaming, "runs_in_flight", lambda: True)
    left = []
    monkeypatch.setattr(_entry.os, "_exit", lambda code: left.append(code))
    with pytest.raises(SystemExit):  # the real os._exit would not return
        _entry.run([])
    assert left == [130]


def test_free_memory_trims_always_and_collects_only_for_a_large_model(monkeypatch):
    import gc
    import sys
    import types

    from onnxq.io import session

    collected, trimmed = [], []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    libc = types.SimpleNamespace(malloc_trim=lambda pad: trimmed.append(pad))
    monkeypatch.setattr(session.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(sys, "platform", "linux")
    small = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    session.free_memory(small)
    assert not collected and trimmed == [0]  # the heap is handed back whatever the model
    session.free_memory()  # no model: always
    assert collected and trimmed == [0, 0]


def test_a_ctrl_c_right_after_the_rename_says_the_file_is_whole(tmp_path, monkeypatch):
    from onnxq.io import graph

    real = graph.os.replace

    def replace_then_interrupt(src, dst):
        real(src, dst)
        raise KeyboardInterrupt  # as if SIGINT landed between the rename and the next line

    monkeypatch.setattr(interrupt, "_written", [])
    monkeypatch.setattr(graph.os, "replace", replace_then_interrupt)
    out = tmp_path / "q.onnx"
    with pytest.raises(KeyboardInterrupt):
        graph.write_bytes_atomic(out, b"whole")
    assert out.read_bytes() == b"whole" and not list(tmp_path.glob(".*"))
    assert interrupt.message() == (
        f"onnxq: interrupted after writing '{out}' (complete); nothing else was written"
    )


def test_a_ctrl_c_before_the_rename_leaves_nothing_and_says_so(tmp_path, monkeypatch):
    from onnxq.io import graph

    def interrupt_instead(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(interrupt, "_written", [])
    monkeypatch.setattr(graph.os, "replace", interrupt_instead)
    with pytest.raises(KeyboardInterrupt):
        graph.write_bytes_atomic(tmp_path / "q.onnx", b"whole")
    assert not list(tmp_path.iterdir()) and interrupt.message() == interrupt.INTERRUPTED


def test_every_pass_hands_the_freed_heap_back(monkeypatch):
    from onnxq.api import quantize
    from onnxq.passes import manager
    from tests.helpers import DIGITS_CNN

    trims = []
    monkeypatch.setattr(manager, "trim_heap", lambda: trims.append(1))
    data = {"input": np.random.default_rng(0).random((4, 1, 28, 28), np.float32)}
    _, report = quantize(DIGITS_CNN, data, progress=False)
    # one per pass of the pipeline (the passes choose runs inside it are recorded too)
    assert 10 < len(trims) <= len(report.passes)


def test_a_later_command_does_not_claim_an_earlier_ones_files(tmp_path, capsys):
    from onnxq import cli
    from onnxq.io import graph

    graph.write_bytes_atomic(tmp_path / "earlier.onnx", b"x")  # a command before, same process
    cli.main(["--version"])
    assert interrupt.message() == interrupt.INTERRUPTED


def test_a_scratch_model_is_not_claimed_as_written(tmp_path):
    """The workers' copy of the float model, in a folder onnxq removes, is no output: a
    Ctrl-C's line named it as written (complete) after its folder was gone."""
    from onnxq.io import graph

    interrupt.new_command()
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    graph.save_scratch(model, tmp_path / "float.onnx")
    assert onnx.load(tmp_path / "float.onnx") == model
    assert interrupt.message() == interrupt.INTERRUPTED
    graph.save_model(model, tmp_path / "q.onnx")
    assert "q.onnx' (complete)" in interrupt.message()


@pytest.mark.parametrize("external", [False, True])
def test_ctrl_c_is_held_back_while_the_outputs_are_renamed(tmp_path, monkeypatch, external):
    from onnxq.io import graph

    real = graph.os.replace
    blocked = []

    def replace(src, dst):
        blocked.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        real(src, dst)

    monkeypatch.setattr(graph.os, "replace", replace)
    weights = np.ones((64, 64), np.float32)
    init = onnx.numpy_helper.from_array(weights, "w")
    g = onnx.helper.make_graph([], "g", [], [onnx.helper.make_tensor_value_info("w", 1, [64, 64])])
    g.initializer.append(init)
    model = onnx.helper.make_model(g)
    if external:  # the > 2 GB path: the model and its .data file, renamed together
        graph._save_external(model, tmp_path / "q.onnx", tmp_path)
    else:
        graph.save_model(model, tmp_path / "q.onnx")
    assert blocked == [True] * (2 if external else 1)
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # unblocked after


def test_a_ctrl_c_between_the_model_and_its_data_comes_after_both(tmp_path, monkeypatch):
    from onnxq.io import graph

    real = graph.os.replace
    renamed = []

    def replace(src, dst):
        real(src, dst)
        renamed.append(Path(dst).name)
        if len(renamed) == 1:  # Ctrl-C after the .data file, before the model
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(graph.os, "replace", replace)
    monkeypatch.setattr(interrupt, "_written", [])
    monkeypatch.setattr(interrupt, "_received", [])  # the SIGINT sent here is this test's only
    g = onnx.helper.make_graph([], "g", [], [onnx.helper.make_tensor_value_info("w", 1, [4])])
    g.initializer.append(onnx.numpy_helper.from_array(np.ones(4, np.float32), "w"))
    # Python's own handler, whatever an earlier test in this process left (the suite failed
    # once with "DID NOT RAISE" where another handler was set)
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            graph._save_external(onnx.helper.make_model(g), tmp_path / "q.onnx", tmp_path)
    finally:
        signal.signal(signal.SIGINT, saved)
    assert renamed == ["q.onnx.data", "q.onnx"]  # both in place when the interrupt came
    assert interrupt.message().startswith("onnxq: interrupted after writing")
