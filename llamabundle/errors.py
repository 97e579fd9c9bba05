"""One error root. Every failure carries what failed, why, and what to do, and an exit code (DESIGN §8)."""

from __future__ import annotations

import os


class LlamaBundleError(Exception):
    """Root of every error the tool reports. Printed once by the CLI, without a traceback."""

    exit_code: int = 1

    def __init__(self, what: str, *, why: str = "", fix: str = "", details: str = "",
                 file: str | None = None, line: int | None = None, col: int | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.why = why
        self.fix = fix
        self.details = details
        # where in a file the problem is (1-based), when known: a GitHub annotation points there.
        # The message (`what`) already names it for people; these are for machines.
        self.file = file
        self.line = line
        self.col = col

    def render(self) -> str:
        lines = [f"error: {self.what}"]
        if self.why:
            lines.append(f"  why: {self.why}")
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        if self.details:
            lines.append(self.details.rstrip())
        return "\n".join(lines)


class UsageError(LlamaBundleError):
    exit_code = 2


class RecipeError(LlamaBundleError):
    exit_code = 2


class ToolchainError(LlamaBundleError):
    exit_code = 3


class BuildError(LlamaBundleError):
    exit_code = 4


class VerifyError(LlamaBundleError):
    exit_code = 5


class StoreError(LlamaBundleError):
    exit_code = 6


class SourceError(StoreError):
    """The pinned source could not be fetched (network) or did not prove the pinned commit."""


class DiskError(StoreError):
    """A file could not be read or written for a reason of the disk, not of the tool: full, read-only, no
    permission, or a path that is not what it should be (exit 6, as for a store)."""


def disk_fix(e: OSError) -> str:
    """What to do about an OSError on a path the message already names, by its cause."""
    import errno

    return {errno.ENOSPC: "free space on that filesystem, or use another directory",
            errno.EDQUOT: "free space on that filesystem (your quota is used up), or use another directory",
            errno.EROFS: "that filesystem is mounted read-only: use a writable directory",
            errno.EACCES: "check its permissions, or use another directory",
            errno.EPERM: "check its permissions, or use another directory",
            errno.ENOTDIR: "a part of that path is a file, not a directory: use another directory",
            errno.EISDIR: "that path is a directory: pass a file",
            errno.ENOENT: "check that the path exists"}.get(e.errno or 0, "check the path and its filesystem, then retry")


_OWNERS: dict[str, str] = {}  # a directory the command line names -> whose it is, e.g. "--out"


def own(path: str | os.PathLike[str], whose: str) -> None:
    """Name whose a directory is (the cache, --out, the install root, a store): a disk error under it says so."""
    _OWNERS[os.path.abspath(path)] = whose


def forget_owners() -> None:
    _OWNERS.clear()


def owner_of(path: str) -> str | None:
    """Whose the deepest owned directory holding `path` is (None: no directory the command line names)."""
    full = os.path.abspath(path)

    def holds(d: str) -> bool:  # (an --out is filled first beside it: .NAME.partial-<owner>)
        partial = os.path.join(os.path.dirname(d), f".{os.path.basename(d)}.partial-")
        return full == d or full.startswith(d.rstrip(os.sep) + os.sep) or full.startswith(partial)

    hits = [d for d in _OWNERS if holds(d)]
    return _OWNERS[max(hits, key=len)] if hits else None


def in_whose(path: str | os.PathLike[str]) -> str:
    """" (in the cache, …)" for a path under an owned directory, else ""."""
    whose = owner_of(os.fspath(path))
    return f" (in {whose})" if whose else ""


def from_os_error(e: OSError, *, doing: str = "") -> DiskError:
    """The OSError as one clear message naming the path that failed, whose it is (own()), why, and what to do."""
    if e.filename is None and (isinstance(e, (ConnectionError, TimeoutError))
                               or type(e).__module__.split(".")[0] in ("requests", "urllib3", "http", "ssl")):
        return DiskError(f"a network connection failed{' while trying to ' + doing if doing else ''}",
                         why=str(e)[:300] or type(e).__name__, fix="check the network and retry")
    path = e.filename if e.filename is not None else "a file"
    what = f"cannot {doing} {path}" if doing else f"cannot use {path}"
    if e.filename2 is not None:
        what += f" (and {e.filename2})"
    if e.filename is not None:
        what += in_whose(path)
    return DiskError(what, why=e.strerror or str(e), fix=disk_fix(e))
