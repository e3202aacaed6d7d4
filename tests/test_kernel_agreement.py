"""scripts/kernel_agreement.py: one int8 model run fused and with optimizations off."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_well_conditioned_model_agrees_with_itself_across_kernels():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "kernel_agreement.py"), "digits_cnn"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    fused = float(line.split("metric fused ")[1].split(",")[0])
    plain = float(line.split("unfused ")[1].split(";")[0])
    sqnr = float(line.split("output SQNR ")[1].split(" dB")[0])
    agree = float(line.split("top-1 agreement ")[1].split("%")[0])
    assert fused > 95 and abs(fused - plain) <= 0.5  # both readings are the int8 model
    # the two differ only at rounding ties: far closer to each other than int8 is to fp32
    assert sqnr > 60 and agree >= 99.5


def test_the_second_reading_runs_the_spec_ops_unfused():
    import onnx
    import onnxruntime as ort

    sys.path.insert(0, str(ROOT / "scripts"))
    import kernel_agreement

    import onnxq.demo

    model = onnx.load(str(Path(onnxq.demo.__file__).parent / "digits_cnn.onnx"))
    fused, plain = kernel_agreement.sessions(model)
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert plain.get_session_options().graph_optimization_level == off
    assert fused.get_session_options().graph_optimization_level != off
