"""What it costs onnxruntime to hand out the tensors calibration observes, and the alternatives.

    python -m benchmarks.exposure_cost MODEL.onnx --data FILE.npz [--samples 256] [--method minmax]
    python -m benchmarks.exposure_cost --zoo NAME [--samples 256] [--openvino]   (a zoo model)

The calibrate step cannot be faster than onnxruntime producing the tensors it observes. This
script takes the float model and the tensor names of a real calibration pass (onnxq's own,
caught as it opens its session) and times, on the same samples, one at a time:

* ``floor``: the model as it is, nothing exposed;
* ``exposed``: those tensors as extra graph outputs (what the pass does);
* ``reduced``: a ReduceMin and a ReduceMax per tensor in the graph instead, only scalars out
  (what MinMax needs; an in-graph alternative to exposing);
* ``exposed, 2 runs``: two runs at once on two threads, one onnxruntime thread each (what the
  pass does on a 2-core machine);
* ``..., no layout transforms``: the floor and ``exposed`` at 1 thread with onnxruntime's
  optimizations below its layout transforms (``ORT_ENABLE_EXTENDED``). At its default level
  onnxruntime runs convolutions in a blocked channel layout (NCHWc) and must reorder every
  exposed tensor back to NCHW; without that layout the floor is slower, but exposing costs
  little: the difference of the two pairs is the reorders' cost.

Each at 1 onnxruntime thread and at onnxruntime's default, as a ratio to the floor at its
default threads (the floor of ``benchmarks.calibration``). With ``--openvino`` (where OpenVINO
is installed) three more rows: the floor, ``exposed`` and ``reduced`` run by OpenVINO's CPU
plugin (f32, its default threads), as ratios to the same onnxruntime floor: whether the other
runtime onnxq uses hands the tensors out cheaper. The samples are stacked on axis 0 of
every array of ``--data`` and fed one at a time.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper


def _observed(path: str, feeds: list[dict[str, np.ndarray]], method: str) -> tuple[Any, list]:
    """The float model and tensor names of onnxq's calibration pass on ``feeds``."""
    import onnxq
    from onnxq.calibrate import calibration

    caught: dict[str, Any] = {}
    original = calibration.Calibrator._float

    def spy(self: Any, names: list[str], streaming: bool = False, **kwargs: Any) -> Any:
        if streaming:
            caught["model"] = onnx.ModelProto()
            caught["model"].CopyFrom(self.quantizer.float_model)
            caught["names"] = list(names)
        return original(self, names, streaming, **kwargs)

    calibration.Calibrator._float = spy  # type: ignore[method-assign]
    try:
        onnxq.quantize(
            path,
            lambda: iter(feeds),
            method=method,
            rounding="nearest",
            bias_correction="none",
            progress=False,
        )
    finally:
        calibration.Calibrator._float = original  # type: ignore[method-assign]
    return caught["model"], caught["names"]


def _session(model: onnx.ModelProto, threads: int, layout: bool = True) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    if not layout:  # every optimization but the layout transforms (NCHWc)
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for name in names:
        out.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    return out


def _reduced(model: onnx.ModelProto, names: list[str]) -> tuple[onnx.ModelProto, list[str]]:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    scalars = []
    for i, name in enumerate(names):
        for op in ("ReduceMin", "ReduceMax"):
            result = f"__{op}_{i}"
            out.graph.node.append(helper.make_node(op, [name], [result], keepdims=0))
            out.graph.output.append(helper.make_tensor_value_info(result, TensorProto.FLOAT, []))
            scalars.append(result)
    return out, scalars


def _timed(session: Any, names: list[str] | None, feeds: list, runs: int = 1) -> float:
    session.run(names, feeds[0])

    def work(part: list) -> None:
        for feed in part:
            session.run(names, feed)

    threads = [threading.Thread(target=work, args=(feeds[i::runs],)) for i in range(runs)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--data", help=".npz: one array per input, samples on axis 0")
    ap.add_argument("--zoo", help="a zoo model: its file and its recipe's calibration feeds")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--method", default="minmax")
    ap.add_argument("--openvino", action="store_true", help="also time OpenVINO's CPU plugin")
    args = ap.parse_args()
    if args.zoo:
        from benchmarks.zoo import _setup

        _, _, recipe, files = _setup(args.zoo)
        args.model = str(files["model"])
        feeds = recipe.calibration(args.samples)[: args.samples]
    elif args.model and args.data:
        arrays = dict(np.load(args.data))
        count = min(args.samples, *(len(v) for v in arrays.values()))
        feeds = [{k: v[i : i + 1] for k, v in arrays.items()} for i in range(count)]
    else:
        ap.error("give MODEL.onnx --data FILE.npz, or --zoo NAME")
    count = len(feeds)
    model, names = _observed(args.model, feeds, args.method)
    exposed = _with_outputs(model, names)
    reduced, scalars = _reduced(model, names)
    sizes = [o.nbytes for o in _session(exposed, 1).run(names, feeds[0])]
    print(
        f"{Path(args.model).name}: {count} feeds, {len(names)} tensors observed, "
        f"{sum(sizes) / 1e6:.1f} MB of them a feed"
    )
    floor = _timed(_session(model, 0), None, feeds)
    rows = [("floor, 1 thread", _timed(_session(model, 1), None, feeds))]
    for threads, label in ((1, "1 thread"), (0, "default threads")):
        rows.append((f"exposed, {label}", _timed(_session(exposed, threads), names, feeds)))
        rows.append((f"reduced, {label}", _timed(_session(reduced, threads), scalars, feeds)))
    rows.append(("exposed, 2 runs of 1 thread", _timed(_session(exposed, 1), names, feeds, 2)))
    for label, graph, wanted in (("floor", model, None), ("exposed", exposed, names)):
        seconds = _timed(_session(graph, 1, layout=False), wanted, feeds)
        rows.append((f"{label}, 1 thread, no layout transforms", seconds))
    if args.openvino:
        from onnxq.io.openvino import OpenVINOSession

        for label, graph, wanted in (
            ("floor", model, None),
            ("exposed", exposed, names),
            ("reduced", reduced, scalars),
        ):
            rows.append((f"OpenVINO {label}", _timed(OpenVINOSession(graph), wanted, feeds)))
    print(f"  floor (default threads) {floor:.3f} s")
    for name, seconds in rows:
        print(f"  {name:40s} {seconds:.3f} s ({seconds / floor:.2f}x the floor)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
