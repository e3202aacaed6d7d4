"""The ``onnxq`` command line: quantize, inspect, demo.

Bad input ends with one line ``onnxq: error: ...`` on stderr and exit code 2; no output file is
written (outputs are written atomically, after verification).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from onnxq import __version__
from onnxq.annotate.quantizer import Quantizer
from onnxq.annotate.targets import load_targets, targets
from onnxq.api import quantize_with, resolve_call
from onnxq.calibrate.dataset import inputs_hint, model_inputs
from onnxq.calibrate.sources import as_dataset
from onnxq.calibrators import DEFAULT_METHOD, METHODS
from onnxq.core.errors import ConfigError, OnnxqError
from onnxq.demo import run_demo
from onnxq.io.graph import load_model, save_model, write_text_atomic
from onnxq.io.interrupt import interrupted, message, new_command
from onnxq.io.loader import load_object
from onnxq.io.paths import reads_of, refuse_collisions, writes_of
from onnxq.io.text import TerminalWriter, one_line, shown
from onnxq.lower.convert import convert
from onnxq.lower.formats import get_format
from onnxq.options import (
    BIAS_CORRECTIONS,
    DEPTHWISE_SCALINGS,
    EQUALIZATIONS,
    FALLBACKS,
    ROUNDINGS,
    SMOOTHQUANT,
    Options,
    resolve,
)
from onnxq.passes.load import quantized_ops, raise_for_output, refuse_quantized
from onnxq.passes.manager import op_histogram
from onnxq.passes.verify import verify
from onnxq.post.subgraphs import declared_bodies
from onnxq.prepare.kind import KINDS
from onnxq.report import mark_carried
from onnxq.simulate.compare import compare
from onnxq.tools import zoo


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what was wrong and where the help is, exit 2.

    argparse's own error printed the whole usage (27 lines for quantize) before the line
    that mattered, and echoed a bad value whole.
    """

    def error(self, message: str) -> NoReturn:
        """Print one line naming the problem and the help command; exit 2."""
        print(
            one_line(f"{self.prog}: error: {message}; `{self.prog} --help` lists the options"),
            file=sys.stderr,
        )
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="onnxq", description="Post-training int8 quantization of ONNX models.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command")

    q = sub.add_parser("quantize", help="quantize a float model with calibration data")
    _quantize_io(q)
    _quantize_calibration(q)
    _quantize_precision(q)
    _quantize_run(q)

    i = sub.add_parser("inspect", help="op histogram and what each pattern matches, and why not")
    i.add_argument("model")
    i.add_argument("--explain", action="store_true", help="list every node with its reason")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.add_argument("--exclude", nargs="+", default=[], metavar="NODE")
    i.add_argument("--config", default=None, metavar="FILE.toml", help="per-node settings")
    i.add_argument("--target", default=None, help="explain for this target's patterns")
    i.add_argument("--target-file", default=None, metavar="FILE.toml")

    c = sub.add_parser("convert", help="retarget an already-quantized model (no calibration)")
    c.add_argument("model", help="a quantized .onnx model (QDQ or QOperator; never modified)")
    c.add_argument("-o", "--output", required=True, help="where to write the converted model")
    c.add_argument(
        "--format",
        required=True,
        choices=["qoperator", "qdq", "openvino"],
        help="qoperator: QLinear ops (onnxruntime CPU); qdq: standard Q/DQ; openvino: "
        "FakeQuantize on the float graph (run by the OpenVINO runtime)",
    )
    c.add_argument("--quiet", action="store_true", help="no summary")

    k = sub.add_parser("compare", help="per output and per layer SQNR/cosine, float vs quantized")
    k.add_argument("float_model", help="the float .onnx model")
    k.add_argument("quant_model", help="its quantized form (QOperator or QDQ)")
    k.add_argument(
        "--data", required=True, help="samples, as for quantize (.npz, folder, module:function)"
    )
    k.add_argument("--samples", type=int, default=None, help="use at most N samples")
    k.add_argument("--batch-size", type=int, default=None)
    _html_report(k, "a per-layer chart, the layers table, the worst tensors' ranges")
    k.add_argument("--json", action="store_true", help="print JSON instead of a table")

    g = sub.add_parser(
        "debug",
        help="when accuracy drops: rank the groups, find the fewest to keep float, write the "
        "config, check the target runtime",
    )
    g.add_argument("model", help="the float .onnx model (never modified)")
    g.add_argument("--data", required=True, help="calibration samples, as for quantize")
    g.add_argument(
        "--eval",
        default=None,
        metavar="MODULE:FUNCTION",
        help="your metric: called with a model file's path, returns a number (higher is "
        "better); default: output cosine with fp32 on the calibration samples",
    )
    g.add_argument("--target", default=None, help="quantize as for this target (default ort-cpu)")
    g.add_argument("--target-file", default=None, metavar="FILE.toml")
    _fallback_flag(g, "")
    g.add_argument(
        "--recover",
        type=float,
        default=0.8,
        help="share of the lost metric the fix must win back (default 0.8)",
    )
    g.add_argument(
        "--budget",
        type=float,
        default=120.0,
        help="seconds the sensitivity ranking may take (default 120; it uses fewer samples)",
    )
    g.add_argument("--samples", type=int, default=None, help="use at most N samples")
    g.add_argument("--batch-size", type=int, default=None)
    g.add_argument("--preprocess", default=None, help="image preprocessing, as for quantize")
    g.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FIX.toml",
        help="where to write the config (default MODEL_fix.toml in the current folder)",
    )
    _html_report(g, "the ranking, the bisection, the layers, the decisions, the check")
    g.add_argument("--json", action="store_true", help="print JSON instead of the report")

    t = sub.add_parser("targets", help="list the targets and their conventions")
    t.add_argument("--target-file", default=None, metavar="FILE.toml")

    z = sub.add_parser("zoo", help="the model zoo: list, fetch or run its models")
    z.add_argument("action", choices=["list", "fetch", "run"])
    z.add_argument("models", nargs="*", help="model names (default: all)")
    z.add_argument("--manifest", default=None, help="manifest.toml (default models/manifest.toml)")
    z.add_argument("--target", default="ort-cpu", help="target for run (default ort-cpu)")
    z.add_argument("--json", action="store_true", help="run: print the results as JSON")
    z.add_argument("--output-dir", default=None, help="run: also save each int8 model here")
    d = sub.add_parser("demo", help="quantize the bundled digits CNN and compare fp32 vs int8")
    d.add_argument("-o", "--output", default=None, help="also write the int8 demo model here")
    d.add_argument("--runs", type=int, default=300, help="latency runs per model (default 300)")
    return p


def _html_report(parser: argparse.ArgumentParser, holds: str) -> None:
    parser.add_argument(
        "--report",
        default=None,
        metavar="FILE.html",
        help=f"also write a self-contained HTML report ({holds}; opens without a network)",
    )


def _quantize_io(q: argparse.ArgumentParser) -> None:
    """quantize: the model, the output, the data, the target and the output format."""
    q.add_argument("model", help="float .onnx model (never modified)")
    q.add_argument("-o", "--output", required=True, help="where to write the int8 model")
    q.add_argument(
        "--data",
        default=None,
        help="calibration data: an .npz (arrays keyed by input name, samples on axis 0), a "
        "folder of .npy/.npz files (one sample each), a folder of images with --preprocess, "
        "or module:function returning feeds, arrays or a CalibrationDataReader",
    )
    q.add_argument(
        "--method",
        default=DEFAULT_METHOD,
        choices=list(METHODS),
        help=f"calibration method (default {DEFAULT_METHOD})",
    )
    q.add_argument(
        "--bias-correction",
        default="auto",
        choices=list(BIAS_CORRECTIONS),
        help="sequential: run the int8 model layer after layer on the first 64 calibration "
        "samples and set each Conv/Gemm/MatMul bias so that its output mean per channel "
        "matches the float layer's, earlier corrections applied; fast: subtract the mean shift "
        "of the weight rounding, from the input means; layerwise: the shift of the int8 layer "
        "on its int8 input; auto (default): sequential for CNNs (fast when --budget leaves it "
        "out or the data cannot be read twice), none otherwise",
    )
    q.add_argument(
        "--smoothquant",
        default="auto",
        choices=list(SMOOTHQUANT),
        help="move activation outliers of MatMul/Gemm inputs into their weights (alpha per "
        "layer, kept only where the int8 error drops); auto (default): on for transformers",
    )
    q.add_argument(
        "--equalization",
        default="auto",
        choices=list(EQUALIZATIONS),
        help="cross-layer equalization: balance the channel ranges of Conv → [Relu/Clip/Pad] → "
        "Conv chains and absorb activation offsets into the next bias (exact in float); auto "
        "(default): on for CNNs with --per-tensor weights",
    )
    q.add_argument(
        "--depthwise-scaling",
        default="auto",
        choices=list(DEPTHWISE_SCALINGS),
        help="on: scale each channel of a depthwise convolution's input to span the tensor's "
        "int8 range, the filters taking the inverse, where the factor folds into a constant "
        "Mul/Div/Add, BatchNormalization or Conv upstream (exact in float; needs per-channel "
        "weights); auto (default): the model is also quantized rescaled where it can be, and "
        "that kept only if it scores higher on the held-back samples by more than their noise "
        "(it helps PP-LCNet detectors and can hurt recognisers); off: never",
    )
    q.add_argument(
        "--rounding",
        default="auto",
        choices=list(ROUNDINGS),
        help="optimized: round each Conv/Gemm/MatMul weight for the least output error on the "
        "layer's calibration inputs (GPTQ-style; per layer never worse than nearest); auto "
        "(default): optimized for CNNs and transformers, nearest otherwise",
    )
    q.add_argument(
        "--max-drop",
        type=float,
        default=None,
        metavar="X",
        help="accuracy-driven fallback: return the fewest groups (ranked by the SQNR each "
        "loses) to float until the metric is at most X below fp32's, measured on every 8th "
        "calibration batch, held back; writes the best model found",
    )
    q.add_argument(
        "--metric",
        default=None,
        metavar="MODULE:FUNCTION",
        help="your evaluation, called with a model file's path, returning a number or one per "
        "sample (higher is better): the recipe choice scores its candidates with it (each "
        "as the model it writes), and --max-drop its trials (default: held-back output SQNR; "
        "for --max-drop, mean output cosine with fp32, in %%)",
    )
    _fallback_flag(q, "with --max-drop: ")
    q.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="bound the whole call: a default algorithm (equalization, SmoothQuant, optimized "
        "rounding) whose estimated time does not fit is left out, and the summary says which; "
        "estimates come from timing the float model on the first batch (default: no limit, "
        "every default runs)",
    )
    q.add_argument(
        "--recipe",
        default="auto",
        metavar="NAME",
        help="auto (default): with 32 or more calibration batches, hold back every 8th, fit "
        "each candidate (ranges MSE or MinMax, optimized or nearest rounding, sequential, fast "
        "or no bias correction) on the rest and write the one with the least output error on "
        "the held-back batches, switching from auto's pick only when the gain is above their "
        "noise; fixed: auto's picks, fitted on every batch; or pin one candidate by the name "
        "the report gives it, e.g. minmax/nearest/fast (ranges/rounding/bias correction)",
    )
    q.add_argument(
        "--model-kind",
        default="auto",
        choices=list(KINDS),
        help="the model's kind, which picks the default algorithms; auto (default): read from "
        "the graph (attention: transformer; LSTM/GRU/Loop: rnn; convolutions: cnn)",
    )
    q.add_argument(
        "--target",
        default=None,
        help="runtime conventions: ort-cpu (default), tensorrt, openvino, generic, or one from "
        "--target-file; explicit options win (`onnxq targets` lists them)",
    )
    q.add_argument(
        "--target-file",
        default=None,
        metavar="FILE.toml",
        help="register targets from [target.NAME] tables",
    )
    q.add_argument(
        "--weight-dtype",
        default="int8",
        choices=["int8", "int4"],
        help="int4: weight-only block-wise int4 MatMul/Gemm weights (QDQ, opset 21); "
        "no calibration data needed",
    )
    q.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="rows per int4 block along the reduced axis (default 32)",
    )
    q.add_argument(
        "--format",
        default=None,
        choices=["qoperator", "qdq", "openvino"],
        help="qoperator: QLinear ops for onnxruntime CPU (default); qdq: standard ONNX "
        "QuantizeLinear/DequantizeLinear around float ops; openvino: FakeQuantize "
        "(org.openvinotoolkit) for the OpenVINO runtime",
    )
    q.add_argument(
        "--weight-bits",
        type=int,
        default=None,
        choices=[8, 7],
        help="7: weights in [-63, 63] to avoid int16 accumulator overflow on "
        "AVX2/AVX-512 CPUs without VNNI",
    )


def _quantize_calibration(q: argparse.ArgumentParser) -> None:
    """quantize: how ranges are chosen (or loaded)."""
    q.add_argument(
        "--percentile",
        type=float,
        default=99.999,
        help="percentile kept by --method percentile (default 99.999)",
    )
    q.add_argument(
        "--bins",
        type=int,
        default=2048,
        help="histogram bins of percentile/entropy/mse (default 2048)",
    )
    q.add_argument(
        "--preprocess",
        default=None,
        help='image preprocessing, e.g. "resize=256,crop=224,mean=0.485/0.456/0.406,'
        'std=0.229/0.224/0.225,color=rgb,layout=nchw"',
    )
    q.add_argument(
        "--callback",
        default=None,
        metavar="MODULE:CLASS",
        help="a CalibrationCallback subclass to calibrate every pattern",
    )
    q.add_argument(
        "--save-ranges",
        default=None,
        metavar="FILE",
        help="write the chosen activation ranges (JSON keyed by tensor name)",
    )
    q.add_argument(
        "--load-ranges",
        default=None,
        metavar="FILE",
        help="use a saved range table instead of calibration data",
    )


def _quantize_precision(q: argparse.ArgumentParser) -> None:
    """quantize: per-channel, activation dtypes and per-node settings."""
    pc = q.add_mutually_exclusive_group()
    pc.add_argument(
        "--per-channel",
        dest="per_channel",
        action="store_const",
        const=True,
        default=None,
        help="per-channel weight scales (the default of every built-in target)",
    )
    pc.add_argument(
        "--per-tensor",
        dest="per_channel",
        action="store_const",
        const=False,
        help="one scale per weight tensor",
    )
    q.add_argument(
        "--activation-dtype",
        default=None,
        choices=["uint8", "int8", "int16"],
        help="activation type (default uint8, the fast U8S8 path of onnxruntime CPU)",
    )
    q.add_argument(
        "--unsigned-after-relu",
        action="store_const",
        const=True,
        default=None,
        help="with symmetric int8 activations: uint8 with zero point 0 for tensors a Relu makes "
        "non-negative (twice the resolution; OpenVINO's convention; --format qdq or openvino)",
    )
    q.add_argument(
        "--symmetric-activations",
        action="store_const",
        const=True,
        default=None,
        help="zero point 0 for every activation (with --activation-dtype int8: what TensorRT "
        "expects; use with --format qdq)",
    )
    q.add_argument(
        "--exclude", nargs="+", default=[], metavar="NODE", help="node names to keep in float"
    )
    q.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="per-node settings (keep_float, method) by op type, node-name regex and node name",
    )


def _quantize_run(q: argparse.ArgumentParser) -> None:
    """quantize: batching, reports and checks."""
    q.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="calibration batch size for models with a dynamic batch axis",
    )
    q.add_argument("--samples", type=int, default=None, help="use at most N calibration samples")
    q.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="run the calibration pass on N local processes, each with its share of the "
        "cores and of the batches; the statistics merge into what one process gathers (the "
        "same model, byte for byte, with the built-in methods)",
    )
    q.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the calibration pass as Ray tasks (pip install 'onnxq[ray]'): on a local "
        "cluster, or on the one at ADDRESS (auto, HOST:PORT); --workers tasks (default: the "
        "cluster's CPUs), each reading its own share of --data (a folder, an .npz or "
        "module:function taking shard and shards)",
    )
    q.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="onnxruntime threads of each calibration process, and at most that many runs "
        "at once (default: the cores but one with two runs in flight, or the cores shared "
        "out among the --workers)",
    )
    q.add_argument(
        "--report",
        default=None,
        metavar="FILE",
        help="write the quantization report here: HTML (charts, decisions) for a .html name, "
        "else JSON",
    )
    q.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    q.add_argument(
        "--verbose",
        action="store_true",
        help="a longer summary: calibration, requantize, every algorithm and pass with its time",
    )
    q.add_argument(
        "--no-latency-check",
        action="store_true",
        help="skip timing fp32 against int8 (by default a model that runs slower in int8 is "
        "flagged with the measured ratio)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``onnxq`` console script.

    What it prints on stdout escapes control characters (node names come from the model:
    an ESC or BEL byte in one would drive the terminal).
    """
    new_command()
    with contextlib.redirect_stdout(TerminalWriter(sys.stdout)):
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        parser = _parser()
        args = parser.parse_args(argv)
        if args.version:
            print(f"onnxq {__version__}")
            return 0
        if args.command == "quantize":
            return _quantize(args)
        if args.command == "targets":
            return _targets(args)
        if args.command == "compare":
            return _compare(args)
        if args.command == "debug":
            return _debug(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "zoo":
            return _zoo(args)
        if args.command == "demo":
            return run_demo(output=args.output, runs=args.runs)
        parser.print_help()
        return 2
    except KeyboardInterrupt:
        print(message(), file=sys.stderr)
        return 130
    except Exception as exc:
        if interrupted():  # Ctrl-C that surfaced as another error (an import, a run)
            print(message(), file=sys.stderr)
            return 130
        return _failed(exc)


def _failed(exc: Exception) -> int:
    """One line for an exception that ends a command, and its exit code."""
    if isinstance(exc, OnnxqError):
        print(f"onnxq: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, OSError):  # a file onnxq was pointed at cannot be read or written
        where = f" '{exc.filename}'" if exc.filename else ""
        print(one_line(f"onnxq: error: {exc.strerror or exc}{where}"), file=sys.stderr)
        return 2
    if os.environ.get("ONNXQ_DEBUG"):  # an onnxq bug: one line unless debugging
        raise exc
    print(
        one_line(
            f"onnxq: internal error: {type(exc).__name__}: {exc} (set ONNXQ_DEBUG=1 for "
            "the traceback and please report it)"
        ),
        file=sys.stderr,
    )
    return 1


def _zoo(args: argparse.Namespace) -> int:
    manifest = zoo.load_manifest(args.manifest)
    models = manifest.select(args.models)
    if args.action == "list":
        width = max(len(m.name) for m in models)
        for m in models:
            flags = " (slow)" if m.slow else ""
            print(f"{m.name:<{width}}  {m.source:<32} {m.description}{flags}")
        return 0
    if args.action == "fetch":
        for m in models:
            files = zoo.fetch(manifest, m, log=lambda s: print(s, file=sys.stderr))
            print(f"{m.name}: {files['model']}")
        return 0
    results, failed = [], []
    errors: list[dict[str, str]] = []
    for m in models:
        out = None
        if args.output_dir:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            out = Path(args.output_dir) / f"{m.name}.int8.onnx"
        try:
            res = zoo.run_model(
                manifest, m, target=args.target, output=out, log=lambda s: print(s, file=sys.stderr)
            )
        except OnnxqError as exc:  # one model that cannot run does not stop the others
            failed.append(m.name)
            errors.append({"model": m.name, "error": str(exc)})
            if not args.json:
                print(f"{m.name}: FAILED: {exc}", flush=True)
            continue
        results.append(res)
        if res.failures:
            failed.append(m.name)
        if not args.json:
            verdict = "ok" if not res.failures else "FAILED: " + "; ".join(res.failures)
            before, after = (
                ("original", "converted") if m.expect != "quantize" else ("fp32", "int8")
            )
            print(
                f"{m.name}: {res.metric} {before} {res.fp32:.2f}{res.unit} → {after} "
                f"{res.int8:.2f}{res.unit}{zoo.noise_text(res.noise)}"
                + (f", worst sample {res.worst:.2f}{res.unit}" if res.worst is not None else "")
                + f" (bar: ≤ {res.max_loss:g} "
                "points worse), "
                f"{res.quantized_nodes} nodes int8, {res.fp32_bytes / 1024:.0f} → "
                f"{res.int8_bytes / 1024:.0f} KiB, {res.seconds:.1f} s: {verdict}",
                flush=True,
            )
    if args.json:
        print(json.dumps([r.to_dict() for r in results] + errors, indent=1))
    return 1 if failed else 0


def _quantize(args: argparse.Namespace) -> int:
    refuse_collisions(
        [
            *reads_of("the model", args.model),
            *reads_of("--data", args.data),
            *reads_of("--config", args.config),
            *reads_of("--target-file", args.target_file),
            *reads_of("--load-ranges", args.load_ranges),
        ],
        [
            *writes_of("-o", args.output, model=True),
            *writes_of("--report", args.report),
            *writes_of("--save-ranges", args.save_ranges),
        ],
    )
    if _is_html(args.report):
        _needs_matplotlib("--report")
    src, dst = Path(args.model), _output_path(args.output)
    if args.target_file:
        load_targets(args.target_file, _warn)
    if args.data is None and args.load_ranges is None and args.weight_dtype != "int4":
        raise ConfigError("quantize needs calibration data: --data PATH (or --load-ranges FILE)")
    callback = None
    if args.callback is not None:
        cls = load_object(args.callback, "--callback")
        callback = cls() if isinstance(cls, type) else cls
        if not callable(getattr(callback, "calibrate_pattern", None)):
            raise ConfigError(
                f"--callback {args.callback!r} is not a CalibrationCallback (it has "
                "no calibrate_pattern method)"
            )
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    if args.samples is not None and args.samples < 1:
        raise ConfigError(f"--samples {args.samples} must be >= 1")
    options = resolve_call(
        Options(
            method=args.method,
            per_channel=args.per_channel,
            activation_dtype=args.activation_dtype,
            symmetric_activations=args.symmetric_activations,
            unsigned_after_relu=args.unsigned_after_relu,
            config=args.config,
            target=args.target,
            weight_dtype=args.weight_dtype,
            block_size=args.block_size,
            exclude=args.exclude,
            batch_size=args.batch_size,
            samples=args.samples,
            workers=args.workers,
            threads=args.threads,
            ray=args.ray,
            percentile=args.percentile,
            bins=args.bins,
            preprocess=args.preprocess,
            callback=callback,
            save_ranges=args.save_ranges,
            load_ranges=args.load_ranges,
            format=args.format,
            weight_bits=args.weight_bits,
            progress=None if not args.quiet else False,
            output=str(dst),
            latency_check=not args.no_latency_check,
            bias_correction=args.bias_correction,
            smoothquant=args.smoothquant,
            equalization=args.equalization,
            depthwise_scaling=args.depthwise_scaling,
            rounding=args.rounding,
            max_drop=args.max_drop,
            metric=args.metric,
            fallback=args.fallback,
            model_kind=args.model_kind,
            budget=args.budget,
            recipe=args.recipe,
        ),
        cli=True,
    )
    qmodel, report = quantize_with(str(src), args.data, options)
    if _is_html(args.report):
        _quantize_html(args, src, qmodel, report)
    elif args.report:
        write_text_atomic(args.report, json.dumps(report.to_dict(), indent=2))
    if not args.quiet:
        print(report.summary(verbose=args.verbose))
        print(f"wrote {dst}")
    else:  # warnings are never silent, even with --quiet
        for w in report.warnings:
            _warn(w)
    return 0


def _quantize_html(args: argparse.Namespace, src: Path, qmodel: Any, report: Any) -> None:
    """Quantize --report F.html: the float and int8 models compared on a few batches."""
    from onnxq.tools.html import quantize_page

    float_model = load_model(str(src))
    feeds: list[Any] = []
    if args.data is not None:
        dataset = as_dataset(
            args.data, model_inputs(float_model), args.batch_size, args.samples, args.preprocess
        )
        for feed in dataset.batches():
            feeds.append(dict(feed))
            if len(feeds) == 8:
                break
    page = quantize_page(f"onnxq quantize: {src.name}", float_model, qmodel, report, feeds)
    write_text_atomic(args.report, page)


def _warn(message: str) -> None:
    print(f"onnxq: warning: {one_line(message)}", file=sys.stderr)


def _output_path(output: str, option: str = "-o") -> Path:
    """An output path whose folder exists (collisions are refused before, by refuse_collisions)."""
    dst = Path(output)
    if not (dst.parent if str(dst.parent) else Path(".")).is_dir():
        raise ConfigError(
            f"output folder '{dst.parent}' does not exist; create it or choose another {option}"
        )
    return dst


def _is_html(report: str | None) -> bool:
    return report is not None and str(report).lower().endswith((".html", ".htm"))


def _needs_matplotlib(option: str) -> None:
    """Refuse an HTML report before any work when matplotlib, which draws it, is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(
            f"{option}: an HTML report draws its charts with matplotlib, which is not "
            'installed; pip install matplotlib (or pip install "onnxq[report]"), or leave '
            f"{option} out"
        )


def _convert(args: argparse.Namespace) -> int:
    refuse_collisions(reads_of("the model", args.model), writes_of("-o", args.output, model=True))
    dst = _output_path(args.output)
    model, report = convert(load_model(args.model), args.format)
    verify(model, runtime=get_format(args.format).runtime)
    save_model(model, dst)
    if not args.quiet:
        print(report.summary())
        print(f"wrote {dst}")
    return 0


def _targets(args: argparse.Namespace) -> int:
    if args.target_file:
        load_targets(args.target_file, _warn)
    for t in targets():
        pats = "all patterns" if t.patterns is None else ", ".join(t.patterns)
        sym = (" symmetric" if t.symmetric_activations else "") + (
            " (int16 too)" if t.int16_activations else ""
        )
        print(
            f"{t.name:<10} format={t.format} activations={t.activation_dtype}{sym} "
            f"per_channel={t.per_channel} weight_bits={t.weight_bits or 'auto'}; {pats}"
        )
        if t.description:
            print(f"{'':<10} {t.description}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    refuse_collisions(
        [
            *reads_of("the float model", args.float_model),
            *reads_of("the quantized model", args.quant_model),
            *reads_of("--data", args.data),
        ],
        writes_of("--report", args.report),
    )
    if args.report is not None:
        _needs_matplotlib("--report")
        _output_path(args.report, "--report")
    float_model = load_model(args.float_model)
    quant_model = load_model(args.quant_model)
    _check_compare_order(args.float_model, float_model, args.quant_model, quant_model)
    _check_same_inputs(args.float_model, float_model, args.quant_model, quant_model)
    dataset = as_dataset(args.data, model_inputs(float_model), args.batch_size, args.samples)
    result = compare(float_model, quant_model, dataset)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.table())
    if args.report:
        from itertools import islice

        from onnxq.tools.html import compare_page

        feeds = [dict(f) for f in islice(dataset.batches(), 8)]  # for the range histograms
        title = f"onnxq compare: {Path(args.quant_model).name}"
        write_text_atomic(args.report, compare_page(title, float_model, quant_model, result, feeds))
    return 0


def _check_same_inputs(
    float_path: str, float_model: Any, quant_path: str, quant_model: Any
) -> None:
    """Both models read the same inputs: else they are not one model before and after."""
    first = [i.name for i in model_inputs(float_model)]
    second = [i.name for i in model_inputs(quant_model)]
    if set(first) != set(second):
        raise ConfigError(
            f"'{shown(quant_path)}' reads {', '.join(map(repr, second))} and "
            f"'{shown(float_path)}' reads {', '.join(map(repr, first))}: compare measures a "
            "quantized model against the float model it was quantized from; give that pair"
        )


def _check_compare_order(
    float_path: str, float_model: Any, quant_path: str, quant_model: Any
) -> None:
    """The float model goes first, a quantized one second: say so when they do not."""
    first, second = quantized_ops(float_model), quantized_ops(quant_model)
    if first and not second:
        raise ConfigError(
            f"'{shown(float_path)}' is the quantized model (it holds {', '.join(first)}) and "
            f"'{shown(quant_path)}' the float one: give the float model first, `onnxq compare "
            "FLOAT.onnx QUANTIZED.onnx`"
        )
    if first:
        raise ConfigError(
            f"the first model '{shown(float_path)}' is quantized (it holds {', '.join(first)}); "
            "compare measures a quantized model against its float model: give the float one "
            "first"
        )
    if not second:
        raise ConfigError(
            f"the second model '{shown(quant_path)}' holds no quantized op; give the model "
            "onnxq quantize wrote"
        )


def _fallback_flag(parser: argparse.ArgumentParser, prefix: str) -> None:
    parser.add_argument(
        "--fallback",
        default=None,
        choices=list(FALLBACKS),
        help=f"{prefix}what a group goes back to: float, or int16 activations with int8 "
        "weights (QDQ format; a group whose error is in its weights still goes to float); "
        "default: int16 where the target runs int16 activations (int16_activations = true in "
        "its [target.NAME] table), else float",
    )


def _debug(args: argparse.Namespace) -> int:
    from onnxq.tools.debug import debug, default_fix_path

    if args.target_file:
        load_targets(args.target_file, _warn)
    if args.budget is not None and not args.budget >= 0:
        raise ConfigError(f"--budget {args.budget} must be ≥ 0 seconds")
    for flag, value in (("--samples", args.samples), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be ≥ 1")
    output = args.output if args.output is not None else default_fix_path(args.model)
    refuse_collisions(
        [
            *reads_of("the model", args.model),
            *reads_of("--data", args.data),
            *reads_of("--target-file", args.target_file),
        ],
        [*writes_of("-o", output), *writes_of("--report", args.report)],
    )
    if args.report is not None:
        _needs_matplotlib("--report")
    for option, path in (("-o", output), ("--report", args.report)):
        if path is not None:
            _output_path(path, option)
    result = debug(
        args.model,
        args.data,
        eval=args.eval,
        target=args.target,
        fallback=args.fallback,
        recover=args.recover,
        budget=args.budget,
        batch_size=args.batch_size,
        samples=args.samples,
        preprocess=args.preprocess,
        output=output,
        data_label=args.data,
        target_file=args.target_file,
        report=args.report,
        cli=True,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.summary())
    return 0


def _body_decisions(quantizer: Quantizer, options: Any) -> list[Any]:
    """What quantize would do inside each If branch and Loop/Scan body, named NODE/BODY/NODE."""
    from dataclasses import replace

    out = []
    for node, attr, body in declared_bodies(quantizer.float_model):
        try:
            inner = Quantizer(body, options.patterns, options.quantizer_config())
            found = mark_carried(inner, options=options)
        except OnnxqError as exc:
            _warn(f"{node.op_type} '{node.name}' {attr}: not explained: {exc}")
            continue
        out += [replace(d, node=f"{node.name}/{attr}/{d.node}") for d in found]
    return out


def _inspect(args: argparse.Namespace) -> int:

    if args.target_file:
        load_targets(args.target_file, _warn)
    options = resolve(target=args.target, config=args.config, exclude=args.exclude, cli=True)
    float_model = load_model(args.model)
    refuse_quantized(float_model, f"'{args.model}'", "inspect")
    float_model = raise_for_output(float_model, options)  # as quantize's load pass does
    quantizer = Quantizer(float_model, options.patterns, options.quantizer_config())
    for w in quantizer.warnings:
        _warn(w)
    hist = op_histogram(quantizer.float_model)
    decisions = mark_carried(quantizer, options=options) + _body_decisions(quantizer, options)
    if args.json:
        from dataclasses import asdict

        print(json.dumps({"ops": hist, "nodes": [asdict(d) for d in decisions]}, indent=2))
        return 0
    print(inputs_hint(model_inputs(quantizer.float_model)))
    print("ops: " + ", ".join(f"{k} {v}" for k, v in hist.items()))
    by_pattern: dict[str, list[str]] = {}
    for d in decisions:
        if d.quantized:
            by_pattern.setdefault(d.pattern, []).append(d.node)
    for pattern, nodes in by_pattern.items():
        print(f"{pattern}: {', '.join(nodes)}")
    left = [d for d in decisions if not d.quantized]
    shown = left if args.explain else [d for d in left if d.pattern]
    if shown:
        print("not quantized:")
        width = max(len(d.node) for d in shown)
        for d in shown:
            print(f"  {d.node:<{width}}  {d.op:<12} {d.reason}")
    unruled = Counter(d.op for d in left if d not in shown)
    if unruled:
        ops = ", ".join(f"{op} ×{k}" for op, k in sorted(unruled.items()))
        print(f"not quantized, no rule for them: {ops} (--explain lists each with its reason)")
    q = sum(d.quantized for d in decisions)
    print(f"{q} of {len(decisions)} nodes would be quantized; {len(left)} stay float")
    return 0


if __name__ == "__main__":
    sys.exit(main())
