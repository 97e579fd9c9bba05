"""verify_unpacked at the load level: the bundle's programs run (the load check, waiting for a GPU's driver) while
the static checks read its files, and the report still reads in the levels' order with the static check's failure
the one raised; VerifyReport.merge carries every field of another check's report."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest

from llamabundle import verify
from llamabundle.bundle.manifest import ContentCheck, parse
from llamabundle.errors import VerifyError
from tests import bundles as tb


def _bundle(tmp: Path) -> tuple[Path, Any]:
    root = tmp / "bundle"
    m = tb.write_bundle(root, {"LICENSE": b"MIT\n"}, {"LICENSE": "license"})
    return root, parse(m)


def test_the_load_check_runs_while_the_static_check_reads_and_the_report_keeps_the_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, m = _bundle(tmp_path)
    load_started = threading.Event()
    seen: list[str] = []

    def static(root: Path, manifest: object) -> list[str]:
        seen.append(f"load started before static ended: {load_started.wait(10)}")
        return []

    def load(root: Path, manifest: object, report: verify.VerifyReport, **_: object) -> None:
        load_started.set()
        report.levels["load"] = "passed"
        report.backends_loaded["CPU"] = "libggml-cpu-x64.so"

    monkeypatch.setattr(verify, "check_static", static)
    monkeypatch.setattr(verify, "check_load", load)
    report = verify.verify_unpacked(root, m, ContentCheck(files=1, bytes=4), level=verify.Level.LOAD, label="b.zip")
    assert seen == ["load started before static ended: True"]
    assert list(report.levels) == ["manifest", "static", "load"]
    assert report.backends_loaded == {"CPU": "libggml-cpu-x64.so"}
    # at the static level nothing runs
    load_started.clear()
    seen.clear()
    monkeypatch.setattr(verify, "check_static", lambda root, manifest: seen.append("static") or [])
    report = verify.verify_unpacked(root, m, ContentCheck(files=1, bytes=4), level=verify.Level.STATIC, label="b.zip")
    assert seen == ["static"] and not load_started.is_set() and list(report.levels) == ["manifest", "static"]


def test_a_static_failure_is_the_one_raised_and_waits_for_the_load_check(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    root, m = _bundle(tmp_path)
    load_done = threading.Event()

    def static(root: Path, manifest: object) -> list[str]:
        raise VerifyError("libllama.so imports libfoo.so.1, which is neither in the bundle nor on every machine")

    def load(root: Path, manifest: object, report: verify.VerifyReport, **_: object) -> None:
        threading.Event().wait(0.3)
        load_done.set()
        raise VerifyError("llama-server --list-devices exited with 1")

    monkeypatch.setattr(verify, "check_static", static)
    monkeypatch.setattr(verify, "check_load", load)
    with pytest.raises(VerifyError, match="imports libfoo.so.1"):
        verify.verify_unpacked(root, m, ContentCheck(files=1, bytes=4), level=verify.Level.LOAD, label="b.zip")
    assert load_done.is_set(), "nothing the load check started is left running"
    monkeypatch.setattr(verify, "check_static", lambda root, manifest: [])
    with pytest.raises(VerifyError, match="exited with 1"):
        verify.verify_unpacked(root, m, ContentCheck(files=1, bytes=4), level=verify.Level.LOAD, label="b.zip")


def test_merge_carries_every_field() -> None:
    full = verify.VerifyReport(path="p", key="k", platform="linux-x86_64", files=1, bytes=2,
                               levels={"load": "passed"}, backends_loaded={"CPU": "x"}, devices=["CUDA0"],
                               compute_caps={"CUDA0": "9.0"}, ops=[{"device": "CUDA0"}], load_env={"PATH": "/b"},
                               load_source="llamabundle-probe", modules={"m": "loaded"}, device_ids={"CUDA0": "0000"})
    empty = verify.VerifyReport(path="p", key="k", platform="linux-x86_64", files=1, bytes=2)
    empty.merge(full)
    assert empty == full
    defaults = verify.VerifyReport(path="p", key="k", platform="linux-x86_64", files=1, bytes=2)
    identity = {"path", "key", "platform", "files", "bytes"}
    assert all(getattr(full, f.name) != getattr(defaults, f.name)
               for f in dataclasses.fields(verify.VerifyReport) if f.name not in identity), "set every field above"
