"""onnxruntime sessions, built one way everywhere (CPU, all optimisations, quiet logs)."""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxq.core.errors import ModelError
from onnxq.io import graph
from onnxq.io.cores import CoreShare
from onnxq.io.graph import serialize
from onnxq.io.hostcheck import PRECISE_OPTION, u8s8_saturates

_SHARE: CoreShare | None = None


def _pool_threads() -> int:
    """Intra-op threads now: 0 (onnxruntime's choice) unless other processes hold cores."""
    global _SHARE
    if _SHARE is None:
        _SHARE = CoreShare()
    return _SHARE.threads()


def make_session(
    model: onnx.ModelProto,
    threads: int = 0,
    optimize: bool = True,
    exact: bool = False,
    expose: Iterable[str] = (),
    as_written: bool = False,
    spin: bool = True,
    weights: Mapping[str, np.ndarray] | None = None,
    arena: bool = True,
) -> Any:
    """An onnxruntime CPU InferenceSession for ``model``.

    ``threads`` 0: onnxruntime's choice, or where other processes hold some of this one's
    cores when the session is built, as many as they leave free (onnxq.io.cores).
    onnxruntime's pool spins while it waits: a pool of every core, on a machine where another
    job held one of two, took the sequential bias correction of nudenet_320n 2.97 s against
    2.33 s. Its results are the same bits on any number.

    ``weights``: the values of the initializers ``model`` holds as in-memory stubs
    (onnxq.io.graph.split_weights), handed to onnxruntime as arrays.

    ``expose`` names inner tensors to add as outputs of the session. They are appended to the
    model only while the session is built, then removed: no second copy of the weights is made.
    Such a session has no arena of its own (one keeps the peak of every tensor handed out for
    as long as the session lives: EfficientNet-Lite1's whole default quantize peaked at 1,154
    MiB with it, 877 MiB without); it allocates from the process's **shared arena** below.

    ``exact`` selects onnxruntime's exact U8S8 path on CPUs without VNNI (see onnxq.io.hostcheck):
    for onnxq's own layer-by-layer measurements, which must see the quantization error, not the
    host's int16 clipping. What users run (verify, compare, the zoo) uses the default session.

    ``as_written`` runs QuantizeLinear and DequantizeLinear as the model writes them, with the
    other optimisations on: onnxruntime's QDQ transformers otherwise fuse them into integer
    kernels, and since version 1.20 quantize the float weight of a Conv whose input comes
    from a DequantizeLinear (on its own per-tensor grid: an emulation whose weights are already
    on their grids moved by 0.33 at MobileNetV2's first layer). Such sessions are built for
    one piece of a model each (onnxq.calibrate.sequential) and share the arena too.

    The shared arena: one onnxruntime CPU arena for every exposing or as-written session of
    the process, so that a piece, a candidate or a batch reuses the memory the one before it
    freed. Without any arena each tensor was a fresh allocation and its pages were faulted in
    again on every run: EfficientNet-Lite1's sequential bias correction (65 piece sessions) took
    1.4 million page faults and 3.5 s of system time, 127,000 and 0.3 s with it; the same bytes.
    It grows by what is asked, and the pass manager hands its free memory back after every
    pass (:func:`release_shared_arena`).

    ``arena`` False: no memory arena either, for a session run a few times while the process
    goes on to other work (the verification session, which the checks after quantizing run
    on four batches: its arena kept the 128 MB peak of PP-OCRv5's detector while the check
    compared every layer on a session of its own).

    ``spin`` False stops the threads of onnxruntime's pool from spinning while they wait for
    work: for a session that shares the cores with numpy work in this process (a calibration
    pass whose statistics are folded while onnxruntime runs on every core).
    """
    import onnxruntime as ort

    def options(precise: bool) -> Any:
        opts = ort.SessionOptions()
        # the exact path is tried first and may fail where the default loads (onnxruntime 1.32
        # cannot build it for int8 weights that several QDQ layers share): its error is not
        # the user's to see
        opts.log_severity_level = 4 if precise else 3
        if precise:
            opts.add_session_config_entry(PRECISE_OPTION, "1")
        opts.intra_op_num_threads = pool
        opts.inter_op_num_threads = 1
        if not spin:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if not optimize:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if as_written:
            opts.add_session_config_entry("session.disable_quant_qdq", "1")
        if (as_written or expose) and _shared_arena(ort):
            opts.add_session_config_entry("session.use_env_allocators", "1")
        elif as_written or expose or not arena:  # (the first two: the shared one was refused)
            opts.enable_cpu_mem_arena = False
        if expose:
            # the memory pattern's one block for the run's other tensors, with no arena, is a
            # fresh mapping every run past glibc's 32 MiB mmap ceiling (EfficientNet-Lite1's
            # calibration session: 38 MB a batch, 1.3 of 1.5 million page faults and 2.4 s of
            # system time); tensor by tensor, glibc reuses what the last run freed. The other
            # sessions without an arena keep it: turned off there it raised the default
            # quantize's peak by about 100 MiB and saved no time
            opts.enable_mem_pattern = False
        return opts

    pool = threads or _pool_threads()  # one reading, whichever path below builds it
    precise = exact and u8s8_saturates()
    added = _append_outputs(model, expose)
    try:
        return _session(ort, model, options(precise), weights)
    except Exception as exc:  # onnxruntime raises its own exception types
        if precise:  # the exact path has no int8-activation QLinearConv; those kernels are exact
            try:
                return _session(ort, model, options(False), weights)
            except Exception:  # report the first failure below
                pass
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"onnxruntime cannot load the model: {first}") from None
    finally:
        if added:
            del model.graph.output[-added:]


class _Arena:
    """The process's shared arena (module state: one per process)."""

    #: registered (True), refused by onnxruntime (False), or not tried yet (None)
    registered: bool | None = None
    #: whether a session was built on it since the last release
    used = False
    #: the one-node session and the run options whose run releases it, made at the first release
    release: tuple[Any, Any] | None = None


def _shared_arena(ort: Any) -> bool:
    """Register the shared CPU arena once; False where onnxruntime refuses (then none is used)."""
    if _Arena.registered is None:
        try:
            info = ort.OrtMemoryInfo(
                "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
            )
            # extend by what is asked (1): the arena holds no more than its largest run needs
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
            _Arena.registered = True
        except Exception:  # an onnxruntime without env allocators, or one already registered
            _Arena.registered = False
    _Arena.used = _Arena.registered
    return _Arena.registered


def release_shared_arena() -> None:
    """Hand the shared arena's free memory back to the heap (then :func:`trim_heap` frees it).

    A run with arena shrinkage on a one-node session that allocates from it: onnxruntime frees
    the arena's unused regions, which every pass's sessions have let go by then. Nothing to do
    when no session used it since the last release.
    """
    if not _Arena.used:
        return
    _Arena.used = False
    if _Arena.release is None:
        import onnxruntime as ort

        x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
        y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
        node = onnx.helper.make_node("Identity", ["x"], ["y"])
        tiny = onnx.helper.make_model(
            onnx.helper.make_graph([node], "release", [x], [y]),
            opset_imports=[onnx.helper.make_opsetid("", 13)],
        )
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.use_env_allocators", "1")
        run = ort.RunOptions()
        run.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        session = ort.InferenceSession(
            tiny.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        _Arena.release = (session, run)
    session, run = _Arena.release
    session.run(None, {"x": np.zeros(1, np.float32)}, run)


def _append_outputs(model: onnx.ModelProto, names: Iterable[str]) -> int:
    """Append ``names`` (those not already outputs) as graph outputs; returns how many."""
    have = {o.name for o in model.graph.output}
    wanted = [n for n in dict.fromkeys(names) if n not in have]
    if not wanted:
        return 0
    types = output_types(model)
    if any(n not in types for n in wanted):  # a model saved without value_info (a peer's)
        types = {**inferred_types(model), **types}
    model.graph.output.extend(
        onnx.helper.make_tensor_value_info(n, types.get(n, onnx.TensorProto.FLOAT), None)
        for n in wanted
    )
    return len(wanted)


def inferred_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types onnx's type inference finds (on a weightless copy); {} if it cannot."""
    try:
        return output_types(onnx.shape_inference.infer_shapes(graph.skeleton(model)))
    except Exception:  # onnx raises several types; the caller falls back to float
        return {}


#: models above this size hand onnxruntime their weights as arrays, not inside the bytes
SHARED_WEIGHTS_BYTES = 32 * 2**20
#: models above this size hand it a file with external data (no array copies at all)
FILE_WEIGHTS_BYTES = 256 * 2**20


def _session(
    ort: Any, model: onnx.ModelProto, opts: Any, weights: Mapping[str, np.ndarray] | None
) -> Any:
    providers = ["CPUExecutionProvider"]
    if weights is not None:  # the caller holds the weights as arrays: onnxruntime copies them
        names = graph.in_memory_names(model)
        values = [ort.OrtValue.ortvalue_from_numpy(weights[n]) for n in names]
        opts.add_external_initializers(names, values)
        return ort.InferenceSession(serialize(model), opts, providers=providers)
    size = graph.weight_bytes(model)
    if size < SHARED_WEIGHTS_BYTES:
        return ort.InferenceSession(serialize(model), opts, providers=providers)
    # serialized bytes, onnxruntime's parsed copy and its tensors were three copies of the
    # weights at once (VGG19: +1.7 GB): give it the weights as arrays beside a weightless graph.
    # onnxruntime copies them while it loads the model; they are freed on return.
    if size < FILE_WEIGHTS_BYTES:
        stub, held = graph.split_weights(model)
        values = [ort.OrtValue.ortvalue_from_numpy(graph.tensor_array(t)) for t in held]
        opts.add_external_initializers([t.name for t in held], values)
        return ort.InferenceSession(serialize(stub), opts, providers=providers)
    # a large model (or one past protobuf's 2 GB): a file with external data, written one
    # tensor at a time; the arrays above were a whole extra copy of the weights while it loaded
    with tempfile.TemporaryDirectory(prefix="onnxq-session-") as tmp:
        path = Path(tmp) / "model.onnx"
        graph.write_external(model, path, "model.onnx.data")
        return ort.InferenceSession(str(path), opts, providers=providers)


def output_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor whose type the model records."""
    g = model.graph
    types: dict[str, int] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in g.initializer:
        types[init.name] = init.data_type
    return types


#: models below this size skip :func:`free_memory`'s collection: what it frees is small, and a
#: full collection costs in proportion to the whole process's objects (in a long-lived
#: process, 26 ms each of the five passes that asked for it: 80% of quantizing a tiny model)
FREE_MEMORY_BYTES = 64 * 2**20


def free_memory(model: onnx.ModelProto | None = None) -> None:
    """Hand freed heap pages back to the system; for a large model, collect cycles first.

    glibc keeps freed blocks in its arenas; ``malloc_trim`` returns them (a no-op elsewhere).
    The calibration stream's outputs are allocated on onnxruntime's thread and freed on the
    caller's: after calibrating a YOLOv8n at 320 px (12 MB of weights) glibc held 842 MB, of
    which ``malloc_trim`` returned 460 MB, and every later pass started from there (the
    recipe choice peaked at 922 MB, 759 MB after the trim). The trim costs milliseconds, so it
    runs for every model; the collection (and the file weights read last,
    onnxq.io.graph.RECENT_BYTES) only with a ``model`` of at least :data:`FREE_MEMORY_BYTES`
    or none.
    """
    import gc

    if model is None or graph.weight_bytes(model) >= FREE_MEMORY_BYTES:
        graph.forget_recent()
        gc.collect()
    release_shared_arena()
    trim_heap()


#: growth of the resident memory past which :func:`trim_heap_if_grown` trims
TRIM_GROWTH = 32 << 20


#: (pid, descriptor) of this process's /proc/self/statm, kept open: the calibrate pass reads it
#: every batch, and opening it was 40 µs of each (a Loop body's 8,236 iterations: 0.4 s)
_STATM: tuple[int, int] | None = None
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """The resident memory of the process now (Linux), else None."""
    global _STATM
    try:
        if _STATM is None or _STATM[0] != os.getpid():  # a forked child reads its own
            _STATM = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_STATM[1], 128, 0).split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no os.pread
        return None


def trim_heap_if_grown(since: int | None, growth: int = TRIM_GROWTH) -> int | None:
    """:func:`trim_heap` when the resident memory grew by ``growth`` bytes past ``since``.

    For a loop that frees much on every round (the sequential correction's pieces, each with a
    session of its own): glibc keeps what a round freed, the next rounds start from there and
    the process climbs to the sum (OriNet: 146 -> 430 MB over ten pieces holding 25 MB of
    tensors). A trim costs milliseconds, so it runs only past the growth. Returns the
    resident memory to compare the next round with.
    """
    now = resident_bytes()
    if now is None:
        return None
    if since is None:
        return now
    if now > since + growth:
        trim_heap()
        return resident_bytes()
    return since


def trim_heap() -> None:
    """Hand the heap pages glibc holds free back to the system (a no-op elsewhere).

    Milliseconds: the pass manager calls it after every pass, once the pass's own arrays are
    gone (a pass that trims inside still holds its locals then: the sequential bias
    correction left 814 MB resident on EfficientNet-Lite1 where 351 MB were in use).
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass
