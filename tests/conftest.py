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


#: the most memory one test process (or a child it waited for) may hold, per tier (MiB)
MEMORY_BOUND_MIB = {"fast": 2048, "slow": 3072}


def _peak_mib() -> int:
    """This process's peak RSS since the last reset (VmHWM), in MiB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _reset_peak() -> None:
    """Start this process's peak RSS afresh (Linux: writing 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


@pytest.fixture(autouse=True)
def _memory_bound(request: pytest.FixtureRequest):
    """Fail the test whose process, or a child process it ran, went over the tier's bound.

    The children's figure is the largest of any child this process has waited for, so a child
    over the bound fails the test that ran it (and that one only).
    """
    import resource

    tier = "slow" if request.config.getoption("--slow") else "fast"
    bound = int(os.environ.get("ONNXQ_TEST_MEMORY_MIB", MEMORY_BOUND_MIB[tier]))
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    _reset_peak()
    yield
    own = _peak_mib()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    child = children if children > children_before else 0
    if max(own, child) > bound:
        pytest.fail(
            f"peak RSS {own} MiB in the test process, {child} MiB in a child: over the "
            f"{bound} MiB bound of the {tier} tier (ONNXQ_TEST_MEMORY_MIB changes it)"
        )
