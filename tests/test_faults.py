"""Faults: a full disk, a killed process, Ctrl-C and hostile data files.

Each leaves no partial output and ends in one line (exit 2, or 130 for Ctrl-C), never a
traceback. Failures are injected where they happen: in the write, by a signal, in the file.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
from helpers import DIGITS_CNN

import onnxq.calibrate.dataset as dataset
import onnxq.io.graph as graph
from onnxq.cli import main

CNN = DIGITS_CNN
X = np.random.default_rng(0).uniform(0, 1, (16, 1, 28, 28)).astype(np.float32)


def _calib(tmp_path):
    path = tmp_path / "calib.npz"
    np.savez(path, input=X)
    return path


def _quantize(out, data, *extra):
    return main(["quantize", str(CNN), "-o", str(out), "--data", str(data), "--quiet", *extra])


@pytest.mark.parametrize("existing", [False, True])
def test_a_full_disk_during_the_save_leaves_no_partial_output(
    tmp_path, monkeypatch, capsys, existing
):
    data = _calib(tmp_path)
    out = tmp_path / "q.onnx"
    if existing:
        out.write_bytes(b"the previous model")

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(graph.os, "fsync", disk_full)
    assert _quantize(out, data, "--no-latency-check") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "No space left on device" in err and str(out) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["calib.npz"] + (["q.onnx"] if existing else [])
    )
    if existing:  # the old file is untouched, not half overwritten
        assert out.read_bytes() == b"the previous model"


def test_an_unwritable_report_is_one_line(tmp_path, capsys):
    data = _calib(tmp_path)
    (tmp_path / "afile").write_text("not a folder")
    rc = _quantize(tmp_path / "q.onnx", data, "--report", str(tmp_path / "afile" / "r.json"))
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Not a directory" in err and "r.json" in err


# a child that quantizes, then blocks inside the atomic write (or calibration) until signalled
CHILD = r"""
import os, signal, sys, time
# a shell starts background jobs with SIGINT ignored, and Python then installs no handler:
# give the child the handler an interactive onnxq has (the suite itself may run in background)
signal.signal(signal.SIGINT, signal.default_int_handler)
import onnxq.io.graph as graph
from onnxq.cli import main
stage, ready = sys.argv[1], sys.argv[2]

def block(*args, **kwargs):
    open(ready, "w").close()
    time.sleep(60)

if stage == "save":
    real = graph.os.fsync
    graph.os.fsync = lambda fd: (block(), real(fd))
else:
    import onnxq.calibrate.streaming as streaming
    real_run = streaming.run_checked
    def slow(*args, **kwargs):
        block()
        return real_run(*args, **kwargs)
    streaming.run_checked = slow
from onnxq._entry import run
run(["quantize", sys.argv[3], "-o", sys.argv[4], "--data", sys.argv[5], "--quiet"])
"""


def _child(tmp_path, stage):
    data = _calib(tmp_path)
    ready = tmp_path / "ready"
    out = tmp_path / "q.onnx"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, stage, str(ready), str(CNN), str(out), str(data)],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the child never reached the blocking point"
        time.sleep(0.05)
    return proc, out


def test_a_process_killed_during_the_save_leaves_no_output(tmp_path):
    proc, out = _child(tmp_path, "save")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not out.exists()  # only a hidden temporary file may remain, never q.onnx


def test_ctrl_c_during_calibration_exits_130_with_one_line_and_no_output(tmp_path):
    proc, out = _child(tmp_path, "calibrate")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip() == "onnxq: interrupted; no output written"
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".q.onnx")]


def test_an_npz_with_an_object_array_is_refused(tmp_path, capsys):
    path = tmp_path / "calib.npz"
    np.savez(path, input=np.array([X[0], "text"], dtype=object))
    assert _quantize(tmp_path / "q.onnx", path) == 2
    err = capsys.readouterr().err.strip()
    assert "object array" in err and "'input'" in err and err.count("\n") == 0


def test_a_decompression_bomb_is_refused_before_it_is_loaded(tmp_path, monkeypatch, capsys):
    # 256 MB of zeros compress to 250 KB; with the limit at 64 MB it must be refused from the
    # header, before numpy allocates anything (the real limit is half the free memory)
    path = tmp_path / "calib.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("input.npy", "w", force_zip64=True) as handle:
            header = {"descr": "<f4", "fortran_order": False, "shape": (2**26, 1, 1, 1)}
            np.lib.format.write_array_header_1_0(handle, header)
            block = bytes(1 << 20)
            for _ in range(256):
                handle.write(block)
    assert path.stat().st_size < 2**20
    monkeypatch.setattr(dataset, "MEMBER_LIMIT", 64 * 2**20)
    loads = []
    monkeypatch.setattr(dataset.np, "load", lambda *a, **k: loads.append(a))
    assert _quantize(tmp_path / "q.onnx", path) == 2
    err = capsys.readouterr().err.strip()
    assert "0.2 GiB" in err and "folder of .npz files" in err and err.count("\n") == 0
    assert loads == []  # refused from the header alone


def test_a_truncated_npz_member_is_refused(tmp_path, capsys):
    path = tmp_path / "calib.npz"
    with zipfile.ZipFile(path, "w") as archive:
        with archive.open("input.npy", "w") as handle:
            header = {"descr": "<f4", "fortran_order": False, "shape": (16, 1, 28, 28)}
            np.lib.format.write_array_header_1_0(handle, header)
            handle.write(bytes(100))
    assert _quantize(tmp_path / "q.onnx", path) == 2
    err = capsys.readouterr().err.strip()
    assert "truncated" in err and err.count("\n") == 0
