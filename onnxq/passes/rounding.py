"""Optimized weight rounding: GPTQ-style rounding of Conv/Gemm/MatMul weights.

Needs ``state.quantizer``, the solved ``state.values`` (the weight grids) and the layer input
Hessians that :func:`taps` asked the calibrate pass to accumulate (``state.hessians``). Leaves
``state.constants`` (each rounded weight as the float value of its chosen grid integers, which
materialize and the OpenVINO lowering quantize exactly back to those integers) and
``state.rounding`` (per layer: the output error of nearest and of optimized rounding, or why
the layer kept nearest rounding), which the report lists. Runs before bias correction, which
then removes the mean shift of the rounding actually used.

``rounding``: ``optimized`` rounds every eligible layer, ``nearest`` none, ``auto`` (the
default) the layers of CNNs and transformers. The layer's weight must be a constant read by
this node alone; a convolution's ``auto_pad`` SAME pads are resolved for each batch's size. Bounds:
a layer needs at least as many calibration rows as its weight has inputs (fewer over-fit the
calibration data), and the Hessians of one model hold at most :data:`MEMORY_BUDGET` bytes
(the rest keep nearest rounding, each with the reason).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxq.core.qparams import qrange
from onnxq.io.cores import CoreShare
from onnxq.match.dfpattern import node_attr
from onnxq.passes.defaults import runs
from onnxq.passes.manager import PassResult, State, release
from onnxq.solve.rounding import ConvShape, Grid, HessianObserver, round_weight

#: bytes of layer Hessians (float64 K×K per group) one model may hold while calibrating
MEMORY_BUDGET = 1 << 30


@dataclass(frozen=True)
class _Layer:
    """One Conv/Gemm/MatMul with a constant weight, as the rounding sees it."""

    node: str
    input: str
    weight: str
    #: the weight's quantization placeholders
    scale: str
    zero_point: str
    #: Conv geometry (None: dense) and how the stored weight maps to (G, M, K)
    conv: ConvShape | None
    transposed: bool  # dense weight stored (N, K) (Gemm transB=1)


def _layers(state: State) -> tuple[list[_Layer], dict[str, str]]:
    """The layers to round, and the skipped ones with their reasons (node -> reason)."""
    q = state.quantizer
    nodes = {n.name: n for n in q.float_graph.nodes}
    readers: dict[str, int] = {}
    for n in q.float_graph.nodes:
        for t in n.inputs:
            readers[t.name] = readers.get(t.name, 0) + 1
    layers, skipped = [], {}
    for rec in q.records:
        node = nodes.get(rec.node)
        if node is None or node.op not in ("Conv", "Gemm", "MatMul") or len(rec.inputs) < 2:
            continue
        wq = rec.inputs[1]
        if wq.role != "weight" or len(node.inputs) < 2 or node.inputs[1].name != wq.tensor:
            continue
        w = q.float_value(wq.tensor)
        why = _unsupported(node, w, wq.axis, readers.get(wq.tensor, 0))
        if why:
            skipped[node.name] = why
            continue
        conv = None
        if node.op == "Conv":
            spatial = w.ndim - 2
            pads = node_attr(node, "pads") or [0] * 2 * spatial
            conv = ConvShape(
                tuple(w.shape[2:]),
                tuple(node_attr(node, "strides") or [1] * spatial),
                tuple(node_attr(node, "dilations") or [1] * spatial),
                tuple(int(p) for p in pads),
                int(node_attr(node, "group") or 1),
                _auto_pad(node),
            )
        transposed = node.op == "Gemm" and bool(int(node_attr(node, "transB") or 0))
        layers.append(
            _Layer(
                node.name,
                rec.inputs[0].tensor,
                wq.tensor,
                wq.scale,
                wq.zero_point,
                conv,
                transposed,
            )
        )
    return layers, skipped


def _auto_pad(node: Any) -> str:
    """A Conv's ``auto_pad`` (NOTSET when not written)."""
    pad = node_attr(node, "auto_pad")
    return (pad.decode() if isinstance(pad, bytes) else pad) or "NOTSET"


def _unsupported(node: Any, w: Any, axis: int | None, readers: int) -> str:
    """Why this layer keeps nearest rounding ('' when it can be rounded)."""
    if readers != 1:
        return f"its weight '{node.inputs[1].name}' is shared by {readers} nodes"
    if node.op == "Conv":
        pad = _auto_pad(node)
        if pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
            return f"auto_pad {pad}"
        if w.ndim < 3 or axis not in (None, 0):
            return "not a per-output-channel convolution weight"
        return ""
    if w.ndim != 2:
        return f"a {w.ndim}-D weight"
    if node.op == "Gemm" and int(node_attr(node, "transA") or 0):
        return "Gemm transA (its input's channels are its rows)"
    out_axis = 0 if node.op == "Gemm" and int(node_attr(node, "transB") or 0) else 1
    if axis not in (None, out_axis, out_axis - 2):
        return "weight scales not along the output channels"
    return ""


def taps(state: State) -> dict[str, list[HessianObserver]]:
    """Ask the calibrate pass for every layer's input Hessian, within the memory budget."""
    if not runs("rounding", state) or state.options.load_ranges is not None:
        return {}
    layers, skipped = _layers(state)
    state.rounding = {n: {"skipped": why} for n, why in skipped.items()}
    out: dict[str, list[HessianObserver]] = {}
    held = 0
    samples = state.dataset.most_samples() if state.dataset is not None else None
    for layer in layers:
        w = state.quantizer.float_value(layer.weight)
        groups = layer.conv.group if layer.conv is not None else 1
        k = w[0].size if layer.conv is not None else w.shape[1 if layer.transposed else 0]
        bound = _most_rows(state, layer, samples)
        if bound is not None and bound < k:  # its Hessian would be gathered, then dropped
            state.rounding[layer.node] = {
                "skipped": f"at most {bound} calibration rows for {k} weight inputs (needs "
                "at least as many: fewer over-fit the calibration data)"
            }
            continue
        size = groups * k * k * 8
        if held + size > MEMORY_BUDGET:
            state.rounding[layer.node] = {
                "skipped": f"its {size >> 20} MB input Hessian is past the memory bound"
            }
            continue
        held += size
        batches = state.dataset.num_batches() if state.dataset is not None else None
        obs = HessianObserver(layer.conv, groups, k, batches)
        state.hessians[layer.node] = (layer, obs)
        out.setdefault(layer.input, []).append(obs)
    return out


def _most_rows(state: State, layer: _Layer, samples: int | None) -> int | None:
    """An upper bound on the Hessian rows ``layer`` can get from ``samples`` samples.

    A sample gives a dense layer one row per position of its input's middle axes and a
    convolution one per output position; None where a shape or the sample count is unknown.
    Only a bound below the layer's inputs is acted on: those layers kept nearest rounding
    anyway, after the pass had accumulated a K × K Hessian (8,192 inputs: 512 MB) for nothing.
    """
    if samples is None:
        return None
    tensors = state.quantizer.float_graph.tensors()
    node = next((n for n in state.quantizer.float_graph.nodes if n.name == layer.node), None)
    if node is None:
        return None
    shape = node.outputs[0].shape if layer.conv is not None else tensors[layer.input].shape
    middle = (shape[2:] if layer.conv is not None else shape[1:-1]) if shape else None
    if middle is None or not all(isinstance(d, int) and d > 0 for d in middle):
        return None
    return samples * math.prod(middle)


def _as_rows(w: np.ndarray, layer: _Layer) -> np.ndarray:
    """The weight as (G, M/G, K): one row per output channel, grouped as the input is."""
    if layer.conv is not None:
        return w.reshape(layer.conv.group, w.shape[0] // layer.conv.group, -1)
    return (w if layer.transposed else w.T)[None]


def _from_rows(rows: np.ndarray, w: np.ndarray, layer: _Layer) -> np.ndarray:
    """Inverse of :func:`_as_rows`."""
    if layer.conv is not None:
        return rows.reshape(w.shape)
    return rows[0] if layer.transposed else rows[0].T


def _grid(state: State, layer: _Layer, rows: np.ndarray) -> Grid:
    scale = np.asarray(state.values[layer.scale], np.float64)
    zp_arr = np.asarray(state.values[layer.zero_point])
    shape = rows.shape[:2]
    bits = state.quantizer.config.weight_bits
    lo, hi = qrange(zp_arr.dtype.name, narrow=True)
    if bits < 8 and lo < 0:
        lo, hi = -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    scale = np.broadcast_to(scale.reshape(-1), (int(np.prod(shape)),)).reshape(shape)
    zp = np.broadcast_to(zp_arr.astype(np.float64).reshape(-1), (scale.size,)).reshape(shape)
    return Grid(scale, zp, lo, hi)


class WeightRounding:
    """Round each layer's weight to the grid integers with the least output error."""

    name = "rounding"

    def run(self, state: State) -> PassResult:
        """Round every layer whose input Hessian was collected."""
        if not runs("rounding", state):
            why = state.over_budget.get("rounding", f"{state.kind} model")
            return PassResult(f"off ({state.options.rounding}, {why})")
        if not state.hessians:
            if state.options.load_ranges is not None:
                return PassResult("off (ranges loaded: no calibration data streamed)")
            return PassResult("no Conv/Gemm/MatMul with a constant weight to round")
        done = 0
        # the factorizations' BLAS on the cores other processes leave free, asked per layer
        # (the same bits on any number of threads: tests/test_cores.py)
        from threadpoolctl import ThreadpoolController

        blas, share = ThreadpoolController(), CoreShare()
        # never more than the BLAS has now (OPENBLAS_NUM_THREADS and the like are the user's)
        most = max([lib.num_threads for lib in blas.select(user_api="blas").lib_controllers] or [1])
        for name, (layer, obs) in state.hessians.items():
            h = obs.hessian()
            obs.release()  # its sums are in ``h`` now: one K×K float64 array, not three
            k = 0 if h is None else h.shape[-1]
            if h is None or obs.rows < k:
                state.rounding[name] = {
                    "skipped": f"{obs.rows} calibration rows for {k} weight inputs (needs "
                    "at least as many: fewer over-fit the calibration data)"
                }
                continue
            if not np.isfinite(h).all():
                state.rounding[name] = {
                    "skipped": "its calibration inputs are too large for their products to "
                    "fit a float (values past about 1e19); check the data for outliers"
                }
                continue
            w = np.asarray(state.quantizer.float_value(layer.weight), np.float64)
            rows = _as_rows(w, layer)
            grid = _grid(state, layer, rows)
            with blas.limit(limits=min(most, share.free()), user_api="blas"):
                result = round_weight(rows, h, grid)
            rounded = _from_rows(grid.value(result.q), w, layer).astype(np.float32)
            state.constants[layer.weight] = rounded
            state.rounding[name] = {
                "weight": layer.weight,
                "sqnr_nearest_db": _db(result.error_nearest),
                "sqnr_db": _db(result.error),
                "rows_changed": result.rows_changed,
                "rows": int(rows.shape[0] * rows.shape[1]),
            }
            done += 1
        mine = {id(obs) for _, obs in state.hessians.values()}
        state.hessians = {}
        if state.calibrator is not None:  # the calibrate pass kept the observers as its taps
            state.calibrator.taps = {
                t: kept
                for t, observers in state.calibrator.taps.items()
                if (kept := [o for o in observers if id(o) not in mine])
            }
        release(state)  # the Hessians (VGG19: 680 MB of heap held after them otherwise)
        return PassResult(describe(state.rounding) or "nothing rounded")


def _db(error: float) -> float:
    return round(float(10 * np.log10(1 / max(error, 1e-30))), 2)


def describe(rounding: dict[str, Any]) -> str:
    """One line for the summary: how many layers, and the gain in output SQNR."""
    done = [v for v in rounding.values() if "sqnr_db" in v]
    if not done:
        return ""
    gain = [v["sqnr_db"] - v["sqnr_nearest_db"] for v in done]
    return (
        f"{len(done)} of {len(rounding)} layers rounded for least output error (layer SQNR "
        f"+{float(np.median(gain)):.1f} dB median, +{min(gain):.1f} to +{max(gain):.1f} dB)"
    )
