"""Children die with their parent on Windows: each child runs in a job object of its own that kills every
process in it when its handle closes, so a grandchild whose parent already exited (which taskkill /T, following
parent links, no longer finds) ends with its step, on a timeout, and when llamabundle itself is killed. Real
processes; these run on the Windows CI job (.github/workflows/ci.yml), not on Linux."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llamabundle import proc
from tests.processes import wait_text

pytestmark = pytest.mark.skipif(sys.platform != "win32", reason="Windows only: job objects")

ROOT = Path(__file__).resolve().parents[2]
# The tool: starts a grandchild that sleeps, writes its pid, prints "ready", then exits ("exit") or hangs ("hang").
TOOL = """\
import subprocess, sys, time
pidfile, mode = sys.argv[1], sys.argv[2]
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(pidfile + ".tmp", "w") as f:
    f.write(str(g.pid))
import os
os.replace(pidfile + ".tmp", pidfile)
print("ready", flush=True)
if mode == "hang":
    time.sleep(300)
"""


def _alive(pid: int, *, within: float = 10.0) -> bool:
    """Whether pid is still running after `within` seconds (False as soon as it has exited)."""
    import ctypes

    k32 = ctypes.WinDLL("kernel32", use_last_error=True)
    k32.OpenProcess.restype = ctypes.c_void_p
    handle = k32.OpenProcess(0x00100000, False, pid)  # SYNCHRONIZE
    if not handle:
        return False  # gone (or never there)
    try:
        return bool(k32.WaitForSingleObject(ctypes.c_void_p(handle), int(within * 1000)) != 0)  # 0: signalled, exited
    finally:
        k32.CloseHandle(ctypes.c_void_p(handle))


def _kill(pid: int) -> None:
    subprocess.run(["taskkill", "/F", "/PID", str(pid)], capture_output=True, check=False)


def tool(tmp_path: Path, mode: str) -> tuple[list[str], Path]:
    script = tmp_path / "tool.py"
    script.write_text(TOOL)
    pidfile = tmp_path / "grandchild.pid"
    return [sys.executable, str(script), str(pidfile), mode], pidfile


def test_a_grandchild_left_by_a_finished_step_is_ended(tmp_path: Path) -> None:
    argv, pidfile = tool(tmp_path, "exit")
    done = proc.capture(argv, timeout=120)
    assert done.returncode == 0 and "ready" in done.stdout
    pid = int(pidfile.read_text())
    try:
        assert not _alive(pid), f"the grandchild {pid} outlived its finished step"
    finally:
        _kill(pid)


def test_a_timeout_ends_the_grandchild_too(tmp_path: Path) -> None:
    argv, pidfile = tool(tmp_path, "hang")
    with pytest.raises(proc.Timeout):
        proc.capture(argv, timeout=15)
    pid = int(pidfile.read_text())
    try:
        assert not _alive(pid), f"the grandchild {pid} outlived the timeout"
    finally:
        _kill(pid)


PARENT = """\
import sys
from llamabundle import proc
proc.capture(sys.argv[1:], timeout=600)
"""


def test_what_a_child_started_dies_when_llamabundle_is_killed(tmp_path: Path) -> None:
    argv, pidfile = tool(tmp_path, "hang")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *argv], cwd=ROOT)
    try:
        pid = int(wait_text(pidfile, procs=[parent], timeout=60))
        parent.kill()  # TerminateProcess: nothing in llamabundle runs after it
        parent.wait(timeout=30)
        try:
            assert not _alive(pid), f"the grandchild {pid} outlived its killed llamabundle"
        finally:
            _kill(pid)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
