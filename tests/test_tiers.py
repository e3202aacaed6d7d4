"""The tiers hold: a test that needs a Debian package skips without it, naming the command.

A fresh machine has none of the packages the slow tier uses (`dataset-fashion-mnist`,
`espeak-ng`, `fonts-dejavu-core`, `chromium`). Every test function that reaches one of them (the
Fashion-MNIST loader, the browser, a zoo model's data) must call ``needs_debian`` or
``skip_without_packages`` first, or be reached only through a helper that does; a test that
only names one says "needs no Debian package" in a comment, with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import needs_debian

TESTS = Path(__file__).resolve().parent
#: what reaches a Debian package, as it is written in a test
USES = (
    "fashion()",
    "CHROMIUM",
    "chromium",
    "espeak",
    "DejaVu",
    "run_model(",
    '"zoo", "run"',
    "same_outputs.py",  # quantizes the committed models, fashion_cnn among them
    "SCRIPT",
)
#: the calls that skip (or, under CI=true, fail) without it
GUARDS = ("needs_debian(", "skip_without_packages(")


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def _guarded(name: str, functions: dict[str, ast.FunctionDef], source: str, seen: set) -> bool:
    """Whether ``name`` calls a guard, itself or through the module's helpers it calls."""
    if name in seen or name not in functions:
        return False
    seen.add(name)
    body = ast.get_source_segment(source, functions[name]) or ""
    if any(g in body for g in GUARDS):
        return True
    called = {
        c.func.id
        for c in ast.walk(functions[name])
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
    }
    return any(_guarded(f, functions, source, seen) for f in called)


def test_every_test_that_needs_a_debian_package_skips_without_it():
    unguarded = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.name == "test_tiers.py":
            continue
        source = path.read_text()
        tree = ast.parse(source)
        functions = _functions(tree)
        for name, fn in functions.items():  # helpers too: a test may reach one through them
            body = ast.get_source_segment(source, fn) or ""
            exempt = "needs no Debian package" in body  # said, with why, in the test
            if (
                any(u in body for u in USES)
                and not exempt
                and not _guarded(name, functions, source, set())
            ):
                # the package may be reached through a helper: follow the calls
                unguarded.append(f"{path.relative_to(TESTS)}::{name}")
    assert not unguarded, f"functions that need a Debian package without skipping: {unguarded}"


def test_a_missing_package_skips_with_its_install_command(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setitem(
        __import__("helpers").DEBIAN_PROBES, "dataset-fashion-mnist", "/nonexistent/file"
    )
    with pytest.raises(pytest.skip.Exception, match="apt-get install dataset-fashion-mnist"):
        needs_debian("dataset-fashion-mnist")
    monkeypatch.setenv("CI", "true")  # .ci/run installs it: there the test runs (and fails)
    needs_debian("dataset-fashion-mnist")
