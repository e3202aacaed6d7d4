"""Where the calibrate step's time goes, per part, next to plain fp32 inference of the same data.

    python -m benchmarks.profile_calibration MODEL.onnx [--samples 64] [--batch-size 16]
                                          [--method minmax] [--data FILE.npz] [--workers 1]

Without ``--data`` the samples are seeded uniform [0, 1) values in the model's input shape
(timing does not depend on the values much; a zoo recipe's data can be saved to an .npz for
real ones). The parts, all in this process's main thread unless said otherwise:

* ``inference (waited)``: time the main thread waited for onnxruntime (the run overlaps the
  folding of the previous batch on another thread: only the part not hidden is counted);
* ``ranges``: the observers of every tensor (min/max, histograms);
* ``channel sums``: per-channel input sums for bias correction;
* ``hessians``: optimized rounding's input patches and ``x xᵀ`` products;
* ``other``: the rest of the step (the finite check of every tensor, session creation, the
  callbacks choosing the values).

The floor is onnxruntime at its default threads running the same batches, exposing nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx

PARTS: dict[str, float] = defaultdict(float)


def _instrument() -> None:
    """Wrap the pieces of Statistics.add and run_ahead's wait with timers."""
    import onnxq.calibrate.statistics as st
    import onnxq.calibrate.streaming as streaming

    def timed(owner, name, part, obj=None):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                PARTS[part] += time.perf_counter() - t

        setattr(owner, name, wrapper)

    timed(st, "channel_means", "channel sums")
    timed(streaming._Runner, "result", "inference (waited)")
    original = st.Statistics.add

    def add(self, names, outs, samples, index, **options):
        taps = self.taps
        observers = self.observers
        timed_taps = {}
        for name, lst in taps.items():
            timed_taps[name] = [_Timed(t, "hessians") for t in lst]
        timed_obs = {n: [_Timed(o, "ranges") for o in lst] for n, lst in observers.items()}
        self.taps, self.observers = timed_taps, timed_obs
        try:
            return original(self, names, outs, samples, index, **options)
        finally:
            self.taps, self.observers = taps, observers

    st.Statistics.add = add


class _Timed:
    """An observer whose ``observe`` is timed under ``part``."""

    def __init__(self, inner, part):
        self.inner, self.part = inner, part

    def observe(self, *a, **k):
        return self._timed("observe", *a, **k)

    def __getattr__(self, name):
        if name == "observe_range" and hasattr(self.inner, name):
            return lambda *a, **k: self._timed(name, *a, **k)
        raise AttributeError(name)

    def _timed(self, method, *a, **k):
        t = time.perf_counter()
        try:
            return getattr(self.inner, method)(*a, **k)
        finally:
            PARTS[self.part] += time.perf_counter() - t


def _feeds(model: onnx.ModelProto, args) -> dict[str, np.ndarray]:
    if args.data:
        return dict(np.load(args.data))
    rng = np.random.default_rng(0)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        feeds[vi.name] = rng.uniform(0, 1, [args.samples, *dims[1:]]).astype(dtype)
    return feeds


def _floor(path: str, feeds: dict[str, np.ndarray], batch: int) -> float:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    n = len(next(iter(feeds.values())))
    sess.run(None, {k: v[:batch] for k, v in feeds.items()})
    start = time.perf_counter()
    for i in range(0, n, batch):
        sess.run(None, {k: v[i : i + batch] for k, v in feeds.items()})
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--method", default="minmax")
    ap.add_argument("--data", default=None, help="one .npz of samples stacked on their first axis")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    if args.data and not Path(args.data).is_file():
        ap.error(
            f"--data {args.data}: expected one .npz file of samples stacked on their first "
            "axis (batches of different shapes: time them with onnxq quantize --verbose)"
        )
    import onnxq

    model = onnx.load(args.model)
    feeds = _feeds(model, args)
    floor = _floor(args.model, feeds, args.batch_size)
    if args.workers == 1:
        _instrument()
    _, report = onnxq.quantize(
        args.model,
        feeds,
        method=args.method,
        batch_size=args.batch_size,
        progress=False,
        workers=args.workers,
    )
    step = report.seconds["calibrate"]
    print(f"{Path(args.model).name}: {report.calibration.samples} samples, method {args.method}")
    print(f"  fp32 inference (floor)   {floor:7.2f} s")
    print(f"  calibrate step           {step:7.2f} s  ({step / floor:.1f}x the floor)")
    if args.workers == 1:
        for part in ("inference (waited)", "ranges", "channel sums", "hessians"):
            print(f"    {part:<22} {PARTS[part]:7.2f} s")
        print(f"    {'other':<22} {step - sum(PARTS.values()):7.2f} s")
    print(f"  rounding pass            {report.seconds.get('rounding', 0.0):7.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
