"""Inputs nobody listed: each ends in one line (exit 2) or a warning, never an internal error.

Every case here reproduced a traceback, an ``internal error``, a silent wrong result or a file
read from outside what the user gave, before its fix.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import zipfile

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN, make_model, run
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxq
import onnxq.calibrate.dataset as dataset
from onnxq.annotate import targets as targets_module
from onnxq.cli import main
from onnxq.core.errors import ModelError

CNN = str(DIGITS_CNN)
X = np.random.default_rng(0).uniform(0, 1, (16, 1, 28, 28)).astype(np.float32)


def _quantize(tmp_path, data, *extra):
    out = tmp_path / "q.onnx"
    argv = ["quantize", CNN, "-o", str(out), "--data", str(data), "--no-latency-check", *extra]
    return main(argv), out


def _npz(tmp_path, name="d.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def _one_error_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("onnxq"), err
    assert "internal error" not in err and "Traceback" not in err, err
    return lines[0]


# --------------------------------------------------------------------------------------------
# the Python API reads only what it is given


def _external_matmul(location, folder_key=None):
    w = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[5, 4])
    w.data_location = onnx.TensorProto.EXTERNAL
    entries = [("location", location), ("offset", "0"), ("length", "80")]
    if folder_key is not None:
        entries.append(("onnxq_folder", folder_key))
    for key, value in entries:
        e = w.external_data.add()
        e.key, e.value = key, value
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, 5])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 4])],
        [w],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_a_planted_private_key_reads_nothing(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(20, dtype=np.float32).tobytes())
    model = _external_matmul(str(secret).lstrip("/"), folder_key="/")
    data = {"x": np.ones((8, 5), np.float32)}
    with pytest.raises(ModelError, match="private external-data key"):
        onnxq.quantize(model, data, progress=False)
    with pytest.raises(ModelError, match="private external-data key"):
        onnxq.quantize(model, data, progress=False, base_dir=str(tmp_path))


def test_a_model_proto_s_external_data_needs_its_folder_and_stays_inside_it(tmp_path):
    rng = np.random.default_rng(1)
    folder = tmp_path / "m"
    folder.mkdir()
    weights = rng.normal(size=(5, 4)).astype(np.float32)
    (folder / "w.bin").write_bytes(weights.tobytes())
    (tmp_path / "outside.bin").write_bytes(weights.tobytes())
    x = rng.normal(size=(16, 5)).astype(np.float32)
    model = _external_matmul("w.bin")
    with pytest.raises(ModelError, match="pass base_dir="):
        onnxq.quantize(model, {"x": x}, progress=False)
    for escape in ("../outside.bin", str(tmp_path / "outside.bin")):
        with pytest.raises(ModelError, match="not a file inside the model's folder"):
            onnxq.quantize(_external_matmul(escape), {"x": x}, base_dir=folder, progress=False)
    q, _ = onnxq.quantize(model, {"x": x}, base_dir=folder, progress=False)
    onnx.save(model, folder / "m.onnx")  # the same model as a file: the same bytes out
    same, _ = onnxq.quantize(str(folder / "m.onnx"), {"x": x}, progress=False)
    assert q.SerializeToString() == same.SerializeToString()
    (got,) = run(q, {"x": x})
    want = x @ weights
    sqnr = 10 * np.log10(np.sum(want**2) / np.sum((got - want) ** 2))
    assert sqnr > 30, sqnr


def test_dims_that_disagree_with_the_data_are_refused(tmp_path, capsys):
    w = nh.from_array(np.ones((5, 256), np.float32), "w")
    w.dims[:] = [5, 128]
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [h.make_tensor_value_info("x", 1, [1, 5])],
        [h.make_tensor_value_info("y", 1, [1, 128])],
        [w],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)  # the checker lets it through
    onnx.save(model, tmp_path / "m.onnx")
    data = _npz(tmp_path, x=np.ones((4, 1, 5), np.float32))
    rc = main(
        ["quantize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx")]
        + [
            "--data",
            str(data),
        ]
    )
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "'w' declares dims [5, 128] (640 values) but holds 1280 values" in line


# --------------------------------------------------------------------------------------------
# .npz files: names first, headers of every member, only the inputs read


def _member(archive, name, header_shape, dtype="<f4", payload=b""):
    """A zip member holding an .npy header that declares ``header_shape`` (and little data)."""
    header = repr({"descr": dtype, "fortran_order": False, "shape": header_shape}).encode()
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    raw = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + payload
    archive.writestr(name, raw)


def test_unused_npz_members_are_refused_before_any_is_loaded(tmp_path, capsys, monkeypatch):
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("input.npy", _npy_bytes(X))
        _member(z, "labels.npy", (400_000_000,), payload=b"\0" * 64)
    loads = []
    real = np.lib.format.read_array
    monkeypatch.setattr(
        np.lib.format, "read_array", lambda *a, **k: loads.append(1) or real(*a, **k)
    )
    rc, out = _quantize(tmp_path, path)
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "['labels'] that name no input of the model" in line
    assert not loads and not out.exists()


def test_a_member_without_the_npy_suffix_is_checked_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dataset, "MEMBER_LIMIT", 64 * 2**20)
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        _member(z, "input", (288 * 2**30 // 4, 1, 1, 1), payload=b"\0" * 64)
    rc, out = _quantize(tmp_path, path)
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "member 'input'" in line and "309237645312 bytes" in line
    assert not out.exists()


def test_a_member_that_is_not_an_array_is_named(tmp_path, capsys):
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("input", b"not a numpy array at all")
    rc, _ = _quantize(tmp_path, path)
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "member 'input' is not a numpy array" in line


def _npy_bytes(array):
    import io

    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# calibration values: tiny, NaN, Inf, outliers


def test_tiny_calibration_values_quantize(tmp_path, capsys):
    data = _npz(tmp_path, input=(X * 1e-37).astype(np.float32))
    rc, out = _quantize(tmp_path, data, "--quiet")
    err = capsys.readouterr().err
    assert rc == 0 and out.exists() and "internal error" not in err, err


def test_nan_warnings_reach_stderr_with_quiet(tmp_path, capsys):
    x = X.copy()
    x[3, 0, 0, 0] = np.nan
    rc, out = _quantize(tmp_path, _npz(tmp_path, input=x), "--quiet")
    err = capsys.readouterr().err
    assert rc == 0 and out.exists()
    assert "onnxq: warning: NaN/Inf values on the calibration data" in err and "'input' 1" in err


def test_data_with_no_finite_value_is_refused_naming_the_tensor(tmp_path, capsys):
    data = _npz(tmp_path, input=np.full_like(X, np.inf))
    rc, out = _quantize(tmp_path, data, "--quiet")
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "tensor 'input' held no finite value" in line and not out.exists()


@pytest.mark.parametrize("outlier", [1e6, 3e38])
def test_one_outlier_sample_is_named_and_nothing_leaks(tmp_path, outlier):
    """A single 3e38 pixel gave a 0 dB model, a numpy RuntimeWarning and (with the default
    optimized rounding) an internal LinAlgError; now: the model, and one warning naming the
    batch."""
    x = X.copy()
    x[5, 0, 3, 3] = outlier
    data = _npz(tmp_path, input=x)
    # the console script's entry, in a child: numpy's warnings would show on its stderr
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from onnxq._entry import run; run()",
            "quantize",
            CNN,
            "-o",
            str(tmp_path / "q.onnx"),
            "--data",
            str(data),
            "--quiet",
            "--no-latency-check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    assert "RuntimeWarning" not in child.stderr and "internal error" not in child.stderr
    lines = child.stderr.strip().splitlines()
    assert all(line.startswith("onnxq: warning: ") for line in lines), child.stderr
    named = [line for line in lines if "calibration batch(es) 5 reach" in line]
    assert len(named) == 1 and "tensor 'input'" in named[0], child.stderr


# --------------------------------------------------------------------------------------------
# config and target files


def test_a_target_file_of_bad_types_is_one_line(tmp_path, capsys):
    data = _npz(tmp_path, input=X[:4])
    for text, message in (
        ("target = 5\n", "target = 5 must be tables"),
        ('[target.x]\npatterns = 5\nformat = "qdq"\n', "patterns = 5 in [target.x]"),
        ("[target.x]\nweight_bits = 6.5\n", "weight_bits = 6.5 in [target.x] must be 8, 7"),
        ("[target.x]\nformat = 3\n", "format = 3 in [target.x] must be a string"),
        ("[target.x]\nper_channel = 1\n", "per_channel = 1 in [target.x] must be true or"),
    ):
        (tmp_path / "t.toml").write_text(text)
        rc, _ = _quantize(tmp_path, data, "--target-file", str(tmp_path / "t.toml"))
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2 and message in line, line


def test_redefining_a_built_in_target_is_a_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(targets_module, "_REGISTRY", dict(targets_module._REGISTRY))
    (tmp_path / "t.toml").write_text('[target.ort-cpu]\nformat = "qdq"\n')
    rc, out = _quantize(
        tmp_path, _npz(tmp_path, input=X), "--quiet", "--target-file", str(tmp_path / "t.toml")
    )
    err = capsys.readouterr().err
    assert rc == 0 and "[target.ort-cpu] replaces the built-in target 'ort-cpu'" in err
    assert "QuantizeLinear" in {n.op_type for n in onnx.load(out).graph.node}


def test_a_config_for_an_absent_op_type_is_a_warning(tmp_path, capsys):
    (tmp_path / "c.toml").write_text("[op_type.LSTM]\nkeep_float = true\n")
    rc, _ = _quantize(
        tmp_path, _npz(tmp_path, input=X), "--quiet", "--config", str(tmp_path / "c.toml")
    )
    err = capsys.readouterr().err
    assert rc == 0 and "op type(s) ['LSTM'] that the model does not have" in err


def test_a_shared_node_name_in_exclude_is_refused_with_its_matches(tmp_path, capsys):
    rng = np.random.default_rng(0)
    weights = {f"w{i}": rng.normal(size=(8, 8)).astype(np.float32) for i in range(3)}
    nodes = [
        h.make_node("MatMul", ["x", "w0"], ["a"], name="mm"),
        h.make_node("MatMul", ["a", "w1"], ["b"], name="mm"),
        h.make_node("MatMul", ["b", "w2"], ["y"], name="mm"),
    ]
    onnx.save(
        make_model(nodes, [("x", [None, 8])], [("y", [None, 8])], weights), tmp_path / "m.onnx"
    )
    data = _npz(tmp_path, x=rng.normal(size=(16, 8)).astype(np.float32))
    argv = ["quantize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx")]
    assert main([*argv, "--data", str(data), "--exclude", "mm"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--exclude mm is ambiguous: 3 nodes" in line and "mm, mm_1, mm_2" in line
    assert main([*argv, "--data", str(data), "--exclude", "mm_1", "mm_2", "--quiet"]) == 0
    kept = [n for n in onnx.load(tmp_path / "q.onnx").graph.node if n.op_type == "MatMul"]
    assert len(kept) == 2


# --------------------------------------------------------------------------------------------
# the terminal and the length of what is echoed


def test_inspect_escapes_control_characters_in_names(tmp_path, capsys):
    model = onnx.load(CNN)
    model.graph.node[0].name = "conv\x1b[31mred\x07bell"
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["inspect", str(tmp_path / "m.onnx"), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "conv\\x1b[31mred\\x07bell" in out


def test_a_huge_option_value_is_cut_in_the_message(tmp_path, capsys):
    data = _npz(tmp_path, input=X[:4])
    rc, _ = _quantize(tmp_path, data, "--target", "x" * 5_000_000)
    err = capsys.readouterr().err
    assert rc == 2 and len(err) < 2500 and "characters left out" in err


def test_an_unknown_choice_is_one_line_not_the_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["quantize", CNN, "-o", "q.onnx", "--method", "mse2"])
    assert exc.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "invalid choice: 'mse2'" in line and "--help" in line


def test_many_unknown_node_tables_give_a_short_line(tmp_path, capsys):
    tables = "".join(f'[node."n{i}"]\nkeep_float = true\n' for i in range(20_000))
    (tmp_path / "c.toml").write_text(tables)
    rc, _ = _quantize(tmp_path, _npz(tmp_path, input=X[:4]), "--config", str(tmp_path / "c.toml"))
    err = capsys.readouterr().err
    assert rc == 2 and len(err) < 2500 and "names node(s)" in err


# --------------------------------------------------------------------------------------------
# optional dependencies are asked for before any work


@pytest.mark.parametrize("command", ["quantize", "compare", "debug"])
def test_an_html_report_without_matplotlib_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch, command
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    shutil.copy(CNN, tmp_path / "m.onnx")
    data = str(_npz(tmp_path, input=X[:4]))
    report = str(tmp_path / "r.html")
    argv = {
        "quantize": ["quantize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx")],
        "compare": ["compare", str(tmp_path / "m.onnx"), str(tmp_path / "m.onnx")],
        "debug": ["debug", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "f.toml")],
    }[command]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([*argv, "--data", data, "--report", report]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "matplotlib, which is not installed" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# --------------------------------------------------------------------------------------------
# files onnxq writes for the user to read back


@pytest.mark.parametrize(
    "name",
    [
        "conv1\nkeep_float = true\n#",
        "conv\x00\x1b[31m\x07",
        'quote" ] [node."x"',
        "emoji \U0001f600 and \u2028 separator",
        "back\\slash\r\n",
    ],
)
def test_debug_s_config_holds_any_node_name_as_data(name):
    import tomllib

    from onnxq.annotate.config import UserConfig
    from onnxq.simulate.sensitivity import GroupScore, Ranking
    from onnxq.tools.debug import _config_text

    group = GroupScore(name, "Conv", (name, name + "/relu"), 0.01, 0.005, 0.005, 0.02, 0.3, 0.4)
    ranking = Ranking(0.05, [group], 16, 40, 3.0, 120.0, 1)
    text = _config_text(
        name, "ort-cpu", f"metric of {name}", 99.0, 97.0, 98.5, [group], ranking, ["float"], {}, "x"
    )
    doc = tomllib.loads(text)  # valid TOML, whatever the name holds
    assert doc == {"node": {name: {"keep_float": True}, name + "/relu": {"keep_float": True}}}
    assert set(UserConfig.from_dict(doc).node) == {name, name + "/relu"}
    assert all(line.startswith("#") or not line or line[0] in "[k" for line in text.split("\n"))


def test_the_terminal_writer_follows_its_stream_when_it_closes():
    """Ray's colorama keeps the stdout it found (onnxq's escaping writer) and asks it isatty()
    at exit: after the real stream closed that raised 'I/O operation on closed file'."""
    import io

    from onnxq.io.text import TerminalWriter

    stream = io.StringIO()
    writer = TerminalWriter(stream)
    writer.write("node\x1b[31m\n")
    assert stream.getvalue() == "node\\x1b[31m\n"
    stream.close()
    assert writer.closed and not writer.isatty()
