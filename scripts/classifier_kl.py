"""How far a zoo photo classifier's int8 output is from fp32's, beyond top-1 agreement.

    python scripts/classifier_kl.py mobilenetv2_dogs '{}' '{"bias_correction": "fast"}'

For each set of ``quantize`` options (JSON), on the zoo's evaluation crops: top-1 agreement
with fp32 (the zoo's metric), agreement on the crops whose fp32 top class leads the second by
more than 0.1 in probability, the mean KL divergence ``Σ p_fp32 · log(p_fp32 / p_int8)`` of
the softmax outputs, the output SQNR and the quantize time. Agreement on crops with small
margins moves by a few crops from run to run; the KL divergence and SQNR say whether the
model as a whole moved toward fp32. For the models of the ``photo-classes`` recipe
(``mobilenetv2_dogs``, ``efficientnet_lite1``).
"""

from __future__ import annotations

import json
import sys

import numpy as np
from zoo_variants import load, variants


def _probabilities(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    if np.allclose(z.sum(-1), 1.0, atol=1e-3) and z.min() >= 0:
        return z  # already a softmax
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def main(argv: list[str]) -> int:
    name = argv[0]
    model, files, recipe = load(name)
    batches = recipe._batches("evaluation", model.evaluation, 16)
    ref = np.concatenate([recipe.float_run(b)[0] for b in batches])
    p = _probabilities(ref)
    top2 = np.sort(p, -1)[:, -2:]
    confident = top2[:, 1] - top2[:, 0] > 0.1
    for options, run, seconds in variants(model, files, recipe, argv[1:]):
        hyp = np.concatenate([run(b)[0] for b in batches])
        agree = ref.argmax(-1) == hyp.argmax(-1)
        logq = np.log(np.clip(_probabilities(hyp), 1e-12, 1))
        kl = float(np.mean(np.sum(p * (np.log(np.clip(p, 1e-12, 1)) - logq), -1)))
        sqnr = 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((ref - hyp) ** 2))
        print(
            f"{name} {json.dumps(options)}: agreement {100 * agree.mean():.2f}% "
            f"(margin > 0.1: {100 * agree[confident].mean():.2f}% of {int(confident.sum())}), "
            f"KL {kl:.4f}, output SQNR {sqnr:.2f} dB, quantize {seconds:.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
