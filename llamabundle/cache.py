"""The cache directory's layout (LLAMABUNDLE_CACHE_DIR): where sources, build trees, built zips, fetched
bundles, locks and scratch directories lie, and the sweep of what killed runs left there."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from . import scratch

SOURCE_PREFIX = "src-"  # a source being fetched, or a cached tree being discarded
STAGE_PREFIX = "stage-"  # a bundle being collected and packed
REPRO_PREFIX = "repro-"  # the second build of --check-reproducible
UNPACK_PREFIX = "unpack-"  # a fetched bundle being checked
VERIFY_PREFIX = "verify-"  # verify's copies of the bundles it runs
TMP_PREFIXES = (STAGE_PREFIX, REPRO_PREFIX, UNPACK_PREFIX, VERIFY_PREFIX, SOURCE_PREFIX)  # what commands make in tmp/


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
