"""The model's kind (CNN, transformer, recurrent), read from its graph, for the defaults.

NNCF asks the user for ``model_type``; here the graph answers:

* **rnn**: a recurrent cell (LSTM, GRU, RNN) or a Loop/Scan body, anywhere in the model;
* **transformer**: attention (a Softmax whose input comes from a MatMul of two activations, or
  a fused Attention op), where linear layers (MatMul/Gemm with constant weights) are at least
  as many as convolutions (a CNN with one attention neck stays a CNN);
* **cnn**: convolutions;
* **other**: none of these (an MLP, a model of elementwise ops).

The kind sets which algorithms run by default (``onnxq.passes.pipeline``); ``model_kind=`` /
``--model-kind`` overrides the detection.
"""

from __future__ import annotations

from collections import Counter

import onnx

from onnxq.io.graph import graphs_of

KINDS = ("auto", "cnn", "transformer", "rnn", "other")
_RECURRENT = {"LSTM", "GRU", "RNN", "Loop", "Scan"}
_ATTENTION = {"Attention", "MultiHeadAttention", "GroupQueryAttention"}


def _nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    out = []
    for n in graph.node:
        out.append(n)
        for _, body in graphs_of(n):
            out.extend(_nodes(body))
    return out


def _attention(nodes: list[onnx.NodeProto], constants: set[str]) -> int:
    """Softmax nodes fed (within a few ops) by a MatMul of two activations: attention."""
    producers = {o: n for n in nodes for o in n.output}
    found = 0
    for n in nodes:
        if n.op_type != "Softmax":
            continue
        frontier = [n.input[0]]
        for _ in range(6):
            ops = [producers[t] for t in frontier if t in producers]
            if any(p.op_type == "MatMul" and not set(p.input) & constants for p in ops):
                found += 1
                break
            frontier = [i for p in ops for i in p.input if i not in constants]
    return found


def _constants(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> set[str]:
    names = {i.name for i in model.graph.initializer}
    return names | {o for n in nodes if n.op_type == "Constant" for o in n.output}


def detect(model: onnx.ModelProto) -> tuple[str, str]:
    """``(kind, why)`` for ``model``."""
    nodes = _nodes(model.graph)
    ops = Counter(n.op_type for n in nodes)
    recurrent = sorted(op for op in ops if op in _RECURRENT)
    if recurrent:
        return "rnn", "it holds " + ", ".join(f"{ops[op]} {op}" for op in recurrent)
    convs = ops["Conv"] + ops["ConvTranspose"]
    constants = _constants(model, nodes)
    linear = sum(
        1 for n in nodes if n.op_type in ("MatMul", "Gemm") and set(n.input[1:2]) & constants
    )
    heads = sum(ops[op] for op in _ATTENTION) or _attention(nodes, constants)
    if heads and linear >= convs:
        return (
            "transformer",
            f"{heads} attention heads' Softmax, {linear} linear layers, {convs} convolutions",
        )
    if convs:
        return "cnn", f"{convs} convolutions" + (f", {heads} attention" if heads else "")
    return "other", f"no convolution, attention or recurrent cell ({linear} linear layers)"
