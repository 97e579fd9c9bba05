"""The habits that keep the rooms tidy: mypy (strict, configured in pyproject.toml) finds no error in the
package, and ruff none in the package, the tests and the benchmarks. Both are test dependencies, so a
missing one fails here rather than passing unseen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lint

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)


def test_mypy_strict_finds_nothing() -> None:
    res = run("mypy", "--no-incremental", "--cache-dir", "/dev/null")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "Success: no issues found" in res.stdout


def test_ruff_finds_nothing() -> None:
    res = run("ruff", "check", "--no-cache", "llamabundle", "tests", "bench")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
