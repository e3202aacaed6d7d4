"""scripts/input_noise.py: the float model's metric under noise on its inputs alone."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_input_noise_lowers_the_float_models_metric_as_the_noise_grows():
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "input_noise.py"),
            "digits_cnn",
            "--snr",
            "60",
            "-10",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    head, quiet, loud = done.stdout.strip().splitlines()
    fp32 = float(head.split("fp32 ")[1])
    at60 = float(quiet.split(": ")[1])
    at0 = float(loud.split(": ")[1])
    assert "at 60 dB" in quiet and "at -10 dB" in loud
    assert abs(at60 - fp32) <= 1.0  # noise 1000x below the signal: the digits barely move
    assert at0 < fp32 - 10  # noise three times the signal: far below
