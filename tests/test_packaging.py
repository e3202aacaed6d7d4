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


def test_no_large_tracked_file_outside_the_model_folders():
    # generated dumps (profiles, caches) must not be committed; models live in models/ or the demo
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(["git", "ls-files", "-z"], capture_output=True, cwd=root, timeout=60)
    if res.returncode != 0:
        import pytest

        pytest.skip("not a git checkout")
    big = [
        name
        for name in res.stdout.decode().split("\0")
        if name
        and not name.startswith(("models/", "onnxq/demo/"))
        and (root / name).is_file()
        and (root / name).stat().st_size > 1_000_000
    ]
    assert big == [], f"tracked files over 1 MB outside models/: {big}"
