"""The scoreboard: every zoo model, fp32 against onnxq, onnxruntime.quantization and NNCF.

    pip install -e ".[bench]"          # nncf, matplotlib
    python -m benchmarks.zoo [MODEL ...] [--runs 200] [--out docs] [--batch 1]

For each model of ``models/manifest.toml`` (the same calibration samples, evaluation set and
machine for every variant):

* ``fp32``       the float model;
* ``onnxq``      ``onnxq.quantize`` with the ``ort-cpu`` defaults (QOperator);
* ``onnxq-qdq``  the same in QDQ format;
* ``ort``        ``onnxruntime.quantization.quantize_static`` at its defaults (QDQ, int8, MinMax);
* ``ort-pc``     its best per-channel setting: ``quant_pre_process`` first, opset raised to 13
                 where lower (per-channel QDQ needs it), ``per_channel=True``;
* ``nncf``       ``nncf.quantize`` at its defaults (``model_type=TRANSFORMER`` for transformers),
                 on the model converted to opset 13 where it is below 10 (NNCF refuses those).

Measured: the model's metric; latency in onnxruntime CPU at 1 and 2 threads, batch 1 (``--batch``
N: N calibration samples in one batch, on models whose batch dimension is free), median of
``--runs`` runs (more where a block of them is over in under 0.5 s), in one block per variant
whose sessions are created afresh in a shuffled order (in a fixed order the variant after
fp32 ran 3-5% slower whatever its model), each after 20 warm-up runs, the variants taking
turns run by run in a shuffled order; file size; wall time and peak RSS of the quantization
(each in its own process, so the figures do not mix).
Writes ``docs/benchmark.md`` (the README shows it), ``docs/benchmark.json`` and
``docs/benchmark.png``. A run of some models replaces their rows and keeps the others' (the
page then says which run measured which rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import platform
import random
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from benchmarks.latency import interleaved
from benchmarks.memory import peak_rss_bytes

ROOT = Path(__file__).resolve().parents[1]
#: each block of the latency runs lasts at least this long (see :func:`latency`)
BLOCK_SECONDS = 0.5
VARIANTS = ("fp32", "onnxq", "onnxq-qdq", "ort", "ort-pc", "nncf")


def _setup(name: str) -> tuple[Any, Any, Any, dict[str, Path]]:
    from onnxq.tools.zoo import fetch, load_manifest, make_recipe

    manifest = load_manifest(ROOT / "models" / "manifest.toml")
    model = manifest.models[name]
    files = fetch(manifest, model, log=lambda s: print(s, file=sys.stderr))
    return manifest, model, make_recipe(manifest, model, files), files


class _Reader:
    """onnxruntime's CalibrationDataReader over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._it = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def _opset_raised(model: onnx.ModelProto, below: int) -> onnx.ModelProto:
    """``model`` converted to opset 13 when its default-domain opset is below ``below``."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset >= below:
        return model
    from onnx import version_converter

    return version_converter.convert_version(model, 13)


def _ort(src: Path, feeds: list[dict[str, np.ndarray]], out: Path, best: bool) -> None:
    from onnxruntime.quantization import QuantFormat, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    path = src
    if best:
        pre = out.with_suffix(".pre.onnx")
        try:
            # it writes scratch files (a model and its weights) into the working folder
            paths = str(src.resolve()), str(pre.resolve())
            with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
                quant_pre_process(*paths)
            path = pre
        except Exception as exc:  # its symbolic shape inference fails on some models
            print(
                f"  quant_pre_process failed ({type(exc).__name__}); raw model used",
                file=sys.stderr,
            )
        model = onnx.load(str(path))
        raised = _opset_raised(model, below=13)
        if raised is not model:
            onnx.save(raised, str(pre))
            path = pre
    quantize_static(
        str(path), str(out), _Reader(feeds), quant_format=QuantFormat.QDQ, per_channel=best
    )


def _nncf(src: Path, feeds: list[dict[str, np.ndarray]], out: Path, kind: str) -> None:
    import nncf

    kwargs: dict[str, Any] = {"subset_size": len(feeds)}
    if kind == "transformer":
        kwargs["model_type"] = nncf.ModelType.TRANSFORMER
    # NNCF refuses opsets below 10; its user converts first, as onnxruntime does itself
    model = _opset_raised(onnx.load(str(src)), below=10)
    quantized = nncf.quantize(model, nncf.Dataset(feeds), **kwargs)
    onnx.save(quantized, str(out))


def _build(args: tuple[str, str, str]) -> tuple[float, float, str]:
    """Child process: quantize one variant; (wall seconds, peak RSS MiB, error)."""
    name, variant, out = args
    try:
        _, model, recipe, files = _setup(name)
        feeds = recipe.calibration(model.calibration)
        src = files["model"]
        start = time.perf_counter()
        if variant.startswith("onnxq"):
            import onnxq

            fmt = "qdq" if variant == "onnxq-qdq" else None
            onnxq.quantize(
                str(src), feeds, target="ort-cpu", format=fmt, output=out, progress=False
            )
        elif variant.startswith("ort"):
            _ort(src, feeds, Path(out), best=variant == "ort-pc")
        else:
            _nncf(src, feeds, Path(out), model.kind)
        seconds = time.perf_counter() - start
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        return (
            0.0,
            0.0,
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}",
        )
    return seconds, peak_rss_bytes() / 2**20, ""


def _session(path: Path, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # idle pool threads must not spin: the sessions run interleaved and would steal the cores
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _batched(path: Path, feeds: list[dict[str, np.ndarray]], batch: int) -> dict[str, np.ndarray]:
    """``batch`` samples of ``feeds`` in one feed on every input whose first dimension is
    symbolic (the others: the first feed's value). Only feeds shaped as the first one join it
    (a decoder's steps, each prefix a token longer, or padded batches of other lengths)."""
    dynamic, fixed = [], []
    for inp in onnx.load(str(path), load_external_data=False).graph.input:
        if inp.name not in feeds[0]:
            continue
        dims = inp.type.tensor_type.shape.dim
        if bool(dims) and (dims[0].dim_param or dims[0].dim_value == 0):
            dynamic.append(inp.name)
        else:
            fixed.append(inp.name)
    first = feeds[0]
    alike = [f for f in feeds if all(np.shape(f[x])[1:] == np.shape(first[x])[1:] for x in dynamic)]
    out = {x: np.concatenate([f[x] for f in alike])[:batch] for x in dynamic}
    out.update({x: first[x] for x in fixed})
    return out


def latency(
    paths: dict[str, Path], feed: dict[str, np.ndarray], threads: int, runs: int
) -> dict[str, float]:
    """Median ms per variant over at least ``runs`` runs each.

    The runs are split into one block per variant, each with its sessions created afresh in
    an order of its own (shuffled, seeded by the block); within a block the variants take
    turns run by run, each round in a shuffled order. In one fixed order of creation and of
    runs the variant after fp32 ran 3-5% slower on MTCNN whatever its model (two copies of one
    file differed so), and rotating the order keeps who follows whom. A block runs for at
    least :data:`BLOCK_SECONDS`: a model of 0.2 ms gets a thousand runs or more, enough to
    tell 3% apart.
    """
    names = list(paths)
    pooled: dict[str, list[float]] = {k: [] for k in names}
    for block in range(len(names)):
        order = random.Random(block).sample(names, len(names))
        sessions = {k: _session(paths[k], threads) for k in order}
        calls = {k: partial(s.run, None, feed) for k, s in sessions.items()}
        for k, v in interleaved(-(-runs // len(names)), calls, 20, BLOCK_SECONDS).items():
            pooled[k] += v
        del sessions, calls
    return {k: float(np.median(v) * 1e3) for k, v in pooled.items()}


def bench_model(name: str, runs: int, tmp: Path, batch: int = 1) -> dict[str, Any]:
    from onnxq.tools.zoo import Scores, runner

    _, model, recipe, files = _setup(name)
    src = files["model"]
    paths: dict[str, Path] = {"fp32": src}
    rows: dict[str, dict[str, Any]] = {"fp32": {"seconds": 0.0, "rss_mib": 0.0, "error": ""}}
    if model.expect == "already-quantized":
        print(f"{name}: already int8, skipped", file=sys.stderr)
        return {}
    ctx = mp.get_context("spawn")
    for variant in VARIANTS[1:]:
        out = tmp / f"{name}.{variant}.onnx"
        with ctx.Pool(1) as pool:
            seconds, rss, error = pool.map(_build, [(name, variant, str(out))])[0]
        rows[variant] = {"seconds": seconds, "rss_mib": rss, "error": error}
        if not error:
            paths[variant] = out
        print(
            f"{name} {variant}: built in {seconds:.1f} s{' FAILED ' + error if error else ''}",
            file=sys.stderr,
        )
    scores: dict[str, Scores] = {}
    for variant, path in list(paths.items()):  # a variant that does not run leaves it
        try:
            scores[variant] = Scores(recipe, runner(path), model.evaluation)
            rows[variant]["metric"] = scores[variant].value
            if variant != "fp32" and "fp32" in scores:
                rows[variant]["noise"] = scores[variant].noise(scores["fp32"])
            rows[variant]["bytes"] = path.stat().st_size
        except Exception as exc:
            rows[variant]["error"] = f"does not run: {type(exc).__name__}"
            paths.pop(variant)
    feed = _batched(src, recipe.calibration(batch), batch)
    for threads in (1, 2):
        for variant, ms in latency(paths, feed, threads, runs).items():
            rows[variant][f"ms_{threads}t"] = ms
    return {
        "model": name,
        "description": model.description,
        "metric": recipe.metric,
        "unit": recipe.unit,
        "higher_is_better": recipe.higher_is_better,
        "variants": rows,
    }


def _fmt(row: dict[str, Any], key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "–"


def markdown(results: list[dict[str, Any]], runs: int, batch: int = 1) -> str:
    """The scoreboard as Markdown."""
    from onnxq.tools.zoo import noise_text

    lines = [
        "# onnxq scoreboard",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {mp.cpu_count()} cores, "
        f"onnxruntime {ort.__version__}, Python {platform.python_version()}. "
        f"Latency: batch {batch}, median of at least {runs} runs (in {len(VARIANTS)} blocks of "
        f"{BLOCK_SECONDS} s or more) after warm-up, variants interleaved, "
        "sessions created and run in shuffled orders; ratio = variant / fp32 at "
        "the same thread count (below 1: faster). Peak RSS: the whole quantization process.",
        *_runs_line(results),
        "",
        "| model | metric | variant | metric value | Δ vs fp32 | ms 1 thread | × fp32 "
        "| ms 2 threads | × fp32 | size KiB | quantize s | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        rows = res["variants"]
        base = rows["fp32"]
        sign = 1 if res["higher_is_better"] else -1
        for variant in VARIANTS:
            row = rows.get(variant)
            if row is None:
                continue
            if row.get("error"):
                lines.append(
                    f"| {res['model']} | {res['metric']} | {variant} | failed: {row['error']} |"
                    + " |" * 8
                )
                continue
            delta = sign * (row["metric"] - base["metric"]) if "metric" in row else float("nan")
            r1 = row.get("ms_1t", float("nan")) / base.get("ms_1t", float("nan"))
            r2 = row.get("ms_2t", float("nan")) / base.get("ms_2t", float("nan"))
            better = "higher" if sign > 0 else "lower"
            name = f"**{variant}**" if variant == "onnxq" else variant
            noise = row.get("noise")
            shown_delta = "" if variant == "fp32" else format(delta, "+.2f") + noise_text(noise)
            cells = [
                res["model"],
                f"{res['metric']} ({res['unit']}, {better} is better)",
                name,
                _fmt(row, "metric", ".2f"),
                shown_delta,
                _fmt(row, "ms_1t", ".3f"),
                f"{r1:.2f}",
                _fmt(row, "ms_2t", ".3f"),
                f"{r2:.2f}",
                f"{row.get('bytes', 0) / 1024:.0f}",
                f"{row['seconds']:.1f}",
                f"{row['rss_mib']:.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Δ vs fp32: metric points, positive = better than fp32; ± its noise, twice the "
        "standard error of the paired per-sample difference (none where the metric is not a "
        "mean over samples).",
        "",
    ]
    return "\n".join(lines)


def _runs_line(results: list[dict[str, Any]]) -> list[str]:
    """Which rows each run measured, when the scoreboard holds rows of more than one run."""
    groups: dict[str, list[str]] = {}
    for res in results:
        run = res.get("run")
        key = (
            f"{run['date']} ({run['machine']}, onnxruntime {run['onnxruntime']}, batch "
            f"{run['batch']}, median of {run['runs']} runs)"
            if run
            else "an earlier run"
        )
        groups.setdefault(key, []).append(res["model"])
    if len(groups) < 2:
        return []
    return [
        "",
        "Rows measured in different runs: "
        + "; ".join(f"{', '.join(models)}: {key}" for key, models in groups.items())
        + ".",
    ]


def chart(results: list[dict[str, Any]], path: Path) -> None:
    """Two panels: metric change vs fp32 and latency ratio at 1 thread, per model and variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [v for v in VARIANTS if v != "fp32"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(results)), 8))
    width = 0.8 / len(shown)
    x = np.arange(len(results))
    for i, variant in enumerate(shown):
        deltas, ratios = [], []
        for res in results:
            row, base = res["variants"].get(variant, {}), res["variants"]["fp32"]
            sign = 1 if res["higher_is_better"] else -1
            ok = row and not row.get("error") and "metric" in row
            deltas.append(sign * (row["metric"] - base["metric"]) if ok else np.nan)
            ratios.append(row["ms_1t"] / base["ms_1t"] if ok and "ms_1t" in row else np.nan)
        axes[0].bar(x + i * width, deltas, width, label=variant)
        axes[1].bar(x + i * width, ratios, width, label=variant)
    for ax, title in zip(
        axes,
        (
            "metric change vs fp32 (points, higher is better)",
            "latency / fp32 at 1 thread (lower is better)",
        ),
        strict=True,
    ):
        ax.set_xticks(x + 0.4 - width / 2, [r["model"] for r in results], rotation=20, ha="right")
        ax.set_title(title)
        ax.axhline(0 if "metric" in title else 1, color="black", linewidth=0.8)
    axes[0].set_ylim(bottom=max(-10, np.nanmin(axes[0].get_ylim()[0])))  # bars below are cut
    axes[1].set_ylim(0, min(3, axes[1].get_ylim()[1]))  # so are ratios above 3
    axes[0].legend(ncol=len(shown), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def measured_by(runs: int, batch: int) -> dict[str, Any]:
    """What a run's rows were measured with: the day, machine, runtime and latency runs."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {mp.cpu_count()} cores",
        "onnxruntime": ort.__version__,
        "runs": runs,
        "batch": batch,
    }


def merged(
    earlier: list[dict[str, Any]], new: list[dict[str, Any]], order: list[str]
) -> list[dict[str, Any]]:
    """The scoreboard with ``new``'s models replacing their earlier rows, the others kept.

    A run of a few models updates their rows and leaves the rest of the scoreboard as it was
    (each row says when it was measured); models are listed in the manifest's order.
    """
    rows = {r["model"]: r for r in earlier}
    rows.update({r["model"]: r for r in new})
    rank = {name: i for i, name in enumerate(order)}
    return sorted(rows.values(), key=lambda r: (rank.get(r["model"], len(rank)), r["model"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1, help="samples per latency run")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    parser.add_argument(
        "--render", action="store_true", help="only rewrite the .md and .png from benchmark.json"
    )
    args = parser.parse_args()
    if args.render:
        out = Path(args.out)
        results = json.loads((out / "benchmark.json").read_text())
        (out / "benchmark.md").write_text(markdown(results, args.runs))
        chart(results, out / "benchmark.png")
        return 0
    from onnxq.tools.zoo import load_manifest

    manifest = load_manifest(ROOT / "models" / "manifest.toml")
    names = [m.name for m in manifest.select(args.models)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            res = bench_model(name, args.runs, Path(tmp), args.batch)
            if res:
                results.append(res)
                rows = [
                    ln
                    for ln in markdown([res], args.runs, args.batch).splitlines()
                    if ln.startswith(f"| {name} ")
                ]
                print("\n".join(rows), file=sys.stderr, flush=True)
    run = measured_by(args.runs, args.batch)
    for res in results:
        res["run"] = run
    print(update_scoreboard(out, results, list(manifest.models), args.runs, args.batch))
    return 0


def update_scoreboard(
    out: Path, results: list[dict[str, Any]], order: list[str], runs: int, batch: int = 1
) -> str:
    """Write ``results`` into ``out``'s benchmark.json, .md and .png, keeping the other rows.

    ``order``: the manifest's model names (the rows' order). Returns the markdown.
    """
    from onnxq.io.graph import write_text_atomic

    earlier = out / "benchmark.json"
    if earlier.exists():
        results = merged(json.loads(earlier.read_text()), results, order)
    write_text_atomic(out / "benchmark.json", json.dumps(results, indent=1))
    text = markdown(results, runs, batch)
    write_text_atomic(out / "benchmark.md", text)
    chart(results, out / "benchmark.png")
    return text


if __name__ == "__main__":
    sys.exit(main())
