"""The install root's slot lock (runtime/slotlock.py, docs/install-rules.md#the-slot-lock): a directory renamed
into place, its owner judged by pid and start time, broken when the owner is dead, never when it lives or
runs on another host; real processes hold it and die holding it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llamabundle import scratch
from llamabundle.runtime import slotlock

HOLD = """
import sys, time
from pathlib import Path
from llamabundle.runtime import slotlock
with slotlock.holding(Path(sys.argv[1]), sys.argv[2], timeout=60):
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
"""


def holder(locks: Path, name: str, seconds: float) -> subprocess.Popen[str]:
    """A real process that takes the lock and holds it for `seconds` (it says "held" once it has it)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(locks), name, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "held\n"
    return p


def dead_pid() -> tuple[int, int]:
    """The pid and start time of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    start = scratch.start_time(p.pid)
    p.kill()
    p.wait()
    assert start is not None and scratch.start_time(p.pid) is None
    return p.pid, start


def plant(locks: Path, name: str, **owner: object) -> Path:
    """A NAME.held directory as another taker (another language) would leave it."""
    held = locks / f"{name}{slotlock.HELD}"
    held.mkdir(parents=True)
    record = {"by": "install.mjs", "host": socket.gethostname(), "since": "2026-12-04T00:00:00Z", **owner}
    (held / slotlock.OWNER).write_text(json.dumps(record), encoding="utf-8")
    return held


def test_held_while_the_body_runs_with_its_owner_and_nothing_left_after(tmp_path: Path) -> None:
    locks = tmp_path / ".locks"
    with slotlock.holding(locks, "cpu", timeout=5) as held:
        owner = slotlock.read_owner(held)
        assert owner is not None and owner.pid == os.getpid() and owner.host == socket.gethostname()
        assert owner.start == scratch.start_time(os.getpid()) and owner.by.startswith("llamabundle ")
        assert owner.token.startswith(f"{os.getpid()}-{owner.start}-")
        assert sorted(p.name for p in locks.iterdir()) == ["cpu.held"]
    assert list(locks.iterdir()) == []


def test_a_live_holder_makes_a_taker_wait_then_busy_naming_it(tmp_path: Path) -> None:
    locks = tmp_path / ".locks"
    p = holder(locks, "cpu", 30)
    told: list[slotlock.Owner | None] = []
    try:
        t0 = time.monotonic()
        with pytest.raises(slotlock.Busy) as e, slotlock.holding(locks, "cpu", timeout=0.6, on_wait=told.append):
            pytest.fail("taken while a live process holds it")
        assert time.monotonic() - t0 >= 0.6
        assert e.value.owner is not None and e.value.owner.pid == p.pid
        assert [o.pid for o in told if o] == [p.pid]  # told once
        assert f"pid {p.pid}" in str(e.value)
    finally:
        p.kill()
        p.wait()
    assert (locks / "cpu.held").is_dir()  # killed holding it: the lock outlives it, stale now


def test_the_lock_of_a_process_killed_holding_it_is_broken_at_once(tmp_path: Path) -> None:
    locks = tmp_path / ".locks"
    p = holder(locks, "cpu", 30)
    token = slotlock.read_owner(locks / "cpu.held").token  # type: ignore[union-attr]
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    t0 = time.monotonic()
    with slotlock.holding(locks, "cpu", timeout=30) as held:
        assert time.monotonic() - t0 < 5
        assert slotlock.read_owner(held).pid == os.getpid()  # type: ignore[union-attr]
        assert (locks / f".stale-{token}" / "broken").is_file()  # moved aside, kept for STALE_KEEP


def test_a_reused_pid_is_told_apart_by_its_start_time(tmp_path: Path) -> None:
    locks = tmp_path / ".locks"
    mine = scratch.start_time(os.getppid())
    assert mine  # the parent runs, with a start time
    plant(locks, "cpu", pid=os.getppid(), start=mine + 1, token=f"{os.getppid()}-{mine + 1}-abcdef")
    with slotlock.holding(locks, "cpu", timeout=5):
        pass
    plant(locks, "cpu", pid=os.getppid(), start=mine, token=f"{os.getppid()}-{mine}-abcdef")  # that very process: live
    with pytest.raises(slotlock.Busy), slotlock.holding(locks, "cpu", timeout=0.3):
        pass


def test_start_0_means_compare_by_pid_only(tmp_path: Path) -> None:
    locks = tmp_path / ".locks"
    plant(locks, "a", pid=os.getppid(), start=0, token=f"{os.getppid()}-0-abcdef")
    with pytest.raises(slotlock.Busy), slotlock.holding(locks, "a", timeout=0.3):
        pass
    pid, _ = dead_pid()
    plant(locks, "b", pid=pid, start=0, token=f"{pid}-0-abcdef")
    with slotlock.holding(locks, "b", timeout=5):
        pass


def test_a_holder_on_another_host_is_never_judged(tmp_path: Path) -> None:
    locks = tmp_path / ".locks"
    pid, start = dead_pid()
    plant(locks, "cpu", pid=pid, start=start, host="elsewhere.example", token=f"{pid}-{start}-abcdef")
    with pytest.raises(slotlock.Busy) as e, slotlock.holding(locks, "cpu", timeout=0.3):
        pass
    assert "on elsewhere.example" in str(e.value)


def test_an_unreadable_owner_is_waited_for_then_broken_once_old(tmp_path: Path) -> None:
    locks = tmp_path / ".locks"
    held = locks / "cpu.held"
    held.mkdir(parents=True)
    (held / slotlock.OWNER).write_text("{not json", encoding="utf-8")
    with pytest.raises(slotlock.Busy) as e, slotlock.holding(locks, "cpu", timeout=0.3):
        pass
    assert e.value.owner is None
    old = time.time() - slotlock.INVALID_AGE - 5
    os.utime(held, (old, old))
    with slotlock.holding(locks, "cpu", timeout=5) as now:
        assert slotlock.read_owner(now).pid == os.getpid()  # type: ignore[union-attr]


def test_a_late_breaker_cannot_move_the_next_holders_lock(tmp_path: Path) -> None:
    """Two waiters judge the same dead holder: the first breaks it and takes the lock; the second, late, tries to
    move NAME.held to the same .stale-<dead token> name and fails, the new holder's lock untouched."""
    locks = tmp_path / ".locks"
    pid, start = dead_pid()
    dead = f"{pid}-{start}-abcdef"
    plant(locks, "cpu", pid=pid, start=start, token=dead)
    with slotlock.holding(locks, "cpu", timeout=5) as held:
        mine = slotlock.read_owner(held)
        slotlock._break(locks, held, dead)  # what the late waiter does
        assert slotlock.read_owner(held) == mine


def test_release_leaves_a_lock_that_is_no_longer_its_own(tmp_path: Path) -> None:
    locks = tmp_path / ".locks"
    with slotlock.holding(locks, "cpu", timeout=5) as held:
        os.rename(held, locks / ".stale-x")  # a waiter wrongly judged this process dead, and another took it
        other = plant(locks, "cpu", pid=os.getppid(), start=0, token=f"{os.getppid()}-0-fedcba")
    assert slotlock.read_owner(other) is not None and slotlock.read_owner(other).token == f"{os.getppid()}-0-fedcba"  # type: ignore[union-attr]


def test_the_sweep_removes_dead_takers_leftovers_and_old_broken_locks(tmp_path: Path) -> None:
    locks = tmp_path / ".locks"
    pid, start = dead_pid()
    for n in (f".new-{pid}-{start}-aaaaaa", f".released-{pid}-{start}-bbbbbb", ".stale-old", ".stale-young",
              f".new-{os.getppid()}-{scratch.start_time(os.getppid())}-cccccc"):
        (locks / n).mkdir(parents=True)
    old = time.time() - slotlock.STALE_KEEP - 5
    os.utime(locks / ".stale-old", (old, old))
    with slotlock.holding(locks, "cpu", timeout=5):
        pass
    assert sorted(p.name for p in locks.iterdir()) == sorted([".stale-young", f".new-{os.getppid()}-{scratch.start_time(os.getppid())}-cccccc"])


def test_many_processes_and_threads_take_turns_and_lose_no_update(tmp_path: Path) -> None:
    """A counter read, then written a moment later, by 4 processes x 15 turns under the lock: every turn counts."""
    locks, counter = tmp_path / ".locks", tmp_path / "n"
    counter.write_text("0")
    code = ("import sys, time\nfrom pathlib import Path\nfrom llamabundle.runtime import slotlock\n"
            "for _ in range(15):\n"
            "    with slotlock.holding(Path(sys.argv[1]), 'cpu', timeout=60):\n"
            "        n = int(Path(sys.argv[2]).read_text()); time.sleep(0.002); Path(sys.argv[2]).write_text(str(n + 1))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(locks), str(counter)]) for _ in range(4)]

    def turns() -> None:
        for _ in range(15):
            with slotlock.holding(locks, "cpu", timeout=60):
                n = int(counter.read_text())
                time.sleep(0.002)
                counter.write_text(str(n + 1))

    threads = [threading.Thread(target=turns) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    assert counter.read_text() == str(6 * 15)
    assert list(locks.iterdir()) == []
