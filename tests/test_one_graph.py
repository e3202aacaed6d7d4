"""One graph through the pipeline: the float model is imported once per quantize call.

Preprocessing imports the caller's model and hands the graph it edited on, with the shapes
inference found written into it; everything derived from it (the annotated template, each
FakeQuantize lowering and emulation) is a copy of that graph. The passes from materialize to
share-scales edit one graph, exported once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import helper as h

import onnxq
from onnxq.annotate.quantizer import Quantizer
from onnxq.api import quantize
from onnxq.io.graph import copy_graph, export_model, import_graph, tidy
from onnxq.prepare.preprocess import prepare
from tests.helpers import DIGITS_CNN, make_model

#: the onnx package's PyTorch-converted and real models (140 in onnx 1.17+)
CORPUS = sorted((Path(onnx.__file__).parent / "backend" / "test" / "data").glob("*/*/model.onnx"))

_DEMO = np.load(Path(onnxq.__file__).parent / "demo" / "digits.npz")
#: 32 batches: the recipe choice runs (five candidates emulated), and the sequential correction
DATA = {"input": _DEMO["calib"][:32].astype(np.float32) / 16.0}


@pytest.mark.parametrize(
    "options", [{}, {"format": "qdq"}, {"format": "openvino"}, {"target": "tensorrt"}]
)
def test_one_graph_import_per_call(monkeypatch: pytest.MonkeyPatch, options: dict) -> None:
    calls: list[int] = []
    real = gs.import_onnx

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gs, "import_onnx", counted)
    _, report = quantize(str(DIGITS_CNN), DATA, progress=False, **options)
    assert report.choice.get("candidates"), "the recipe choice did not run"
    # preprocessing's; the Quantizer, the emulations, the FakeQuantize lowering and the passes
    # after materialize import nothing (they were 11 on this call before)
    assert len(calls) == 1


def _described(graph: gs.Graph) -> dict[str, tuple]:
    """What the rules read of each tensor: its class, dtype, shape and type."""
    return {
        name: (
            type(t).__name__,
            str(t.dtype),
            None if t.shape is None else tuple(t.shape),
            getattr(t, "type", None),
        )
        for name, t in graph.tensors().items()
    }


def test_preprocessing_hands_on_the_graph_an_import_would_give() -> None:
    """The graph preprocessing edited, with the inferred shapes, is the import of its model."""
    assert len(CORPUS) > 100
    for path in [*CORPUS, DIGITS_CNN]:
        model, graph = prepare(onnx.load(path))
        imported = import_graph(model)
        assert _described(graph) == _described(imported), path
        assert graph.opset == imported.opset, path
        ours = export_model(copy_graph(graph), model).SerializeToString()
        assert ours == export_model(imported, model).SerializeToString(), path


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


def test_tidy_sorts_a_long_chain_from_deep_in_a_call_stack() -> None:
    """graphsurgeon's sort recurses once per node of the longest chain; tidy allows for it.

    The QDQ template of a 100-layer MLP is written inside ``onnxq debug``'s own calls, where the
    default limit of 1,000 frames ran out.
    """
    nodes = [h.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"r{i}") for i in range(1500)]
    graph = import_graph(make_model(nodes, [("t0", [2])], [("t1500", [2])]))
    graph.nodes.reverse()

    def deep(levels: int) -> list[str]:
        if levels:
            return deep(levels - 1)
        tidy(graph)
        return [n.name for n in graph.nodes]

    limit = sys.getrecursionlimit()
    assert deep(limit - 100) == [f"r{i}" for i in range(1500)]
    assert sys.getrecursionlimit() == limit
