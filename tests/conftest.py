"""The test tiers, and how pytest-xdist shares them among its workers (pyproject: `-n auto --dist loadgroup`).
unit (tests/unit) is hermetic and spread over every worker; `lint` (ruff, mypy, actionlint, zizmor over the
tree) runs on one worker; `race` (tests that kill, interrupt or race real processes) run one at a time on one
worker, so that they never race each other for the CPU; `e2e` (tests/e2e: real builds) keeps the tests of
the one shared CPU build (`first_build`) on one worker and each other e2e module on one worker, so that each
build is made once. `-m "not e2e"` runs the unit tier; `-n 0` runs serially."""

from __future__ import annotations

from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent / "e2e"
SHARED_BUILD = "first_build"  # tests/e2e/conftest.py: the session's one real build of the CPU recipe


def group_of(item: pytest.Item) -> str | None:
    """The xdist group an item runs in (None: any worker)."""
    if item.get_closest_marker("e2e"):
        fixtures = getattr(item, "fixturenames", ())
        return "e2e-cpu-build" if SHARED_BUILD in fixtures else f"e2e-{item.path.stem}"
    for mark in ("lint", "race"):
        if item.get_closest_marker(mark):
            return mark
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == E2E:
            item.add_marker(pytest.mark.e2e)
        group = group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
