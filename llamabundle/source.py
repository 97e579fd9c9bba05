"""Fetch llama.cpp at exactly the pinned commit, from the recipe's sources in order, and prove it.

A source that cannot be reached is skipped (with the reason); a source that delivers another commit
is an error and is never used. Proven trees are cached by commit under `<cache>/src/<commit>/`,
published by rename with a marker written last, under a file lock.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from . import gitindex, net, proc, pyindex
from .archive import extract_tar
from .bundle import sha256_file
from .errors import SourceError, VerifyError
from .log import Log
from .recipe import GithubSource, GitSource, PathSource, PypiSource, Recipe, Settings, Source

MARKER = ".llamabundle-source.json"


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


def cached_source(recipe: Recipe, settings: Settings) -> SourceTree | None:
    commit = recipe.llama_cpp.commit
    path = settings.cache_dir / "src" / commit
    marker = path / MARKER
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    if info.get("commit") != commit:
        return None
    t = info.get("commit_time")
    return SourceTree(path=path, commit=commit, origin=info.get("origin", "?"), commit_time=t if isinstance(t, int) else None)


def fetch_source(recipe: Recipe, settings: Settings, log: Log) -> SourceTree:
    commit = recipe.llama_cpp.commit
    final = settings.cache_dir / "src" / commit
    lock_dir = settings.cache_dir / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / f"src-{commit}.lock")):
        hit = cached_source(recipe, settings)
        if hit is not None:
            log.info(f"    source: {commit[:12]} from the cache ({hit.origin})")
            return hit
        shutil.rmtree(final, ignore_errors=True)  # an entry without its marker is incomplete
        work = settings.cache_dir / "tmp"
        work.mkdir(parents=True, exist_ok=True)
        failures: list[str] = []
        recipe_dir = Path(recipe.origin).parent if recipe.origin else Path.cwd()
        for src in recipe.llama_cpp.sources:
            name = describe(src)
            with tempfile.TemporaryDirectory(dir=work, prefix="src-") as tmp:
                try:
                    tree, commit_time = _FETCH[type(src)](src, commit, Path(tmp), settings=settings, log=log,
                                                          recipe_dir=recipe_dir)
                except SourceUnavailable as e:
                    reason = e.what + (f" ({e.why})" if e.why else "")
                    log.warn(f"source {name} unavailable: {reason}; trying the next source")
                    failures.append(f"{name}: {reason}")
                    continue
                (tree / MARKER).write_text(json.dumps({"commit": commit, "origin": name, "commit_time": commit_time},
                                                      indent=1))
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tree, final)
                log.info(f"    source: {commit[:12]} proven from {name}")
                return SourceTree(path=final, commit=commit, origin=name, commit_time=commit_time)
        raise SourceError(f"no source delivered llama.cpp {commit[:12]}",
                          why="every source in llama_cpp.sources failed:\n    " + "\n    ".join(failures),
                          fix="check the network, or add a source that is reachable here (pypi:, path:, git:)")


# ----------------------------------------------------------------------------------- github


Fetched = tuple[Path, int | None]  # the tree, and the commit's committer time when proven


def _fetch_github(src: GithubSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path) -> Fetched:
    url = f"{settings.github_archive_url}/{src.repo}/tar.gz/{commit}"
    archive = tmp / "source.tar.gz"
    try:
        net.download(url, archive, http=net.session(), log=log, connect_timeout=settings.connect_timeout)
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
    return tops[0], archive_time(archive)


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


def _fetch_git(src: GitSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path) -> Fetched:
    git = proc.which("git", purpose="the git: source needs git")
    repo = tmp / "repo"
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    try:
        proc.run([git, "init", "-q", str(repo)], log=log, error=SourceUnavailable, what="git init", env=env)
        proc.run([git, "-C", str(repo), "fetch", "-q", "--depth", "1", src.url, commit], log=log, error=SourceUnavailable,
                 what=f"git fetch {src.url} {commit[:12]}", env=env, timeout=1800)
        proc.run([git, "-C", str(repo), "checkout", "-q", "--detach", "FETCH_HEAD"], log=log, error=SourceUnavailable,
                 what="git checkout", env=env)
    except SourceUnavailable as e:
        raise SourceUnavailable(e.what, why=(e.details.splitlines() or [""])[-1]) from None
    head = proc.capture([git, "-C", str(repo), "rev-parse", "HEAD"]).stdout.strip()
    if head != commit:
        raise SourceMismatch(f"git:{src.url} checked out {head}, not {commit}")
    when = _git_commit_time(git, repo)
    shutil.rmtree(repo / ".git")
    return repo, when


def _git_commit_time(git: str, repo: Path) -> int | None:
    out = proc.capture([git, "-C", str(repo), "log", "-1", "--format=%ct", "HEAD"]).stdout.strip()
    return int(out) if out.isdigit() else None


# ------------------------------------------------------------------------------------- path


def _fetch_path(src: PathSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path) -> Fetched:
    root = (recipe_dir / src.path).resolve()
    if not root.is_dir():
        raise SourceUnavailable(f"{root} is not a directory")
    git = proc.which("git", purpose="the path: source proves its commit with git")
    head = proc.capture([git, "-C", str(root), "rev-parse", "HEAD"])
    if head.returncode != 0:
        raise SourceMismatch(f"path:{root} is not a git checkout", why=head.stderr.strip(),
                             fix="point path: at a git checkout of llama.cpp, so its commit can be proven")
    if head.stdout.strip() != commit:
        raise SourceMismatch(f"path:{root} is at commit {head.stdout.strip()}, not {commit}",
                             fix=f"run `git -C {root} checkout {commit}` or change the recipe")
    dirty = proc.capture([git, "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    if dirty.stdout.strip():
        raise SourceMismatch(f"path:{root} has local changes", why=dirty.stdout.strip().splitlines()[0],
                             fix="commit or stash them: a bundle must be built from exactly the pinned commit")
    files = proc.capture([git, "-C", str(root), "ls-files", "-z"]).stdout.split("\0")
    out = tmp / "tree"
    for rel in filter(None, files):
        s = root / rel
        d = out / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.is_symlink():
            os.symlink(os.readlink(s), d)
        elif s.is_file():
            shutil.copy2(s, d)
    return out, _git_commit_time(git, root)


# ------------------------------------------------------------------------------------- pypi


def _fetch_pypi(src: PypiSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path) -> Fetched:
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
    head = (gitdir / "HEAD").read_text().strip()
    if head != commit:
        raise SourceMismatch(f"pypi:{src.package}=={src.version} vendors llama.cpp {head}, not {commit}",
                             fix="pin the commit that this sdist vendors, or another sdist version")
    try:
        entries = gitindex.read_index((gitdir / "index").read_bytes())
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
    return vendored, gitindex.loose_commit_time(gitdir, commit)


def _pypi_sdist(src: PypiSource, settings: Settings, log: Log) -> Path:
    """The sdist, from the download cache or the index by URL (never pip), sha256-checked either way."""
    cache = settings.cache_dir / "downloads" / src.sha256
    for f in cache.glob("*.tar.gz") if cache.is_dir() else ():
        if sha256_file(f) == src.sha256:
            return f
        log.warn(f"{f} does not have the pinned sha256: not trusted, downloading it again")
        f.unlink()
    name = pyindex.sdist_filename(src.package, src.version)
    try:
        return pyindex.download_pinned(src.package, name, sha256=src.sha256, size=None, dest_dir=cache,
                                       index_url=settings.pip_index_url, http=net.session(), log=log,
                                       connect_timeout=settings.connect_timeout, mismatch_error=SourceMismatch)
    except net.NetworkError as e:  # the index or the file host unreachable: try the next source
        raise SourceUnavailable(e.what, why=e.why) from None
    except VerifyError as e:
        if isinstance(e, SourceMismatch):
            raise
        raise SourceMismatch(e.what, why=e.why, fix=e.fix) from None


_FETCH = {GithubSource: _fetch_github, GitSource: _fetch_git, PathSource: _fetch_path, PypiSource: _fetch_pypi}
