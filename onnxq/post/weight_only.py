"""Weight-only int4: block-wise int4 weights for MatMul and Gemm (opset 21 DequantizeLinear).

Each constant weight W (K × N, reduced over K) is cut into blocks of ``block_size`` rows per
column; a block b of column n gets ``scale = max|W_b,n| / 7`` and int4 values in [−8, 7]::

    W ≈ DequantizeLinear(W_int4, scale[K / block_size, N], axis=0, block_size=block_size)

Activations stay float, so no calibration data is needed; the model shrinks about 7× on those
weights and onnxruntime can run the DequantizeLinear → MatMul pair with its n-bit kernels.
The opset is raised to 21 (int4 and ``block_size`` need it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper

from onnxq.core.errors import ConfigError
from onnxq.io.graph import GraphEditor, export_model, import_graph
from onnxq.pattern import node_attr
from onnxq.prepare.opset import raise_opset
from onnxq.prepare.preprocess import preprocess

INT4_OPSET = 21


@dataclass
class WeightOnlyReport:
    """Which weights became int4 and why the others did not."""

    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """A few lines for a terminal."""
        lines = [f"int4 block-wise weights: {len(self.quantized)} nodes"]
        lines += [f"  left float: {n}: {why}" for n, why in self.skipped.items()]
        return "\n".join(lines)


def int4_blocks(w: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values in [−8, 7], scales) of a (K, N) weight, blocks of ``block_size`` along K."""
    k, n = w.shape
    nb = -(-k // block_size)  # the last block may be partial (scale has ceil(K / B) rows)
    padded = np.zeros((nb * block_size, n))
    padded[:k] = w
    blocks = padded.reshape(nb, block_size, n)
    scale = np.abs(blocks).max(axis=1) / 7.0
    scale = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.round(blocks / scale[:, None, :]), -8, 7).astype(np.int8)
    return q.reshape(nb * block_size, n)[:k], scale.astype(np.float32)


def quantize_weights_int4(
    model: onnx.ModelProto,
    block_size: int = 32,
    nodes: set[str] | None = None,
    prepare: bool = True,
) -> tuple[onnx.ModelProto, WeightOnlyReport]:
    """The model with block-wise int4 MatMul/Gemm weights (``model`` is not modified).

    ``nodes`` limits the pass to those node names (per-node ``weight_dtype = "int4"``);
    ``prepare=False`` skips preprocessing, for a model that is already quantized elsewhere and
    already at opset 21 (folding constants would undo its DequantizeLinear weights).
    """
    if block_size < 16 or block_size & (block_size - 1):
        raise ConfigError(f"--block-size {block_size} must be a power of two >= 16")
    if prepare:
        pre = raise_opset(preprocess(model), INT4_OPSET, "int4 weights")
    else:
        pre = raise_opset(model, INT4_OPSET, "int4 weights")
    graph = import_graph(pre)
    editor = GraphEditor(graph)
    report = WeightOnlyReport()
    packed: dict[str, np.ndarray] = {}
    for node in list(graph.nodes):
        if node.op not in ("MatMul", "Gemm") or (nodes is not None and node.name not in nodes):
            continue
        why = _int4_weight(editor, node, block_size, packed)
        if why is None:
            report.quantized.append(node.name)
        else:
            report.skipped[node.name] = why
    editor.finish()
    out = export_model(graph, pre)
    for init in out.graph.initializer:
        if init.name in packed:
            init.CopyFrom(
                numpy_helper.from_array(packed[init.name].astype(ml_dtypes.int4), init.name)
            )
    out.ir_version = max(out.ir_version, 10)
    return out, report


def _int4_weight(
    editor: GraphEditor, node: gs.Node, block_size: int, packed: dict[str, np.ndarray]
) -> str | None:
    weight = node.inputs[1]
    if not isinstance(weight, gs.Constant):
        return "the weight is not a constant"
    w = np.asarray(weight.values)
    if w.ndim != 2 or w.dtype != np.float32:
        return f"the weight is {w.dtype} with shape {list(w.shape)}, expected float32 2-D"
    trans_b = node.op == "Gemm" and int(node_attr(node, "transB") or 0) == 1
    if node.op == "Gemm" and int(node_attr(node, "transA") or 0) == 1:
        return "Gemm with transA=1 is left float"
    kn = w.T if trans_b else w  # (K, N), reduced over K
    q, scale = int4_blocks(kn, block_size)
    if trans_b:  # keep Gemm's layout: blocks run along axis 1 of the (N, K) weight
        q, scale, axis = q.T.copy(), scale.T.copy(), 1
    else:
        axis = 0
    # stored int8 in the graph; export_model's caller packs it as INT4 (graphsurgeon cannot)
    q_const = editor.constant(f"{weight.name}_int4", q)
    packed[q_const.name] = q
    s_const = editor.constant(f"{weight.name}_int4_scale", scale)
    out = editor.variable(f"{weight.name}_dequantized", np.float32, list(w.shape))
    editor.add_node(
        "DequantizeLinear",
        [q_const, s_const],
        [out],
        f"{node.name}_weight_dq",
        {"axis": axis, "block_size": block_size},
    )
    editor.set_input(node, 1, out)
    return None
