"""The documentation builds with ``mkdocs build --strict``: a broken link fails the suite."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "-f",
        str(root / "mkdocs.yml"),
    ]
    return subprocess.run([*cmd, "-d", str(site)], capture_output=True, text=True)


def test_docs_build_strict(tmp_path):
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [the gone page](gone.md).\n")
    done = _build(tmp_path, tmp_path / "site")
    assert done.returncode != 0 and "gone.md" in done.stdout + done.stderr
