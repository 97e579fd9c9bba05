"""Install a CUDA toolkit from NVIDIA's redist archives (no installer, no admin rights). Each archive is
downloaded once into ``<cache>/downloads/<sha256>/<name>`` (size and sha256 checked while streaming,
re-hashed before reuse), extracted safely and flattened with the others into one root (each component's
LICENSE as LICENSE.<component>; lib64 -> lib on Linux; a file two components ship must be the same), with
version.json and the marker last, renamed into place under a file lock: two concurrent installs give one
complete root (docs/cuda-toolkit.md)."""

from __future__ import annotations

import filecmp
import os
import posixpath
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import requests

from .... import archive as archive_mod
from .... import net, platforms
from ....digest import sha256_file
from ....errors import ToolchainError, VerifyError
from ....log import Log
from ....settings import Settings
from . import layout
from .manifest import Archive, Manifest
from .plan import ToolkitPlan, plan_toolkit

LICENSE_NAMES = ("LICENSE", "LICENSE.txt")


@dataclass
class InstallResult:
    toolkit: layout.Toolkit
    reused: bool
    downloaded_bytes: int = 0
    downloaded: list[str] = field(default_factory=list)  # archive names fetched from the network
    from_cache: list[str] = field(default_factory=list)  # archive names reused from the download cache


# ------------------------------------------------------------------------------------ downloads


def download_path(cache_dir: Path, a: Archive) -> Path:
    return cache_dir / "downloads" / a.sha256 / a.name


def is_cached(cache_dir: Path, a: Archive) -> bool:
    """Cheap: the cached file exists with the pinned size (an install re-hashes it before use)."""
    p = download_path(cache_dir, a)
    try:
        return p.is_file() and p.stat().st_size == a.size
    except OSError:
        return False


def cached_map(plan: ToolkitPlan, cache_dir: Path) -> dict[str, bool]:
    return {pa.component: is_cached(cache_dir, pa.archive) for pa in plan.archives}






def fetch_archive(a: Archive, *, base_url: str, cache_dir: Path, http: requests.Session, log: Log,
                  retries: int = 4, backoff: float = 1.0, connect_timeout: float = 10.0) -> tuple[Path, bool]:
    """The verified archive in the download cache; (path, True) when it had to be downloaded."""
    path = download_path(cache_dir, a)
    with layout.cache_lock(cache_dir, f"download-{a.sha256}"):
        if path.is_file():
            if path.stat().st_size == a.size and sha256_file(path) == a.sha256:
                return path, False
            log.warn(f"cached {a.name} does not match its pinned sha256/size; downloading it again")
            path.unlink()
        url = a.url(base_url)
        log.info(f"    download {a.name} ({a.size:,} bytes) from {url}")
        net.download(url, path, http=http, log=log, sha256=a.sha256, size=a.size, retries=retries, backoff=backoff,
                     mismatch_error=ToolchainError, connect_timeout=connect_timeout)
        return path, True


# ------------------------------------------------------------------------------------- assemble


def _conflict(rel: PurePosixPath, comp: str, owners: Mapping[PurePosixPath, str], why: str) -> ToolchainError:
    other = next((owners[p] for p in (rel, *rel.parents) if p in owners), "another component")
    return ToolchainError(f"components {other} and {comp} both ship {rel} with different content",
                          why=why, fix="drop one of the two components from the recipe")


def _merge(src: Path, dst: Path, rel: PurePosixPath, comp: str, owners: dict[PurePosixPath, str]) -> None:
    """Move src's entries into dst; identical duplicates are fine, anything else is a conflict."""
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        r = rel / entry.name
        s, d = Path(entry.path), dst / entry.name
        if entry.is_symlink():
            target = os.readlink(s)
            resolved = posixpath.normpath(posixpath.join(str(r.parent), target.replace("\\", "/")))
            if posixpath.isabs(target) or resolved == ".." or resolved.startswith("../"):
                raise ToolchainError(f"{comp}: the link {r} -> {target} points outside the toolkit",
                                     fix="do not use this archive")
            if d.is_symlink() or d.exists():
                if d.is_symlink() and os.readlink(d) == target:
                    continue
                raise _conflict(r, comp, owners, f"{r} is a link to {target} in {comp}")
            os.rename(s, d)
        elif entry.is_dir():
            if d.is_symlink() or (d.exists() and not d.is_dir()):
                raise _conflict(r, comp, owners, f"{r} is a directory in {comp} and not in the other")
            if not d.exists():
                os.rename(s, d)
            else:
                _merge(s, d, r, comp, owners)
                continue
        else:
            if d.is_symlink() or d.exists():
                if d.is_file() and not d.is_symlink() and filecmp.cmp(s, d, shallow=False):
                    continue
                raise _conflict(r, comp, owners, "the two files differ")
            os.rename(s, d)
        owners[r] = comp


def _top_dir(xdir: Path, a: Archive) -> Path:
    entries = list(xdir.iterdir())
    dirs = [e for e in entries if e.is_dir() and not e.is_symlink()]
    if len(entries) != 1 or len(dirs) != 1:
        raise ToolchainError(f"{a.name}: expected one top directory ({a.component}-{a.platform}-{a.version}-archive/)",
                             why=f"found {', '.join(sorted(e.name for e in entries)) or 'nothing'}",
                             fix="the archive is not a CUDA redist archive; check the manifest and mirror")
    return dirs[0]


def assemble(plan: ToolkitPlan, archives: Mapping[str, Path], tree: Path, *, log: Log | None = None) -> None:
    """Build the whole toolkit tree at `tree` (which must not exist): files, licenses, version.json, marker."""
    tree.mkdir(parents=True)
    staging = tree.parent / f"{tree.name}.x"
    owners: dict[PurePosixPath, str] = {}
    try:
        for pa in plan.archives:
            a = pa.archive
            xdir = staging / a.component
            try:
                if a.kind == "zip":
                    archive_mod.extract_zip(archives[a.component], xdir)
                else:
                    archive_mod.extract_tar(archives[a.component], xdir)
            except VerifyError as e:
                raise ToolchainError(f"cannot extract {a.name}", why=f"{e.what}; {e.why}".rstrip("; "),
                                     fix=e.fix or "remove it from the download cache and retry") from None
            top = _top_dir(xdir, a)
            for lic in LICENSE_NAMES:
                if (top / lic).is_file() and not (top / lic).is_symlink():
                    os.rename(top / lic, tree / f"LICENSE.{a.component}")
                    owners[PurePosixPath(f"LICENSE.{a.component}")] = a.component
                    break
            else:
                if log is not None:
                    log.warn(f"{a.name} has no LICENSE file")
            _merge(top, tree, PurePosixPath("."), a.component, owners)
            shutil.rmtree(xdir)
        if platforms.get(plan.platform).system == "linux":
            lib64 = tree / "lib64"
            if not lib64.exists() and not lib64.is_symlink():
                (tree / "lib").mkdir(exist_ok=True)
                os.symlink("lib", lib64, target_is_directory=True)
        layout.write_version_json(tree, version=plan.version, components=plan.components)
        layout.write_marker(tree, version=plan.version, platform=plan.platform, source=plan.source,
                            components=plan.components)  # last: its presence means "complete"
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# -------------------------------------------------------------------------------------- install






def installed(plan: ToolkitPlan, root: Path) -> layout.Toolkit | None:
    """The toolkit at root when it is this plan's and complete; None when absent. Raises when changed or foreign."""
    return layout.installed_as(root, layout.Wanted(version=plan.version, platform=plan.platform, source=plan.source,
                                                 components=plan.components))




def install(plan: ToolkitPlan, *, cache_dir: Path, base_url: str, log: Log, dest: Path | None = None,
            http: requests.Session | None = None, retries: int = 4, backoff: float = 1.0,
            connect_timeout: float = 10.0) -> InstallResult:
    """Install the plan into `dest` (default: its content-addressed root under cache_dir); reuse a complete one."""
    if plan.source != "redist":
        raise ToolchainError(f"toolkit source '{plan.source}' is not installed by the redist installer")
    own_root = dest is None
    root = (plan.root(cache_dir) if dest is None else dest).absolute()
    root.parent.mkdir(parents=True, exist_ok=True)
    wanted = layout.Wanted(version=plan.version, platform=plan.platform, source=plan.source, components=plan.components)
    with layout.root_lock(cache_dir, root):
        tk, replace = layout.claim_root(root, wanted, own_root=own_root, warn=log.warn)
        if tk is not None:
            return InstallResult(toolkit=tk, reused=True)

        http = http or net.session()
        result_downloaded: list[str] = []
        from_cache: list[str] = []
        paths: dict[str, Path] = {}
        for pa in plan.archives:
            path, fetched = fetch_archive(pa.archive, base_url=base_url, cache_dir=cache_dir, http=http, log=log,
                                          retries=retries, backoff=backoff, connect_timeout=connect_timeout)
            paths[pa.component] = path
            (result_downloaded if fetched else from_cache).append(pa.archive.name)

        tk, _ = layout.install_tree(root, replace=replace, assemble=lambda tree: assemble(plan, paths, tree, log=log))
        sizes = {pa.archive.name: pa.archive.size for pa in plan.archives}
        return InstallResult(toolkit=tk, reused=False, downloaded_bytes=sum(sizes[n] for n in result_downloaded),
                             downloaded=result_downloaded, from_cache=from_cache)


def install_redist(*, version: str, platform: str, components: Sequence[str], settings: Settings, log: Log,
                   dest: Path | None = None, manifest: Manifest | str | Path | Mapping[str, Any] | None = None,
                   http: requests.Session | None = None) -> layout.Toolkit:
    """The toolkit of `components` (plus what the major version implies) from NVIDIA's redist archives,
    in its content-addressed root under settings.cache_dir (or `dest`); reused when complete."""
    plan = plan_toolkit(version=version, components=components, platform=platform, manifest=manifest)
    result = install(plan, cache_dir=settings.cache_dir, base_url=settings.cuda_redist_url, log=log, dest=dest,
                     http=http, connect_timeout=settings.connect_timeout)
    state = "installed" if result.reused else f"installed now ({result.downloaded_bytes:,} bytes downloaded)"
    log.info(f"    CUDA {version} (redist): {result.toolkit.root} {state}")
    return result.toolkit
