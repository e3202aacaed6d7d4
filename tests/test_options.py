"""quantize(model, data, options=Options(...), **overrides): one documented options object."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import DIGITS_CNN

import onnxq
from onnxq.api import quantize_state
from onnxq.io.graph import serialize
from onnxq.options import Options, option_names

_DEMO = np.load(Path(onnxq.__file__).parent / "demo" / "digits.npz")
DATA = {"input": _DEMO["calib"][:32].astype(np.float32) / 16.0}
FAST = {"progress": False, "rounding": "nearest", "bias_correction": "none", "samples": 32}


def _sha(model) -> bytes:
    return serialize(model)


def test_an_options_object_and_keywords_give_the_same_model():
    by_keywords, _ = onnxq.quantize(str(DIGITS_CNN), DATA, method="minmax", **FAST)
    by_object, _ = onnxq.quantize(str(DIGITS_CNN), DATA, options=Options(method="minmax", **FAST))
    assert _sha(by_keywords) == _sha(by_object)


def test_keywords_override_the_object_and_leave_it_as_it_was():
    base = Options(method="minmax", **FAST)
    overridden, report = onnxq.quantize(str(DIGITS_CNN), DATA, options=base, format="qdq")
    assert base.format is None  # frozen: the caller's object is never changed
    assert {n.op_type for n in overridden.graph.node} >= {"QuantizeLinear", "DequantizeLinear"}
    plain, _ = onnxq.quantize(str(DIGITS_CNN), DATA, options=base)
    assert "QLinearConv" in {n.op_type for n in plain.graph.node}


def test_an_unknown_option_is_refused_with_the_nearest_name():
    with pytest.raises(onnxq.OnnxqError, match=r"no option 'methd'; did you mean 'method'\?"):
        onnxq.quantize(str(DIGITS_CNN), DATA, methd="minmax")
    with pytest.raises(onnxq.OnnxqError, match=r"no option 'zzz'; the options are the fields"):
        quantize_state(str(DIGITS_CNN), DATA, zzz=1)


def test_options_must_be_an_options_object():
    with pytest.raises(onnxq.OnnxqError, match="options must be an onnxq.Options, not dict"):
        onnxq.quantize(str(DIGITS_CNN), DATA, options={"method": "minmax"})


def test_quantize_state_takes_the_same_options():
    state = quantize_state(str(DIGITS_CNN), DATA, options=Options(method="minmax", **FAST))
    assert state.options.method == "minmax" and state.options.rounding == "nearest"
    assert np.all([v.size for v in state.values.values()])


def test_every_option_is_documented_where_it_is_defined():
    # each field of Options carries a comment (#:) or shares the one of the field above it
    source = inspect.getsource(Options)
    body = source[source.index('"""', source.index('"""') + 3) + 3 :]
    undocumented, comment_seen = [], False
    for line in body.splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            comment_seen = True
        elif re.match(r"\w+: ", stripped):
            name = stripped.split(":")[0]
            if not comment_seen and name not in _SHARED_COMMENT:
                undocumented.append(name)
            comment_seen = False
    assert not undocumented, undocumented
    assert option_names() == tuple(f.name for f in dataclasses.fields(Options))


#: fields documented by the comment above the field before them
_SHARED_COMMENT = {"symmetric_activations", "block_size", "bins", "load_ranges"}
