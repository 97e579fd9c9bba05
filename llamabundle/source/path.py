"""The path: source: a local git checkout at the commit without local changes; its tracked files are copied."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from .. import gitindex, proc
from ..log import Log
from ..recipe import PathSource
from ..settings import Settings
from .base import Fetched, SourceMismatch, SourceUnavailable, query
from .git import commit_time

KIND = PathSource


def describe(src: PathSource) -> str:
    return f"path:{src.path}"


def fetch(src: PathSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path,
          env: Mapping[str, str]) -> Fetched:
    root = (recipe_dir / src.path).resolve()
    if not root.is_dir():
        raise SourceUnavailable(f"{root} is not a directory")
    git = proc.which("git", purpose="the path: source proves its commit with git")
    head = query([git, "-C", str(root), "rev-parse", "HEAD"], what=f"git rev-parse in {root}")
    if head.returncode != 0:
        raise SourceMismatch(f"path:{root} is not a git checkout", why=head.stderr.strip(),
                             fix="point path: at a git checkout of llama.cpp, so its commit can be proven")
    if head.stdout.strip() != commit:
        raise SourceMismatch(f"path:{root} is at commit {head.stdout.strip()}, not {commit}",
                             fix=f"run `git -C {root} checkout {commit}` or change the recipe")
    dirty = query([git, "-C", str(root), "status", "--porcelain", "--untracked-files=no"], what=f"git status in {root}")
    if dirty.stdout.strip():
        raise SourceMismatch(f"path:{root} has local changes", why=dirty.stdout.strip().splitlines()[0],
                             fix="commit or stash them: a bundle must be built from exactly the pinned commit")
    files = query([git, "-C", str(root), "ls-files", "-z"], what=f"git ls-files in {root}").stdout.split("\0")
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
    return Fetched(tree=out, commit_time=commit_time(git, root),
                   proof={"method": "a git checkout at the commit without local changes; its tracked files copied",
                          "path": str(root), "files": tracked})
