"""For the tests that start, kill or interrupt real processes: waiting for a marker another process writes
(`wait_for`, `wait_text`: never reading a marker half-written) and whether a process is still running (a zombie
counts as gone: PID 1 of a container may never reap it)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def wait_for(what: Path | Callable[[], Any], *, procs: Sequence[subprocess.Popen[Any]] = (), timeout: float = 60,
             name: str = "") -> Any:
    """Poll until `what` holds: a path that exists, or a callable's truthy result (returned). A process of `procs`
    that ends first fails the wait with what it printed; the timeout is a guard against hanging, not a timing
    assert (a loaded machine may take long)."""
    cond = what.exists if isinstance(what, Path) else what
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args!r} ended ({p.returncode}) before {name or what}: {p.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {name or what}")
        time.sleep(0.01)


def wait_text(path: Path, **kw: Any) -> str:
    """The text another process writes into `path`, once there is some: a marker is created before it is
    written, so `exists()` alone can read it empty."""
    return str(wait_for(lambda: path.is_file() and path.read_text().strip(), name=str(path), **kw))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited (PID 1 of a container may never reap it)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def alive(pid: int) -> bool:
    """Still running after the signals sent to it have had a moment to land."""
    for _ in range(500):  # up to 10 s: a loaded 2-core machine can be slow to deliver and reap
        if not _alive(pid):
            return False
        time.sleep(0.02)
    return True
