"""--config: per-node keep_float and method with priority global < op type < regex < name."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import MODELS

import onnxq
from onnxq.cli import main
from onnxq.config import UserConfig
from onnxq.errors import ConfigError

CNN = str(MODELS / "digits_cnn.onnx")
X = np.random.default_rng(8).uniform(0, 1, (40, 1, 28, 28)).astype(np.float32)

DOC = {
    "method": "minmax",
    "op_type": {"Conv": {"method": "percentile"}, "Gemm": {"keep_float": True}},
    "node_regex": [
        {"pattern": "^conv[23]$", "method": "mse"},
        {"pattern": "^conv3$", "method": "entropy"},
    ],
    "node": {"conv3": {"method": "average-max"}},
}


def test_priority_global_op_regex_name():
    cfg = UserConfig.from_dict(DOC)
    assert cfg.resolve("relu1", "Relu").method == "minmax"
    assert cfg.resolve("conv1", "Conv").method == "percentile"
    assert cfg.resolve("conv2", "Conv").method == "mse"  # regex beats op type
    s3 = cfg.resolve("conv3", "Conv")
    assert s3.method == "average-max" and s3.source == '[node."conv3"]'  # name beats all
    assert cfg.resolve("fc", "Gemm").keep_float


def test_config_drives_quantization(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(
        'method = "minmax"\n\n[op_type.Gemm]\nkeep_float = true\n\n[node."conv2"]\nmethod = "mse"\n'
    )
    ranges = tmp_path / "r.json"
    q, report = onnxq.quantize(
        CNN, {"input": X}, config=str(toml), save_ranges=str(ranges), progress=False
    )
    ops = [n.op_type for n in q.graph.node]
    assert "Gemm" in ops and "QGemm" not in ops
    fc = next(d for d in report.decisions if d.node == "fc")
    assert not fc.quantized and "[op_type.Gemm]" in fc.reason
    minmax, _ = onnxq.quantize(
        CNN, {"input": X}, method="minmax", save_ranges=str(tmp_path / "m.json"), progress=False
    )
    got = json.loads(ranges.read_text())["tensors"]
    ref = json.loads((tmp_path / "m.json").read_text())["tensors"]
    assert got["r2"] != ref["r2"]  # conv2 (→ r2) calibrated with mse
    assert got["r1"] == ref["r1"] and got["r3"] == ref["r3"]  # the rest with minmax


@pytest.mark.parametrize(
    "text, message",
    [
        ("colour = 1\n", "unknown key(s) ['colour']"),
        ('method = "magic"\n', "method 'magic' is unknown"),
        ('[[node_regex]]\npattern = "("\nkeep_float = true\n', "not a valid regular expression"),
        ("[[node_regex]]\nkeep_float = true\n", "needs a pattern"),
        ('[node."nope"]\nkeep_float = true\n', "names node(s) ['nope']"),
        ("keep_float = 3\n", "must be true or false"),
        ("this is = not toml [\n", "not valid TOML"),
    ],
)
def test_bad_configs_are_clear_errors(tmp_path, capsys, text, message):
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    data = tmp_path / "d.npz"
    np.savez(data, input=X[:4])
    rc = main(
        [
            "quantize",
            CNN,
            "-o",
            str(tmp_path / "o.onnx"),
            "--data",
            str(data),
            "--config",
            str(toml),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and message in err and not (tmp_path / "o.onnx").exists()


def test_inspect_with_config(tmp_path, capsys):
    toml = tmp_path / "c.toml"
    toml.write_text('[[node_regex]]\npattern = "^conv"\nkeep_float = true\n')
    assert main(["inspect", CNN, "--explain", "--config", str(toml)]) == 0
    out = capsys.readouterr().out
    assert "kept float by --config (node_regex '^conv')" in out


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        UserConfig.load("/nonexistent/c.toml")
