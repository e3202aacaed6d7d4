"""The HTML report in a real browser: Debian's Chromium, headless, through Playwright.

The report of ``onnxq debug`` on the zoo's digits CNN is opened from a file with the network
off; the page must log no console error, show its sections and charts, and its decisions
filter must work. A screenshot is saved to ``build/artifacts/report.png``.
"""

import os
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import make_model, needs_debian, rng
from onnx import helper as h

from onnxq.cli import main

ARTIFACTS = Path(__file__).resolve().parent.parent / "build" / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _digits(tmp_path):
    import onnxq.demo

    folder = Path(onnxq.demo.__file__).parent
    data = np.load(folder / "digits.npz")
    npz = tmp_path / "calib.npz"
    np.savez(npz, input=data["calib"][:128].astype(np.float32))
    return folder / "digits_cnn.onnx", npz


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    src, npz = _digits(tmp)
    page = tmp / "report.html"
    assert main(["debug", str(src), "--data", str(npz), "-o", str(tmp / "fix.toml"),
                 "--report", str(page)]) == 0  # fmt: skip
    return page


def test_the_report_needs_no_network(report):
    text = report.read_text()
    assert "<script src" not in text and "<link" not in text
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", text)
    assert "url(http" not in text


def test_the_report_of_a_200_node_model_stays_under_2_mb(tmp_path):
    r = rng(3)
    nodes, inits, prev = [], {}, "x"
    for i in range(100):  # 100 Gemm + 99 Relu + ... = 199 nodes
        inits[f"W{i}"] = r.normal(0, 0.25, (16, 16)).astype(np.float32)
        inits[f"B{i}"] = r.normal(0, 0.05, 16).astype(np.float32)
        nodes.append(h.make_node("Gemm", [prev, f"W{i}", f"B{i}"], [f"g{i}"], name=f"L{i}"))
        if i < 99:
            nodes.append(h.make_node("Relu", [f"g{i}"], [f"r{i}"], name=f"relu{i}"))
            prev = f"r{i}"
    model = make_model(nodes, [("x", ["N", 16])], [("g99", ["N", 16])], inits)
    assert len(model.graph.node) == 199
    src, npz, page = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "r.html"
    onnx.save(model, str(src))
    np.savez(npz, x=r.normal(0, 1, (64, 16)).astype(np.float32))
    assert main(["debug", str(src), "--data", str(npz), "-o", str(tmp_path / "f.toml"),
                 "--report", str(page)]) == 0  # fmt: skip
    size = page.stat().st_size
    assert 10_000 < size < 2 * 1024 * 1024, size


@pytest.mark.slow
def test_the_report_renders_in_chromium_and_its_filter_works(report):
    needs_debian("chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"], headless=True
        )
        context = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(report.as_uri())
        page.wait_for_load_state("load")
        headings = page.locator("h2").all_inner_texts()
        for wanted in (
            "Summary",
            "Sensitivity ranking",
            "Per-layer SQNR",
            "Ranges of the worst tensors",
            "Cross-runtime check",
            "Decisions",
        ):
            assert wanted in headings, headings
        assert page.locator("svg").count() >= 3
        rows = page.locator("#decisions-table tbody tr")
        total = rows.count()
        assert total == 10  # every node of the digits CNN
        assert page.locator("#shown").inner_text() == f"{total} of {total} nodes"
        # the text filter: only the rows that mention it stay visible
        page.fill("#filter", "conv")
        visible = [r for r in rows.all() if r.is_visible()]
        assert 0 < len(visible) < total
        assert all("conv" in r.inner_text().lower() for r in visible)
        assert page.locator("#shown").inner_text() == f"{len(visible)} of {total} nodes"
        # the selector: int8 nodes only, then float nodes only (none: all ten run in int8)
        page.fill("#filter", "")
        page.select_option("#which", "int8")
        int8 = [r for r in rows.all() if r.is_visible()]
        assert len(int8) == page.locator("#decisions-table tbody tr.int8").count() > 0
        assert all(r.get_attribute("class") == "int8" for r in int8)
        page.select_option("#which", "float")
        floats = [r for r in rows.all() if r.is_visible()]
        assert len(floats) == total - len(int8)
        assert page.locator("#shown").inner_text() == f"{len(floats)} of {total} nodes"
        page.select_option("#which", "")
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        browser.close()
    assert not errors, errors
    assert (ARTIFACTS / "report.png").stat().st_size > 10_000
    assert os.access(ARTIFACTS / "report.png", os.R_OK)


def test_quantize_and_compare_write_html_reports(tmp_path):
    from test_fallback import _fragile_mlp

    model, data = _fragile_mlp()
    src, npz = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(model, str(src))
    np.savez(npz, **data)
    q, page = tmp_path / "q.onnx", tmp_path / "q.html"
    assert main(["quantize", str(src), "--data", str(npz), "--batch-size", "16", "--max-drop",
                 "0.5", "-o", str(q), "--report", str(page), "--quiet"]) == 0  # fmt: skip
    text = page.read_text()
    for wanted in ("Decisions", "Per-layer SQNR", "Accuracy and latency of the fallback"):
        assert wanted in text
    assert text.count("<svg") >= 2 and "<tr class='int8'>" in text
    # a JSON report is still JSON
    assert main(["quantize", str(src), "--data", str(npz), "-o", str(q), "--report",
                 str(tmp_path / "r.json"), "--quiet"]) == 0  # fmt: skip
    assert (tmp_path / "r.json").read_text().lstrip().startswith("{")
    cmp = tmp_path / "c.html"
    assert main(["compare", str(src), str(q), "--data", str(npz), "--report", str(cmp)]) == 0
    text = cmp.read_text()
    assert "Ranges of the worst tensors" in text and "Per-layer SQNR" in text
