"""The github: source: the archive tarball of the commit, proven by the commit `git archive` records in its pax
header (and the commit's time by its members' mtime)."""

from __future__ import annotations

import tarfile
from collections.abc import Mapping
from pathlib import Path

from .. import net
from ..archive import extract_tar
from ..log import Log
from ..recipe import GithubSource
from ..settings import Settings
from .base import Fetched, SourceMismatch, SourceUnavailable

KIND = GithubSource


def describe(src: GithubSource) -> str:
    return f"github:{src.repo}"


def fetch(src: GithubSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path,
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
