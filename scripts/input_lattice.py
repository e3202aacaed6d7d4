"""Would a photo classifier gain from its input grid matching the pixel lattice exactly?

    python scripts/input_lattice.py mobilenetv2_dogs efficientnet_lite1

Images normalized as ``(p / 255 − 0.5) / 0.5`` (the zoo's two depthwise classifiers, PP-OCR's
recognisers) take the 256 values ``(p − 127.5) · 2/255``. No 8-bit grid with an integer zero
point holds them: their zero sits half a step between two levels. The default grid (the MSE
range, about 1.98/255 a step) rounds every pixel by a pattern that depends on its value.

The other way measured here: add half a step to the input, so that it lands on the grid of
step 2/255 and zero point 127 (lossless), and take the same shift out of the first Conv's bias
(``b − δ·ΣW``). That is exact inside the image; where the Conv pads with zeros it is off by
``δ·W`` on the padded taps (a zero in the shifted input is −δ in the original). For each
model the script prints:

* ``float, shifted``: the float model with that shift and bias, i.e. the border's own cost;
* ``int8 default``: the model as ``onnxq quantize`` writes it;
* ``int8 lattice``: quantized with the shift, the input's range pinned to the lattice (every
  other range, rounding and correction as by default).

Top-1 agreement with fp32 and the mean KL divergence of the softmax outputs, on the zoo's
evaluation crops (the metric of ``scripts/classifier_kl.py``). For the models of the
``photo-classes`` recipe whose first node is a Conv with a bias.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402
from classifier_kl import _probabilities  # noqa: E402
from onnx import numpy_helper  # noqa: E402
from zoo_variants import load  # noqa: E402

from onnxq.api import quantize  # noqa: E402
from onnxq.calibrators.histogram import MSECallback  # noqa: E402
from onnxq.tools.zoo import runner  # noqa: E402

#: the pixel lattice of ``(p / 255 − 0.5) / 0.5``: its step and the shift onto integer levels
STEP = np.float32(2 / 255)
SHIFT = np.float32(1 / 255)


class PinnedInput(MSECallback):
    """The default method, except that ``tensor`` gets the range ``(lo, hi)``."""

    def __init__(self, tensor: str, lo: float, hi: float):
        super().__init__()
        self.tensor, self.range = tensor, (lo, hi)

    def activation_range(self, info: Any, qt: Any) -> tuple[float, float]:
        """The pinned range for the input, the default one for every other tensor."""
        if qt.tensor == self.tensor:
            return self.range
        return super().activation_range(info, qt)


def shifted(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose first Conv expects the input plus SHIFT (its bias takes the shift out)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    name = out.graph.input[0].name
    first = next(n for n in out.graph.node if name in n.input)
    if first.op_type != "Conv" or len(first.input) < 3:
        raise SystemExit(f"{first.name}: the input's first reader is not a Conv with a bias")
    inits = {i.name: i for i in out.graph.initializer}
    w = numpy_helper.to_array(inits[first.input[1]]).astype(np.float64)
    b = numpy_helper.to_array(inits[first.input[2]]).astype(np.float64)
    corrected = (b - float(SHIFT) * w.sum(axis=(1, 2, 3))).astype(np.float32)
    inits[first.input[2]].CopyFrom(numpy_helper.from_array(corrected, first.input[2]))
    return out


def scores(ref: np.ndarray, hyp: np.ndarray) -> str:
    """Top-1 agreement (%) and mean KL divergence of ``hyp`` from ``ref``."""
    p = _probabilities(ref)
    logq = np.log(np.clip(_probabilities(hyp), 1e-12, 1))
    kl = float(np.mean(np.sum(p * (np.log(np.clip(p, 1e-12, 1)) - logq), -1)))
    return f"agreement {100 * np.mean(ref.argmax(-1) == hyp.argmax(-1)):.2f}%, KL {kl:.4f}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="zoo models of the photo-classes recipe")
    args = ap.parse_args(argv)
    for name in args.models:
        model, files, recipe = load(name)
        if tuple(recipe.mean) != (0.5, 0.5, 0.5) or tuple(recipe.std) != (0.5, 0.5, 0.5):
            raise SystemExit(f"{name}: its input is not (p/255 - 0.5)/0.5")
        base = onnx.load(str(files["model"]))
        moved = shifted(base)
        gin = base.graph.input[0].name

        def plus(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return {k: (v + SHIFT).astype(np.float32) for k, v in feeds.items()}

        calibration = recipe.calibration(model.calibration)
        options = {"target": "ort-cpu", "progress": False, **model.quantize}
        default, _ = quantize(base, calibration, **options)
        # the shifted input holds (k − 127)·STEP for k = 0..255: the grid of zero point 127
        pinned = PinnedInput(gin, -127 * float(STEP), 128 * float(STEP))
        lattice, _ = quantize(moved, [plus(f) for f in calibration], callback=pinned, **options)
        rows = {
            "float, shifted": (runner(moved), plus),
            "int8 default": (runner(default), lambda f: f),
            "int8 lattice": (runner(lattice), plus),
        }
        batches = recipe._batches("evaluation", model.evaluation, 16)
        ref = np.concatenate([recipe.float_run(b)[0] for b in batches])
        for label, (run, feed) in rows.items():
            hyp = np.concatenate([run(feed(b))[0] for b in batches])
            print(f"{name} {label}: {scores(ref, hyp)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
