"""Whether a process is still running, for the tests that kill or interrupt real processes (a zombie counts as
gone: PID 1 of a container may never reap it)."""

from __future__ import annotations

import os
import time


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
