"""Temporary files and directories that name their owner, and the sweep that removes those of dead owners.

Every temporary path the tool makes beside something it will publish (a store entry, a download, an
unpacked bundle, an install) is called `<prefix><pid>-<start>-<rand><suffix>`: the owner's process id,
its start time (clock ticks since boot on Linux, 100 ns units since 1601 on Windows, 0 where unknown)
and a random part. A pid alone is not enough: pids are reused, and a later process with the same pid
must not keep a dead one's 600 MB leftover alive. `sweep` removes the leftovers of owners that are no
longer running, and never those of a live one (nor the caller's own)."""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path

_OWNED = re.compile(r"(\d+)-(\d+)-[0-9a-f]{6}")
# names of versions before owners were recorded: `<prefix><pid>` (archive's .partial-) or a random tail
_LEGACY_PID = re.compile(r"(\d+)")
LEGACY_AGE = 24 * 3600  # a leftover without an owner is removed once it is this old (seconds)


def start_time(pid: int) -> int | None:
    """When process `pid` started (an opaque number, stable for the life of the process), or None when no
    such process runs. 0: it runs, but its start time cannot be read on this system."""
    # one branch per platform, in an if/elif/else that mypy evaluates for the platform it checks
    if sys.platform == "win32":
        return _windows_start_time(pid)
    elif sys.platform.startswith("linux"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            return None
        except OSError:
            return 0
        fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
        if fields and fields[0] in ("Z", "X"):  # a zombie is dead: only its exit status remains
            return None
        return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0
    else:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0
        return 0


# defined on Windows only: ctypes.WinDLL and ctypes.get_last_error exist there alone, and mypy checks this
# block only when it checks for win32 (start_time calls it from its win32 branch)
if sys.platform == "win32":
    def _windows_start_time(pid: int) -> int | None:  # pragma: no cover - Windows only
        import ctypes
        from ctypes import wintypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return 0 if ctypes.get_last_error() == 5 else None  # ERROR_ACCESS_DENIED: it exists
        try:
            code = wintypes.DWORD()
            if kernel32.GetExitCodeProcess(handle, ctypes.byref(code)) and code.value != 259:  # STILL_ACTIVE
                return None
            times = [wintypes.FILETIME() for _ in range(4)]
            if not kernel32.GetProcessTimes(handle, *(ctypes.byref(t) for t in times)):
                return 0
            return (times[0].dwHighDateTime << 32) | times[0].dwLowDateTime
        finally:
            kernel32.CloseHandle(handle)


@cache
def _my_start() -> int:
    return start_time(os.getpid()) or 0


def owner_token() -> str:
    """`<pid>-<start>-<rand>`: unique to this call, and names this process as the owner."""
    return f"{os.getpid()}-{_my_start()}-{os.urandom(3).hex()}"


def owned(directory: Path, prefix: str, suffix: str = "") -> Path:
    """A new path in `directory` (not created) that names this process as its owner."""
    return directory / f"{prefix}{owner_token()}{suffix}"


def replace_text(path: Path, text: str, *, prefix: str) -> bool:
    """Best effort: `text` as the file `path`, written under an owned name beside it (`prefix`: what sweep
    removes) and renamed over it, so that a reader sees the old file or the new one, whole. False when it could
    not be written (a read-only or full disk); nothing of it is left then."""
    tmp = owned(path.parent, prefix)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


def make_dir(directory: Path, prefix: str) -> Path:
    """A new directory in `directory` owned by this process (directory is created when missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    while True:
        path = owned(directory, prefix)
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def owner_alive(tail: str, *, mtime: float | None = None, now: float | None = None) -> bool:
    """Whether the owner named by `tail` (the name after its prefix) still runs. A legacy name with only a
    pid is alive while that pid runs; one without any owner is alive until it is LEGACY_AGE old."""
    m = _OWNED.match(tail)
    if m:
        pid, start = int(m.group(1)), int(m.group(2))
        running = start_time(pid)
        if running is None:
            return False
        return start == 0 or running == 0 or running == start
    m = _LEGACY_PID.fullmatch(tail.split(".", 1)[0])
    if m:
        return start_time(int(m.group(1))) is not None
    if mtime is None:
        return True
    return (now if now is not None else time.time()) - mtime < LEGACY_AGE


def sweep(directory: Path, prefixes: Iterable[str], *, on_removed: Callable[[Path, int], None] | None = None) -> list[Path]:
    """Remove the entries of `directory` whose name starts with one of `prefixes` and whose owner is dead.
    Returns what was removed; `on_removed(path, bytes)` is told each one. Errors are ignored: a leftover
    that cannot be removed now is tried again by the next run."""
    prefixes = tuple(prefixes)
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            continue
        path = directory / name
        try:
            st = path.lstat()
        except OSError:
            continue
        if owner_alive(name[len(prefix):], mtime=st.st_mtime):
            continue
        size = size_of(path)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(path)
        if on_removed is not None:
            on_removed(path, size)
    return removed


_TAIL = re.compile(r"[.-](\d+-\d+-[0-9a-f]{6})(?:\.[a-z]+)?$")  # ...<sep><owner token>[.part|.tmp]


def sweep_owned(directory: Path) -> list[Path]:
    """Remove the hidden entries of `directory` that name a dead owner, whatever made them (`.NAME.<owner>.part`,
    `.NAME.part-<owner>`, `.NAME.partial-<owner>`): what a killed fetch, pack or unpack left beside any key's files."""
    removed: list[Path] = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(".")]
    except OSError:
        return removed
    for name in names:
        m = _TAIL.search(name)
        if m is None:
            continue
        removed += sweep(directory, [name[:m.start(1)]])
    return removed


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (links not followed)."""
    if not path.is_dir() or path.is_symlink():
        try:
            return path.lstat().st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total
