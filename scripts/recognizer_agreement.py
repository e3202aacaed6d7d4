"""How far a zoo text recogniser's int8 output is from fp32's, beyond its CER.

    python scripts/recognizer_agreement.py rapidocr_v4_rec '{}' '{"depthwise_scaling": "on"}'

For each set of ``quantize`` options (JSON), on the zoo's evaluation lines: the CER against
the rendered text (the zoo's metric), the CER against the text fp32 decodes, the per-step
argmax agreement with fp32 and the output SQNR. The CER against the rendered text counts
fp32's own misreadings, which an int8 model may repeat or not by chance (300 lines are about
9,000 characters: 0.1% is 9 of them); the other three say whether the model moved toward
fp32. For the models of the ``ocr-lines`` recipe (``ppocrv6_tiny_rec``, ``rapidocr_v4_rec``).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
from zoo_variants import load, variants

from onnxq.tools.zoo import runner


def main(argv: list[str]) -> int:
    name = argv[0]
    model, files, recipe = load(name)
    from models.recipes import edit_distance

    batches = recipe._batches(recipe._lines(2, model.evaluation))
    fp32 = runner(onnx.load(str(files["model"])))
    refs = [fp32(feeds)[0] for _, feeds in batches]
    fp32_text = [recipe.decode(r) for r in refs]
    chars = sum(len(t) for texts, _ in batches for t in texts)
    for options, run, seconds in variants(model, files, recipe, argv[1:]):
        truth_errors = fp32_errors = agree = steps = 0
        num = den = 0.0
        for (texts, feeds), ref, ftexts in zip(batches, refs, fp32_text, strict=True):
            hyp = run(feeds)[0]
            for t, f, h in zip(texts, ftexts, recipe.decode(hyp), strict=True):
                truth_errors += edit_distance(t, h.strip())
                fp32_errors += edit_distance(f.strip(), h.strip())
            agree += int(np.sum(ref.argmax(-1) == hyp.argmax(-1)))
            steps += ref.shape[0] * ref.shape[1]
            num += float(np.sum((ref.astype(np.float64) - hyp) ** 2))
            den += float(np.sum(ref.astype(np.float64) ** 2))
        print(
            f"{name} {json.dumps(options)}: CER {100 * truth_errors / chars:.3f}% "
            f"(against fp32's text {100 * fp32_errors / chars:.3f}%), per-step agreement "
            f"{100 * agree / steps:.2f}%, output SQNR {10 * np.log10(den / num):.2f} dB, "
            f"quantize {seconds:.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
