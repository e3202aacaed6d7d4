"""Where a quantization's loss sits: the model's 8-bit inputs, its int8 weights, the rest.

``onnxq debug`` measures the user's metric on two more models beside the int8 one:

* **inputs alone**: the float model with only its float inputs on the grids the int8 model
  reads them on (the emulation, onnxq.simulate.emulate, with only those switches on). A model whose
  first layers are int8 cannot read its inputs any finer, so this much is lost before any layer
  computes: it is the model's own sensitivity to 8-bit inputs, and no choice of ranges,
  rounding or corrections wins it back (only leaving the first layers float does);
* **int8 weights, 16-bit activations**: the model quantized anew with int16 activations
  everywhere (QDQ; its ranges, rounding and bias corrections solved for that model), run as
  its emulation: onnxruntime would fuse its DequantizeLinear → MatMul/Gemm pairs into
  MatMulNBits, which by default computes the activations in int8 (its
  ``session.qdq_matmulnbits_accuracy_level`` 4), and measure something else. What it loses is
  the weights' share: activation grids, however chosen, cannot bring the int8 model closer to
  fp32 than that (up to the interaction of the two).

Beside them, the metric of the **same int8 model with its quantization computed in float**
(the emulation, every switch on: each QuantizeLinear, DequantizeLinear and op as the ONNX spec
writes it, where the runtime runs integer kernels that requantize their int32 sums). The two
differ only where a value lands within a rounding of a grid point, so the gap between them is
how far the metric moves on rounding ties alone: on MobileNetV2's near-tie crops, about a point
(the same QDQ file run with onnxruntime's integer kernels and with its optimizations off
agrees with itself on 95% of them), on most models nothing. A change smaller than that
between two quantizations is not a difference.

The parts are measured, not modelled: the errors interact and a metric is not a sum, so they
do not add up to the int8 model's loss. Each part is one evaluation of the metric; the second
is one quantization more. (The emulation cannot isolate the weights: the sequential bias
correction sets each bias for the whole int8 model, activation grids included, so its weights
alone would carry corrections for rounding that is not there.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import onnx

from onnxq.core.errors import OnnxqError
from onnxq.simulate.emulate import Emulation


@dataclass(frozen=True)
class LossParts:
    """The metric of the models that isolate one part (None: not measured, see ``notes``)."""

    fp32: float
    int8: float
    #: the float model with only its float inputs on their 8-bit grids
    inputs: float | None
    #: int8 weights, every activation int16 (quantized anew)
    weights: float | None
    #: the same int8 model with its quantization computed in float (its emulation)
    exact: float | None = None
    #: the float graph inputs the int8 model reads on an 8-bit grid
    rounded_inputs: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def loss(self) -> float:
        """Metric points the int8 model loses against fp32."""
        return self.fp32 - self.int8

    def line(self) -> str:
        """One line for the terminal summary."""
        cells = []
        for label, value in (
            ("inputs on their 8-bit grid alone", self.inputs),
            ("int8 weights, 16-bit activations", self.weights),
            ("int8", self.int8),
            ("the same int8 in float arithmetic", self.exact),
        ):
            shown = "-" if value is None else f"{value:.4f} (loss {self.fp32 - value:.4f})"
            cells.append(f"{label} {shown}")
        return "; ".join(cells)

    def ties(self) -> str | None:
        """A warning when rounding ties alone move the metric by a tenth of the loss or more."""
        if self.exact is None or self.loss <= 0:
            return None
        gap = abs(self.exact - self.int8)
        if gap < 0.1 * self.loss:
            return None
        return (
            f"the same int8 model with its quantization computed in float scores "
            f"{self.exact:.4f} against {self.int8:.4f} with the runtime's integer kernels: "
            f"the metric moves {gap:.4f} on rounding ties alone, so a change of that size "
            "between two quantizations (or in the bisection below) is not a difference"
        )

    def advice(self) -> str | None:
        """What the parts say: which of them holds at least half of the int8 model's loss.

        None without a loss, or when neither part could be measured.
        """
        if self.loss <= 0:
            return None
        if self.inputs is not None and self.fp32 - self.inputs >= 0.5 * self.loss:
            names = ", ".join(self.rounded_inputs)
            return (
                f"rounding the inputs ({names}) to their 8-bit grid alone loses "
                f"{self.fp32 - self.inputs:.4f} of the {self.loss:.4f}: the float model is that "
                "sensitive to 8-bit inputs; only its first layers kept float win that back"
            )
        if self.weights is not None and self.fp32 - self.weights >= 0.5 * self.loss:
            return (
                f"with every activation at int16 the int8 weights alone still lose "
                f"{self.fp32 - self.weights:.4f} of the {self.loss:.4f}: no choice of "
                "activation ranges wins that back (the ranking's groups whose noise is in "
                "their weights are where float layers help)"
            )
        if self.weights is not None:
            return (
                f"with every activation at int16 the loss falls to {self.fp32 - self.weights:.4f}: "
                "the 8-bit activation grids (the inputs' included) hold most of it (the ranking "
                "names where)"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "inputs": self.inputs,
            "weights": self.weights,
            "exact": self.exact,
            "rounded_inputs": list(self.rounded_inputs),
            "notes": list(self.notes),
        }


def float_inputs(model: onnx.ModelProto) -> set[str]:
    """Names of the graph inputs that are float tensors (not initializers)."""
    weights = {i.name for i in model.graph.initializer}
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}
    return {
        i.name
        for i in model.graph.input
        if i.name not in weights and i.type.tensor_type.elem_type in floats
    }


def loss_parts(
    emulation: Emulation,
    metric: Callable[[onnx.ModelProto], float],
    fp32: float,
    int8: float,
    inputs: Iterable[str],
    widened: Callable[[], onnx.ModelProto],
) -> LossParts:
    """Measure each part with ``metric`` (higher is better).

    ``emulation``: the int8 model's; ``inputs``: the model's float graph inputs
    (:func:`float_inputs`), of which those with an activation switch are the ones the int8
    model rounds; ``widened()``: the emulation of the model quantized anew with int16
    activations. A part whose model cannot be made or measured (an OnnxqError: a target
    without int16, a metric that cannot run an emulation) is left out, its reason in ``notes``:
    the parts explain, they never stop the run.
    """
    names = set(inputs)
    on_input = [
        k for k, s in enumerate(emulation.switches) if s.kind == "activation" and s.tensor in names
    ]
    notes: list[str] = []

    def measured(label: str, model: Callable[[], onnx.ModelProto]) -> float | None:
        try:
            return float(metric(model()))
        except OnnxqError as exc:
            notes.append(f"{label}: not measured ({exc})")
            return None

    exact = measured("int8 in float arithmetic", emulation.fixed)
    if on_input:
        rounded = measured("inputs alone", lambda: emulation.fixed(on_input))
    else:
        rounded = None
        notes.append("no float input is read on an 8-bit grid")
    return LossParts(
        fp32=fp32,
        int8=int8,
        inputs=rounded,
        weights=measured("int16 activations", widened),
        exact=exact,
        rounded_inputs=tuple(sorted({emulation.switches[k].tensor for k in on_input})),
        notes=tuple(notes),
    )
