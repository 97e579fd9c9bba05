"""`llamabundle bundle` run for real on a build directory whose binaries gcc made in a moment (tests/buildtrees.py):
collect, bundle.json, pack and verify (static and load, through the bundle's own llamabundle-probe). Its --json
output is validated against its committed schema, as every other command's is (tests/unit/test_cli_json.py;
issue 32: `ops_tool` at the top and `verify.compute_caps` were missing from it); the zip's entry dates and
bundle.json's built_at follow the one rule of docs/bundle-format.md, with and without SOURCE_DATE_EPOCH; a
tool whose version is not known is null in bundle.json's toolchain, never ""."""

from __future__ import annotations

import datetime as dt
import json
import time
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llamabundle import backends
from llamabundle.bundle import manifest as manifest_mod
from tests.buildtrees import GCC, LINUX_CPU, cpu_build_tree
from tests.clicontract import valid
from tests.clirun import run

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc makes the build directory's ELF files")


def bundle_json(capsys: pytest.CaptureFixture[str], tmp: Path) -> tuple[dict[str, Any], Path, str]:
    """`llamabundle bundle linux-x86_64-cpu BUILD --out X.zip --json`: its output, valid against its schema, the
    zip and stderr."""
    build = cpu_build_tree(tmp)
    out = tmp / "x.zip"
    code, stdout, err = run(capsys, "bundle", LINUX_CPU, build, "--out", out, "--json")
    assert code == 0, err
    return valid("bundle", json.loads(stdout)), out, err


def entry_dates(zip_path: Path) -> set[tuple[int, ...]]:
    with zipfile.ZipFile(zip_path) as z:
        return {i.date_time for i in z.infolist()}


def manifest_of(zip_path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(zip_path) as z:
        got: dict[str, Any] = json.loads(z.read("bundle.json"))
    return got


def test_bundle_json_is_valid_against_its_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    got, out, _ = bundle_json(capsys, tmp_path)
    assert got["ok"] is True and got["zip"] == str(out) and got["out"] is None and got["ops_tool"] is None
    assert got["verify"]["levels"] == {"manifest": "passed", "static": "passed", "load": "passed"}
    assert got["verify"]["load_source"] == "llamabundle-probe" and got["verify"]["compute_caps"] == {}
    m = manifest_of(out)
    jsonschema.Draft202012Validator(backends.bundle_schema()).validate(m)  # and the bundle.json it made
    manifest_mod.parse(m)


def test_an_unknown_tool_version_is_null_not_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`bundle` reads the build's cmake and compiler from CMake's records; which ninja built it is not recorded."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    _, out, _ = bundle_json(capsys, tmp_path)
    toolchain = manifest_of(out)["toolchain"]
    assert toolchain["ninja"] is None and toolchain["cmake"] == "3.25.1" and toolchain["compiler"] == "GNU 12.2.0"
    assert "" not in toolchain.values()


def test_with_source_date_epoch_the_entries_and_built_at_are_that_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000001")  # an odd second: a zip holds even ones
    _, out, err = bundle_json(capsys, tmp_path)
    assert manifest_of(out)["built_at"] == "2023-11-14T22:13:21Z" and "SOURCE_DATE_EPOCH" not in err
    assert entry_dates(out) == {(2023, 11, 14, 22, 13, 20)}  # the same time, in the zip's two-second steps
    again = tmp_path / "again.zip"  # the same build bundled again: the same bytes
    code, _, err = run(capsys, "bundle", LINUX_CPU, tmp_path / "build", "--out", again)
    assert code == 0 and again.read_bytes() == out.read_bytes(), err


def test_without_source_date_epoch_the_entries_and_built_at_are_the_time_of_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    before = int(time.time()) - 2
    _, out, err = bundle_json(capsys, tmp_path)
    after = int(time.time())
    built_at = manifest_of(out)["built_at"]
    when = dt.datetime.fromisoformat(built_at.replace("Z", "+00:00"))
    assert before <= when.timestamp() <= after, built_at
    assert entry_dates(out) == {(when.year, when.month, when.day, when.hour, when.minute, when.second)}  # not 1980
    assert "SOURCE_DATE_EPOCH is not set" in err  # and it says so
