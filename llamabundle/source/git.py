"""The git: source: a shallow fetch of exactly the commit from a remote, HEAD checked after checkout."""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from .. import proc
from ..log import Log
from ..recipe import GitSource
from ..settings import Settings
from .base import Fetched, SourceMismatch, SourceUnavailable, query

KIND = GitSource


def describe(src: GitSource) -> str:
    return f"git:{src.url}"


def fetch(src: GitSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path,
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
    head = query([git, "-C", str(repo), "rev-parse", "HEAD"], what="git rev-parse").stdout.strip()
    if head != commit:
        raise SourceMismatch(f"git:{src.url} checked out {head[:80]}, not {commit}")
    when = commit_time(git, repo)
    shutil.rmtree(repo / ".git")
    return Fetched(tree=repo, commit_time=when, proof={"method": "git fetch of the commit; HEAD checked out", "url": src.url})


def commit_time(git: str, repo: Path) -> int | None:
    out = query([git, "-C", str(repo), "log", "-1", "--format=%ct", "HEAD"], what="git log").stdout.strip()
    return int(out) if re.fullmatch(r"[0-9]{1,15}", out) else None
