"""Checks of a finished model against its float original, on the machine that made it.

* :func:`accuracy_warnings`: every float graph output is compared with fp32 on a few calibration
  batches; one below :data:`SQNR_FLOOR_DB` is named, with the first layer (graph order) whose
  own SQNR falls below the floor, so the warning says where to look and what to exclude.
* :func:`runtime_warnings`: a model another runtime runs (OpenVINO) is compared with fp32 and
  with the fake-quantized model in onnxruntime; an output far below the latter is named.
* :func:`narrowed_warning`: a MatMul/Gemm that reads 16-bit activations and that onnxruntime
  fuses into MatMulNBits, which computes its activation in 8 bits by default, is named (asked
  of onnxruntime itself: its optimized graph).
* :func:`latency`: fp32 and int8 are timed in the same onnxruntime configuration; a model that
  runs slower in int8 is flagged with the measured ratio (measured, not guessed).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from onnxq.calibrate.dataset import Feed, IterableDataset, model_inputs, shared_batch
from onnxq.calibrate.streaming import run_checked
from onnxq.io.graph import weight_bytes
from onnxq.io.session import make_session
from onnxq.simulate.compare import (
    TensorStats,
    compare,
    float_inputs,
    link_inputs,
    tensor_groups,
)

#: an output below this SQNR against fp32 (on the check's samples) is warned about
SQNR_FLOOR_DB = 15.0
#: a model whose int8 run takes this much longer than fp32 is flagged
SLOWER_RATIO = 1.05
#: the least difference per run (ms) a slower int8 model is flagged for
SLOWER_MS = 0.05
#: the latency check stops early where int8 takes under CLEARLY_FASTER or over CLEARLY_SLOWER
#: of fp32's time, after at least LATENCY_MIN_RUNS runs of each and LATENCY_MIN_SECONDS
CLEARLY_FASTER, CLEARLY_SLOWER = 0.8, 1.3
LATENCY_MIN_RUNS, LATENCY_MIN_SECONDS = 5, 0.1
#: or earlier when the pairs of runs settle the warning (:func:`settled`) at this many sigmas
SIGN_TEST_SIGMAS = 2.0
#: an output the target runtime computes this much below the fake-quantized model is warned about
RUNTIME_GAP_DB = 6.0
#: the layer search (every tensor exposed) runs on one batch of models up to this size
LAYER_SEARCH_BYTES = 64 * 2**20
#: the layer search hands out at most this many bytes of tensors at once (both models)
LAYER_SEARCH_RUN_BYTES = 64 * 2**20
#: onnxruntime's optimized graph is asked for models up to this size (it is written to a file)
NARROWED_SEARCH_BYTES = 2**30
#: the onnxruntime session option that sets MatMulNBits' arithmetic (4: int8 activations)
NBITS_ACCURACY = "session.qdq_matmulnbits_accuracy_level"


def output_sqnr(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    feeds: Sequence[Feed],
    quant_session: Any = None,
    float_outputs: Sequence[dict[str, np.ndarray]] | None = None,
) -> dict[str, float]:
    """SQNR in dB of every float graph output of ``quant_model`` against ``float_model``.

    ``quant_session``: an onnxruntime session of ``quant_model`` already built (by verify).
    ``float_outputs``: fp32's outputs on ``feeds`` when already computed (by calibration).
    """
    stats = output_stats(float_model, quant_model, feeds, quant_session, float_outputs)
    return {n: st.sqnr_db for n, st in stats.items()}


def output_stats(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    feeds: Sequence[Feed],
    quant_session: Any = None,
    float_outputs: Sequence[dict[str, np.ndarray]] | None = None,
) -> dict[str, TensorStats]:
    """The agreement statistics of every float graph output (see :func:`output_sqnr`)."""
    names = [
        o.name
        for o in float_model.graph.output
        if o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    ]
    fs = make_session(float_model) if float_outputs is None else None
    qs = quant_session if quant_session is not None else make_session(quant_model)
    stats = {n: TensorStats(n, True, i) for i, n in enumerate(names)}
    for i, feed in enumerate(feeds):
        ref = (
            run_checked(fs, names, feed, i)
            if float_outputs is None
            else [float_outputs[i][n] for n in names]
        )
        for name, f, q in zip(names, ref, run_checked(qs, names, feed, i)):
            stats[name].add(f, q)
    return stats


def accuracy_warnings(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    feeds: Sequence[Feed],
    quant_session: Any = None,
    float_outputs: Sequence[dict[str, np.ndarray]] | None = None,
    advice: Mapping[str, str] | None = None,
) -> list[str]:
    """One warning per output below the floor, naming the first layer that falls below it.

    ``advice``: node -> what to try when the error first jumps there, added to the warning.
    """
    if not feeds:
        return []
    stats = output_stats(float_model, quant_model, feeds, quant_session, float_outputs)
    holes = [
        f"fp32's output '{n}' is NaN or ±Inf in {st.float_nonfinite} of its {st.count} values "
        f"on the {len(feeds)} check batches: they are left out of every SQNR onnxq reports "
        "(check the data, or the model where it divides, takes a log or a square root)"
        for n, st in stats.items()
        if st.float_nonfinite
    ]
    low = {n: st.sqnr_db for n, st in stats.items() if st.sqnr_db < SQNR_FLOOR_DB}
    if not low:
        return holes
    where = "; run `onnxq compare` to see every layer (the model is too large to search here)"
    if weight_bytes(float_model) <= LAYER_SEARCH_BYTES:
        first = first_below_floor(float_model, quant_model, feeds[0])
        where = (
            f"; the error first jumps at node '{first.node}' ({first.op}, {first.sqnr_db:.1f} "
            f"dB, {first.drop_db:.1f} dB lost there): try --exclude {first.node}, or `onnxq "
            "compare` for every layer" + (advice or {}).get(first.node, "")
            if first is not None
            else "; no single layer falls below the floor: run `onnxq compare` for every layer"
        )
    return holes + [
        f"output '{name}' is {value:.1f} dB SQNR against fp32 on {len(feeds)} calibration "
        f"batch(es), below the {SQNR_FLOOR_DB:g} dB floor{where}"
        for name, value in low.items()
    ]


def narrowed_warning(model: onnx.ModelProto) -> str | None:
    """A warning when onnxruntime computes a MatMul/Gemm of 16-bit activations in 8 bits.

    A QDQ model with int16 activations holds each MatMul/Gemm as DequantizeLinear(int16 x),
    DequantizeLinear(int8 W) → MatMul. onnxruntime (1.32 here; the message names the version)
    fuses the weight's pair into ``com.microsoft.MatMulNBits``, whose default accuracy level (4)
    quantizes the activation to int8 on the fly: the layer does not run with the 16-bit
    activations the model holds.
    Whether it fuses is asked of onnxruntime itself (the graph it optimizes), only for a
    model with such a MatMul/Gemm; None when nothing is fused.
    """
    graph = model.graph
    zero_points = {i.name: i.data_type for i in graph.initializer}
    wide_types = {onnx.TensorProto.INT16, onnx.TensorProto.UINT16}
    wide = {
        n.output[0]
        for n in graph.node
        if n.op_type == "DequantizeLinear"
        and len(n.input) > 2
        and zero_points.get(n.input[2]) in wide_types
    }
    # the MatMul/Gemm nodes that read one, by output (MatMulNBits keeps the output's name)
    readers = {
        n.output[0]: n.name or n.output[0]
        for n in graph.node
        if n.op_type in ("MatMul", "Gemm") and n.input and n.input[0] in wide
    }
    if not readers or weight_bytes(model) > NARROWED_SEARCH_BYTES:
        return None
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        optimized = onnx.load(opts.optimized_model_filepath, load_external_data=False)
    fused = sorted(
        readers[n.output[0]]
        for n in optimized.graph.node
        if n.op_type == "MatMulNBits" and n.output and n.output[0] in readers
    )
    if not fused:
        return None
    shown = ", ".join(f"'{name}'" for name in fused[:5]) + (" …" if len(fused) > 5 else "")
    return (
        f"{len(fused)} MatMul/Gemm node(s) reading int16 activations ({shown}) are fused by "
        f"onnxruntime {ort.__version__} into MatMulNBits, which by default quantizes their "
        f"activations to int8 on the fly ({NBITS_ACCURACY} = 4): run the model with "
        f'SessionOptions.add_session_config_entry("{NBITS_ACCURACY}", "0") for 16-bit '
        "arithmetic there"
    )


def runtime_warnings(
    runtime: str,
    float_model: onnx.ModelProto,
    emulated: onnx.ModelProto,
    target: Any,
    feeds: Sequence[Feed],
    float_outputs: Sequence[dict[str, np.ndarray]] | None = None,
) -> list[str]:
    """One warning per output the target runtime computes far worse than onnxq made it.

    Worse: below the SQNR floor against fp32, or :data:`RUNTIME_GAP_DB` below the
    fake-quantized model (``emulated``, run in onnxruntime) on the same batches.

    ``target``: the quantized model's session in its own runtime (``run(names, feed)``). Integer
    kernels round an occasional value the other way, which costs at most about 3 dB here (two
    noises of equal power); a conversion or kernel fault costs far more (OpenVINO on nudenet's
    box head: 14 dB against 40 dB).
    """
    if not feeds:
        return []
    got = output_sqnr(float_model, emulated, feeds, target, float_outputs)
    made = output_sqnr(float_model, emulated, feeds, None, float_outputs)
    warnings = []
    for name, value in got.items():
        expected = made.get(name, value)
        where = (
            f"output '{name}' is {value:.1f} dB SQNR against fp32 in {runtime} on {len(feeds)} "
            f"batch(es)"
        )
        if value < expected - RUNTIME_GAP_DB:
            warnings.append(
                f"{where}, where the same model fake-quantized (onnxruntime) is {expected:.1f} "
                f"dB: {runtime} computes this model apart from what onnxq made; run `onnxq "
                "debug` with the same --target to find the layers where it parts and a config "
                "that keeps them float"
            )
        elif value < SQNR_FLOOR_DB:
            warnings.append(
                f"{where}, below the {SQNR_FLOOR_DB:g} dB floor (fake-quantized in onnxruntime: "
                f"{expected:.1f} dB, so the quantization, not {runtime}); run `onnxq debug` to "
                "find the groups that cost it, or `onnxq compare` for every layer"
            )
    return warnings


def first_below_floor(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, feed: Feed
) -> TensorStats | None:
    """The first layer, in graph order, below :data:`SQNR_FLOOR_DB` on ``feed``'s first sample.

    Every tensor of both models is handed out at once when one sample's fit in
    :data:`LAYER_SEARCH_RUN_BYTES`; otherwise the tensors are compared in groups of that size,
    in graph order, each group by two sessions of its own, until one holds such a layer
    (LEADER's fingerprint network: 1.4 GB of float tensors for one 256×256 image, 3.2 GB
    held when every tensor of both models was handed out at once).
    """
    specs = model_inputs(float_model)
    sample = _first_sample(feed, specs)
    data = IterableDataset([sample]).bind(specs)
    groups = search_groups(float_model, sample)
    stats: dict[str, TensorStats] = {}
    for group in groups:
        found = compare(float_model, quant_model, data, names=group)
        for st in [*found.outputs, *found.layers]:
            stats[st.name] = st
        data.reset()
        if any(st.sqnr_db < SQNR_FLOOR_DB for st in found.layers):
            break
    if len(groups) > 1:  # the drops across groups: each layer's inputs from any group
        link_inputs(float_model, stats)
        rank = {n: i for i, n in enumerate(name for g in groups for name in g)}
        for st in stats.values():
            st.order = rank.get(st.name, len(rank))
    inputs = set(float_inputs(float_model))
    layers = sorted(
        (st for st in stats.values() if not st.is_output and st.name not in inputs),
        key=lambda st: st.order,
    )
    return next((st for st in layers if st.sqnr_db < SQNR_FLOOR_DB), None)


def search_groups(model: onnx.ModelProto, sample: Feed) -> list[list[str]]:
    """The model's tensors in graph order, in groups the search hands out at once."""
    names = float_inputs(model) + [o for n in model.graph.node for o in n.output if o]
    return tensor_groups(model, names, sample, LAYER_SEARCH_RUN_BYTES)


def _first_sample(feed: Feed, specs: Sequence[Any]) -> Feed:
    """``feed`` cut to its first sample where every input's batch dimension is free.

    The layer search exposes every tensor of both models: on PP-OCRv4's recogniser one batch
    of 8 lines was 1.3 GB of outputs (the suite's peak memory); one line is an eighth of it.
    """
    shapes = {s.name: s.shape for s in specs}
    if any(not shapes.get(n) or shapes[n][0] is not None for n in feed) or not shared_batch(feed):
        return feed
    return {n: np.asarray(v)[:1] for n, v in feed.items()}


@dataclass(frozen=True)
class Latency:
    """Median milliseconds per run of one feed, fp32 and int8, in onnxruntime."""

    fp32_ms: float
    int8_ms: float
    runs: int

    @property
    def ratio(self) -> float:
        """int8 time over fp32 time (> 1: slower)."""
        return self.int8_ms / self.fp32_ms if self.fp32_ms > 0 else 1.0

    def warning(self) -> str:
        """'' unless int8 is slower than fp32 by :data:`SLOWER_RATIO` and :data:`SLOWER_MS`.

        Both: a 1.25× over 0.009 against 0.008 ms is timer noise that no one would notice.
        """
        if self.ratio <= SLOWER_RATIO or self.int8_ms - self.fp32_ms <= SLOWER_MS:
            return ""
        return (
            f"the int8 model runs {self.ratio:.2f}× slower than fp32 here ({self.int8_ms:.3f} "
            f"vs {self.fp32_ms:.3f} ms per batch, median of {self.runs} onnxruntime CPU runs): "
            "the Q/DQ work outweighs the int8 kernels on a model this small; keep it float, or "
            "--exclude the layers that gain least"
        )


def settled(above: int, runs: int) -> bool:
    """Whether ``runs`` pairs of runs taken in turns settle the warning's ratio test.

    A sign test: ``above`` pairs took int8 over :data:`SLOWER_RATIO` × that pair's fp32 time.
    Where the median ratio sits near the warning about half the pairs are above; the test is
    settled when the count is farther from half than :data:`SIGN_TEST_SIGMAS` standard
    deviations (√runs / 2): five pairs all below, or more pairs mostly on one side.
    """
    return abs(above - runs / 2) > SIGN_TEST_SIGMAS * math.sqrt(runs) / 2


def latency(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, feed: Feed, seconds: float = 0.3
) -> Latency:
    """Time both models on ``feed``, one run of each in turn (1 thread), medians per model.

    Taking turns keeps the ratio fair when the machine's speed drifts. Stops after at least
    :data:`LATENCY_MIN_RUNS` runs of each and :data:`LATENCY_MIN_SECONDS` once the ratio is
    clear of the warning (int8 under :data:`CLEARLY_FASTER` of fp32's time, or over
    :data:`CLEARLY_SLOWER`, or the pairs of runs on one side of :data:`SLOWER_RATIO` by a sign
    test: :func:`settled`); else after about ``seconds`` for each model (2,000 runs at most).
    """
    sessions = {
        key: make_session(m, threads=1) for key, m in (("fp32", float_model), ("int8", quant_model))
    }
    for session in sessions.values():
        session.run(None, feed)  # warm-up
    samples: dict[str, list[float]] = {key: [] for key in sessions}
    above = 0  # pairs whose int8 run took over SLOWER_RATIO × their fp32 run
    start = time.perf_counter()
    while True:
        for key, session in sessions.items():
            t = time.perf_counter()
            session.run(None, feed)
            samples[key].append(time.perf_counter() - t)
        above += samples["int8"][-1] > SLOWER_RATIO * samples["fp32"][-1]
        n = len(samples["fp32"])
        spent = time.perf_counter() - start
        if n >= 2000 or (n >= LATENCY_MIN_RUNS and spent >= 2 * seconds):
            break
        if n >= LATENCY_MIN_RUNS and spent >= LATENCY_MIN_SECONDS:
            ratio = statistics.median(samples["int8"]) / max(
                statistics.median(samples["fp32"]), 1e-12
            )
            if ratio <= CLEARLY_FASTER or ratio >= CLEARLY_SLOWER or settled(above, n):
                break
    times = {key: statistics.median(v) * 1e3 for key, v in samples.items()}
    return Latency(times["fp32"], times["int8"], len(samples["fp32"]))
