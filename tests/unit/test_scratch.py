"""Temporary paths that name their owner (pid and start time), and the sweep that removes only dead owners'."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llamabundle import scratch

CHILD = """
import sys, time
from pathlib import Path
from llamabundle import scratch
d = scratch.make_dir(Path(sys.argv[1]), ".publish-")
(d / "big.part").write_bytes(b"x" * 4096)
print(d.name, flush=True)
time.sleep(600)
"""


def start_owner(directory: Path) -> tuple[subprocess.Popen[str], Path]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, directory / p.stdout.readline().strip()


@pytest.mark.race
def test_a_live_owners_leftover_is_kept_and_a_killed_ones_removed(tmp_path: Path) -> None:
    p, owned = start_owner(tmp_path)
    try:
        assert owned.is_dir() and owned.name.startswith(f".publish-{p.pid}-")
        assert scratch.sweep(tmp_path, [".publish-"]) == []
        assert owned.is_dir()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    removed: list[tuple[Path, int]] = []
    assert scratch.sweep(tmp_path, [".publish-"], on_removed=lambda path, size: removed.append((path, size))) == [owned]
    assert removed == [(owned, 4096)]
    assert not owned.exists()


def test_a_reused_pid_does_not_keep_a_dead_owners_leftover(tmp_path: Path) -> None:
    """The pid runs (it is ours) but started at another time: its owner is dead."""
    mine = scratch.start_time(os.getpid())
    assert mine  # Linux: clock ticks since boot
    stale = tmp_path / f".publish-{os.getpid()}-{mine + 1}-abcdef"
    stale.mkdir()
    live = scratch.make_dir(tmp_path, ".publish-")
    assert scratch.sweep(tmp_path, [".publish-"]) == [stale]
    assert live.is_dir()


def test_only_the_named_prefixes_are_touched(tmp_path: Path) -> None:
    dead = 2**22 + 12345  # above pid_max's default: no such process
    (tmp_path / f".publish-{dead}-1-abcdef").mkdir()
    (tmp_path / f"keep-{dead}-1-abcdef").mkdir()
    (tmp_path / "0123456789abcdef").mkdir()  # a store entry's key directory
    assert [p.name for p in scratch.sweep(tmp_path, [".publish-"])] == [f".publish-{dead}-1-abcdef"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0123456789abcdef", f"keep-{dead}-1-abcdef"]


def test_legacy_names_pid_only_or_no_owner(tmp_path: Path) -> None:
    """Leftovers of versions before owners were recorded: `.X.partial-<pid>` lives while the pid runs; a
    random tail (tempfile) is removed once it is a day old."""
    (tmp_path / f".out.partial-{os.getpid()}").mkdir()
    (tmp_path / ".out.partial-4194999").mkdir()
    young, old = tmp_path / ".publish-k2j3h4", tmp_path / ".publish-a8b9c0"
    young.mkdir()
    old.mkdir()
    past = time.time() - scratch.LEGACY_AGE - 60
    os.utime(old, (past, past))
    removed = sorted(p.name for p in scratch.sweep(tmp_path, [".out.partial-", ".publish-"]))
    assert removed == [".out.partial-4194999", ".publish-a8b9c0"]


def test_a_zombie_owner_is_dead(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while scratch.start_time(p.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)  # exited but not reaped: a zombie, whose start time is still readable from /proc
    assert scratch.start_time(p.pid) is None
    p.wait()


def test_sweeping_a_missing_or_unreadable_directory_is_a_no_op(tmp_path: Path) -> None:
    assert scratch.sweep(tmp_path / "nope", [".publish-"]) == []


@pytest.mark.race
def test_write_atomic_removes_a_killed_writers_temporary_file(tmp_path: Path) -> None:
    from llamabundle.runtime.results import write_atomic

    dead = tmp_path / ".probe.json.4194999-1-abcdef.tmp"  # a writer SIGKILLed between open and rename
    dead.write_text("{half")
    mine = tmp_path / f".probe.json.{os.getpid()}-{scratch.start_time(os.getpid())}-abcdef.tmp"
    mine.write_text("{live")  # a live writer's (here: ours) is kept
    write_atomic(tmp_path / "probe.json", "{}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [mine.name, "probe.json"]
