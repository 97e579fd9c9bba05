"""The test tiers, and how pytest-xdist shares them among its workers (pyproject: `-n auto --dist loadgroup`).
unit (tests/unit) is hermetic and spread over every worker; `lint` (ruff, mypy, actionlint, zizmor over the
tree) runs on one worker; `race` (tests that kill, interrupt or race real processes) run one at a time on one
worker, so that they never race each other for the CPU, and so do the fault matrix's (`faults`); `e2e` (tests/e2e: real builds) keeps the tests of
the one shared CPU build (`first_build`) on one worker and each other e2e module on one worker, so that each
build is made once (AFTER_SHARED: the modules that build from the shared build's compiler cache, on either worker),
and the workers take the groups in the order `rank` gives. `-m "not e2e"` runs the unit tier; `-n 0` runs serially."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

E2E = Path(__file__).resolve().parent / "e2e"
SHARED_BUILD = "first_build"  # tests/e2e/conftest.py: the session's one real build of the CPU recipe (3 variants)


# e2e modules whose builds take their compiles from the compiler cache the shared build filled, each a group of its own
# (not the shared build's): whichever worker is free takes it. On the other worker, its `first_build` waits for the
# shared build (the key's build lock: one process makes a key with a cache), then finds the tree built (a build with
# nothing to compile), so these builds still start after the cache is full.
AFTER_SHARED = ("test_reproducible", "test_rpc_bundle", "test_vulkan_bundle")  # a worker takes the next group when it
# has 2 tests left: the reproducibility check (2 tests, CI's longest build after the shared one) and the RPC bundle
# go to one worker, so that the Vulkan build goes to the other


def group_of(item: pytest.Item) -> str | None:
    """The xdist group an item runs in (None: any worker)."""
    if item.get_closest_marker("e2e"):
        fixtures = getattr(item, "fixturenames", ())
        own = item.path.stem in AFTER_SHARED or SHARED_BUILD not in fixtures
        return f"e2e-{item.path.stem}" if own else "e2e-cpu-build"
    for mark in ("lint", "race", "faults"):
        if item.get_closest_marker(mark):
            return mark
    return None


# The order in which the workers take the groups (pyproject: --no-loadscope-reorder, of pytest-xdist 3.8, keeps it):
# the shared CPU build first, for it and the tests after it on its worker are the longest chain; the `race` and
# `faults` tiers on the other worker while that one fetches the source and builds the web UI (npm: minutes of one
# core), before any compiler runs beside them; then the builds that share no compile with the shared one (another
# compiler); then those that compile only what is their own from the shared build's compiler cache (AFTER_SHARED:
# on either worker, once the shared build is done), the other e2e modules, `lint`, and last the unit tests, in small
# pieces that fill both workers to the end.
FIRST_GROUPS = ("e2e-cpu-build", "race", "faults", "e2e-test_aarch64_bundle", "e2e-test_windows_mingw",
                *(f"e2e-{m}" for m in AFTER_SHARED))


def rank(group: str | None) -> int:
    if group in FIRST_GROUPS:
        return FIRST_GROUPS.index(group)
    if group is None:
        return len(FIRST_GROUPS) + 2
    return len(FIRST_GROUPS) + (0 if group.startswith("e2e-") else 1)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    groups = {}
    for item in items:
        if item.path.parent == E2E:
            item.add_marker(pytest.mark.e2e)
        group = groups[item] = group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: rank(groups[item]))  # stable: within a rank, the collection's order


SLOW_PHASE = float(os.environ.get("LLAMABUNDLE_TEST_SLOW_PHASE", "60"))  # seconds
_STARTED = time.monotonic()
_CPU_KEY = pytest.StashKey[float]()  # CPU seconds when the phase began
_CPU_BY_GROUP: dict[str, float] = {}


def _cpu_seconds() -> float:
    """User and system seconds of this process and of the children it has waited for (a build's compilers too)."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Each phase's report carries the CPU seconds the phase took (user_properties: cpu_seconds), counted where it
    ran, so that the end of the run can say which groups the cores went to (a wall time on a busy machine cannot)."""
    report = yield
    now = _cpu_seconds()
    if (before := item.stash.get(_CPU_KEY, None)) is not None:
        report.user_properties += [("cpu_seconds", round(now - before, 2)), ("test_group", group_of(item) or "unit")]
    item.stash[_CPU_KEY] = now  # the next phase starts about here
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_KEY] = _cpu_seconds()


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A test phase that took SLOW_PHASE seconds or more (a fixture's setup: a real build) is said when it ends,
    with the time since the session started, the worker and the CPU seconds it took: `--durations` prints only at
    the end, which a run stopped by CI's time limit never reaches. Said by xdist's controller (or the one process of
    -n 0), which also adds up each group's CPU seconds for the end of the run."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    said = dict(report.user_properties)
    cpu, group = said.get("cpu_seconds", 0.0), str(said.get("test_group", "unit"))
    assert isinstance(cpu, float | int)
    _CPU_BY_GROUP[group] = _CPU_BY_GROUP.get(group, 0.0) + cpu
    if report.duration < SLOW_PHASE:
        return
    worker = getattr(getattr(report, "node", None), "gateway", None)
    where = f" {worker.id}" if worker is not None else ""
    sys.stderr.write(f"\n[{time.monotonic() - _STARTED:5.0f} s{where}] {report.when} {report.outcome} in "
                     f"{report.duration:.0f} s ({cpu:.0f} s of CPU): {report.nodeid}\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """CPU seconds by test group (builds count their compilers): where CI's two cores went."""
    if os.environ.get("PYTEST_XDIST_WORKER") or sum(_CPU_BY_GROUP.values()) < SLOW_PHASE:
        return
    terminalreporter.write_sep("=", f"CPU seconds by group ({sum(_CPU_BY_GROUP.values()):.0f} in all)")
    for group, cpu in sorted(_CPU_BY_GROUP.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{cpu:9.0f}  {group}")


def pytest_configure(config: pytest.Config) -> None:
    """pytest 9.2 keeps node ids where pytest-xdist 3.8 cannot add a test's group to them (pytest-xdist#1386):
    the groups would be spread over the workers in silence (each building the shared build again)."""
    from importlib.metadata import version

    if (config.getoption("dist", "no") == "loadgroup" and config.getoption("numprocesses", None)
            and pytest.version_tuple[:2] >= (9, 2)
            and tuple(int(x) for x in version("pytest-xdist").split(".")[:2]) <= (3, 8)):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {version('pytest-xdist')} cannot "
                                "keep the test groups together (pytest-xdist#1386): install the test extra's pins "
                                "(pip install -e '.[test]'), or run serially with -n 0")


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a worker: every grouped test carries its group in its node id, which is how xdist's scheduler sees
    it. A pytest whose node ids xdist cannot extend (9.2, pytest-xdist#1386) would spread the groups over the
    workers in silence (each building the shared build again): stop instead."""
    if not (hasattr(session.config, "workerinput") and session.config.getvalue("loadgroup")):
        return
    lost = [item.nodeid for item in session.items
            if (mark := item.get_closest_marker("xdist_group")) and not item.nodeid.endswith(f"@{mark.args[0]}")]
    if lost:
        raise pytest.UsageError(f"pytest-xdist could not group {len(lost)} tests (e.g. {lost[0]}): this pytest and "
                                "pytest-xdist do not work together for --dist loadgroup (pytest-xdist#1386); "
                                "install the test extra's pins (pip install -e '.[test]')")

