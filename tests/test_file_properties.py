"""Property tests of the files onnxq reads: configs, target files, .npz data, external data.

Random and adversarial contents (hypothesis): every outcome is a value or an OnnxqError with a
one-line message — never another exception — and the command line writes nothing but ``-o``.
The fast tier draws a few dozen files per format; ``pytest --slow`` draws hundreds.
"""

from __future__ import annotations

import io
import string
import struct
import zipfile

import numpy as np
import onnx
import pytest
import tomli_w
from helpers import DIGITS_CNN, examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnxq.annotate import targets as targets_module
from onnxq.annotate.config import KEYS, UserConfig
from onnxq.calibrate.dataset import InputSpec, NpzDataset
from onnxq.cli import main
from onnxq.core.errors import OnnxqError
from onnxq.io.graph import load_model

SETTINGS = settings(
    max_examples=examples(40, 400),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

names = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=12)
scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    names,
    st.sampled_from(["minmax", "mse", "int8", "int16", "qdq", "auto", "conv", "Concat"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(names, inner, max_size=3)),
    max_leaves=12,
)
keys = st.one_of(st.sampled_from(sorted(KEYS | {"pattern", "format", "patterns"})), names)
tables = st.dictionaries(keys, values, max_size=4)
config_docs = st.fixed_dictionaries(
    {},
    optional={
        "method": values,
        "keep_float": values,
        "op_type": st.one_of(values, st.dictionaries(names, tables, max_size=3)),
        "node": st.one_of(values, st.dictionaries(names, tables, max_size=3)),
        "node_regex": st.one_of(values, st.lists(tables, max_size=3)),
    },
)
target_docs = st.fixed_dictionaries(
    {}, optional={"target": st.one_of(values, st.dictionaries(names, tables, max_size=3))}
)
raw_texts = st.one_of(
    st.binary(max_size=200),
    st.integers(1, 3000).map(lambda n: b"a = " + b"[" * n + b"]" * n),
    st.integers(1, 3000).map(lambda n: b"a = " + b"{b = " * n + b"1" + b"}" * n),
    st.text(alphabet=string.printable, max_size=200).map(str.encode),
)


def _dumps(doc):
    try:
        return tomli_w.dumps(doc).encode()
    except (TypeError, ValueError):  # NaN keys and the like TOML cannot write
        return b"x = 1\n"


@SETTINGS
@given(doc=st.one_of(config_docs.map(_dumps), raw_texts))
def test_any_config_file_is_a_config_or_one_error(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_bytes(doc)
    try:
        UserConfig.load(path)
    except OnnxqError as exc:
        assert "\n" not in str(exc).strip() or "\\n" in repr(str(exc))


@SETTINGS
@given(doc=st.one_of(target_docs.map(_dumps), raw_texts))
def test_any_target_file_is_targets_or_one_error(tmp_path_factory, doc, monkeypatch):
    monkeypatch.setattr(targets_module, "_REGISTRY", dict(targets_module._REGISTRY))
    path = tmp_path_factory.mktemp("tgt") / "t.toml"
    path.write_bytes(doc)
    try:
        targets_module.load_targets(path, warn=lambda message: None)
    except OnnxqError:
        pass


def _npy(descr, shape, payload):
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + payload


members = st.tuples(
    st.one_of(st.sampled_from(["x", "x.npy", "y.npy", "labels"]), names),
    st.one_of(
        st.builds(
            _npy,
            st.sampled_from(["<f4", "<f8", "|u1", "<i8", "|O", "<c8", "|b1", ">f4", "<U3"]),
            st.lists(st.integers(0, 2**40), max_size=4).map(tuple),
            st.binary(max_size=64),
        ),
        st.binary(max_size=80),
        st.just(np.lib.format.magic(1, 0) + b"\xff\xff" + b"{" * 10),
    ),
)


@SETTINGS
@given(entries=st.lists(members, max_size=4))
@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_any_npz_is_samples_or_one_error(tmp_path_factory, entries):
    path = tmp_path_factory.mktemp("npz") / "d.npz"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, raw in entries:
            z.writestr(name or "_", raw)
    path.write_bytes(buf.getvalue())
    spec = InputSpec("x", np.dtype(np.float32), (None, 4))
    try:
        ds = NpzDataset(path, inputs=[spec]).bind([spec])
        for _ in ds.batches():
            pass
    except OnnxqError:
        pass


external = st.fixed_dictionaries(
    {
        "location": st.one_of(
            st.sampled_from(["w.bin", "../w.bin", "/etc/passwd", "sub/../w.bin", "", "."]),
            names,
        ),
    },
    optional={
        "offset": st.one_of(st.integers(-5, 200).map(str), names),
        "length": st.one_of(st.integers(-5, 200).map(str), names),
        "onnxq_folder": st.sampled_from(["/", "", "x"]),
        "checksum": names,
    },
)


@SETTINGS
@given(entry=external, dims=st.lists(st.integers(0, 40), min_size=1, max_size=3))
def test_any_external_data_entry_is_read_inside_the_folder_or_refused(
    tmp_path_factory, entry, dims
):
    folder = tmp_path_factory.mktemp("ext")
    (folder / "w.bin").write_bytes(np.arange(64, dtype=np.float32).tobytes())
    model = onnx.load(DIGITS_CNN)
    t = model.graph.initializer[0]
    t.ClearField("raw_data")
    t.ClearField("float_data")
    del t.dims[:]
    t.dims.extend(dims)
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in entry.items():
        e = t.external_data.add()
        e.key, e.value = key, value
    onnx.save(model, folder / "m.onnx")
    for source, base in ((str(folder / "m.onnx"), None), (model, folder)):
        try:
            load_model(source, check=False, base_dir=base)
        except OnnxqError:
            continue
        assert entry.get("location") and not entry["location"].startswith("/")
        assert "onnxq_folder" not in entry


@settings(max_examples=examples(8, 60), deadline=None, derandomize=True)
@given(
    doc=st.one_of(config_docs.map(_dumps), raw_texts),
    target=st.one_of(target_docs.map(_dumps), raw_texts),
)
def test_the_command_writes_only_its_output(tmp_path_factory, doc, target):
    folder = tmp_path_factory.mktemp("cli")
    (folder / "c.toml").write_bytes(doc)
    (folder / "t.toml").write_bytes(target)
    np.savez(folder / "d.npz", input=np.random.default_rng(0).uniform(size=(4, 1, 28, 28)))
    before = {p.name for p in folder.iterdir()}
    saved = dict(targets_module._REGISTRY)
    try:
        argv = ["quantize", str(DIGITS_CNN), "-o", str(folder / "q.onnx"), "--quiet"]
        argv += ["--data", str(folder / "d.npz"), "--config", str(folder / "c.toml")]
        argv += ["--target-file", str(folder / "t.toml"), "--no-latency-check"]
        rc = main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    finally:
        targets_module._REGISTRY.clear()
        targets_module._REGISTRY.update(saved)
    assert rc in (0, 2)
    after = {p.name for p in folder.iterdir()}
    assert after - before <= {"q.onnx"} and (rc == 0) == ("q.onnx" in after)


@pytest.fixture(autouse=True)
def _no_internal_errors(capsys):
    yield
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err, err
