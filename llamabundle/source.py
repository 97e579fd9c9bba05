"""Fetch llama.cpp at exactly the pinned commit, from the recipe's sources in order, and prove it.

A source that cannot be reached is skipped (with the reason); a source that delivers another commit
is an error and is never used. Proven trees are cached by commit under `<cache>/src/<commit>/`,
published by rename with a marker written last, under a file lock.

The marker records what the proof checked (how the commit was proven: the archive's digest, the git
index's digest) and what the proven tree was: every file's path, type and mode, size and mtime, their
count, total size and a digest of that listing. Before a cached tree is used it is re-proven by a stat
walk against that record (no file is read): a tree that was emptied, added to or altered since, or a
marker that is damaged or of an older format, is a cache miss (logged with what differs) and the
source is fetched again; it never reaches a build. Fetches work in `<cache>/tmp/src-<owner>` directories
(scratch.py); those of dead owners are removed by the next fetch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from . import cache, gitindex, net, proc, pyindex, scratch
from .archive import extract_tar
from .digest import sha256_file
from .errors import SourceError, VerifyError
from .log import Log
from .recipe import GithubSource, GitSource, PathSource, PypiSource, Recipe, Source
from .settings import Settings

MARKER = ".llamabundle-source.json"
MARKER_FORMAT = 2  # 1 (no "format" field): commit, origin and commit_time only, trusted alone
TMP_PREFIX = cache.SOURCE_PREFIX  # fetch directories and discarded trees in <cache>/tmp, named by their owner
_HEX64 = re.compile(r"[0-9a-f]{64}")


class SourceUnavailable(SourceError):
    """This source could not deliver anything (network, missing file): try the next one."""


class SourceMismatch(VerifyError):
    """A source delivered something other than the pinned commit: never used."""


@dataclass(frozen=True, kw_only=True)
class SourceTree:
    path: Path
    commit: str
    origin: str
    commit_time: int | None = None  # the commit's committer date (unix time), when the source could prove it


def describe(src: Source) -> str:
    if isinstance(src, GithubSource):
        return f"github:{src.repo}"
    if isinstance(src, GitSource):
        return f"git:{src.url}"
    if isinstance(src, PathSource):
        return f"path:{src.path}"
    return f"pypi:{src.package}=={src.version}"


# ------------------------------------------------------------------------------- the tree's record


Listing = dict[str, tuple[int, int, int]]  # path ("/"-separated, from the root) -> (st_mode, size, mtime_ns)


@dataclass(frozen=True, kw_only=True)
class TreeRecord:
    """What a stat walk of a source tree finds: every non-directory entry (files, symlinks) but the marker."""
    listing: Listing

    @property
    def files(self) -> int:
        return len(self.listing)

    @property
    def bytes(self) -> int:
        return sum(size for _mode, size, _mtime in self.listing.values())

    @property
    def digest(self) -> str:
        return listing_digest(self.listing)

    def to_json(self) -> dict[str, Any]:
        return {"files": self.files, "bytes": self.bytes, "digest": self.digest}


def listing_digest(listing: Listing) -> str:
    """sha256 of the sorted `path NUL mode NUL size NUL mtime_ns LF` lines."""
    h = hashlib.sha256()
    for path in sorted(listing):
        mode, size, mtime = listing[path]
        h.update(f"{path}\0{mode}\0{size}\0{mtime}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def record_tree(root: Path) -> TreeRecord:
    """A stat walk of root (nothing is read, symlinks are not followed): what the marker records, and what a
    cached tree is compared with before it is used. Raises OSError when root cannot be walked."""
    listing: Listing = {}
    stack = [(str(root), "")]
    while stack:
        where, rel = stack.pop()
        with os.scandir(where) as it:
            for e in it:
                name = e.name if not rel else f"{rel}/{e.name}"
                if not rel and e.name == MARKER:
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append((e.path, name))
                    continue
                st = e.stat(follow_symlinks=False)
                listing[name] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return TreeRecord(listing=listing)


def _describe_entry(mode: int, size: int) -> str:
    kind = "a symlink" if stat.S_ISLNK(mode) else "a file" if stat.S_ISREG(mode) else "a special file"
    return f"{kind} of {size} bytes"


def tree_difference(recorded: TreeRecord, found: TreeRecord, *, sample: int = 3) -> str | None:
    """None when the trees are the same; else what differs, in one line (counts, then a few examples)."""
    if recorded.listing == found.listing:
        return None
    was, now = recorded.listing, found.listing
    missing = sorted(was.keys() - now.keys())
    added = sorted(now.keys() - was.keys())
    changed = []
    for path in sorted(was.keys() & now.keys()):
        (m0, s0, t0), (m1, s1, t1) = was[path], now[path]
        if (m0, s0, t0) == (m1, s1, t1):
            continue
        if stat.S_IFMT(m0) != stat.S_IFMT(m1):
            changed.append(f"{path} (was {_describe_entry(m0, s0)}, is {_describe_entry(m1, s1)})")
        elif s0 != s1:
            changed.append(f"{path} (size {s0} -> {s1})")
        elif m0 != m1:
            changed.append(f"{path} (mode {stat.S_IMODE(m0):o} -> {stat.S_IMODE(m1):o})")
        else:
            changed.append(f"{path} (modified: mtime {t0} -> {t1} ns)")
    counts = (f"{recorded.files} files ({recorded.bytes} bytes) were proven, {found.files} ({found.bytes} bytes) "
              f"are there: {len(missing)} missing, {len(added)} added, {len(changed)} changed")
    examples = [*(f"missing {p}" for p in missing[:sample]), *(f"added {p}" for p in added[:sample]),
                *(f"changed {p}" for p in changed[:sample])]
    return counts + (" (" + "; ".join(examples) + ")" if examples else "")


# ------------------------------------------------------------------------------------- the marker


class MarkerDamaged(ValueError):
    """The marker is not one this version wrote: the cached tree is not trusted."""


@dataclass(frozen=True, kw_only=True)
class Marker:
    commit: str
    origin: str
    commit_time: int | None
    proof: Mapping[str, Any]  # how the commit was proven (method, digests): for people and for the record
    tree: TreeRecord

    def to_json(self) -> dict[str, Any]:
        return {"format": MARKER_FORMAT, "commit": self.commit, "origin": self.origin, "commit_time": self.commit_time,
                "proof": dict(self.proof), "tree": self.tree.to_json(),
                "listing": {p: list(v) for p, v in sorted(self.tree.listing.items())}}


def _int(value: Any, field: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MarkerDamaged(f"'{field}' is {str(value)[:40]!r}, not a non-negative integer")
    return value


def parse_marker(text: str) -> Marker:
    """A marker from its JSON text; raises MarkerDamaged naming what is wrong."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise MarkerDamaged(f"it is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise MarkerDamaged("it is not a JSON object")
    fmt = data.get("format")
    if fmt != MARKER_FORMAT or isinstance(fmt, bool):
        raise MarkerDamaged("it was written by an older llamabundle, which did not record the tree" if fmt is None
                            else f"it has format {repr(fmt)[:20]}, not {MARKER_FORMAT}")
    for k in ("commit", "origin", "proof", "tree", "listing"):
        if k not in data:
            raise MarkerDamaged(f"it lacks '{k}'")
    commit, origin, proof, tree, listing = (data[k] for k in ("commit", "origin", "proof", "tree", "listing"))
    if not isinstance(commit, str) or not isinstance(origin, str):
        raise MarkerDamaged("'commit' and 'origin' must be strings")
    if not isinstance(proof, dict) or not isinstance(tree, dict) or not isinstance(listing, dict):
        raise MarkerDamaged("'proof', 'tree' and 'listing' must be objects")
    files, total = _int(tree.get("files"), "tree.files"), _int(tree.get("bytes"), "tree.bytes")
    digest = tree.get("digest")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise MarkerDamaged("'tree.digest' is not a sha256")
    entries: Listing = {}
    for path, v in listing.items():
        if not path or not isinstance(v, list) or len(v) != 3:
            raise MarkerDamaged(f"listing entry {path[:80]!r} is not [mode, size, mtime_ns]")
        mode, size, mtime = (_int(x, f"listing[{path[:80]!r}]") for x in v)
        entries[path] = (mode or 0, size or 0, mtime or 0)
    record = TreeRecord(listing=entries)
    try:
        consistent = record.files == files and record.bytes == total and record.digest == digest
    except UnicodeEncodeError:
        consistent = False
    if not consistent:
        raise MarkerDamaged("its listing does not add up to its own file count, size and digest")
    return Marker(commit=commit, origin=origin, commit_time=_int(data.get("commit_time"), "commit_time", optional=True),
                  proof=proof, tree=record)


def write_marker(tree: Path, marker: Marker) -> None:
    (tree / MARKER).write_text(json.dumps(marker.to_json(), indent=None, separators=(",", ":")) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------- the cache


def cached_source(recipe: Recipe, settings: Settings, log: Log | None = None) -> SourceTree | None:
    """The cached tree of the pinned commit, re-proven against its marker by a stat walk; None (a miss, told
    to `log` with the reason) when it is absent, its marker is damaged or old, or the tree has changed."""
    commit = recipe.llama_cpp.commit
    path = cache.source_dir(settings.cache_dir, commit)
    marker, why = reprove(path, commit)
    if marker is None:
        if why is not None and log is not None:
            log.warn(f"source cache {path} is not used: {why}; fetching the source again")
        return None
    return SourceTree(path=path, commit=commit, origin=marker.origin, commit_time=marker.commit_time)


def reprove(path: Path, commit: str) -> tuple[Marker | None, str | None]:
    """(the marker, None) when the tree at `path` is still the one proven for `commit`; else (None, why),
    why being None when there is nothing there at all."""
    marker_path = path / MARKER
    if not marker_path.is_file():
        return None, ("it has no marker (an interrupted fetch)" if os.path.lexists(path) else None)
    try:
        marker = parse_marker(marker_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return None, f"its marker cannot be read ({e})"
    except MarkerDamaged as e:
        return None, f"its marker {MARKER} is damaged: {e}"
    if marker.commit != commit:
        return None, f"its marker names commit {marker.commit[:40]!r}"
    try:
        found = record_tree(path)
    except OSError as e:
        return None, f"it cannot be walked ({e.strerror or e})"
    differs = tree_difference(marker.tree, found)
    if differs is not None:
        return None, f"the tree changed since it was proven: {differs}"
    return marker, None


def _discard(path: Path, work: Path) -> None:
    """Move a cache entry that is not trusted out of the way (one rename), then remove it."""
    if not os.path.lexists(path):
        return
    work.mkdir(parents=True, exist_ok=True)
    aside = scratch.owned(work, TMP_PREFIX)
    os.replace(path, aside)
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)  # what cannot be removed now, a later sweep removes
    else:
        aside.unlink(missing_ok=True)


def fetch_source(recipe: Recipe, settings: Settings, log: Log, *, env: Mapping[str, str] | None = None) -> SourceTree:
    """llama.cpp at the recipe's pinned commit, from its first source that can prove it (cached and re-proved
    in `<cache>/src/<commit>`). `env`: the environment child processes (git) run with."""
    env = env or {}
    commit = recipe.llama_cpp.commit
    final = cache.source_dir(settings.cache_dir, commit)
    work = cache.tmp_dir(settings.cache_dir)
    lock_dir = cache.lock_dir(settings.cache_dir)
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(lock_dir / f"src-{commit}.lock"))
        with lock:
            return _fetch_locked(recipe, settings, log, final=final, work=work, env=env)
    except OSError as e:
        where = e.filename or settings.cache_dir
        raise SourceError(f"cannot fetch the source into the cache: {where}", why=e.strerror or str(e),
                          fix="check that LLAMABUNDLE_CACHE_DIR is writable and has free space") from None


def _fetch_locked(recipe: Recipe, settings: Settings, log: Log, *, final: Path, work: Path,
                  env: Mapping[str, str]) -> SourceTree:
    commit = recipe.llama_cpp.commit
    scratch.sweep(work, [TMP_PREFIX])  # what killed fetches left (never a live one's)
    hit = cached_source(recipe, settings, log)
    if hit is not None:
        log.info(f"    source: {commit[:12]} from the cache ({hit.origin})")
        return hit
    _discard(final, work)  # an entry without a valid marker, or whose tree changed, is not used
    failures: list[str] = []
    recipe_dir = Path(recipe.origin).parent if recipe.origin else Path.cwd()
    for src in recipe.llama_cpp.sources:
        name = describe(src)
        tmp = scratch.make_dir(work, TMP_PREFIX)
        try:
            try:
                fetched = _FETCH[type(src)](src, commit, tmp, settings=settings, log=log, recipe_dir=recipe_dir,
                                             env=env)
            except SourceUnavailable as e:
                reason = e.what + (f" ({e.why})" if e.why else "")
                log.warn(f"source {name} unavailable: {reason}; trying the next source")
                failures.append(f"{name}: {reason}")
                continue
            marker = Marker(commit=commit, origin=name, commit_time=fetched.commit_time, proof=fetched.proof,
                            tree=record_tree(fetched.tree))
            write_marker(fetched.tree, marker)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(fetched.tree, final)
            log.info(f"    source: {commit[:12]} proven from {name} ({marker.tree.files} files)")
            return SourceTree(path=final, commit=commit, origin=name, commit_time=fetched.commit_time)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise SourceError(f"no source delivered llama.cpp {commit[:12]}",
                      why="every source in llama_cpp.sources failed:\n    " + "\n    ".join(failures),
                      fix="check the network, or add a source that is reachable here (pypi:, path:, git:)")


@dataclass(frozen=True, kw_only=True)
class Fetched:
    tree: Path
    commit_time: int | None  # the commit's committer time, when the source proves it
    proof: dict[str, Any]  # how the commit was proven, recorded in the marker


def _query(argv: list[str], *, what: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """A short git query through the subprocess gateway; a hang or a git that cannot start is unavailable."""
    try:
        return proc.capture(argv, timeout=timeout)
    except proc.Timeout:
        raise SourceUnavailable(f"{what}: git did not answer in {timeout:.0f}s") from None
    except OSError as e:
        raise SourceUnavailable(f"{what}: git could not be started", why=str(e)) from None


# ----------------------------------------------------------------------------------- github


def _fetch_github(src: GithubSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path,
               env: Mapping[str, str]) -> Fetched:
    url = f"{settings.github_archive_url}/{src.repo}/tar.gz/{commit}"
    archive = tmp / "source.tar.gz"
    try:
        digest = net.download(url, archive, http=net.session(), log=log, connect_timeout=settings.connect_timeout)
    except net.NetworkError as e:
        raise SourceUnavailable(e.what, why=e.why) from None
    proven = archive_commit(archive)
    if proven != commit:
        raise SourceMismatch(f"github:{src.repo} delivered commit {proven or 'unknown'}, not {commit}",
                             why="the archive's pax header names another commit", fix="check the recipe's commit and source")
    out = tmp / "x"
    extract_tar(archive, out)
    tops = list(out.iterdir())
    if len(tops) != 1 or not tops[0].is_dir():
        raise SourceMismatch(f"github:{src.repo}: the archive does not hold one top directory")
    return Fetched(tree=tops[0], commit_time=archive_time(archive),
                   proof={"method": "the commit in the archive's pax header (git archive)", "archive_sha256": digest})


def archive_commit(archive: Path) -> str | None:
    """The commit `git archive` records in the pax global header (comment=<sha1>)."""
    try:
        with tarfile.open(archive) as tf:
            tf.next()
            return tf.pax_headers.get("comment")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise SourceMismatch(f"{archive.name} is not a readable tar archive", why=str(e)) from None


def archive_time(archive: Path) -> int | None:
    """`git archive` gives every member the commit's committer time as its mtime."""
    try:
        with tarfile.open(archive) as tf:
            first = tf.next()
            return int(first.mtime) if first is not None and first.mtime > 0 else None
    except (tarfile.TarError, OSError, EOFError) as e:
        raise SourceMismatch(f"{archive.name} is not a readable tar archive", why=str(e)) from None


# -------------------------------------------------------------------------------------- git


def _fetch_git(src: GitSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path,
               env: Mapping[str, str]) -> Fetched:
    git = proc.which("git", purpose="the git: source needs git")
    repo = tmp / "repo"
    env = {**env, "GIT_TERMINAL_PROMPT": "0"}  # never a password prompt
    try:
        proc.run([git, "init", "-q", str(repo)], log=log, error=SourceUnavailable, what="git init", env=env)
        proc.run([git, "-C", str(repo), "fetch", "-q", "--depth", "1", src.url, commit], log=log, error=SourceUnavailable,
                 what=f"git fetch {src.url} {commit[:12]}", env=env, timeout=1800)
        proc.run([git, "-C", str(repo), "checkout", "-q", "--detach", "FETCH_HEAD"], log=log, error=SourceUnavailable,
                 what="git checkout", env=env)
    except SourceUnavailable as e:
        raise SourceUnavailable(e.what, why=(e.details.splitlines() or [""])[-1]) from None
    head = _query([git, "-C", str(repo), "rev-parse", "HEAD"], what="git rev-parse").stdout.strip()
    if head != commit:
        raise SourceMismatch(f"git:{src.url} checked out {head[:80]}, not {commit}")
    when = _git_commit_time(git, repo)
    shutil.rmtree(repo / ".git")
    return Fetched(tree=repo, commit_time=when, proof={"method": "git fetch of the commit; HEAD checked out", "url": src.url})


def _git_commit_time(git: str, repo: Path) -> int | None:
    out = _query([git, "-C", str(repo), "log", "-1", "--format=%ct", "HEAD"], what="git log").stdout.strip()
    return int(out) if re.fullmatch(r"[0-9]{1,15}", out) else None


# ------------------------------------------------------------------------------------- path


def _fetch_path(src: PathSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path,
               env: Mapping[str, str]) -> Fetched:
    root = (recipe_dir / src.path).resolve()
    if not root.is_dir():
        raise SourceUnavailable(f"{root} is not a directory")
    git = proc.which("git", purpose="the path: source proves its commit with git")
    head = _query([git, "-C", str(root), "rev-parse", "HEAD"], what=f"git rev-parse in {root}")
    if head.returncode != 0:
        raise SourceMismatch(f"path:{root} is not a git checkout", why=head.stderr.strip(),
                             fix="point path: at a git checkout of llama.cpp, so its commit can be proven")
    if head.stdout.strip() != commit:
        raise SourceMismatch(f"path:{root} is at commit {head.stdout.strip()}, not {commit}",
                             fix=f"run `git -C {root} checkout {commit}` or change the recipe")
    dirty = _query([git, "-C", str(root), "status", "--porcelain", "--untracked-files=no"], what=f"git status in {root}")
    if dirty.stdout.strip():
        raise SourceMismatch(f"path:{root} has local changes", why=dirty.stdout.strip().splitlines()[0],
                             fix="commit or stash them: a bundle must be built from exactly the pinned commit")
    files = _query([git, "-C", str(root), "ls-files", "-z"], what=f"git ls-files in {root}").stdout.split("\0")
    out = tmp / "tree"
    out.mkdir()
    tracked = 0
    for rel in filter(None, files):
        if not gitindex.safe_path(rel):
            raise SourceMismatch(f"path:{root}: git lists a file outside the checkout: {rel[:200]!r}",
                                 fix="check the checkout and the git on PATH")
        s = root / rel
        d = out / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.is_symlink():
            os.symlink(os.readlink(s), d)
        elif s.is_file():
            shutil.copy2(s, d)
        else:
            continue
        tracked += 1
    return Fetched(tree=out, commit_time=_git_commit_time(git, root),
                   proof={"method": "a git checkout at the commit without local changes; its tracked files copied",
                          "path": str(root), "files": tracked})


# ------------------------------------------------------------------------------------- pypi


def _fetch_pypi(src: PypiSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path,
               env: Mapping[str, str]) -> Fetched:
    sdist = _pypi_sdist(src, settings, log)
    out = tmp / "x"
    with log.progress("extract sdist") as bar:
        extract_tar(sdist, out)
        bar.update(1, 1)
    tops = [p for p in out.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise SourceMismatch(f"{sdist.name}: expected one top directory in the sdist")
    top = tops[0]
    vendored = top / "vendor" / "llama.cpp"
    gitdir = top / ".git" / "modules" / "vendor" / "llama.cpp"
    if not (gitdir / "HEAD").is_file() or not (gitdir / "index").is_file() or not vendored.is_dir():
        raise SourceMismatch(f"{sdist.name} does not vendor llama.cpp with its git index",
                             why="expected vendor/llama.cpp and .git/modules/vendor/llama.cpp/{HEAD,index}",
                             fix="use a llama-cpp-python sdist that ships the submodule's git metadata")
    head = (gitdir / "HEAD").read_text(encoding="utf-8", errors="replace").strip()
    if head != commit:
        raise SourceMismatch(f"pypi:{src.package}=={src.version} vendors llama.cpp {head}, not {commit}",
                             fix="pin the commit that this sdist vendors, or another sdist version")
    index = (gitdir / "index").read_bytes()
    try:
        entries = gitindex.read_index(index)
    except gitindex.IndexFormatError as e:
        raise SourceMismatch(f"{sdist.name}: the vendored git index is unreadable", why=str(e)) from None
    check = gitindex.check_tree(vendored, entries)
    if not check.clean:
        sample = [*(f"missing {p}" for p in check.missing[:3]), *(f"modified {p}" for p in check.modified[:3]),
                  *(f"extra {p}" for p in check.extra[:3])]
        raise SourceMismatch(f"pypi:{src.package}=={src.version}: vendored tree differs from commit {commit[:12]}",
                             why=f"{len(check.missing)} missing, {len(check.modified)} modified, {len(check.extra)} extra: "
                             + "; ".join(sample), fix="do not use this sdist")
    log.info(f"    pypi:{src.package}=={src.version}: {check.checked} files match the git index of {commit[:12]}")
    (vendored / ".git").unlink(missing_ok=True)  # a gitdir pointer that would dangle once moved
    return Fetched(tree=vendored, commit_time=gitindex.loose_commit_time(gitdir, commit),
                   proof={"method": "every vendored file hashed against the submodule's git index",
                          "sdist_sha256": src.sha256, "index_sha256": hashlib.sha256(index).hexdigest(),
                          "index_entries": len(entries)})


def _pypi_sdist(src: PypiSource, settings: Settings, log: Log) -> Path:
    """The sdist, from the download cache or the index by URL (never pip), sha256-checked either way."""
    downloads = settings.cache_dir / "downloads" / src.sha256
    for f in downloads.glob("*.tar.gz") if downloads.is_dir() else ():
        if sha256_file(f) == src.sha256:
            return f
        log.warn(f"{f} does not have the pinned sha256: not trusted, downloading it again")
        f.unlink()
    name = pyindex.sdist_filename(src.package, src.version)
    try:
        return pyindex.download_pinned(src.package, name, sha256=src.sha256, size=None, dest_dir=downloads,
                                       index_url=settings.pip_index_url, http=net.session(), log=log,
                                       connect_timeout=settings.connect_timeout, mismatch_error=SourceMismatch)
    except net.NetworkError as e:  # the index or the file host unreachable: try the next source
        raise SourceUnavailable(e.what, why=e.why) from None
    except VerifyError as e:
        if isinstance(e, SourceMismatch):
            raise
        raise SourceMismatch(e.what, why=e.why, fix=e.fix) from None


_FETCH: dict[type, Callable[..., Fetched]] = {GithubSource: _fetch_github, GitSource: _fetch_git, PathSource: _fetch_path,
                                              PypiSource: _fetch_pypi}
