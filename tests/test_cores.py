"""The cores other processes leave free (onnxq.io.cores), on fake kernel counters."""

import numpy as np
from helpers import rng
from threadpoolctl import ThreadpoolController

from onnxq.io.cores import MIN_INTERVAL, CoreShare, busy_seconds
from onnxq.solve.rounding import Grid, round_weight


class Counters:
    """A fake clock, the cores' busy seconds and this process's own CPU seconds."""

    def __init__(self):
        self.t = self.busy = self.own = 0.0

    def run(self, seconds: float, others: float, own: float) -> None:
        """``seconds`` of wall time with ``others`` cores busy elsewhere and ``own`` here."""
        self.t += seconds
        self.own += own * seconds
        self.busy += (others + own) * seconds

    def share(self, cores: int = 2) -> CoreShare:
        return CoreShare(
            frozenset(range(cores)), lambda _: self.busy, lambda: self.own, lambda: self.t
        )


def test_free_cores_are_the_affinity_set_less_what_other_processes_used():
    c = Counters()
    share = c.share()
    assert share.free() == 2  # no interval yet: every core
    c.run(0.5, others=1.0, own=2.0)  # another job on one core; our own use does not count
    assert share.free() == 1
    c.run(MIN_INTERVAL / 2, others=0.0, own=2.0)  # too short to tell: the last answer
    assert share.free() == 1
    c.run(0.5, others=0.1, own=1.0)  # the job ended (a little background stays)
    assert share.free() == 2
    c.run(0.5, others=3.0, own=0.0)  # more than the cores: still one
    assert share.free() == 1


def test_unreadable_counters_leave_every_core():
    share = CoreShare(frozenset({0, 1, 2}), lambda _: None, lambda: 0.0)
    assert share.free() == 3
    assert busy_seconds(frozenset({0}), path="/nonexistent/stat") is None


def test_busy_time_counts_only_the_cores_this_process_may_use(tmp_path):
    import os

    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  300 0 30 1000 5 0 3 0 0 0\n"
        "cpu0 100 0 10 500 5 0 1 0 0 0\n"  # user nice system idle iowait irq softirq steal
        "cpu1 200 0 20 500 0 0 2 7 0 0\n"
        "intr 12345\n"
    )
    hz = os.sysconf("SC_CLK_TCK")
    assert busy_seconds(frozenset({0}), str(stat)) == 111 / hz  # idle and iowait are not busy
    assert busy_seconds(frozenset({0, 1}), str(stat)) == (111 + 229) / hz  # steal is


def test_rounding_gives_the_same_bits_on_one_blas_thread_as_on_all():
    # the rounding pass sets the BLAS threads from the machine's load: the weights it writes
    # must not depend on it (factorizations and block products of a 512-input layer)
    r = rng(21)
    k, m = 512, 48
    x = r.normal(0, 1, (4 * k, k))
    h = (x.T @ x / len(x))[None]
    w = r.normal(0, 0.05, (1, m, k))
    scale = np.full((1, m), np.abs(w).max() / 127)
    grid = Grid(scale, np.zeros_like(scale), -127, 127)
    blas = ThreadpoolController()
    with blas.limit(limits=1, user_api="blas"):
        one = round_weight(w, h, grid)
    with blas.limit(limits=2, user_api="blas"):
        two = round_weight(w, h, grid)
    np.testing.assert_array_equal(one.q, two.q)
    assert one.error == two.error


def test_a_session_without_a_thread_count_takes_the_free_cores(monkeypatch):
    from helpers import make_model
    from onnx import helper as h

    from onnxq.io import session

    class OneFree:
        def threads(self) -> int:
            return 1

    model = make_model([h.make_node("Relu", ["x"], ["y"])], [("x", [1, 4])], [("y", None)], {})
    monkeypatch.setattr(session, "_SHARE", OneFree())
    assert session.make_session(model).get_session_options().intra_op_num_threads == 1
    assert session.make_session(model, threads=2).get_session_options().intra_op_num_threads == 2


def test_a_runtime_pool_keeps_its_own_choice_unless_cores_are_taken(tmp_path):
    from onnxq.io.cores import physical_cores

    c = Counters()
    share = c.share(cores=2)
    c.run(0.5, others=0.0, own=2.0)
    assert share.threads() == 0  # quiet: onnxruntime's own choice (its physical cores)
    c.run(0.5, others=1.0, own=1.0)
    assert share.threads() == 1
    # two hyper-threads of one core count once
    for cpu, sib in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(sib + "\n")
    assert physical_cores(frozenset(range(4)), str(tmp_path)) == 2
    assert physical_cores(frozenset({0, 1}), str(tmp_path / "none")) == 2
