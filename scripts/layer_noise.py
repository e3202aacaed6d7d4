"""Where a zoo CNN's int8 noise sits, layer by layer, and whether a per-layer fix could remove it.

    python scripts/layer_noise.py mobilenetv2_dogs '{}' ['{"rounding": "nearest"}' ...] [--refit]

For each set of ``quantize`` options (JSON; the QDQ format is used, so that every Conv's float
output exists in the int8 model), on the first 128 evaluation crops of the zoo recipe, per
Conv in graph order:

* ``SQNR``: the int8 model's Conv output (before its own output grid) against fp32's, in dB:
  the noise of every layer up to this one;
* ``affine``: the same after the best gain and offset per output channel (least squares on
  these crops). A per-channel bias and scale correction can win back at most the difference;
* with ``--refit``, for 1×1 convolutions: the weights and bias refitted by least squares to map
  the int8 model's input of the layer to fp32's output, on the calibration crops (a small
  ridge), and scored on the evaluation crops against the layer's own float weights on the
  same input (``orig``). Both use float weights, so only the refit is compared.

For the models of the ``photo-classes`` recipe (``mobilenetv2_dogs``, ``efficientnet_lite1``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from zoo_variants import load

from onnxq.api import quantize
from onnxq.io.session import make_session

#: evaluation crops scored; calibration crops rows drawn for --refit
CROPS = 128
REFIT_ROWS = 20_000
#: ridge added to the refit's normal equations, as a fraction of their mean diagonal
RIDGE = 1e-3


def _rows(x: np.ndarray) -> np.ndarray:
    """(N, C, ...) -> (N·..., C) float64."""
    return np.moveaxis(x, 1, -1).reshape(-1, x.shape[1]).astype(np.float64)


def _sqnr(signal: float, noise: float) -> float:
    return float(10 * np.log10(signal / max(noise, 1e-30)))


def _convs(f: onnx.ModelProto, q: onnx.ModelProto) -> list[tuple[onnx.NodeProto, onnx.NodeProto]]:
    fc = [n for n in f.graph.node if n.op_type == "Conv"]
    qc = [n for n in q.graph.node if n.op_type == "Conv"]
    if len(fc) != len(qc):
        raise SystemExit(f"{len(fc)} Conv nodes in the float model, {len(qc)} in the int8 one")
    return list(zip(fc, qc, strict=True))


def _gather(
    pairs: list[tuple[onnx.NodeProto, onnx.NodeProto]],
    f_sess: Any,
    q_sess: Any,
    batches: list[dict[str, np.ndarray]],
    wanted: str,
) -> list[list[np.ndarray]]:
    """Per Conv, the rows of (fp32 output, int8 output) or (int8 input, fp32 output)."""
    out: list[list[np.ndarray]] = [[] for _ in pairs]
    f_names = [fn.output[0] for fn, _ in pairs]
    q_names = [qn.output[0] if wanted == "outputs" else qn.input[0] for _, qn in pairs]
    for feeds in batches:
        fo = f_sess.run(f_names, feeds)
        qo = q_sess.run(q_names, feeds)
        for k, (a, b) in enumerate(zip(fo, qo, strict=True)):
            out[k].append(np.stack([_rows(a), _rows(b)]) if wanted == "outputs" else (b, a))
    return out


def main(argv: list[str]) -> int:
    refit = "--refit" in argv
    argv = [a for a in argv if a != "--refit"]
    name = argv[0]
    model, files, recipe = load(name)
    f = onnx.load(str(files["model"]))
    weights = {i.name: numpy_helper.to_array(i) for i in f.graph.initializer}
    evaluation = recipe._batches("evaluation", CROPS, 16)
    calibration = recipe._batches("calibration", model.calibration, 16)
    for text in argv[1:] or ["{}"]:
        options = json.loads(text)
        q, _ = quantize(
            str(files["model"]),
            recipe.calibration(model.calibration),
            target="ort-cpu",
            progress=False,
            **{**model.quantize, **options, "format": "qdq"},
        )
        pairs = _convs(f, q)
        f_sess = make_session(f, expose=[t for fn, _ in pairs for t in (fn.output[0], fn.input[0])])
        q_sess = make_session(q, expose=[t for _, qn in pairs for t in (qn.output[0], qn.input[0])])
        print(f"{name} {json.dumps(options)}")
        outputs = _gather(pairs, f_sess, q_sess, evaluation, "outputs")
        fits = {}
        if refit:
            ones = [
                k for k, (fn, _) in enumerate(pairs) if weights[fn.input[1]].shape[2:] == (1, 1)
            ]
            sub = [pairs[k] for k in ones]
            train = _gather(sub, f_sess, q_sess, calibration, "inputs")
            test = _gather(sub, f_sess, q_sess, evaluation, "inputs")
            rng = np.random.default_rng(0)
            for k, tr, te in zip(ones, train, test, strict=True):
                fits[k] = _refit(pairs[k][0], weights, tr, te, rng)
        for k, (fn, _) in enumerate(pairs):
            y = np.concatenate(outputs[k], axis=1)  # (2, rows, C): fp32, int8
            ref, hyp = y[0], y[1]
            signal = float(np.sum(ref**2))
            noise = float(np.sum((ref - hyp) ** 2))
            mr, mh = ref.mean(0), hyp.mean(0)
            cov = ((ref - mr) * (hyp - mh)).sum(0)
            var_h = ((hyp - mh) ** 2).sum(0)
            var_r = ((ref - mr) ** 2).sum(0)
            left = float(np.sum(var_r - cov**2 / np.maximum(var_h, 1e-30)))
            line = (
                f"  {k:3d} {fn.output[0][-32:]:32s} SQNR {_sqnr(signal, noise):6.2f} dB, "
                f"affine {_sqnr(signal, left):6.2f} dB"
            )
            if k in fits:
                line += f", 1x1 held out: orig {fits[k][0]:6.2f} dB, refit {fits[k][1]:6.2f} dB"
            print(line, flush=True)
    return 0


def _refit(
    node: onnx.NodeProto,
    weights: dict[str, np.ndarray],
    train: list[tuple[np.ndarray, np.ndarray]],
    test: list[tuple[np.ndarray, np.ndarray]],
    rng: np.random.Generator,
) -> tuple[float, float]:
    """Held-out SQNR of a 1×1 Conv's float weights and of its least-squares refit (dB)."""
    w = weights[node.input[1]][:, :, 0, 0].astype(np.float64)
    b = weights[node.input[2]].astype(np.float64) if len(node.input) > 2 else np.zeros(len(w))
    x = np.concatenate([_rows(a) for a, _ in train])
    y = np.concatenate([_rows(c) for _, c in train])
    if len(x) > REFIT_ROWS:
        keep = rng.choice(len(x), REFIT_ROWS, replace=False)
        x, y = x[keep], y[keep]
    x1 = np.hstack([x, np.ones((len(x), 1))])
    h = x1.T @ x1
    h[np.diag_indices_from(h)] += RIDGE * np.trace(h) / len(h)
    solved = np.linalg.solve(h, x1.T @ y)
    w2, b2 = solved[:-1].T, solved[-1]
    xt = np.concatenate([_rows(a) for a, _ in test])
    yt = np.concatenate([_rows(c) for _, c in test])
    signal = float(np.sum(yt**2))
    orig = _sqnr(signal, float(np.sum((yt - xt @ w.T - b) ** 2)))
    new = _sqnr(signal, float(np.sum((yt - xt @ w2.T - b2) ** 2)))
    return orig, new


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
