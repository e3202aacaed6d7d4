"""A model with external data keeps its weights in its data file while onnxq works on it.

onnxq.io.graph leaves such weights in the file (file weights) and reads each when a step needs
it, so no whole copy of the float weights sits beside onnxruntime's session. The output must be
the same bytes as when the weights are loaded first, the input files untouched, and the
model handed back to a Python caller self-contained.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import pytest
from helpers import DIGITS_CNN, run

import onnxq
import onnxq.lower.qoperator as qoperator
from benchmarks import big_model
from onnxq.api import quantize_state
from onnxq.cli import main
from onnxq.core.errors import ModelError
from onnxq.io.graph import (
    FOLDER_KEY,
    has_file_weights,
    load_model,
    serialize,
    tensor_array,
)


def _external(tmp_path, source=DIGITS_CNN, name="ext.onnx"):
    """``source`` saved with every initializer in ``name``.data; returns the model path."""
    model = onnx.load(str(source))
    path = tmp_path / name
    onnx.save_model(
        model, str(path), save_as_external_data=True, location=name + ".data", size_threshold=0
    )
    return path


@pytest.fixture
def digits():
    pixels = np.load(str(DIGITS_CNN.parent / "digits.npz"))["calib"][:48]
    return {"input": pixels.astype(np.float32) / 255}


def _hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_a_loaded_model_leaves_its_weights_in_the_file(tmp_path):
    path = _external(tmp_path)
    model = load_model(str(path))
    inline = onnx.load(str(path))  # onnx reads the data in
    assert has_file_weights(model)
    assert model.ByteSize() < inline.ByteSize() / 10
    for t, u in zip(model.graph.initializer, inline.graph.initializer, strict=True):
        assert any(e.key == FOLDER_KEY for e in t.external_data)
        np.testing.assert_array_equal(tensor_array(t), onnx.numpy_helper.to_array(u))


@pytest.mark.parametrize("fmt", ["qoperator", "qdq"])
def test_the_output_is_the_same_bytes_as_with_the_weights_loaded(tmp_path, digits, fmt):
    """Sequential bias correction, emulation and lowering all read the weights from the file."""
    path = _external(tmp_path)
    before = _hashes(tmp_path)
    from_file, _ = onnxq.quantize(str(path), digits, format=fmt, progress=False)
    loaded, _ = onnxq.quantize(onnx.load(str(path)), digits, format=fmt, progress=False)
    assert not has_file_weights(from_file)  # handed back self-contained
    assert serialize(from_file) == serialize(loaded)
    assert _hashes(tmp_path) == before  # the input model and its data file are untouched
    (out,) = run(from_file, {"input": digits["input"][:4]})
    (ref,) = run(onnx.load(str(path)), {"input": digits["input"][:4]})
    assert (out.argmax(1) == ref.argmax(1)).mean() >= 0.75


def test_the_cli_writes_the_same_file_as_from_the_loaded_model(tmp_path, digits):
    path = _external(tmp_path)
    data = tmp_path / "calib.npz"
    np.savez(data, **digits)
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    rc = main(["quantize", str(path), "--data", str(data), "-o", str(out), "--quiet"])
    assert rc == 0
    loaded, _ = onnxq.quantize(onnx.load(str(path)), digits, progress=False)
    assert out.read_bytes() == serialize(loaded)  # one file: the int8 model is under 2 GB
    assert sorted(p.name for p in out.parent.iterdir()) == ["q.onnx"]


def test_a_weight_folded_before_matching_is_read_in(tmp_path):
    """Transpose(W) is folded by running onnxruntime on it: W must reach it with its data."""
    from onnx import TensorProto
    from onnx import helper as h

    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32), "W"),
        onnx.numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b"),
    ]
    nodes = [
        h.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
        h.make_node("MatMul", ["x", "Wt"], ["y0"]),
        h.make_node("Add", ["y0", "b"], ["y1"]),
        h.make_node("Relu", ["y1"], ["y"]),
    ]
    graph = h.make_graph(
        nodes,
        "transposed_weight",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32])],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "t.onnx"
    onnx.save_model(
        model, str(path), save_as_external_data=True, location="t.onnx.data", size_threshold=0
    )
    x = {"x": rng.standard_normal((64, 16)).astype(np.float32)}
    from_file, _ = onnxq.quantize(str(path), x, progress=False)
    loaded, _ = onnxq.quantize(onnx.load(str(path)), x, progress=False)
    ops = [n.op_type for n in from_file.graph.node]
    assert ops == ["QuantizeLinear", "QGemm", "DequantizeLinear"]  # folded, then matched
    assert serialize(from_file) == serialize(loaded)


def test_the_template_holds_no_copy_of_the_weights(tmp_path, monkeypatch):
    """Float weights stay in the file; int8 weights over the limit have no data until solved."""
    path = big_model.build(tmp_path / "model", hidden=64, blocks=2)
    tokens = {"x": np.random.default_rng(0).standard_normal((4, 8, 64)).astype(np.float32)}
    expected, _ = onnxq.quantize(onnx.load(str(path)), tokens, progress=False)
    monkeypatch.setattr(qoperator, "UNFILLED_BYTES", 1024)
    state = quantize_state(str(path), tokens, progress=False)
    weights = big_model.weight_bytes(path)
    assert state.quantizer.float_model.ByteSize() < weights / 20
    assert state.quantizer.template.ByteSize() < weights / 20
    assert serialize(onnxq.io.graph.with_file_weights(state.model)) == serialize(expected)


@pytest.mark.parametrize(
    ("location", "says"),
    [
        ("../elsewhere.data", "not a file inside the model's folder"),
        ("/tmp/absolute.data", "not a file inside the model's folder"),
    ],
)
def test_external_data_outside_the_folder_is_refused(tmp_path, location, says, capsys):
    path = _external(tmp_path)
    model = onnx.load(str(path), load_external_data=False)
    for e in model.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = location
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match=says):
        load_model(str(path))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_truncated_data_file_is_named_before_any_work(tmp_path, capsys):
    path = _external(tmp_path)
    data = tmp_path / "ext.onnx.data"
    data.write_bytes(data.read_bytes()[:-100])
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and "ext.onnx.data" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("offset", "twelve", "external data offset 'twelve', not a whole number of bytes"),
        ("offset", "-4", "external data offset '-4', not a whole number of bytes"),
        ("length", "7", "declares 7 bytes of external data where its type and shape need"),
    ],
)
def test_a_malformed_external_data_entry_is_named(tmp_path, key, value, says, capsys):
    path = _external(tmp_path)
    model = onnx.load(str(path), load_external_data=False)
    entries = model.graph.initializer[0].external_data
    found = [e for e in entries if e.key == key]
    entry = found[0] if found else entries.add()
    entry.key, entry.value = key, value
    onnx.save(model, str(path))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_missing_data_file_of_a_branch_weight_is_named(tmp_path, capsys):
    # the only external weight sits in an If branch: the error must still name its file
    from onnx import TensorProto, helper

    w = onnx.numpy_helper.from_array(np.arange(64, dtype=np.float32), "w")
    then = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y_then"])],
        "then",
        [],
        [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, [64])],
        [w],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y_else"])],
        "else",
        [],
        [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, [64])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [64]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "branch.onnx"
    onnx.save(
        model, str(path), save_as_external_data=True, location="branch.data", size_threshold=0
    )
    assert (tmp_path / "branch.data").is_file()
    assert main(["inspect", str(path)]) == 0  # loads while the file is there
    capsys.readouterr()
    (tmp_path / "branch.data").unlink()
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "'branch.data'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
