"""The subprocess gateway with real child processes: timeouts that end silent and chatty children
(and their children), a heartbeat while a step is silent, interrupts that leave nothing running."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from llamabundle import proc
from llamabundle.errors import BuildError, SourceError, ToolchainError
from llamabundle.log import Log
from tests.processes import alive, wait_text

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")


def plain_log() -> tuple[Log, io.StringIO]:
    buf = io.StringIO()
    return Log(console=Console(file=buf, width=80, highlight=False, color_system=None)), buf


def script(tmp: Path, body: str) -> list[str]:
    """A child that records its pid and the pid of a grandchild it starts, then does `body`."""
    f = tmp / "child.sh"
    f.write_text("#!/bin/sh\n"
                 f"echo $$ > {tmp}/child.pid\n"
                 f"sleep 300 & echo $! > {tmp}/grandchild.pid\n"
                 f"{body}\n"
                 f"echo finished > {tmp}/finished\n")
    f.chmod(0o755)
    return [str(f)]


def pids(tmp: Path) -> list[int]:
    return [int((tmp / n).read_text()) for n in ("child.pid", "grandchild.pid")]


@pytest.mark.race
def test_a_silent_child_is_killed_at_its_timeout_with_its_children(tmp_path: Path) -> None:
    log, _ = plain_log()
    with pytest.raises(SourceError) as e:
        proc.run(script(tmp_path, "sleep 300"), log=log, error=SourceError, what="git fetch", timeout=1)
    assert e.value.exit_code == 6 and e.value.what == "git fetch: timed out after 1s"
    assert "stopped with its children" in e.value.why
    assert not any(alive(p) for p in pids(tmp_path))
    assert not (tmp_path / "finished").exists()


@pytest.mark.race
def test_a_chatty_child_is_killed_at_its_timeout_too(tmp_path: Path) -> None:
    log, _ = plain_log()
    body = "i=0; while true; do i=$((i+1)); echo line $i; sleep 0.05; done"
    with pytest.raises(BuildError) as e:
        proc.run(script(tmp_path, body), log=log, error=BuildError, what="the build", timeout=1)
    assert e.value.exit_code == 4 and "timed out" in e.value.what
    assert "line " in e.value.details  # the tail of what it printed
    assert not any(alive(p) for p in pids(tmp_path))
    assert not (tmp_path / "finished").exists()


def test_the_timeout_error_class_is_the_callers(tmp_path: Path) -> None:
    with pytest.raises(ToolchainError) as e:
        proc.run(["sleep", "30"], log=plain_log()[0], error=ToolchainError, what="nvcc --version", timeout=0.5)
    assert e.value.exit_code == 3


def test_a_step_that_left_a_child_holding_the_output_returns_and_the_child_is_ended(tmp_path: Path) -> None:
    out = proc.run(script(tmp_path, "echo done"), log=plain_log()[0], error=BuildError, what="configure", timeout=120)
    assert out.splitlines()[-1] == "done" and (tmp_path / "finished").exists()
    assert not any(alive(p) for p in pids(tmp_path))


@pytest.mark.race
def test_a_failure_kills_what_the_child_started(tmp_path: Path) -> None:
    with pytest.raises(BuildError) as e:
        proc.run(script(tmp_path, "echo broken; exit 3"), log=plain_log()[0], error=BuildError, what="the build")
    assert "(exit code 3)" in e.value.what and "broken" in e.value.details
    assert not any(alive(p) for p in pids(tmp_path))


def test_a_silent_step_shows_a_heartbeat_on_a_pipe(tmp_path: Path) -> None:
    log, buf = plain_log()
    proc.run(["sh", "-c", "sleep 1.6; echo ok"], log=log, error=BuildError, what="linking ggml-cuda", heartbeat=0.5)
    beats = [ln for ln in buf.getvalue().splitlines() if "still running: linking ggml-cuda" in ln]
    assert 2 <= len(beats) <= 4, buf.getvalue()
    assert all(len(ln) <= 80 for ln in beats)


def test_output_resets_the_heartbeat(tmp_path: Path) -> None:
    log, buf = plain_log()
    proc.run(["sh", "-c", "for i in 1 2 3 4 5 6; do echo $i; sleep 0.2; done"], log=log, error=BuildError,
             what="chatty", heartbeat=0.5)
    assert "still running" not in buf.getvalue()


@pytest.mark.race
def test_an_interrupt_kills_the_group_and_propagates(tmp_path: Path) -> None:
    log, _ = plain_log()
    def interrupt_when_started() -> None:
        wait_text(tmp_path / "grandchild.pid")
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=interrupt_when_started)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        proc.run(script(tmp_path, "sleep 300"), log=log, error=BuildError, what="the build")
    timer.join()
    assert not any(alive(p) for p in pids(tmp_path))


@pytest.mark.race
def test_capture_kills_the_group_on_timeout(tmp_path: Path) -> None:
    import subprocess

    with pytest.raises(subprocess.TimeoutExpired):
        proc.capture(script(tmp_path, "sleep 300"), timeout=0.5)
    assert not any(alive(p) for p in pids(tmp_path))
    with pytest.raises(OSError):
        proc.capture([str(tmp_path / "no-such-program")])


def test_a_missing_program_is_a_toolchain_error(tmp_path: Path) -> None:
    with pytest.raises(ToolchainError, match="cannot start"):
        proc.run([str(tmp_path / "nope")], log=plain_log()[0], error=BuildError, what="x")


def test_capture_returns_soon_after_the_child_exits_even_if_its_child_holds_the_output(tmp_path: Path) -> None:
    """nvidia-smi printing its answer and exiting while something it started keeps stdout open: the answer is
    taken after ORPHAN_GRACE, not after the whole timeout, and the orphan is ended."""
    pidfile = tmp_path / "orphan.pid"
    script = f"echo answer; sleep 300 & echo $! > {pidfile}; exit 3"
    t0 = time.monotonic()
    done = proc.capture(["sh", "-c", script], timeout=60)
    took = time.monotonic() - t0
    assert (done.returncode, done.stdout) == (3, "answer\n")
    assert took < 10, took
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
        if state in ("Z", "X"):
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"


def test_capture_timeout_keeps_what_was_printed(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired) as e:
        proc.capture(["sh", "-c", "echo partial; exec sleep 300"], timeout=1)
    assert e.value.output == "partial\n"


def test_wait_exit_gives_the_exit_code_times_out_and_takes_a_reaped_process() -> None:
    """proc.wait_exit: woken by the child's pidfd, the same answers as Popen.wait."""
    quick = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    assert proc.wait_exit(quick, 30) == 7
    assert proc.wait_exit(quick, 30) == 7  # reaped already: the code it had
    slow = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait_exit(slow, 0.2)
        assert slow.returncode is None
    finally:
        slow.kill()
    assert proc.wait_exit(slow, 30) == -9
    untimed = subprocess.Popen(["true"])
    assert proc.wait_exit(untimed, None) == 0
