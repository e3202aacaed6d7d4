"""--config: per-node keep_float and method with priority global < op type < regex < name."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN, rng

import onnxq
from onnxq.annotate.config import UserConfig
from onnxq.cli import main
from onnxq.core.errors import ConfigError

CNN = str(DIGITS_CNN)
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


def test_config_as_a_dict_is_the_toml_document_and_another_type_is_refused(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[op_type.Gemm]\nkeep_float = true\n")
    from_file, _ = onnxq.quantize(CNN, {"input": X}, config=str(toml), progress=False)
    from_dict, _ = onnxq.quantize(
        CNN, {"input": X}, config={"op_type": {"Gemm": {"keep_float": True}}}, progress=False
    )
    assert from_file.SerializeToString() == from_dict.SerializeToString()
    with pytest.raises(ConfigError, match="config is a int; give a TOML file's path"):
        onnxq.quantize(CNN, {"input": X}, config=42, progress=False)


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
        ('method = "magic"\n', "method = 'magic' is not one of minmax"),
        ('[op_type.Conv]\nmethod = "magic"\n', "method = 'magic' (in [op_type.Conv])"),
        ("op_type = 5\n", "op_type = 5 must be tables of settings"),
        ('node = "conv1"\n', "node = 'conv1' must be tables of settings"),
        ("a = " + "[" * 2000 + "]" * 2000 + "\n", "nests arrays or tables deeper"),
        ("a = " + "{b = " * 1200 + "1" + "}" * 1200 + "\n", "nests arrays or tables deeper"),
        ("[[node_regex]]\npattern = 5\n", "needs a pattern"),
        ('[[node_regex]]\npattern = "("\nkeep_float = true\n', "not a valid regular expression"),
        ("[[node_regex]]\nkeep_float = true\n", "needs a pattern"),
        ('[node."nope"]\nkeep_float = true\n', "names node(s) ['nope']"),
        ("keep_float = 3\n", "must be true or false"),
        ("this is = not toml [\n", "not valid TOML"),
        (bytes(range(256)), "is not text (TOML is UTF-8)"),
    ],
)
def test_bad_configs_are_clear_errors(tmp_path, capsys, text, message):
    toml = tmp_path / "bad.toml"
    toml.write_bytes(text if isinstance(text, bytes) else text.encode())
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


def _two_convs():
    from helpers import make_model

    gen = np.random.default_rng(4)
    nodes = [
        onnx.helper.make_node("Conv", ["x", "W1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
        onnx.helper.make_node("Relu", ["a"], ["r"], name="relu1"),
        onnx.helper.make_node("Conv", ["r", "W2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    inits = {
        "W1": gen.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "W2": gen.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32),
    }
    return make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", None)], inits)


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_dtype_conflict_inserts_exactly_one_rescale(fmt):
    # conv1 writes r as uint8 (the global dtype); conv2 is configured int8 and reads r as int8:
    # the two constraints on r conflict, and exactly one DQ→Q rescale must remain, on r
    from helpers import run

    model = _two_convs()
    data = {"x": np.random.default_rng(5).normal(0, 1, (16, 3, 8, 8)).astype(np.float32)}
    cfg = UserConfig.from_dict({"node": {"conv2": {"activation_dtype": "int8"}}})
    q, report = onnxq.quantize(model, data, config=cfg, format=fmt, progress=False)
    assert report.rescales == ["r"]
    conv2 = next(d for d in report.decisions if d.node == "conv2")
    assert (
        conv2.quantized and "activations int8" in conv2.reason and '[node."conv2"]' in conv2.reason
    )
    zps = {i.name: onnx.numpy_helper.to_array(i) for i in q.graph.initializer}
    if fmt == "qoperator":
        kinds = [n.op_type for n in q.graph.node]
        assert kinds.count("QuantizeLinear") == 2 and kinds.count("QLinearConv") == 2
    assert zps["r_zero_point"].dtype == np.uint8 and zps["r_int8_zero_point"].dtype == np.int8
    assert zps["y_int8_zero_point"].dtype == np.int8
    ref, got = run(model, {"x": data["x"][:2]})[0], run(q, {"x": data["x"][:2]})[0]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    # without the setting there is no conflict and no rescale
    _, plain = onnxq.quantize(model, data, format=fmt, progress=False)
    assert plain.rescales == []


def test_a_node_entry_beats_the_global_dtype_across_its_group():
    # global int16, conv1 uint8: conv1's group (conv1 and its folded relu1) reads the graph
    # input and writes r as uint8 (the node's own entry beats the global one reaching relu1);
    # conv2 reads r as int16 through exactly one rescale
    from helpers import run

    model = _two_convs()
    data = {"x": np.random.default_rng(5).normal(0, 1, (16, 3, 8, 8)).astype(np.float32)}
    cfg = UserConfig.from_dict(
        {"activation_dtype": "int16", "node": {"conv1": {"activation_dtype": "uint8"}}}
    )
    q, report = onnxq.quantize(model, data, config=cfg, format="qdq", progress=False)
    zps = {i.name: onnx.numpy_helper.to_array(i).dtype for i in q.graph.initializer}
    read = {n.input[0]: zps[n.input[2]] for n in q.graph.node if n.op_type == "QuantizeLinear"}
    assert read["x"] == np.uint8
    assert report.rescales == ["r"]
    by = {d.node: d for d in report.decisions}
    assert '[node."conv1"]' in by["conv1"].reason and "activations uint8" in by["conv1"].reason
    assert "activations int16 (config global)" in by["conv2"].reason
    ref, got = run(model, {"x": data["x"][:2]})[0], run(q, {"x": data["x"][:2]})[0]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_a_node_entry_beats_the_global_per_channel_setting():
    model = _two_convs()
    data = {"x": np.random.default_rng(5).normal(0, 1, (16, 3, 8, 8)).astype(np.float32)}
    cfg = UserConfig.from_dict({"per_channel": False, "node": {"conv1": {"per_channel": True}}})
    q, _ = onnxq.quantize(model, data, config=cfg, progress=False)
    scales = {i.name: onnx.numpy_helper.to_array(i).shape for i in q.graph.initializer}
    assert scales["W1_scale"] == (8,) and scales["W2_scale"] == ()


def test_dtype_conflict_in_openvino_output_matches_the_qdq_model():
    # conv2 reads r as int8 where conv1 writes it uint8: with one range the two are one grid,
    # so the FakeQuantize model rounds r once (the QDQ model's rescale is exact) and computes
    # what the QDQ model does
    import onnxruntime as ort

    from onnxq.io.openvino import OpenVINOSession, available

    if not available():
        pytest.skip("OpenVINO is not installed: pip install openvino")
    model = _two_convs()
    data = {"x": np.random.default_rng(5).normal(0, 1, (16, 3, 8, 8)).astype(np.float32)}
    cfg = UserConfig.from_dict({"node": {"conv2": {"activation_dtype": "int8"}}})
    qdq, _ = onnxq.quantize(model, data, config=cfg, format="qdq", progress=False)
    fq, _ = onnxq.quantize(model, data, config=cfg, format="openvino", progress=False)
    options = ort.SessionOptions()  # the spec's arithmetic, as FakeQuantize computes it
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        qdq.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    a, b = session.run(None, data)[0], OpenVINOSession(fq).run(None, data)[0]
    noise = np.sum((a - b).astype(np.float64) ** 2) / np.sum(a.astype(np.float64) ** 2)
    assert 10 * np.log10(1 / max(noise, 1e-30)) > 80
    on_r = [n for n in fq.graph.node if n.op_type == "FakeQuantize" and n.input[0].startswith("r")]
    assert len(on_r) == 1


@pytest.mark.parametrize(
    "table, message",
    [
        ({"activation_dtype": "int4"}, "is not one of uint8, int8, int16"),
        ({"weight_dtype": "int2"}, "is not one of int8, int4"),
        (
            {"per_channel": "yes"},
            'per_channel = .yes. \\(in \\[node."conv2"\\]\\) must be true or false',
        ),
    ],
)
def test_per_node_settings_are_validated(table, message):
    with pytest.raises(ConfigError, match=message):
        UserConfig.from_dict({"node": {"conv2": table}})


def _three_matmuls():
    from helpers import make_model

    gen = np.random.default_rng(8)
    h = onnx.helper
    nodes = [
        h.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        h.make_node("Relu", ["h"], ["r"], name="relu1"),
        h.make_node("MatMul", ["r", "W2"], ["z"], name="mm2"),
        h.make_node("Relu", ["z"], ["r2"], name="relu2"),
        h.make_node("MatMul", ["r2", "W3"], ["y"], name="mm3"),
    ]
    inits = {
        "W1": gen.normal(0, 0.3, (64, 128)).astype(np.float32),
        "W2": gen.normal(0, 0.1, (128, 128)).astype(np.float32),
        "W3": gen.normal(0, 0.1, (128, 10)).astype(np.float32),
    }
    model = make_model(nodes, [("x", ["N", 64])], [("y", None)], inits)
    return model, {"x": gen.normal(0, 1, (64, 64)).astype(np.float32)}


MIXED = {
    "node": {
        "mm1": {"per_channel": False},
        "mm2": {"weight_dtype": "int4"},
        "mm3": {"activation_dtype": "int16"},
    }
}


def test_mixed_precision_per_node_in_qdq():
    # mm1 per-tensor int8, mm2 block-wise int4 weights with float activations, mm3 A16W8:
    # one model, run by onnxruntime, close to float
    from helpers import run

    model, data = _three_matmuls()
    q, report = onnxq.quantize(
        model, data, config=UserConfig.from_dict(MIXED), format="qdq", progress=False
    )
    inits = {i.name: i for i in q.graph.initializer}
    assert onnx.numpy_helper.to_array(inits["W1_scale"]).shape == ()  # per tensor
    assert onnx.numpy_helper.to_array(inits["W3_scale"]).shape == (10,)  # per channel
    assert inits["W2_int4"].data_type == onnx.TensorProto.INT4
    block = next(n for n in q.graph.node if n.input[0] == "W2_int4")
    assert {a.name: a.i for a in block.attribute}["block_size"] == 32
    # mm3 reads int16 activations; its result, the graph output, is written float
    zero_points = [onnx.numpy_helper.to_array(i) for i in q.graph.initializer]
    assert any(z.dtype == np.int16 for z in zero_points)
    assert all(n.op_type != "QuantizeLinear" for n in q.graph.node if "y" in n.input)
    # the one warning: onnxruntime runs mm3's int16 activations through 8-bit MatMulNBits
    (warning,) = report.warnings
    assert "1 MatMul/Gemm node(s)" in warning and "'mm3" in warning and "MatMulNBits" in warning
    by = {d.node: d for d in report.decisions}
    assert by["mm2"].quantized and by["mm2"].pattern == "int4-weights"
    assert "activations int16" in by["mm3"].reason
    x = {"x": data["x"][:16]}
    ref, got = run(model, x)[0], run(q, x)[0]
    # int4 weights dominate the error: on these Gaussian weights, about 10% of the output's RMS
    assert np.sqrt(np.mean((got - ref) ** 2)) < 0.15 * np.sqrt(np.mean(ref**2))


def test_requests_the_target_cannot_run_are_ignored_with_a_warning():
    model, data = _three_matmuls()
    cfg = UserConfig.from_dict(MIXED)
    _, report = onnxq.quantize(model, data, config=cfg, format="qoperator", progress=False)
    assert any("'mm3'" in w and "no int16 kernels" in w for w in report.warnings)
    mm3 = next(d for d in report.decisions if d.node == "mm3")
    assert mm3.quantized and "is ignored" in mm3.reason
    assert "warning: node 'mm3'" in report.summary()
    # TensorRT runs symmetric int8 only; int4 on a Conv is not block-wise
    _, report = onnxq.quantize(
        model,
        data,
        config=UserConfig.from_dict({"node": {"mm1": {"activation_dtype": "uint8"}}}),
        target="tensorrt",
        progress=False,
    )
    assert report.warnings == [
        "node 'mm1': activation_dtype uint8 (config [node.\"mm1\"]) is ignored: target "
        "'tensorrt' runs symmetric int8 activations only"
    ]
    _, report = onnxq.quantize(
        _two_convs(),
        {"x": np.random.default_rng(1).normal(0, 1, (8, 3, 8, 8)).astype(np.float32)},
        config=UserConfig.from_dict({"op_type": {"Conv": {"weight_dtype": "int4"}}}),
        progress=False,
    )
    assert len(report.warnings) == 2 and all("MatMul and Gemm only" in w for w in report.warnings)
    assert all(d.quantized for d in report.decisions if d.op == "Conv")


def test_inspect_explains_per_node_precision_and_ignored_requests(tmp_path, capsys):
    cfg = tmp_path / "mixed.toml"
    cfg.write_text(
        '[op_type.Gemm]\nweight_dtype = "int4"\n[node.conv1]\nactivation_dtype = "int16"\n'
    )
    model = str(DIGITS_CNN)
    assert main(["inspect", model, "--explain", "--config", str(cfg)]) == 0
    out = capsys.readouterr()
    assert "int4-weights: fc" in out.out
    assert "node 'conv1': activation_dtype int16" in out.err and "no int16 kernels" in out.err
    # the generic target writes QDQ, which has int16: no warning
    assert main(["inspect", model, "--config", str(cfg), "--target", "generic"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_report_names_python_parameters_from_python_and_flags_from_the_cli(tmp_path, capsys):
    """The same messages, spelled for the caller: exclude / weight_bits=8 vs --exclude."""
    data = {"input": rng(3).normal(0, 1, (16, 1, 28, 28)).astype(np.float32)}
    _, rep = onnxq.quantize(str(DIGITS_CNN), data, exclude=["conv1"], progress=False)
    conv1 = next(d for d in rep.decisions if d.node == "conv1")
    assert "is in exclude" in conv1.reason and "--" not in conv1.reason
    assert all("--" not in line for line in rep.warnings + rep.notes)
    np.savez(tmp_path / "calib.npz", input=data["input"])
    out, js = tmp_path / "q.onnx", tmp_path / "r.json"
    args = ["quantize", str(DIGITS_CNN), "--data", str(tmp_path / "calib.npz"), "-o", str(out)]
    assert main([*args, "--exclude", "conv1", "--report", str(js), "--quiet"]) == 0
    decisions = {d["node"]: d for d in json.loads(js.read_text())["decisions"]}
    assert "is in --exclude" in decisions["conv1"]["reason"]


def test_an_unknown_exclude_is_named_in_the_callers_spelling():
    data = {"input": rng(3).normal(0, 1, (4, 1, 28, 28)).astype(np.float32)}
    with pytest.raises(ConfigError) as err:
        onnxq.quantize(str(DIGITS_CNN), data, exclude=["nope"], progress=False)
    assert str(err.value).startswith("exclude: node(s) ['nope'] are not in the model;"), err.value


@pytest.mark.parametrize(
    "cli, python",
    [
        ("try --exclude /m/conv1/Conv, or", "try exclude=['/m/conv1/Conv'], or"),
        ("ends with --exclude conv2.", "ends with exclude=['conv2']."),
        ("pass --weight-bits 8 for", "pass weight_bits=8 for"),
        ("use --format qdq here", "use format='qdq' here"),
        ("--per-tensor weights", "per_channel=False weights"),
        ("--target-file is CLI only", "--target-file is CLI only"),
    ],
)
def test_pythonize_spells_flags_as_parameters(cli, python):
    from onnxq.options import pythonize

    assert pythonize(cli) == python


def test_with_nodes_merges_over_a_copy():
    cfg = UserConfig.from_dict(
        {"method": "mse", "node": {"conv1": {"method": "entropy"}}}, "user.toml"
    )
    more = cfg.with_nodes({"conv1": {"activation_dtype": "int16"}, "fc": {"keep_float": True}})
    assert cfg.node == {"conv1": {"method": "entropy"}}  # the user's config is left alone
    assert more.resolve("conv1", "Conv").method == "entropy"
    assert more.resolve("conv1", "Conv").activation_dtype == "int16"
    assert more.resolve("fc", "Gemm").keep_float and more.resolve("fc", "Gemm").method == "mse"
    assert more.path == cfg.path
