"""No command writes where it reads, or writes two outputs to one path.

Every pair of (path written, path read) and (path written, other path written) of every
command is tried: exit 2, one line naming both options, every file as it was, nothing new.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN

import onnxq
from onnxq.cli import main
from onnxq.core.errors import ConfigError

X = np.random.default_rng(0).uniform(0, 1, (4, 1, 28, 28)).astype(np.float32)

# per command: the options it reads (flag, file) and writes (flag), and the argv around them;
# a positional is named by its label in messages
COMMANDS = {
    "quantize": {
        "reads": {
            "the model": "m.onnx",
            "--data": "d.npz",
            "--config": "c.toml",
            "--target-file": "t.toml",
            "--load-ranges": "r.json",
        },
        "writes": ["-o", "--report", "--save-ranges"],
    },
    "compare": {
        "reads": {"the float model": "m.onnx", "the quantized model": "q.onnx", "--data": "d.npz"},
        "writes": ["--report"],
    },
    "debug": {
        "reads": {"the model": "m.onnx", "--data": "d.npz", "--target-file": "t.toml"},
        "writes": ["-o", "--report"],
    },
    "convert": {"reads": {"the model": "q.onnx"}, "writes": ["-o"]},
}
POSITIONAL = {"the model", "the float model", "the quantized model"}


def _files(folder):
    shutil.copy(DIGITS_CNN, folder / "m.onnx")
    np.savez(folder / "d.npz", input=X)
    (folder / "c.toml").write_text('method = "minmax"\n')
    (folder / "t.toml").write_text('[target.mine]\nformat = "qdq"\n')
    (folder / "r.json").write_text("{}")
    q, _ = onnxq.quantize(str(folder / "m.onnx"), {"input": X}, format="qdq", progress=False)
    onnx.save(q, folder / "q.onnx")


def _argv(command, folder, paths):
    """argv of ``command`` with each option at ``paths[option]`` (default: its own file)."""
    spec = COMMANDS[command]
    files = {k: str(folder / v) for k, v in spec["reads"].items()}
    files.update({w: str(folder / f"out{w.strip('-')}") for w in spec["writes"]})
    files.update(paths)
    argv = [command] + [files[k] for k in spec["reads"] if k in POSITIONAL]
    for flag in [*spec["reads"], *spec["writes"]]:
        if flag not in POSITIONAL:
            argv += [flag, files[flag]]
    if command == "convert":
        argv += ["--format", "qoperator"]
    return argv


def _state(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _pairs():
    for command, spec in COMMANDS.items():
        for w in spec["writes"]:
            for r in spec["reads"]:
                yield pytest.param(command, w, r, id=f"{command}:{w}={r}")
            for other in spec["writes"]:
                if other < w:
                    yield pytest.param(command, w, other, id=f"{command}:{w}={other}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("collide")
    _files(root)
    return root


@pytest.mark.parametrize(("command", "written", "other"), list(_pairs()))
def test_a_write_onto_a_read_or_another_write_is_refused(folder, capsys, command, written, other):
    spec = COMMANDS[command]
    target = spec["reads"].get(other)
    path = str(folder / target) if target else str(folder / "same.out")
    before = _state(folder)
    rc = main(_argv(command, folder, {written: path, other: path}))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("onnxq: error: "), err
    assert f"{written} '" in err and f"{other} '" in err, err
    assert _state(folder) == before  # nothing changed, nothing written


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_link_to_the_model_is_the_model(tmp_path, capsys, link):
    _files(tmp_path)
    alias = tmp_path / "alias.json"
    (os.symlink if link == "symlink" else os.link)(tmp_path / "m.onnx", alias)
    before = _state(tmp_path)
    argv = ["quantize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q2.onnx")]
    rc = main([*argv, "--data", str(tmp_path / "d.npz"), "--report", str(alias)])
    err = capsys.readouterr().err
    assert rc == 2 and "--report" in err and "the model" in err, err
    assert _state(tmp_path) == before


def test_a_write_inside_the_data_folder_is_refused(tmp_path, capsys):
    _files(tmp_path)
    samples = tmp_path / "samples"
    samples.mkdir()
    for i in range(3):
        np.save(samples / f"s{i}.npy", X[i : i + 1])
    before = _state(samples)
    argv = ["quantize", str(tmp_path / "m.onnx"), "-o", str(samples / "q.onnx")]
    rc = main([*argv, "--data", str(samples)])
    err = capsys.readouterr().err
    assert rc == 2 and "is inside --data" in err, err
    assert _state(samples) == before


def test_the_output_s_data_file_cannot_be_the_model_s(tmp_path, capsys):
    """-o q.onnx writes q.onnx.data past 2 GB: never onto the input's external data file."""
    model = onnx.load(DIGITS_CNN)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="q.onnx.data")
    np.savez(tmp_path / "d.npz", input=X)
    before = _state(tmp_path)
    argv = ["quantize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx")]
    rc = main([*argv, "--data", str(tmp_path / "d.npz")])
    err = capsys.readouterr().err
    assert rc == 2 and "-o's external data" in err and "the model's external data" in err, err
    assert _state(tmp_path) == before


def test_debug_s_default_config_path_is_checked(tmp_path, capsys, monkeypatch):
    """Without -o, debug writes MODEL_fix.toml here: never onto its data."""
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    shutil.copy(tmp_path / "d.npz", tmp_path / "m_fix.toml")
    before = _state(tmp_path)
    rc = main(["debug", "m.onnx", "--data", "m_fix.toml"])
    err = capsys.readouterr().err
    assert rc == 2 and "-o 'm_fix.toml'" in err and "--data" in err, err
    assert _state(tmp_path) == before


def test_the_python_api_checks_its_paths_too(tmp_path):
    _files(tmp_path)
    before = _state(tmp_path)
    model, data = str(tmp_path / "m.onnx"), str(tmp_path / "d.npz")
    for kwargs in (
        {"output": model},
        {"save_ranges": data},
        {"output": str(tmp_path / "x.onnx"), "save_ranges": str(tmp_path / "x.onnx")},
        {"config": str(tmp_path / "c.toml"), "save_ranges": str(tmp_path / "c.toml")},
    ):
        with pytest.raises(ConfigError, match="onnxq never overwrites|its own path"):
            onnxq.quantize(model, data, progress=False, **kwargs)
    from onnxq.tools.debug import debug

    with pytest.raises(ConfigError, match="onnxq never overwrites"):
        debug(model, data, output=data)
    assert _state(tmp_path) == before


def test_demo_never_writes_onto_its_own_model(capsys):
    from onnxq.demo import demo_files

    MODEL_PATH = demo_files()[0]
    before = hashlib.sha256(MODEL_PATH.read_bytes()).hexdigest()
    assert main(["demo", "-o", str(MODEL_PATH), "--runs", "1"]) == 2
    assert "-o" in capsys.readouterr().err
    assert hashlib.sha256(MODEL_PATH.read_bytes()).hexdigest() == before
