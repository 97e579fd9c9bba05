"""The fault matrix in the test suite (marker `faults`): every case ends with its documented exit code, no
traceback, no bytes left behind and no process left running (`python -m tests.faults` prints the table)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.cases import CASES, ROOT, Case, run_case

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("c", CASES, ids=[f"{c.group}: {c.id}" for c in CASES])
def test_the_fault_ends_as_documented(c: Case, tmp_path: Path) -> None:
    o = run_case(c, tmp_path / "case", ROOT)
    if o.code is None:
        pytest.skip(o.skipped)
    assert (o.code, o.traceback) == (c.expect, False), o.text[-3000:]
    assert o.left == [], o.left
    assert o.procs == [], f"still running: {o.procs}"
