"""The GitHub Actions workflows: actionlint finds nothing, and release.yml builds exactly the shipped recipes,
only on a store miss."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
RELEASE = WORKFLOWS / "release.yml"
ON_MISS = "steps.check.outputs.hit != 'true'"


def find_actionlint() -> str | None:
    """actionlint on PATH, else in this interpreter's scripts directory (a venv that was not activated)."""
    exe = "actionlint.exe" if os.name == "nt" else "actionlint"
    found = shutil.which("actionlint")
    if found:
        return found
    for d in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        if d and (Path(d) / exe).is_file():
            return str(Path(d) / exe)
    return None


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), f"{path.name} is not a YAML mapping"
    if True in data and "on" not in data:  # YAML 1.1 reads the key `on` as a boolean
        data["on"] = data.pop(True)
    return data


def condition(step: dict[str, Any]) -> str:
    cond = str(step.get("if", "")).strip()
    m = re.fullmatch(r"\$\{\{(.*)\}\}", cond, re.S)
    return " ".join((m.group(1) if m else cond).split())


def release_steps() -> list[dict[str, Any]]:
    job = load(RELEASE)["jobs"]["bundle"]
    return job["steps"]


def step_running(steps: list[dict[str, Any]], needle: str) -> dict[str, Any]:
    found = [s for s in steps if needle in str(s.get("run", ""))]
    assert len(found) == 1, f"expected one step of release.yml to run `{needle}`, found {len(found)}"
    return found[0]


# ---------------------------------------------------------------------------------------- actionlint


def test_actionlint_finds_nothing() -> None:
    actionlint = find_actionlint()
    if actionlint is None:
        pytest.fail("actionlint is not installed: install the test extra (python3 -m pip install -e '.[test]'), "
                    "which provides the actionlint binary", pytrace=False)
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert files, f"no workflows in {WORKFLOWS}"
    proc = subprocess.run([actionlint, "-no-color", *map(str, files)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and out == "", f"actionlint exited {proc.returncode}:\n{out}"


def test_the_replaced_workflows_are_gone() -> None:
    assert not (WORKFLOWS / "tests.yml").exists() and not (WORKFLOWS / "bundles.yml").exists()  # now ci.yml, release.yml


# ------------------------------------------------------------------------------------------- release.yml


def test_release_triggers_and_permissions() -> None:
    wf = load(RELEASE)
    assert wf["on"]["release"]["types"] == ["published"]
    assert "workflow_dispatch" in wf["on"]
    assert wf["permissions"] == {"contents": "write", "id-token": "write", "attestations": "write"}


def test_release_matrix_is_exactly_the_shipped_recipes() -> None:
    job = load(RELEASE)["jobs"]["bundle"]
    include = job["strategy"]["matrix"]["include"]
    names = [row["recipe"] for row in include]
    shipped = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert shipped, "no recipes/*.yaml"
    assert sorted(names) == shipped and len(names) == len(set(names))
    for row in include:
        recipe = yaml.safe_load((ROOT / "recipes" / f"{row['recipe']}.yaml").read_text(encoding="utf-8"))
        assert recipe["name"] == row["recipe"]
        native_windows = recipe["platform"].startswith("windows-") and recipe["toolchain"]["compiler"] != "mingw"
        runner = "windows-2022" if native_windows else "ubuntu-22.04"  # mingw cross-builds on Linux
        assert row["os"] == runner, f"{row['recipe']} ({recipe['platform']}) must run on {runner}"
    assert job["runs-on"] == "${{ matrix.os }}"
    assert job["env"]["RECIPE"] == "recipes/${{ matrix.recipe }}.yaml"
    assert job["env"]["STORE"] == "github:${{ github.repository }}"


def test_release_checks_then_builds_only_on_a_miss() -> None:
    steps = release_steps()
    check = step_running(steps, "llamabundle check")
    assert check.get("id") == "check"
    assert "if" not in check and "continue-on-error" not in check
    assert '--store "$STORE"' in check["run"]
    # a miss (exit 1) goes on; every other failure still fails the job
    assert "|| rc=$?" in check["run"] and "|| true" not in check["run"]

    build = step_running(steps, "llamabundle build")
    assert condition(build) == ON_MISS
    assert steps.index(check) < steps.index(build)
    assert '--store "$STORE" --publish --json' in build["run"]
    assert build["env"]["GITHUB_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}"
    assert build.get("id") == "build" and 'echo "zip=' in build["run"]

    attest = next(s for s in steps if str(s.get("uses", "")).startswith("actions/attest-build-provenance@"))
    assert attest["uses"] == "actions/attest-build-provenance@v2"
    assert condition(attest) == ON_MISS
    assert attest["with"]["subject-path"] == "${{ steps.build.outputs.zip }}"
    assert steps.index(build) < steps.index(attest)

    cache = next(s for s in steps if str(s.get("uses", "")).startswith("actions/cache@"))
    assert condition(cache) == ON_MISS and steps.index(cache) < steps.index(build)
    assert "matrix.recipe" in cache["with"]["key"]
    # every step after the check that costs anything is skipped on a hit
    for s in steps[steps.index(check) + 1:]:
        assert condition(s) == ON_MISS, f"step {s.get('name') or s.get('uses')} also runs on a hit"


def test_ci_runs_the_ci_script() -> None:
    wf = load(WORKFLOWS / "ci.yml")
    assert set(wf["on"]) == {"push", "pull_request"}
    job = wf["jobs"]["tests"]
    assert job["runs-on"] == "ubuntu-22.04" and job["timeout-minutes"] == 90
    assert job["steps"][-1]["run"] == "bash .ci/run"
    # no cache of llamabundle's trees: .ci/run starts from empty caches
    assert not [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/cache@")]
