"""The two tiers: ``pytest`` runs the fast one; ``pytest --slow`` runs the slow tests too.

The slow tier holds what needs real models or minutes: the zoo, the onnx corpus at full size,
property tests at their full example count, Ray, the browser, the > 2 GB model, the
before/after hashes. A test marks itself ``@pytest.mark.slow``; property tests size their
example counts with ``helpers.examples(fast, slow)``.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="run the slow tier too (real models, full property counts, Ray, the browser)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--slow"):
        os.environ["ONNXQ_TEST_TIER"] = "slow"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow tier: run with pytest --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
