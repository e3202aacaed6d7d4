"""Which quantized groups cost the accuracy: one ranking for ``onnxq debug`` and the fallback.

Each group is measured on the emulation of the finished quantization (onnxq.simulate.emulate), one
onnxruntime run per question, against the fp32 outputs on the same samples:

* **alone quantized**: only the quantizers this group needs on (its weights and corrected
  biases, the activations it reads and writes). The output noise this group causes by itself,
  split into its weights alone and its activations alone;
* **alone float**: every other group int8, this one float, as onnxq would write it (a tensor an
  int8 neighbour writes or reads stays quantized). The share of the whole model's output noise
  that returning this group to float removes. With ``fallback="int16"`` (a target that runs
  int16 activations) the group is returned to int16 activations instead: its weights stay int8;
  a group the split then finds weight-dominated, whose fix is float (:func:`fix`), is measured
  float again while the budget lasts.

Output noise is the mean over the float outputs of Σ(f − q)² / Σ f² (its inverse in dB is the
output SQNR). Groups are ranked by the mean of the two shares of the whole model's noise: the
noise a group adds alone and the noise its return to float removes (they differ where errors
interact, e.g. a coarse grid that only hurts behind another one).

The cost is 2 + 4·G runs for G groups. Within ``budget`` seconds: the samples are cut so that
the screening (every group alone quantized) and "alone float" (2 + 2·G runs) take at most 80%
of the budget (never below one sample); "alone float" goes to the groups that add the most noise
alone first, and the weight/activation split to the best-ranked, while the budget lasts. The
screening is always complete, so a tiny budget still ranks every group (by the noise it adds
alone); the ranking's notes say what was cut.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from onnxq.calibrate.dataset import feed_samples, inner_shapes, shared_batch
from onnxq.io.session import make_session
from onnxq.simulate.emulate import FLAGS, Emulation

#: seconds the ranking may take by default
BUDGET_S = 120.0
#: samples per run where the model's batch axis is free
BATCH = 16


@dataclass
class GroupScore:
    """One group's measurements (noise as a fraction of the output power; SQNR in dB)."""

    node: str
    op: str
    nodes: tuple[str, ...]
    #: output noise with only this group quantized; with only its weights; only its activations
    alone: float
    weights: float | None
    activations: float | None
    #: output noise with every group quantized but this one (None: not measured, budget)
    without: float | None
    #: shares of the whole model's noise: added alone, removed by leaving the group float
    alone_share: float = 0.0
    float_share: float | None = None

    @property
    def score(self) -> float:
        """The ranking key: the mean of the two shares (the first alone if not both)."""
        if self.float_share is None:
            return self.alone_share
        return (self.alone_share + self.float_share) / 2

    @property
    def dominant(self) -> str:
        """``weights``, ``activations`` or ``both`` (within a factor 2), or ``?`` (not split)."""
        if self.weights is None or self.activations is None:
            return "?"
        if self.weights > 2 * self.activations:
            return "weights"
        if self.activations > 2 * self.weights:
            return "activations"
        return "both"

    def row(self) -> dict[str, Any]:
        """JSON-ready."""
        d = asdict(self)
        d.update(
            score=self.score,
            dominant=self.dominant,
            alone_db=db(self.alone),
            without_db=None if self.without is None else db(self.without),
            weights_db=None if self.weights is None else db(self.weights),
            activations_db=None if self.activations is None else db(self.activations),
        )
        return d


@dataclass
class Ranking:
    """Every group, the largest score first, and what was measured."""

    #: output noise with every group quantized
    noise: float
    groups: list[GroupScore]
    samples: int
    runs: int
    seconds: float
    budget: float
    #: how many of the best-ranked groups got the weight/activation split
    split: int
    notes: list[str] = field(default_factory=list)
    #: what "alone float" returned each group to: "float", or "int16" activations
    fallback: str = "float"

    @property
    def sqnr_db(self) -> float:
        """Output SQNR of the whole quantized model."""
        return db(self.noise)

    def table(self, limit: int = 15) -> str:
        """A terminal table (one line when the main graph holds no int8 group)."""
        if not self.groups:
            return "sensitivity: the main graph holds no int8 group to rank" + "".join(
                f"; {n}" for n in self.notes
            )
        lines = [
            f"sensitivity on {self.samples} samples ({self.runs} runs, {self.seconds:.1f} s): "
            f"output SQNR {self.sqnr_db:.2f} dB with every group int8",
            f"  {'group (node)':<36} {'op':<10} {'alone dB':>9} {'weights':>8} {'activ.':>8} "
            f"{self.fallback + ' →':>9} {'share':>6}  dominant",
        ]
        for g in self.groups[:limit]:
            w = "-" if g.weights is None else f"{db(g.weights):.1f}"
            a = "-" if g.activations is None else f"{db(g.activations):.1f}"
            f = "-" if g.without is None else f"{db(g.without):.2f}"
            lines.append(
                f"  {_short(g.node):<36} {g.op:<10} {db(g.alone):>9.2f} {w:>8} {a:>8} "
                f"{f:>9} {100 * g.score:>5.1f}%  {g.dominant}"
            )
        if len(self.groups) > limit:
            lines.append(f"  ... {len(self.groups) - limit} more (see --json)")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "noise": self.noise,
            "sqnr_db": self.sqnr_db,
            "samples": self.samples,
            "runs": self.runs,
            "seconds": round(self.seconds, 3),
            "budget": self.budget,
            "split": self.split,
            "fallback": self.fallback,
            "notes": self.notes,
            "groups": [g.row() for g in self.groups],
        }


def db(noise: float) -> float:
    """Noise as a fraction of the signal power → SQNR in dB (inf for none)."""
    if noise <= 0:
        return math.inf
    return -10.0 * math.log10(noise)


def _short(name: str, width: int = 36) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def rebatch(
    model: Any, feeds: Sequence[dict[str, np.ndarray]], size: int = BATCH
) -> list[dict[str, np.ndarray]]:
    """``feeds`` joined into batches of up to ``size`` samples, where the batch axis is free.

    One run per batch costs far less than one per sample; fixed batch axes keep the feeds.
    Only neighbours of the same shape past the batch axis are joined (calibrate.dataset's
    inner_shapes).
    """
    free = _free_batch(model)
    feeds = [dict(f) for f in feeds]
    if not free or len(feeds) < 2 or any(set(f) != set(feeds[0]) for f in feeds):
        return feeds
    if not all(shared_batch(f) for f in feeds):  # a leading axis that is no batch (LSTM state)
        return feeds
    chunks: list[list[dict[str, np.ndarray]]] = []
    count = 0
    for f in feeds:
        n = feed_samples(f)
        if not chunks or count + n > size or inner_shapes(f) != inner_shapes(chunks[-1][0]):
            chunks.append([])
            count = 0
        chunks[-1].append(f)
        count += n
    return [{k: np.concatenate([c[k] for c in chunk]) for k in chunk[0]} for chunk in chunks]


def rank(
    emulation: Emulation,
    feeds: Sequence[dict[str, np.ndarray]],
    budget: float = BUDGET_S,
    progress: Callable[[int, int], None] | None = None,
    fallback: str = "float",
) -> Ranking:
    """Measure and rank every group of ``emulation`` on ``feeds`` (batches of samples).

    ``fallback``: what "alone float" returns a group to, "float" or "int16" (activations).
    """
    start = time.perf_counter()
    feeds = rebatch(emulation.model, feeds)
    session = make_session(emulation.model)
    names = [o.name for o in session.get_outputs()]
    groups = emulation.groups
    notes: list[str] = []
    runs = 0

    def outputs(on: Any, batches: Sequence[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        nonlocal runs
        runs += 1
        flags = emulation.flags(on)
        return [session.run(names, {**f, FLAGS: flags}) for f in batches]

    outputs([], feeds[:1])  # warm-up
    tick = time.perf_counter()
    outputs([], feeds[:1])
    per_sample = (time.perf_counter() - tick) / max(1, _count(feeds[:1]))
    total = _count(feeds)
    # the screening and alone float (2 + 2·G runs) get at most 80% of the budget
    want = max(1, int(0.8 * budget / ((2 + 2 * len(groups)) * per_sample)))
    batches = list(feeds)
    if want < total:
        batches = _take(batches, want, _free_batch(emulation.model))
        notes.append(
            f"{_count(batches)} of {total} samples used to stay within the {budget:.0f} s budget"
        )
    reference = outputs([], batches)
    floating = [
        i for i, o in enumerate(reference[0]) if np.issubdtype(np.asarray(o).dtype, np.floating)
    ]
    power = [
        sum(float(np.sum(np.square(r[i], dtype=np.float64))) for r in reference) for i in floating
    ]

    def noise(on: Any) -> float:
        got = outputs(on, batches)
        total = 0.0
        for j, i in enumerate(floating):
            err = sum(
                float(np.sum(np.square(g[i].astype(np.float64) - r[i], dtype=np.float64)))
                for g, r in zip(got, reference, strict=True)
            )
            total += err / power[j] if power[j] > 0 else (0.0 if err == 0 else 1.0)
        return total / max(1, len(floating))

    def affordable() -> bool:  # one more run fits in the budget
        spent = time.perf_counter() - start
        return spent + spent / runs <= budget

    whole = noise(None)
    index = {g.node: i for i, g in enumerate(groups)}

    def returned(s: GroupScore, int16: bool) -> None:  # the group alone returned, measured
        s.without = noise(emulation.without([index[s.node]], int16=int16))
        s.float_share = max(0.0, whole - s.without) / whole if whole > 0 else 0.0

    scores = []
    for g in groups:  # every group alone quantized: the screening, always complete
        alone = noise(sorted(set(g.switches)))
        share = alone / whole if whole > 0 else 0.0
        scores.append(GroupScore(g.node, g.op, g.nodes, alone, None, None, None, share))
        if progress is not None:
            progress(len(scores), 3 * len(groups))
    scores.sort(key=lambda s: -s.alone_share)
    floated = 0
    for s in scores:  # alone float, the best-screened first, while the budget lasts
        if floated and not affordable():
            notes.append(
                f"alone float measured for the {floated} groups that add the most noise alone "
                f"of {len(groups)} (budget); the others rank by that noise"
            )
            break
        returned(s, fallback == "int16")
        floated += 1
        if progress is not None:
            progress(len(groups) + floated, 3 * len(groups))
    scores.sort(key=lambda s: -s.score)
    split = 0
    for s in scores:
        if split and not affordable():
            notes.append(
                f"weights/activations split for the {split} best-ranked groups only (budget)"
            )
            break
        g = groups[index[s.node]]
        s.weights = noise(g.weights) if g.weights else 0.0
        s.activations = noise(g.activations) if g.activations else 0.0
        split += 1
        if progress is not None:
            progress(len(groups) + floated + split, 3 * len(groups))
    if fallback == "int16":
        # a group whose noise is in its weights goes to float (fix()): measure that instead
        for s in scores:
            if s.without is not None and fix(s, fallback) == "float" and affordable():
                returned(s, False)
        scores.sort(key=lambda s: -s.score)
    return Ranking(
        whole,
        scores,
        _count(batches),
        runs,
        time.perf_counter() - start,
        budget,
        split,
        notes,
        fallback,
    )


def fix(group: GroupScore, fallback: str) -> str:
    """What returning ``group`` means: "float", or under ``fallback="int16"`` "int16".

    Under int16 a group whose own noise is in its weights (:attr:`GroupScore.dominant`) still
    goes to float: int16 activations would leave its int8 weights as they are.
    """
    return "int16" if fallback == "int16" and group.dominant != "weights" else "float"


def fix_entry(kind: str) -> dict[str, Any]:
    """The ``[node."…"]`` settings of a group returned to ``kind`` ("float" or "int16")."""
    return {"keep_float": True} if kind == "float" else {"activation_dtype": "int16"}


def _count(batches: Sequence[dict[str, np.ndarray]]) -> int:
    return sum(feed_samples(f) for f in batches)


def _free_batch(model: Any) -> bool:
    inits = {i.name for i in model.graph.initializer}
    return all(
        len(i.type.tensor_type.shape.dim) > 0
        and not i.type.tensor_type.shape.dim[0].HasField("dim_value")
        for i in model.graph.input
        if i.name not in inits and i.name != FLAGS
    )


def _take(
    batches: list[dict[str, np.ndarray]], samples: int, free: bool
) -> list[dict[str, np.ndarray]]:
    """The first ``samples`` samples (whole batches where the batch axis is fixed; ≥ 1 batch)."""
    out: list[dict[str, np.ndarray]] = []
    left = samples
    for f in batches:
        n = feed_samples(f)
        if left <= 0:
            break
        if n > left and free:
            out.append({k: v[:left] for k, v in f.items()})
            break
        out.append(f)
        left -= n
    return out
