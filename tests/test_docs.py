"""The documentation builds with ``mkdocs build --strict``: a broken link fails the suite."""

import os
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


# --------------------------------------------------------------------------------------------
# every command and Python example of the docs runs

import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: commands on the zoo's real models: the slow tier runs them (the models come from wheels)
SLOW = re.compile(r"models\.zoo_eval|models/\.cache")
#: commands that measure (minutes of benchmark, or every zoo model): their entry point and
#: arguments are checked with --help; running them is what the benchmarks are for
MEASURE = re.compile(r"^(python -m benchmarks\.|onnxq zoo (run|fetch))")
#: lines that set the environment up rather than show onnxq: not run inside the suite
SKIP = re.compile(r"^(pip install|pytest|apt-get|python scripts/same_outputs)")
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)


def _commands(code: str) -> list[str]:
    """The shell commands of a bash block: continuation lines joined, set-up lines left out."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split("&&")]
        parts = [p + " --help" if MEASURE.match(p) else p for p in parts if not SKIP.match(p)]
        if parts:
            out.append(" && ".join(parts))
    return out


def _examples():
    """Per page, its examples in order: the fast ones, then (slow tier) the zoo's."""
    for page in PAGES:
        found = BLOCK.findall(page.read_text())
        steps = []
        for lang, code in found:
            if lang == "python":
                steps.append(("python", code))
            else:
                steps += [("bash", command) for command in _commands(code)]
        fast = [s for s in steps if not SLOW.search(s[1])]
        slow = [s for s in steps if SLOW.search(s[1])]
        if fast:
            yield pytest.param(page, fast, id=page.name)
        if slow:
            yield pytest.param(page, slow, id=f"{page.name}-zoo", marks=[pytest.mark.slow])


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A folder holding what the examples name: model.onnx, calib.npz, a sample folder,
    the metric and data modules they import."""
    from helpers import DIGITS_CNN

    import onnxq.demo

    data = np.load(Path(onnxq.demo.__file__).parent / "digits.npz")
    calib = (data["calib"][:64] / 16.0).astype(np.float32)
    shutil.copy(DIGITS_CNN, tmp_path / "model.onnx")
    np.savez(tmp_path / "calib.npz", input=calib)
    (tmp_path / "calib_folder").mkdir()
    for i in range(16):
        np.save(tmp_path / "calib_folder" / f"{i:03d}.npy", calib[i : i + 1])
    test = (data["test"] / 16.0).astype(np.float32)
    np.savez(tmp_path / "test.npz", input=test)
    np.save(tmp_path / "labels.npy", data["labels"])
    (tmp_path / "mymetric.py").write_text(
        "import numpy as np, onnxruntime as ort\n"
        "def score(path):\n"
        "    x, y = np.load('test.npz')['input'], np.load('labels.npy')\n"
        "    s = ort.InferenceSession(path, providers=['CPUExecutionProvider'])\n"
        "    return 100 * float((s.run(None, {'input': x})[0].argmax(1) == y).mean())\n"
        "def accuracy(path):\n"  # usage.md's per-sample metric of the recipe choice
        "    x, y = np.load('test.npz')['input'], np.load('labels.npy')\n"
        "    s = ort.InferenceSession(path, providers=['CPUExecutionProvider'])\n"
        "    return s.run(None, {'input': x})[0].argmax(1) == y\n"
    )
    (tmp_path / "mydata.py").write_text(
        "import numpy as np\n"
        "def calibration():\n"
        "    return {'input': np.load('calib.npz')['input']}\n"
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _zoo_models_named(steps: list[tuple[str, str]]) -> set[str]:
    """The zoo models the examples name (``models/.cache/NAME__file``, ``zoo_eval:NAME``)."""
    text = "\n".join(code for _, code in steps)
    found = re.findall(
        r"models/\.cache/([a-z0-9_]+?)__|models\.zoo_eval:([a-z0-9_]+?)(?:_data)?\b", text
    )
    return {a or b for a, b in found}


@pytest.mark.parametrize(("page", "steps"), list(_examples()))
def test_every_example_of_the_docs_runs(sandbox, page, steps):
    """A page's Python blocks run as one script (they build on each other), its shell commands
    one by one, in the page's folder of sample files. The zoo's examples are written for the
    repository's root: the sandbox links its ``models`` folder, and the models they name are
    fetched first."""
    zoo = _zoo_models_named(steps)
    if zoo:
        from onnxq.tools.zoo import fetch, load_manifest

        manifest = load_manifest(ROOT / "models" / "manifest.toml")
        for name in sorted(zoo):
            fetch(manifest, manifest.models[name], lambda _: None)
        (sandbox / "models").symlink_to(ROOT / "models")
    paths = [sandbox, ROOT, ROOT / "tests", ROOT / "tests" / "rules"]  # the test helpers too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}
    script = "\n".join(code for kind, code in steps if kind == "python")
    for kind, code in steps:
        if kind == "python":
            if not script:
                continue
            argv, script = [sys.executable, "-c", script], ""
        else:
            argv = ["bash", "-c", code]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        assert done.returncode == 0, f"{page.name}: {argv[-1][:2000]}\n{done.stderr[-3000:]}"


def test_no_page_repeats_another_s_paragraph():
    """A paragraph of 100 characters or more stands on one page only (README included)."""
    seen: dict[str, str] = {}
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for para in re.split(r"\n\s*\n", text):
            key = " ".join(para.split())
            if len(key) < 100 or key.startswith("|"):
                continue
            assert key not in seen, f"{page.name} repeats a paragraph of {seen[key]}: {key[:80]}"
            seen[key] = page.name
