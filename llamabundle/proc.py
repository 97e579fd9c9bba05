"""The one subprocess gateway: echoes `+ cmd`, finds the program first, streams output to a log,
bounds every child in time, and on failure raises the caller's error class with the last lines of output.

Every child runs in a process group of its own, so a timeout, an interrupt (Ctrl-C) or a failure
ends the child *and* whatever it started (compilers under ninja, pip's build backends, git's
helpers), whether or not they still print. A step that prints nothing for a while shows a heartbeat:
the elapsed time on a terminal, a line every 30 s elsewhere (a CI log that stays silent for many
minutes looks hung, and some CI systems kill silent jobs).
"""

from __future__ import annotations

import collections
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import LlamaBundleError, ToolchainError
from .log import Log

TAIL_LINES = 50
HEARTBEAT = 30.0  # seconds of silence between two "still running" lines on a pipe
KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL of a process group
DEFAULT_TIMEOUT = 3600.0  # seconds: no child runs unbounded; long steps (builds) pass their own
ORPHAN_GRACE = 1.0  # seconds the output may stay open after the child exited (then its group is ended)
_EOF = object()


class Timeout(subprocess.TimeoutExpired):
    """A child of `capture` or `run_until` ran past its timeout (its process group was ended). `output` and
    `stderr` hold what it printed until then. Callers catch this, never subprocess's own class."""


def which(program: str, *, path: str | None = None, purpose: str = "", fix: str = "") -> str:
    found = shutil.which(program, path=path)
    if not found:
        raise ToolchainError(f"'{program}' was not found on PATH", why=purpose or f"llamabundle needs {program}",
                             fix=fix or f"install {program} and make sure it is on PATH")
    return found


def _group_kwargs() -> dict[str, Any]:
    if sys.platform == "win32":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}


def kill_group(p: subprocess.Popen[Any], *, grace: float = KILL_GRACE) -> None:
    """End the child and everything in its process group: SIGTERM, then SIGKILL after `grace` seconds."""
    if sys.platform == "win32":  # pragma: no cover - exercised on the Windows CI job only
        subprocess.run(["taskkill", "/F", "/T", "/PID", str(p.pid)], capture_output=True, check=False)
        p.wait()
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        if sig == signal.SIGKILL:
            break
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; members that ignored SIGTERM still get SIGKILL
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        break
    p.wait()


def _reader(stream: IO[str], lines: queue.Queue[object]) -> None:
    try:
        for line in stream:
            lines.put(line)
    except (OSError, ValueError):
        pass
    finally:
        lines.put(_EOF)


class _Heartbeat:
    """'still running' while a child is silent: a transient status with the elapsed time on a terminal,
    a plain line every `every` seconds elsewhere."""

    def __init__(self, log: Log, what: str, *, every: float) -> None:
        self.log, self.what, self.every = log, what, every
        self.start = self.last = time.monotonic()
        self.tty = log.console.is_terminal and not log.quiet
        self.status: Any = None

    def output(self) -> None:
        self.last = time.monotonic()
        if self.status is not None:
            self.status.stop()
            self.status = None

    def tick(self) -> None:
        now = time.monotonic()
        if self.tty:
            if now - self.last >= 2.0:
                text = f"    {self.what}: running for {_elapsed(now - self.start)}"
                if self.status is None:
                    self.status = self.log.console.status(text)
                    self.status.start()
                else:
                    self.status.update(text)
        elif now - self.last >= self.every:
            self.last = now
            self.log.info(f"    … still running: {self.what} ({_elapsed(now - self.start)})")

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def _elapsed(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@contextmanager
def _started(argv: list[str], *, cwd: Path | None, env: Mapping[str, str] | None,
             stdout: int, stderr: int, raw_errors: bool = False) -> Iterator[subprocess.Popen[str]]:
    """The child, started in a process group of its own; the group is killed if the block raises."""
    try:
        p = subprocess.Popen(argv, cwd=cwd, env=dict(env) if env is not None else None, stdout=stdout, stderr=stderr,
                             stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1, **_group_kwargs())
    except OSError as e:
        if raw_errors:
            raise
        why = "the program does not exist" if isinstance(e, FileNotFoundError) else str(e)
        raise ToolchainError(f"cannot start {argv[0]}", why=why,
                             fix=f"install {os.path.basename(argv[0])}" if isinstance(e, FileNotFoundError)
                             else "check that it is an executable program") from None
    try:
        yield p
    except BaseException:
        kill_group(p)
        raise


def run(
    argv: Sequence[str],
    *,
    log: Log,
    error: type[LlamaBundleError],
    what: str,
    fix: str = "",
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    log_path: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    echo_output: bool = False,
    label: str | None = None,
    heartbeat: float = HEARTBEAT,
) -> str:
    """Run argv; return its combined output. Raises `error` with the output's tail on failure or when
    `timeout` seconds pass (the whole process group is killed either way, and on KeyboardInterrupt). The
    'still running' lines name `label` (what runs), else `what`."""
    argv = [str(a) for a in argv]
    log.command(argv)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    chunks: list[str] = []
    deadline = time.monotonic() + timeout if timeout is not None else None
    beat = _Heartbeat(log, label or what, every=heartbeat)
    logf = open(log_path, "a", encoding="utf-8") if log_path else None
    try:
        with _started(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as p:
            assert p.stdout is not None
            lines: queue.Queue[object] = queue.Queue()
            reader = threading.Thread(target=_reader, args=(p.stdout, lines), daemon=True)
            reader.start()
            exited_at: float | None = None
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    kill_group(p)
                    raise error(f"{what}: timed out after {_elapsed(timeout or 0)}",
                                why=f"`{' '.join(argv[:3])} …` was still running and was stopped with its children",
                                fix=fix, details=_tail_block(tail, log_path))
                if exited_at is None and p.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > ORPHAN_GRACE:
                    kill_group(p)  # it exited, but something it started still holds the output open
                try:
                    item = lines.get(timeout=0.5 if deadline is None else max(0.01, min(0.5, deadline - now)))
                except queue.Empty:
                    beat.tick()
                    continue
                if item is _EOF:
                    break
                line = str(item)
                beat.output()
                if logf:
                    logf.write(line)
                tail.append(line.rstrip("\n"))
                if log_path is None:
                    chunks.append(line)
                if on_line:
                    on_line(line)
                if echo_output:
                    log.info(line.rstrip("\n"))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rc = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                kill_group(p)
                raise error(f"{what}: timed out after {_elapsed(timeout or 0)}", fix=fix,
                            details=_tail_block(tail, log_path)) from None
            _reap_group(p)
    finally:
        beat.close()
        if logf:
            logf.close()
    if rc != 0:
        raise error(f"{what} (exit code {rc})", why=f"`{' '.join(argv[:3])} …` failed", fix=fix,
                    details=_tail_block(tail, log_path))
    return "".join(chunks) if log_path is None else "\n".join(tail)


def _reap_group(p: subprocess.Popen[Any]) -> None:
    """A finished step leaves nothing behind: members of its group still running are killed."""
    if sys.platform == "win32":  # pragma: no cover
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail_block(tail: collections.deque[str], log_path: Path | None) -> str:
    out = [f"--- last {len(tail)} lines of output ---", *tail]
    if log_path:
        out.append(f"--- full log: {log_path}")
    return "\n".join(out)


def inherited(names: Sequence[str]) -> dict[str, str]:
    """The variables of this process's environment among `names`: what a child run in a clean environment
    keeps (the Vulkan loader's driver lookup, for one)."""
    return {k: os.environ[k] for k in names if k in os.environ}


def capture(argv: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a short query command (no echo) and return the completed process, whatever its exit code.
    On timeout its process group is killed and `Timeout` raised; a program that cannot
    be started raises OSError, as subprocess does."""
    args = [str(a) for a in argv]
    with _started(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, raw_errors=True) as p:
        assert p.stdout is not None and p.stderr is not None
        chunks: tuple[list[str], list[str]] = ([], [])
        readers = [threading.Thread(target=_drain, args=(stream, into), daemon=True)
                   for stream, into in zip((p.stdout, p.stderr), chunks, strict=True)]
        for r in readers:
            r.start()
        deadline = time.monotonic() + timeout
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(p, grace=1.0)
            for r in readers:
                r.join(timeout=5)
            raise Timeout(args, timeout, output="".join(chunks[0]), stderr="".join(chunks[1])) from None
        for r in readers:  # it exited; what it started may hold the output open a while, not for ever
            r.join(timeout=max(0.0, min(ORPHAN_GRACE, deadline - time.monotonic())))
        _reap_group(p)
        for r in readers:
            r.join(timeout=5)
    return subprocess.CompletedProcess(args, p.returncode, "".join(chunks[0]), "".join(chunks[1]))


def _drain(stream: Any, into: list[str]) -> None:
    try:
        for piece in iter(lambda: stream.read(1 << 16), ""):
            into.append(piece)
    except (OSError, ValueError):
        pass


@dataclass(frozen=True, kw_only=True)
class Watched:
    """What `run_until` saw: every line, and whether the child exited by itself (returncode) or was stopped."""
    lines: list[str]
    returncode: int | None  # None: it was stopped
    stopped: bool


def run_until(argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, timeout: float, idle: float,
              done: Callable[[str], bool], settling: Callable[[], bool],
              stop: Callable[[], None] | None = None) -> Watched:
    """Run argv, reading stdout and stderr (merged) line by line as they stream, for a program that may not
    exit once it has said what is wanted (a Wine process). After each line `done(line)` says whether the
    wanted output is complete; while `settling()` is true, `idle` seconds without output complete it too.
    Then the process group is killed, `stop()` runs (e.g. `wineserver -k`) and the result says it was
    stopped. Past `timeout` seconds: `Timeout`, with the lines seen as its output. A program that cannot be
    started raises OSError."""
    args = [str(a) for a in argv]
    p = subprocess.Popen(args, cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, text=True, errors="replace", **_group_kwargs())
    assert p.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    stream = p.stdout

    def read() -> None:
        try:
            for line in stream:
                lines.put(line)
        except (OSError, ValueError):
            pass
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: list[str] = []
    complete = False
    deadline = time.monotonic() + timeout
    try:
        while not complete:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(args, timeout, output="\n".join(seen))
            waiting = settling()
            try:
                line = lines.get(timeout=min(left, idle) if waiting else min(left, 0.5))
            except queue.Empty:
                complete = waiting
                continue
            if line is None:  # it exited by itself
                return Watched(lines=seen, returncode=p.wait(), stopped=False)
            line = line.rstrip("\r\n")
            seen.append(line)
            complete = done(line)
    finally:
        if p.poll() is None:
            kill_group(p, grace=0)
            if stop is not None:
                stop()
        reader.join(timeout=5)
    return Watched(lines=seen, returncode=None, stopped=True)
