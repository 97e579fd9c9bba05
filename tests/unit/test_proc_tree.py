"""Children die with their parent (Linux): a tool whose child leaves its process group with setsid is ended
whole on a timeout, on an interrupt and when its step is stopped; the orphans llamabundle adopts as a child
subreaper are reaped (no zombie of ours is left, and no other child's exit status is taken); what a child
started dies when llamabundle itself is killed (the child's guard), whichever thread started it. Real processes, no mocks."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from llamabundle import proc
from llamabundle.errors import BuildError
from llamabundle.log import Log
from tests.processes import wait_for, wait_text

pytestmark = [pytest.mark.race,
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="Linux only: /proc, a child subreaper and PR_SET_PDEATHSIG")]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 4.0  # the step's timeout: long enough for the tool to start its grandchild on a loaded machine

# The tool: forks a grandchild that leaves the group and session with setsid, ignores SIGTERM and writes its pid;
# then the tool prints "ready" and hangs ("hang") or exits 3 ("exit"). "detach" daemonizes it as wineserver
# does: its own parent exits at once (the tool reaps it), then it calls setsid: an orphan holding the output.
TOOL = """\
import os, signal, sys, time
pidfile, mode = sys.argv[1], sys.argv[2]
child = os.fork()
if child == 0:
    if mode == "detach" and os.fork():
        os._exit(0)
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(pidfile + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pidfile + ".tmp", pidfile)
    time.sleep(300)
    os._exit(0)
if mode == "detach":
    os.waitpid(child, 0)
while not os.path.exists(pidfile):
    time.sleep(0.01)
print("ready", flush=True)
if mode == "exit":
    sys.exit(3)
time.sleep(300)
"""


@pytest.fixture
def pidfile(tmp_path: Path) -> Iterator[Path]:
    """Where the grandchild writes its pid; whatever is left of it is killed afterwards (the test failed)."""
    path = tmp_path / "grandchild.pid"
    yield path
    if path.is_file() and path.read_text().strip():
        pid = int(path.read_text())
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        _gone(pid, reap=True)


def tool(pidfile: Path, mode: str) -> list[str]:
    script = pidfile.parent / "tool.py"
    script.write_text(TOOL)
    return [sys.executable, "-S", str(script), str(pidfile), mode]


def quiet_log() -> Log:
    return Log(console=Console(file=io.StringIO(), width=80, highlight=False, color_system=None))


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of pid, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _gone(pid: int, *, timeout: float = 5.0, reap: bool = False) -> bool:
    """Whether pid is gone within `timeout` seconds. A zombie counts as gone only when it is not ours (a
    container's PID 1 may never reap its own): one of ours means a kill left it unreaped. With `reap`, this
    process reaps it itself (a child of a process we killed, reparented to us)."""
    deadline = time.monotonic() + timeout
    while True:
        if reap:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        row = _stat(pid)
        if row is None or (row[0] == "Z" and row[1] != os.getpid()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def grandchild(pidfile: Path) -> int:
    return int(wait_text(pidfile, timeout=30))


def test_run_timeout_ends_a_grandchild_that_left_with_setsid(pidfile: Path) -> None:
    bystander = subprocess.Popen(["sh", "-c", "exit 7"])  # a child of ours that proc did not start: not reaped by it
    wait_for(lambda: (_stat(bystander.pid) or ("Z",))[0] == "Z", timeout=30, name="the bystander to exit")
    with pytest.raises(BuildError, match="timed out"):
        proc.run(tool(pidfile, "hang"), log=quiet_log(), error=BuildError, what="the tool", timeout=TIMEOUT)
    pid = grandchild(pidfile)
    assert _gone(pid), f"the setsid grandchild {pid} outlived the timeout: {_stat(pid)}"
    assert bystander.wait(timeout=5) == 7  # its exit status is still its Popen's


def test_capture_timeout_ends_a_grandchild_that_left_with_setsid(pidfile: Path) -> None:
    with pytest.raises(proc.Timeout) as e:
        proc.capture(tool(pidfile, "hang"), timeout=TIMEOUT)
    assert "ready" in str(e.value.output)
    pid = grandchild(pidfile)
    assert _gone(pid), f"the setsid grandchild {pid} outlived the timeout: {_stat(pid)}"


def test_run_until_timeout_ends_a_grandchild_that_left_with_setsid(pidfile: Path) -> None:
    with pytest.raises(proc.Timeout):
        proc.run_until(tool(pidfile, "hang"), env=dict(os.environ), cwd=pidfile.parent, timeout=TIMEOUT, idle=60,
                       done=lambda line: False, settling=lambda: False)
    pid = grandchild(pidfile)
    assert _gone(pid), f"the setsid grandchild {pid} outlived the timeout: {_stat(pid)}"


def test_an_interrupt_ends_a_grandchild_that_left_with_setsid(pidfile: Path) -> None:
    def interrupt_when_started() -> None:
        wait_text(pidfile, timeout=30)
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=interrupt_when_started)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            proc.run(tool(pidfile, "hang"), log=quiet_log(), error=BuildError, what="the tool", timeout=60)
    finally:
        timer.join()
    pid = grandchild(pidfile)
    assert _gone(pid), f"the setsid grandchild {pid} outlived the interrupt: {_stat(pid)}"


def test_capture_ends_an_orphan_that_left_with_setsid_and_holds_the_output(pidfile: Path) -> None:
    """The tool answers and exits while its setsid child, reparented to us, keeps stdout open."""
    done = proc.capture(tool(pidfile, "exit"), timeout=30)
    assert (done.returncode, done.stdout) == (3, "ready\n")
    pid = grandchild(pidfile)
    assert _gone(pid), f"the orphan {pid} holding the output was left running: {_stat(pid)}"


def test_run_ends_an_orphan_that_left_with_setsid_and_holds_the_output(pidfile: Path) -> None:
    with pytest.raises(BuildError, match=r"exit code 3"):  # not a timeout: the orphan is ended after ORPHAN_GRACE
        proc.run(tool(pidfile, "exit"), log=quiet_log(), error=BuildError, what="the tool", timeout=3 * TIMEOUT)
    pid = grandchild(pidfile)
    assert _gone(pid), f"the orphan {pid} holding the output was left running: {_stat(pid)}"


def test_run_until_leaves_a_detached_holder_of_the_output_to_stop_then_ends_it(pidfile: Path) -> None:
    """wineserver's case: an orphan holding the output is stop()'s to end gracefully; what stop() leaves dies."""
    at_stop: list[bool] = []
    watched = proc.run_until(tool(pidfile, "detach"), env=dict(os.environ), cwd=pidfile.parent, timeout=30, idle=60,
                             done=lambda line: line == "ready", settling=lambda: False,
                             stop=lambda: at_stop.append(_stat(grandchild(pidfile)) is not None))
    assert watched.stopped and watched.lines == ["ready"]
    assert at_stop == [True]  # still running when stop() ran
    pid = grandchild(pidfile)
    assert _gone(pid), f"the detached holder {pid} outlived the stopped run: {_stat(pid)}"


PARENT = """\
import json, sys, threading
from llamabundle import proc
argv, where = json.loads(sys.argv[1]), sys.argv[2]
if where == "thread":
    t = threading.Thread(target=proc.capture, args=(argv,), kwargs={"timeout": 600})
    t.start()
    t.join()
else:
    proc.capture(argv, timeout=600)
"""

# What a killed llamabundle may leave: its child itself; a grandchild under it (a compiler under ninja), whose
# parent dies with llamabundle; a grandchild that left the group and session with setsid (a helper of
# llama-server). Each writes the pid that must be gone.
DESCENDANTS = {
    "child": lambda pidfile: ["sh", "-c", f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile} && exec sleep 300"],
    "grandchild": lambda pidfile: ["sh", "-c", f"sleep 300 & echo $! > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; wait"],
    "setsid grandchild": lambda pidfile: tool(pidfile, "hang"),
}


@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.parametrize("who", list(DESCENDANTS))
def test_what_a_child_started_dies_when_llamabundle_is_killed(pidfile: Path, where: str, who: str) -> None:
    """SIGKILL of the process that started the child (nothing in it can clean up): the child's guard ends the
    child and all it started, whichever thread started it."""
    argv = DESCENDANTS[who](pidfile)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, json.dumps(argv), where], cwd=ROOT, start_new_session=True)
    try:
        pid = int(wait_text(pidfile, procs=[parent], timeout=30))
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _gone(pid, reap=True), f"the {who} {pid} outlived its killed llamabundle: {_stat(pid)}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_the_guard_exits_as_its_program_did_and_holds_nothing(tmp_path: Path) -> None:
    """The Popen's pid is the guard's: it reports the program's exit code or the signal that killed it, a program
    that cannot start is the OSError subprocess gives, and the guard holds none of the program's output (a
    capture returns as soon as the program exits)."""
    assert proc.capture(["sh", "-c", "echo out; echo err >&2; exit 7"]).returncode == 7
    done = proc.capture(["sh", "-c", "kill -TERM $$"])
    assert done.returncode == -signal.SIGTERM
    assert proc.capture(["sh", "-c", "kill -KILL $$"]).returncode == -signal.SIGKILL
    with pytest.raises(FileNotFoundError):
        proc.capture([str(tmp_path / "no-such-program")])
    (tmp_path / "plain").write_text("not a program")
    with pytest.raises(PermissionError):
        proc.capture([str(tmp_path / "plain")])
    p = proc._popen(["sleep", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(_children(p.pid)) == 1, timeout=10, name="the guard's program to start")
        program = _children(p.pid)[0]
        assert Path(f"/proc/{program}/cmdline").read_bytes().split(b"\0")[0] == b"sleep"
        guard_fds = {os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.pid}/fd")}
        assert not any(link.startswith("pipe:") and link != _pipe_of(proc._life()) for link in guard_fds), guard_fds
        os.kill(program, signal.SIGTERM)
        assert p.wait(timeout=10) == -signal.SIGTERM
    finally:
        proc.kill_group(p, grace=0)
        if p.stdout:
            p.stdout.close()
        if p.stderr:
            p.stderr.close()


def _pipe_of(fd: int | None) -> str:
    assert fd is not None
    return os.readlink(f"/proc/self/fd/{fd}")
