"""The pass list of one ``quantize`` call, built from its options.

Adding an algorithm is one pass module and one line here. Passes whose default depends on the
model's kind (read by the load pass) are always listed and decide when they run.
"""

from __future__ import annotations

from onnxq.core.constraints import SAME_SCALE
from onnxq.options import QuantizeOptions
from onnxq.passes import bias_correction, rounding
from onnxq.passes.annotate import Annotate
from onnxq.passes.bias_correction import BiasCorrection, requests
from onnxq.passes.branches import Branches, BranchQuantizer
from onnxq.passes.budget import Budget
from onnxq.passes.calibrate import Calibrate
from onnxq.passes.check import Check
from onnxq.passes.choose import Choose
from onnxq.passes.depthwise_scaling import DepthwiseScaling, DepthwiseTrial
from onnxq.passes.equalize import Equalize
from onnxq.passes.float_outputs import FloatOutputs
from onnxq.passes.int4 import Int4Weights, WeightOnlyInt4
from onnxq.passes.load import Load
from onnxq.passes.lower import Lower
from onnxq.passes.manager import Pass
from onnxq.passes.materialize import Materialize
from onnxq.passes.prepare import Prepare
from onnxq.passes.requantize import Requantize, ShareScales
from onnxq.passes.rounding import WeightRounding
from onnxq.passes.save import Save
from onnxq.passes.smoothquant import SmoothQuant
from onnxq.passes.solve import Solve
from onnxq.passes.verify import Verify


def build(options: QuantizeOptions, quantize_branch: BranchQuantizer) -> list[Pass]:
    """The passes, in order, for ``options``; ``quantize_branch`` quantizes an If branch."""
    if options.weight_dtype == "int4":  # whole-model weight-only int4: no calibration
        return [Load(raise_opsets=False), WeightOnlyInt4(), Verify(), Save()]
    passes: list[Pass] = [Load(), Prepare()]
    if options.budget is not None:
        passes.append(Budget())
    if options.equalization != "off" and options.load_ranges is None:
        passes.append(Equalize())
    if options.smoothquant != "off" and options.load_ranges is None:
        passes.append(SmoothQuant())
    if options.depthwise_scaling == "on" and options.load_ranges is None:
        passes.append(DepthwiseScaling())
    # your metric scores each candidate as the model it writes (the fallback's has its own)
    finish = _finish(options, quantize_branch) if options.choice_metric is not None else []
    choose = Choose(Solve(), WeightRounding(), BiasCorrection(), finish)
    core: list[Pass] = [
        Annotate(),
        Calibrate(requests, (rounding.taps, bias_correction.taps)),
        choose,
    ]
    if options.depthwise_scaling == "auto" and options.load_ranges is None:
        passes.append(DepthwiseTrial(DepthwiseScaling(), core, choose))
    else:
        passes += core
    passes += [*_finish(options, quantize_branch), Verify(), Check(), Save()]
    return passes


def _finish(options: QuantizeOptions, quantize_branch: BranchQuantizer) -> list[Pass]:
    """The passes from solved values to the output model: materialize to the lowering."""
    fmt = options.output_format
    passes: list[Pass] = [Materialize(), Requantize()]
    if set(options.target.shared_scale_ops) & set(SAME_SCALE) and fmt.from_requantized:
        passes.append(ShareScales())
    if fmt.from_requantized:
        passes.append(FloatOutputs())
    return [*passes, Lower(), Int4Weights(), Branches(quantize_branch)]
