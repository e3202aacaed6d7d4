"""One graph through the pipeline: the float model is imported once per quantize call.

Preprocessing imports the caller's model (and shape inference needs a ModelProto between its
folds and the annotation); the Quantizer imports the preprocessed model once, and everything
derived from it (the annotated template, each FakeQuantize lowering and emulation) is a copy
of that graph. The passes from materialize to share-scales edit one graph, exported once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs
import pytest

import onnxq
from onnxq.annotate.quantizer import Quantizer
from onnxq.api import quantize
from onnxq.io.graph import export_model
from tests.helpers import DIGITS_CNN

_DEMO = np.load(Path(onnxq.__file__).parent / "demo" / "digits.npz")
#: 32 batches: the recipe choice runs (five candidates emulated), and the sequential correction
DATA = {"input": _DEMO["calib"][:32].astype(np.float32) / 16.0}


@pytest.mark.parametrize(
    "options", [{}, {"format": "qdq"}, {"format": "openvino"}, {"target": "tensorrt"}]
)
def test_two_graph_imports_per_call(monkeypatch: pytest.MonkeyPatch, options: dict) -> None:
    calls: list[int] = []
    real = gs.import_onnx

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gs, "import_onnx", counted)
    _, report = quantize(str(DIGITS_CNN), DATA, progress=False, **options)
    assert report.choice.get("candidates"), "the recipe choice did not run"
    # preprocessing's and the Quantizer's; the emulations, the FakeQuantize lowering and the
    # passes after materialize import nothing (they were 11 on this call before)
    assert len(calls) == 2


def test_materialized_graph_is_the_materialized_model() -> None:
    q = Quantizer(str(DIGITS_CNN))
    rng = np.random.default_rng(0)
    values = {
        name: (rng.uniform(0.01, 0.1, ph.shape) if ph.kind == "scale" else ph.default())
        for name, ph in q.placeholders.items()
    }
    proto = q.materialize(values)
    held = dict(q.final_values)
    graph = q.materialize_graph(values)
    assert q.final_values.keys() == held.keys()
    assert all(np.array_equal(q.final_values[k], held[k]) for k in held)
    exported = export_model(graph, q.template)
    imported = export_model(gs.import_onnx(proto), proto)
    assert exported.SerializeToString() == imported.SerializeToString()
    # the template graph itself still holds the placeholders' defaults
    again = export_model(q.template_graph.copy(), q.template)
    assert again.SerializeToString() == q.template.SerializeToString()
