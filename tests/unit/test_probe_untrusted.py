"""External tools are not believed unchecked, and do not outlive their timeout (issue 12, item 7).

nvidia-smi output and the kernel driver's version file are validated before the probe uses them (a driver
version is a version, memory sizes are whole MiB, a name is there), with the scan saying what it could not
read. Real fake `nvidia-smi` and `llama-server` programs that start a child and hang are stopped at their
timeout with that child: no process they started is left running afterwards."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import pytest

from llamabundle.gpus import is_driver_version, parse_nvidia_smi, parse_proc_version, read_nvidia_smi
from llamabundle.platforms import load as platform_load
from llamabundle.reasons import Reason
from llamabundle.runtime.doctor import diagnose
from llamabundle.scratch import start_time
from tests import probing
from tests.probing import H200, OLD, SLEEP, fake_smi, installed, make_stage, run_probe


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": str(tmp_path / "emptybin"), "HOME": str(tmp_path)}  # nvidia-smi is found only where given


# ------------------------------------------------------------------------------------ nvidia-smi's lines

BAD_LINES = {
    "GPU, 1.2.3.4.5.6.7.8.9, -5, NaN": "driver version '1.2.3.4.5.6.7.8.9' is not a version like 580.65.06",
    "NVIDIA H200, 580, 143771, 143155": "driver version '580' is not a version like 580.65.06",
    "NVIDIA H200, v580.95.05, 143771, 143155": "driver version 'v580.95.05' is not a version like 580.65.06",
    "NVIDIA H200, 580.95.05, -5, 143155": "memory.total '-5' is not a whole number of MiB",
    "NVIDIA H200, 580.95.05, 143771, NaN": "memory.free 'NaN' is not a whole number of MiB",
    "NVIDIA H200, 580.95.05, 1.4e5, 143155": "memory.total '1.4e5' is not a whole number of MiB",
    "NVIDIA H200, 580.95.05, 143771.5, 143155": "memory.total '143771.5' is not a whole number of MiB",
    ", 580.95.05, 143771, 143155": "no GPU name",
    "NVIDIA H200, 580.95.05": "not 4 comma-separated fields",
    "No devices were found": "not 4 comma-separated fields",
}


@pytest.mark.parametrize("line", list(BAD_LINES))
def test_a_line_that_is_not_a_gpu_is_refused_with_the_reason(tmp_path: Path, env: dict[str, str], line: str) -> None:
    assert parse_nvidia_smi(line + "\n") == []
    gpus, bad = read_nvidia_smi(line + "\n")
    assert gpus == [] and bad == [f"{line!r}: {BAD_LINES[line]}"]
    r = run_probe(tmp_path, env, fake_smi(tmp_path / "bin", line))
    assert r.reason is Reason.GPU_MISSING and r.facts["gpus"] == [] and r.facts["driver"] is None
    assert r.facts["detail"] == f"nvidia-smi listed no GPU: {line!r}: {BAD_LINES[line]}"
    assert r.facts["nvidia_smi_error"] == r.facts["detail"]


def test_real_gpu_lines_are_read_as_they_are() -> None:
    text = ("NVIDIA H200, 580.159.04, 143771, 143156\n"
            "NVIDIA GeForce RTX 4090 Laptop GPU, 572.61, 16376, 15868\n"  # Windows: two parts
            "NVIDIA A100-SXM4-80GB, 535.216.01, [N/A], [Insufficient Permissions]\n"  # MIG / restricted
            "NVIDIA RTX A6000, Founders, 550.54.14, 49140, 0\n")  # a comma in the name
    gpus, bad = read_nvidia_smi(text)
    assert bad == []
    assert [(g.name, g.driver, g.memory_total_mib, g.memory_free_mib) for g in gpus] == [
        ("NVIDIA H200", "580.159.04", 143771, 143156), ("NVIDIA GeForce RTX 4090 Laptop GPU", "572.61", 16376, 15868),
        ("NVIDIA A100-SXM4-80GB", "535.216.01", None, None), ("NVIDIA RTX A6000, Founders", "550.54.14", 49140, 0)]


def test_good_lines_are_kept_and_the_bad_ones_named(tmp_path: Path, env: dict[str, str]) -> None:
    r = run_probe(tmp_path, env, fake_smi(tmp_path / "bin", "GPU, 1.2.3.4.5.6.7.8.9, -5, NaN", H200))
    assert r.reason is Reason.BINARY_MISSING_NVIDIA_DETECTED
    assert [g["name"] for g in r.facts["gpus"]] == ["NVIDIA H200"] and r.facts["driver"] == "580.95.05"
    assert r.facts["nvidia_smi_error"] == ("nvidia-smi printed 1 line(s) that are not GPUs, left out: "
                                           "'GPU, 1.2.3.4.5.6.7.8.9, -5, NaN': driver version '1.2.3.4.5.6.7.8.9' is "
                                           "not a version like 580.65.06")


@pytest.mark.parametrize(("text", "ok"), [("580.65.06", True), ("572.61", True), ("580.159.04", True), ("1.2.3.4", True),
                                          ("580", False), ("1.2.3.4.5", False), ("580.95.05 ", False), ("-5.1", False),
                                          ("NaN", False), ("", False), ("5８0.1", False), ("580..1", False)])
def test_what_a_driver_version_looks_like(text: str, ok: bool) -> None:
    assert is_driver_version(text) is ok


# ------------------------------------------------------------------------------------ the kernel driver's file


def test_the_proc_version_file_names_a_driver_version_or_none() -> None:
    ok = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 2025\n"
    assert parse_proc_version(ok) == "570.124.06"
    assert parse_proc_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  1.2.3.4.5.6.7.8.9  Release Build\n"
                              "GCC version:  gcc version 12.2.0\n") is None  # not the GCC line's version either
    assert parse_proc_version("NVRM version: NVIDIA UNIX Kernel Module  580  Release\n") is None
    assert parse_proc_version("GCC version:  gcc version 12.2.0\n") is None


def test_a_proc_file_without_a_version_is_no_driver_and_says_so(tmp_path: Path, env: dict[str, str]) -> None:
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  1.2.3.4.5.6.7.8.9  Release Build\n")
    r = run_probe(tmp_path, env, None, proc_version=proc)
    assert r.reason is Reason.GPU_MISSING and r.facts["proc_driver"] is None
    assert r.facts["detail"] == (f"nvidia-smi is not on PATH; {proc} names no driver version ('NVRM version: NVIDIA UNIX "
                                 "Open Kernel Module for x86_64  1.2.3.4.5.6.7.8.9  Release Build')")
    proc.write_bytes(b"\xff\xfe garbage \x00\x01")
    assert run_probe(tmp_path, env, None, proc_version=proc).reason is Reason.GPU_MISSING


# ------------------------------------------------------------------------------------ the bundle's floor


def test_a_bundle_floor_that_is_not_a_version_is_refused_not_compared(tmp_path: Path, env: dict[str, str]) -> None:
    m = installed(tmp_path, floor="latest")
    r = run_probe(tmp_path, env, fake_smi(tmp_path / "bin", H200))
    assert r.reason is Reason.BUNDLE_INVALID and r.facts["bundle_key"] == m.key
    assert r.sentence == ("the bundle was refused: its bundle.json records the driver floor 'latest', which is not a "
                          "driver version")
    d = diagnose(root=tmp_path / "data", env=env, cache_dir=tmp_path / "cache", nvidia_smi=str(fake_smi(tmp_path / "b", OLD)),
                 proc_version=tmp_path / "none")
    assert d.to_json()["bundles"][0]["driver_ok"] is None
    row = dict(d.rows())[f"bundle {m.name}"]
    assert "driver floor latest (not a driver version: not compared)" in row


# ------------------------------------------------------------------------------------ children end with them


def gone(pid: int, within: float = 10.0) -> bool:
    """The process no longer runs (a zombie waiting for init counts as gone)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if start_time(pid) is None:
            return True
        time.sleep(0.05)
    return False


def _child_pid(pidfile: Path) -> int:
    text = pidfile.read_text().strip()
    assert text.isdigit(), text
    return int(text)


QUIET_CHILD = "{sleep} 300 </dev/null >/dev/null 2>&1 &\necho $! > {pidfile}\n"  # only its process group ends it
HANGS = {  # how the fake starts its child, then hangs
    "waits for its child": QUIET_CHILD + "wait\n",
    "exec'd into a sleep": QUIET_CHILD + "exec {sleep} 120\n",
    "child ignores SIGTERM": "trap '' TERM\n" + QUIET_CHILD + "wait\n",
    "child holds the output": "{sleep} 300 &\necho $! > {pidfile}\nwait\n",
    "printed a GPU, exited, child holds the output": "{sleep} 300 &\necho $! > {pidfile}\necho '" + H200 + "'\nexit 0\n",
}


@pytest.mark.parametrize("how", list(HANGS))
def test_a_hanging_nvidia_smi_is_stopped_with_its_child(tmp_path: Path, env: dict[str, str], how: str) -> None:
    pidfile = tmp_path / "child.pid"
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\n" + HANGS[how].format(sleep=SLEEP, pidfile=shlex.quote(str(pidfile))))
    smi.chmod(0o755)
    t0 = time.monotonic()
    r = run_probe(tmp_path, env, smi, smi_timeout=1.0)
    took = time.monotonic() - t0
    child = _child_pid(pidfile)
    assert gone(child), f"nvidia-smi's child {child} still runs after the probe returned"
    if how.startswith("printed a GPU"):  # it answered and exited: the answer counts (proc.ORPHAN_GRACE later)
        assert r.reason is Reason.BINARY_MISSING_NVIDIA_DETECTED, r.facts
    else:
        assert r.reason is Reason.GPU_MISSING
        assert r.facts["detail"] == "nvidia-smi did not answer in 1s (it was stopped, with what it started)"
    assert took < 30  # the timeout, then at most the TERM -> KILL grace


def test_an_nvidia_smi_that_exits_leaves_no_child_either(tmp_path: Path, env: dict[str, str]) -> None:
    pidfile = tmp_path / "child.pid"
    smi = fake_smi(tmp_path / "bin", H200)
    body = smi.read_text().replace("#!/bin/sh\n", f"#!/bin/sh\n{SLEEP} 300 >/dev/null 2>&1 &\necho $! > {pidfile}\n")
    smi.write_text(body)
    r = run_probe(tmp_path, env, smi)
    assert r.reason is Reason.BINARY_MISSING_NVIDIA_DETECTED
    assert gone(_child_pid(pidfile))


@pytest.mark.parametrize("how", ["waits for its child", "child ignores SIGTERM"])
def test_a_hanging_llama_server_is_stopped_with_its_child(tmp_path: Path, env: dict[str, str],
                                                          monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    pidfile = tmp_path / "server-child.pid"
    monkeypatch.setitem(probing.SERVERS, "hang_with_child",
                        ("#!/bin/sh\n" + HANGS[how].format(sleep=SLEEP, pidfile=shlex.quote(str(pidfile)))).encode())
    monkeypatch.setattr(platform_load, "LOAD_TIMEOUT", 1)
    stage, _m = make_stage(tmp_path, server="hang_with_child")
    r = run_probe(tmp_path, env, fake_smi(tmp_path / "bin", H200), bundle=stage)
    assert r.reason is Reason.CUDA_STARTUP_FAILED and "did not finish in 1s" in r.facts["detail"]
    child = _child_pid(pidfile)
    assert gone(child), f"llama-server's child {child} still runs after the probe returned"
