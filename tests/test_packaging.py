"""Installation layout: onnxq.patterns and onnxq.calibrators exist, bare folders do not."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_no_top_level_patterns_or_calibrators(tmp_path):
    for name in ("patterns", "calibrators"):
        res = _run(f"import {name}", str(tmp_path))
        assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr


def test_subpackages_import(tmp_path):
    res = _run(
        "import onnxq.patterns, onnxq.calibrators, onnxq.demo; "
        "print(len(onnxq.patterns.default_patterns()))",
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    assert int(res.stdout) >= 8
