"""The pypi: source: an sdist that vendors llama.cpp with its git index (llama-cpp-python), downloaded by URL from
the package index and pinned by sha256; every vendored file is hashed against the submodule's git index."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from .. import gitindex, net, pyindex
from ..archive import extract_tar
from ..digest import sha256_file
from ..errors import VerifyError
from ..log import Log
from ..recipe import PypiSource
from ..settings import Settings
from .base import Fetched, SourceMismatch, SourceUnavailable

KIND = PypiSource


def describe(src: PypiSource) -> str:
    return f"pypi:{src.package}=={src.version}"


def fetch(src: PypiSource, commit: str, tmp: Path, *, settings: Settings, log: Log, recipe_dir: Path,
          env: Mapping[str, str]) -> Fetched:
    sdist = download_sdist(src, settings, log)
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


def download_sdist(src: PypiSource, settings: Settings, log: Log) -> Path:
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
