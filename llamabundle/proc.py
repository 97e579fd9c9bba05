"""The one subprocess gateway: echoes `+ cmd`, finds the program first, streams output to a log,
and on failure raises the caller's error class with the last lines of output."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .errors import LlamaBundleError, ToolchainError
from .log import Log

TAIL_LINES = 50


def which(program: str, *, path: str | None = None, purpose: str = "", fix: str = "") -> str:
    found = shutil.which(program, path=path)
    if not found:
        raise ToolchainError(f"'{program}' was not found on PATH", why=purpose or f"llamabundle needs {program}",
                             fix=fix or f"install {program} and make sure it is on PATH")
    return found


def run(
    argv: Sequence[str],
    *,
    log: Log,
    error: type[LlamaBundleError],
    what: str,
    fix: str = "",
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    log_path: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    echo_output: bool = False,
) -> str:
    """Run argv; return its combined output. Raises `error` with the output's tail on failure."""
    argv = [str(a) for a in argv]
    log.command(argv)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    chunks: list[str] = []
    logf = open(log_path, "a", encoding="utf-8") if log_path else None
    try:
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=dict(env) if env is not None else None,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    text=True, errors="replace", bufsize=1)
        except FileNotFoundError:
            raise ToolchainError(f"cannot start {argv[0]}", why="the program does not exist",
                                 fix=f"install {os.path.basename(argv[0])}") from None
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if logf:
                    logf.write(line)
                tail.append(line.rstrip("\n"))
                if log_path is None:
                    chunks.append(line)
                if on_line:
                    on_line(line)
                if echo_output:
                    log.info(line.rstrip("\n"))
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise error(f"{what}: timed out after {timeout:.0f}s", fix=fix,
                        details=_tail_block(tail, log_path)) from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    finally:
        if logf:
            logf.close()
    if rc != 0:
        raise error(f"{what} (exit code {rc})", why=f"`{' '.join(argv[:3])} …` failed", fix=fix,
                    details=_tail_block(tail, log_path))
    return "".join(chunks) if log_path is None else "\n".join(tail)


def _tail_block(tail: collections.deque[str], log_path: Path | None) -> str:
    out = [f"--- last {len(tail)} lines of output ---", *tail]
    if log_path:
        out.append(f"--- full log: {log_path}")
    return "\n".join(out)


def capture(argv: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a short query command (no echo) and return the completed process, whatever its exit code."""
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=dict(env) if env is not None else None,
                          capture_output=True, text=True, errors="replace", timeout=timeout, stdin=subprocess.DEVNULL)
