"""The install root's per-name lock, a protocol any language follows without a native module: the directory
`<root>/bundles/.locks/NAME.held/` with the holder's `owner.json` (pid, start time, host, token), made by renaming
a directory of the taker's own into place, so exactly one taker wins and the owner is always readable. A waiter
breaks the lock of a holder on this host whose pid runs no more (or runs with another start time) by renaming it
to `.stale-<holder's token>`, a name every waiter of that holder computes alike, kept STALE_KEEP seconds so a
late waiter cannot move the next holder's lock. Readers of an install never take it. docs/install-rules.md#the-slot-lock
gives the protocol step by step; tests/consumer/install.mjs follows it in Node."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .. import __version__, scratch
from .results import utc_timestamp

HELD = ".held"
NEW = ".new-"
STALE = ".stale-"
RELEASED = ".released-"
OWNER = "owner.json"
STALE_KEEP = 600  # seconds a broken lock's directory is kept: a waiter that read the dead holder cannot move a live one
INVALID_AGE = 30  # seconds after which a NAME.held without a readable owner.json (hand-made, or a crashed disk) is stale
_TOKEN = re.compile(r"\d{1,10}-\d{1,20}-[0-9a-f]{6}")
OWNER_BYTES = 4096
# what a rename onto an existing NAME.held gives: Linux ENOTEMPTY/EEXIST, Windows (WinError 183 or 5) EEXIST/EACCES
_HELD_ERRNOS = {errno.EEXIST, errno.ENOTEMPTY, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR}


@dataclass(frozen=True)
class Owner:
    pid: int
    start: int
    host: str
    token: str
    since: str
    by: str

    def describe(self) -> str:
        return f"pid {self.pid}" + (f" on {self.host}" if self.host != socket.gethostname() else "") + \
            (f" ({self.by})" if self.by else "") + (f", since {self.since}" if self.since else "")


class Busy(Exception):
    """The lock stayed held by a live owner until the timeout."""

    def __init__(self, owner: Owner | None, path: Path) -> None:
        super().__init__(f"{path} is held by {owner.describe() if owner else 'an unreadable owner'}")
        self.owner = owner
        self.path = path


def read_owner(held: Path) -> Owner | None:
    """The owner recorded in `held` (a NAME.held directory), or None when there is none or it is not valid."""
    try:
        with open(held / OWNER, "rb") as f:
            raw = f.read(OWNER_BYTES + 1)
        data = json.loads(raw) if len(raw) <= OWNER_BYTES else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    pid, start, host, token = data.get("pid"), data.get("start"), data.get("host"), data.get("token")
    if not (type(pid) is int and pid > 0 and type(start) is int and start >= 0 and isinstance(host, str)
            and isinstance(token, str) and _TOKEN.fullmatch(token)):
        return None
    since, by = data.get("since"), data.get("by")
    return Owner(pid=pid, start=start, host=host, token=token, since=since if isinstance(since, str) else "",
                 by=by if isinstance(by, str) else "")


def alive(owner: Owner) -> bool:
    """Whether `owner` may still hold its lock: a holder on another host always may."""
    if owner.host != socket.gethostname():
        return True
    running = scratch.start_time(owner.pid)
    if running is None:
        return False
    return owner.start == 0 or running == 0 or running == owner.start


def _break(locks: Path, held: Path, tag: str) -> None:
    """Move a stale NAME.held aside as `.stale-<tag>`: only one waiter of that holder succeeds."""
    aside = locks / f"{STALE}{tag}"
    try:
        os.rename(held, aside)
    except OSError:
        return  # another waiter broke it first, or it was released meanwhile
    try:
        (aside / "broken").write_text(f"{utc_timestamp()} by pid {os.getpid()}\n", encoding="utf-8")  # dates the directory
    except OSError:
        pass


def _sweep(locks: Path) -> None:
    """Remove what dead takers left (`.new-`, `.released-`) and broken locks older than STALE_KEEP."""
    scratch.sweep(locks, [NEW, RELEASED])
    now = time.time()
    try:
        names = [n for n in os.listdir(locks) if n.startswith(STALE)]
    except OSError:
        return
    for n in names:
        try:
            if now - (locks / n).stat().st_mtime > STALE_KEEP:
                shutil.rmtree(locks / n, ignore_errors=True)
        except OSError:
            pass


def _take(locks: Path, held: Path, token: str) -> bool:
    new = locks / f"{NEW}{token}"
    if not new.is_dir():
        new.mkdir()
        record = {"by": f"llamabundle {__version__}", "host": socket.gethostname(), "pid": os.getpid(),
                  "since": utc_timestamp(), "start": scratch.start_time(os.getpid()) or 0, "token": token}
        (new / OWNER).write_text(json.dumps(record, sort_keys=True) + "\n", encoding="utf-8")
    try:
        os.rename(new, held)
        return True
    except OSError as e:
        if e.errno in _HELD_ERRNOS:
            return False
        raise  # not "already held": a disk error


@dataclass(frozen=True)
class Held:
    """A lock this process holds: `release()` gives it back."""

    locks: Path
    path: Path
    token: str

    def release(self) -> None:
        owner = read_owner(self.path)
        if owner is None or owner.token != self.token:
            return  # not ours any more (broken by a waiter that judged this process dead): leave the new holder's alone
        gone = self.locks / f"{RELEASED}{self.token}"
        try:
            os.rename(self.path, gone)
        except OSError:
            return
        shutil.rmtree(gone, ignore_errors=True)


def take(locks: Path, name: str, *, timeout: float, on_wait: Callable[[Owner | None], None] | None = None) -> Held:
    """Take slot `name`'s lock in `locks` (created when missing); Busy after `timeout` seconds of a live holder.
    `on_wait` is told the holder once, when this call first has to wait."""
    locks.mkdir(parents=True, exist_ok=True)
    _sweep(locks)
    held = locks / f"{name}{HELD}"
    token = scratch.owner_token()
    deadline = time.monotonic() + timeout
    delay, told = 0.02, False
    try:
        while not _take(locks, held, token):
            owner = read_owner(held)
            if owner is not None and not alive(owner):
                _break(locks, held, owner.token)
                continue
            if owner is None:
                try:
                    age = time.time() - held.lstat().st_mtime
                except OSError:
                    continue  # released between the rename and the read: take it now
                if age > INVALID_AGE:
                    _break(locks, held, f"invalid-{time.time_ns()}")
                    continue
            if time.monotonic() > deadline:
                raise Busy(owner, held)
            if not told and on_wait is not None:
                on_wait(owner)
                told = True
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
    finally:
        shutil.rmtree(locks / f"{NEW}{token}", ignore_errors=True)
    return Held(locks, held, token)


@contextmanager
def holding(locks: Path, name: str, *, timeout: float,
            on_wait: Callable[[Owner | None], None] | None = None) -> Iterator[Path]:
    """`take`, the body, then release (the lock's path is what it yields)."""
    lock = take(locks, name, timeout=timeout, on_wait=on_wait)
    try:
        yield lock.path
    finally:
        lock.release()
