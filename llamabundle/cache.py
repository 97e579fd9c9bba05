"""The cache directory's layout (LLAMABUNDLE_CACHE_DIR): where sources, build trees, built zips, fetched
bundles, locks and scratch directories lie, the sweep of what killed runs left there, and the bound
(LLAMABUNDLE_CACHE_MAX): what a prune may remove, least recently used first."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if sys.platform != "win32":  # Windows has no flock: sources, toolkits and downloads are never pruned there
    import fcntl

from . import scratch

if TYPE_CHECKING:
    from .log import Log

SOURCE_PREFIX = "src-"  # a source being fetched, or a cached tree being discarded
STAGE_PREFIX = "stage-"  # a bundle being collected and packed
REPRO_PREFIX = "repro-"  # the second build of --check-reproducible
UNPACK_PREFIX = "unpack-"  # a fetched bundle being checked
VERIFY_PREFIX = "verify-"  # verify's copies of the bundles it runs
PRUNE_PREFIX = "prune-"  # an entry a prune moved aside to remove
UI_PREFIX = "ui-"  # a web UI being built (webui.py)
TMP_PREFIXES = (STAGE_PREFIX, REPRO_PREFIX, UNPACK_PREFIX, VERIFY_PREFIX, SOURCE_PREFIX, PRUNE_PREFIX,
                UI_PREFIX)  # what commands make in tmp/


def tmp_dir(cache_dir: Path) -> Path:
    """Scratch directories, each named by its owner (scratch.py), never bare /tmp."""
    return cache_dir / "tmp"


def sweep(cache_dir: Path) -> None:
    """Remove what killed runs left in the cache, whatever key it was for: their scratch directories in
    <cache>/tmp, half-packed zips in out/ and half-copied downloads in fetched/<key>/ (never a live run's).
    Every command that uses the cache calls this first."""
    scratch.sweep(tmp_dir(cache_dir), TMP_PREFIXES)
    scratch.sweep_owned(cache_dir / "out")
    try:
        fetched = [d for d in (cache_dir / "fetched").iterdir() if d.is_dir()]
    except OSError:
        fetched = []
    for d in fetched:
        scratch.sweep_owned(d)


def wine_prefix(cache_dir: Path) -> Path:
    """The private Wine prefix a Windows bundle is loaded in on Linux (never the user's ~/.wine)."""
    return cache_dir / "wine"


def lock_dir(cache_dir: Path) -> Path:
    return cache_dir / "locks"


@contextmanager
def waiting_lock(path: Path, log: Log, waiting: str) -> Iterator[None]:
    """An exclusive lock at `path` (its directory made): taken at once, else after logging `waiting` (who holds
    it and that this run waits for it)."""
    from filelock import FileLock, Timeout  # here: a command that takes no lock (a hit) does not load it

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info(waiting)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def compiler_cache_lock(cache_dir: Path, kind: str) -> Path:
    """Held by the build that runs its own server of that compiler cache (sccache: one server per local cache)."""
    return lock_dir(cache_dir) / f"compiler-cache-{kind}.lock"


def build_lock(cache_dir: Path, key: str) -> Path:
    """Held by the one process that makes a key's bundle (its build tree, its zip in out/), and by a prune
    that removes that build tree."""
    return lock_dir(cache_dir) / f"build-{key[:16]}.lock"


def fixed_dir(cache_dir: Path) -> Path:
    """The fixed-length paths a CUDA build is configured at (links to its source and build trees; build.fixed_path)."""
    return cache_dir / "fixed"


def source_dir(cache_dir: Path, commit: str) -> Path:
    return cache_dir / "src" / commit


def build_dir(cache_dir: Path, key: str, tools: Iterable[str | None], toolkit_roots: Iterable[Path] = ()) -> Path:
    """One incremental build tree per key and set of build tools (`tools`: cmake, ninja, ccache; a venv's cmake
    and the system's, or two toolkits of one version, each keep their own instead of wiping each other's)."""
    roots = "|".join(str(r) for r in toolkit_roots) or "None"
    tools_id = hashlib.sha256(f"{'|'.join(map(str, tools))}|{roots}".encode()).hexdigest()[:8]
    return cache_dir / "build" / f"{key[:16]}-{tools_id}"


def zip_name(name: str, key: str) -> str:
    return f"{name}-{key[:12]}.zip"


def out_zip(cache_dir: Path, name: str, key: str) -> Path:
    """Where a build leaves its zip."""
    return cache_dir / "out" / zip_name(name, key)


def fetched_dir(cache_dir: Path, key: str) -> Path:
    """Where a bundle fetched from a store is kept."""
    return cache_dir / "fetched" / key


def blob_dir(cache_dir: Path) -> Path:
    """The blob cache `fetch` assembles bundles from (store.blobcache: each file once, linked into each --out;
    what no --out links any more is pruned after fetch)."""
    return cache_dir / "blobs"


def deflated_dir(cache_dir: Path) -> Path:
    """The deflate streams of large bundle members, by content (bundle.deflate): a build's pack copies the stream
    of a library it packed before (the CUDA toolkit's) instead of deflating it again."""
    return cache_dir / "deflated"


# ------------------------------------------------------------------------------------------ the bound

PRUNABLE = ("fetched", "out", "build", "downloads", "src", "toolkits", "ui", "deflated")  # what a prune may remove
SHARED = ("downloads", "src", "toolkits", "ui", "deflated")  # what any build may use: removed only while no run holds `in_use`
FRESH = 120.0  # seconds: an entry used this recently may belong to a run going on now, and is kept
IN_USE = "in-use.lock"


def _lock_file(cache_dir: Path) -> int | None:
    """An open descriptor of the cache's in-use lock file (None where flock is missing, or it cannot be made)."""
    if sys.platform == "win32":
        return None
    try:
        lock_dir(cache_dir).mkdir(parents=True, exist_ok=True)
        return os.open(lock_dir(cache_dir) / IN_USE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return None


@contextmanager
def in_use(cache_dir: Path) -> Iterator[None]:
    """Held, shared, by every run that may read the cache's sources, toolkits and downloads while it lasts (a
    build, `bundle`, `toolkit install`): a prune removes those only while it holds the lock alone."""
    fd = _lock_file(cache_dir)
    if fd is None or sys.platform == "win32":
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _alone(cache_dir: Path) -> int | None:
    """The in-use lock held exclusively (its descriptor: closing it releases it), or None when a run holds it
    shared now, or where there is no flock (then sources, toolkits and downloads are never pruned)."""
    fd = _lock_file(cache_dir)
    if fd is None or sys.platform == "win32":
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def touch_used(cache_dir: Path, path: Path) -> None:
    """Mark the cache entry holding `path` (a source tree, a toolkit root) as used now; a path outside the
    cache (the user's own toolkit) is left alone."""
    try:
        parts = path.resolve().relative_to(cache_dir.resolve()).parts
    except (OSError, ValueError):
        return
    if len(parts) >= 2 and parts[0] in PRUNABLE:
        touch(cache_dir / parts[0] / parts[1])


# What lies beside a built zip in out/ and goes with it (a prune removes them together): named here, where the
# cache's layout is, and used by the modules that write them
OPS_TOOL_SUFFIX = ".test-backend-ops"  # build --ops-tool: the zip's test-backend-ops (opscheck.sibling_tool)
RPC_PRELOAD_SUFFIX = ".rpc-preload.so"  # beside that tool: its RPC preload (backends.rpc.preload_of)
SECOND_ZIP_SUFFIX = ".second.zip"  # --check-reproducible's second zip, kept where the two differ (repro.py)


def sibling(zip_path: Path, suffix: str) -> Path:
    """The file beside a built zip named by one of the suffixes above: `<name>.test-backend-ops` for `<name>.zip`."""
    return zip_path.with_name(zip_path.name.removesuffix(".zip") + suffix)


def siblings(zip_path: Path) -> tuple[Path, ...]:
    """Everything that may lie beside a built zip and goes with it."""
    return (sibling(zip_path, OPS_TOOL_SUFFIX), sibling(zip_path, OPS_TOOL_SUFFIX + RPC_PRELOAD_SUFFIX),
            sibling(zip_path, SECOND_ZIP_SUFFIX))


@dataclass(frozen=True)
class Entry:
    """One item of the cache, with its size and when it was last used."""

    area: str
    path: Path
    size: int
    used: float  # when last used (its mtime: the tool touches what it uses)
    with_it: tuple[Path, ...] = ()  # removed with it (a zip's siblings())

    def to_json(self) -> dict[str, object]:
        return {"area": self.area, "path": str(self.path), "bytes": self.size, "used": self.used}


def usage(cache_dir: Path) -> dict[str, int]:
    """Bytes under each top-level directory of the cache."""
    try:
        return {d.name: scratch.size_of(d) for d in sorted(cache_dir.iterdir()) if d.is_dir() and not d.is_symlink()}
    except OSError:
        return {}


def entries(cache_dir: Path) -> list[Entry]:
    """What a prune may remove, least recently used first: each fetched bundle, built zip (with its
    siblings), build tree and download."""
    found: list[Entry] = []
    for area in PRUNABLE:
        try:
            items = sorted(p for p in (cache_dir / area).iterdir() if not p.name.startswith("."))
        except OSError:
            continue
        for p in items:
            if area == "out" and p.suffix != ".zip" or p.name.endswith(SECOND_ZIP_SUFFIX):
                continue  # a zip's siblings go with it
            with_it = tuple(q for q in siblings(p) if q.exists())
            try:
                used = p.stat().st_mtime
            except OSError:
                continue
            found.append(Entry(area=area, path=p, size=scratch.size_of(p) + sum(scratch.size_of(q) for q in with_it), used=used,
                               with_it=with_it))
    return sorted(found, key=lambda e: e.used)


BOUND_EVERY = 600.0  # seconds between two measures of the whole cache by the bound


def bound_due(cache_dir: Path, *, now: float | None = None) -> bool:
    """Whether the bound should measure the cache now (then it is stamped as measured): at most every
    BOUND_EVERY seconds, so that a cache hit does not walk every file of the cache each time."""
    stamp = lock_dir(cache_dir) / "bound.stamp"
    now = time.time() if now is None else now
    try:
        if now - stamp.stat().st_mtime < BOUND_EVERY:
            return False
    except OSError:
        pass
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
        os.utime(stamp, (now, now))
    except OSError:
        return False
    return True


def touch(path: Path) -> None:
    """Mark what a run used as used now (the bound removes the least recently used first)."""
    try:
        os.utime(path)
    except OSError:
        pass


def prune(cache_dir: Path, *, limit: int, keep: Iterable[str] = (), dry_run: bool = False,
          now: float | None = None) -> list[Entry]:
    """Remove the least recently used entries until the cache holds at most `limit` bytes, or none is left to
    remove: never one of the keys in `keep` (what this run made or fetched), one used in the last FRESH
    seconds, a build tree whose build lock another process holds (it is building there), nor a source,
    toolkit or download while a run holds `in_use`. Returns what was (with `dry_run`: would be) removed."""
    kept = [k[:12] for k in keep]
    now = time.time() if now is None else now
    total = sum(usage(cache_dir).values())
    removed: list[Entry] = []
    alone: int | None = -1  # the in-use lock held alone (-1: not asked yet; None: it cannot be)
    try:
        for e in entries(cache_dir):
            if total <= limit:
                break
            if any(k in e.path.name for k in kept) or now - e.used < FRESH:
                continue
            if e.area in SHARED:
                if alone == -1:
                    alone = _alone(cache_dir)
                if alone is None:
                    continue
            if _remove(cache_dir, e, dry_run=dry_run):
                removed.append(e)
                total -= e.size
    finally:
        if alone is not None and alone >= 0:
            os.close(alone)
    return removed


def _remove(cache_dir: Path, e: Entry, *, dry_run: bool) -> bool:
    """Remove e (with its siblings), a build tree only if its build lock can be had at once; whether it was
    (with `dry_run`: could be) removed."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(build_lock(cache_dir, e.path.name))) if e.area == "build" else None
    try:
        if lock is not None:
            lock_dir(cache_dir).mkdir(parents=True, exist_ok=True)
            lock.acquire(timeout=0)
    except (Timeout, OSError):
        return False
    try:
        if not dry_run:
            for p in (e.path, *e.with_it):
                if p.is_dir() and not p.is_symlink():
                    # moved aside first: no run finds half of it under its name
                    aside = scratch.owned(tmp_dir(cache_dir), PRUNE_PREFIX)
                    tmp_dir(cache_dir).mkdir(parents=True, exist_ok=True)
                    os.replace(p, aside)
                    shutil.rmtree(aside, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
    except OSError:
        return False
    finally:
        if lock is not None:
            lock.release()
    return True
