"""The zoo's exporters on hand-made files: the legacy PyTorch state-dict reader."""

from __future__ import annotations

import pickle
import sys
import types
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from models.exporters import torch_legacy_state_dict

MAGIC = 0x1950A86A20F9469CFC6C


class _Storage:
    def __init__(self, key: str, data: np.ndarray):
        self.key, self.data = key, data


def _write_legacy(path: Path, monkeypatch, tensors: dict[str, tuple]) -> None:
    """Write ``tensors`` (name -> (storage, offset, shape, stride)) the way torch.save did
    before PyTorch 1.6, with stand-in torch modules (the tests never import PyTorch)."""
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")
    storage_type = type("FloatStorage", (), {"__module__": "torch"})
    torch.FloatStorage = storage_type

    def _rebuild_tensor_v2(*args):  # pragma: no cover - only its name is pickled
        raise AssertionError

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", utils)

    class _Tensor:
        def __init__(self, storage, offset, shape, stride):
            self.args = (storage, offset, shape, stride, False, OrderedDict())

        def __reduce__(self):
            return (_rebuild_tensor_v2, self.args)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, _Storage):
                return ("storage", storage_type, obj.key, "cpu", obj.data.size)
            return None

    storages: dict[str, _Storage] = {}
    state = OrderedDict()
    for name, (storage, offset, shape, stride) in tensors.items():
        storages[storage.key] = storage
        state[name] = _Tensor(storage, offset, shape, stride)
    with open(path, "wb") as f:
        for header in (MAGIC, 1001, {"little_endian": True}):
            pickle.dump(header, f, protocol=2)
        _Pickler(f, protocol=2).dump(state)
        pickle.dump(sorted(storages), f, protocol=2)
        for key in sorted(storages):
            data = storages[key].data.astype("<f4")
            f.write(np.int64(data.size).tobytes())
            f.write(data.tobytes())


def test_the_legacy_reader_rebuilds_views_offsets_and_strides(tmp_path, monkeypatch):
    flat = np.arange(30, dtype=np.float32)
    shared = _Storage("0", flat)
    path = tmp_path / "weights.pth"
    _write_legacy(
        path,
        monkeypatch,
        {
            "conv.weight": (shared, 0, (2, 3), (3, 1)),
            "conv.weight_t": (shared, 0, (3, 2), (1, 3)),  # a transposed view
            "fc.bias": (shared, 20, (4,), (1,)),  # an offset into the same storage
            "other": (_Storage("1", np.full(2, 7.0, np.float32)), 0, (2,), (1,)),
        },
    )
    got = torch_legacy_state_dict(path)
    np.testing.assert_array_equal(got["conv.weight"], flat[:6].reshape(2, 3))
    np.testing.assert_array_equal(got["conv.weight_t"], flat[:6].reshape(2, 3).T)
    np.testing.assert_array_equal(got["fc.bias"], flat[20:24])
    np.testing.assert_array_equal(got["other"], [7.0, 7.0])
    assert got["fc.bias"].dtype == np.float32 and got["fc.bias"].flags.writeable


class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_the_legacy_reader_runs_no_code_from_the_file(tmp_path, capsys):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        for header in (MAGIC, 1001, {}):
            pickle.dump(header, f, protocol=2)
        pickle.dump(OrderedDict(x=_Payload()), f, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="print is not a state dict class"):
        torch_legacy_state_dict(path)
    assert "must never run" not in capsys.readouterr().out


def test_a_file_of_another_format_is_refused(tmp_path):
    path = tmp_path / "new.pth"
    with open(path, "wb") as f:
        pickle.dump(12345, f)
    with pytest.raises(ValueError, match="not a legacy torch.save file"):
        torch_legacy_state_dict(path)
