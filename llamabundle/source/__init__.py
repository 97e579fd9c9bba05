"""Fetch llama.cpp at exactly the pinned commit, from the recipe's sources in order, and prove it. One module per
source kind (github, git, path, pypi: the recipe's vocabulary) behind one registry, KINDS. A source that cannot
be reached is skipped (with the reason); one that delivers another commit is an error and is never used.
Proven trees are cached by commit under `<cache>/src/<commit>/`, published by rename with a marker written
last, under a file lock, and re-proven by a stat walk before each use (proof.py): a tree changed since, or a
damaged marker, is a miss. Fetches work in `<cache>/tmp/src-<owner>` directories (scratch.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from filelock import FileLock

from .. import cache, scratch
from ..errors import SourceError
from ..log import Log
from ..recipe import Recipe, Source
from ..settings import Settings
from . import git, github, path, pypi
from .base import Fetched, SourceMismatch, SourceUnavailable
from .proof import MARKER, Marker, MarkerDamaged, parse_marker, record_tree, reprove, tree_difference, write_marker

KINDS: dict[type, ModuleType] = {m.KIND: m for m in (github, git, path, pypi)}  # one per kind of recipe.Source
TMP_PREFIX = cache.SOURCE_PREFIX  # fetch directories and discarded trees in <cache>/tmp, named by their owner

__all__ = ["KINDS", "MARKER", "TMP_PREFIX", "Fetched", "Marker", "MarkerDamaged", "SourceMismatch", "SourceTree",
           "SourceUnavailable", "cached_source", "describe", "fetch_source", "parse_marker", "record_tree", "reprove",
           "tree_difference", "write_marker"]


@dataclass(frozen=True, kw_only=True)
class SourceTree:
    path: Path
    commit: str
    origin: str
    commit_time: int | None = None  # the commit's committer date (unix time), when the source could prove it


def describe(src: Source) -> str:
    """The source as the recipe names it: github:OWNER/NAME, git:URL, path:PATH, pypi:NAME==VERSION."""
    name: str = KINDS[type(src)].describe(src)
    return name


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
                fetched = KINDS[type(src)].fetch(src, commit, tmp, settings=settings, log=log, recipe_dir=recipe_dir,
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
