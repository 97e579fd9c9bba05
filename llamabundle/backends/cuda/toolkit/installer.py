"""CUDA toolkit from NVIDIA's Windows local installer (`cuda.source: installer`), without running it. The
installer is a 7-Zip self-extractor (sevenzip.py reads it): one top-level folder per redist component, in it
one folder per sub-package that mirrors the installed toolkit, with the sub-package's file list (.nvi). Only
the selected components' folders are extracted, their files moved into the one layout of layout.py (with
each component's licence, version.json and the marker last) in a directory renamed into place under a lock.
The installer is trusted only through its sha256: the one pinned in data/cuda_installers.json, or one the
user passes explicitly; one with neither is refused before anything is read (docs/cuda-toolkit.md)."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

import requests

from .... import data, net, sevenzip
from ....archive import MAX_MEMBERS, MAX_TOTAL_BYTES
from ....digest import sha256_file, sha256_json
from ....errors import ToolchainError
from ....log import Log
from ....settings import Settings
from . import layout
from .manifest import load_manifest
from .plan import IMPLIED_COMPONENTS, check_components

SOURCE = "installer"
PROGRAM_SUFFIXES = (".exe", ".dll", ".bat", ".cmd")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_BOM = b"\xef\xbb\xbf"


# ------------------------------------------------------------------------------------------- data


@cache
def installer_data() -> dict[str, Any]:
    info: dict[str, Any] = json.loads(resources.files(data).joinpath("cuda_installers.json").read_text(encoding="utf-8"))
    _check_data(info)
    return info


def _check_data(info: Mapping[str, Any]) -> None:
    assert int(info["sfx_scan_bytes"]) > 0
    for version, entry in info["installers"].items():
        assert set(entry) >= {"platform", "file", "url", "size", "sha256", "components"}, version
        assert entry["sha256"] is None or _HEX64.match(entry["sha256"]), version
        assert entry["size"] is None or (isinstance(entry["size"], int) and entry["size"] > 0), version
        assert entry["url"].startswith("https://") and entry["url"].endswith("/" + entry["file"]), version
        for comp, spec in entry["components"].items():
            assert spec["folders"] and all(re.fullmatch(r"[A-Za-z0-9_.-]+", f) for f in spec["folders"]), (version, comp)


def installer_versions(info: Mapping[str, Any] | None = None) -> list[str]:
    return sorted((info or installer_data())["installers"])


# ------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True, kw_only=True)
class InstallerFile:
    file: str
    url: str
    size: int | None
    sha256: str | None  # the pinned one (None: not pinned)
    sha256_source: str | None = None


@dataclass(frozen=True, kw_only=True)
class InstallerPlan:
    """What an install from the local installer needs (pure: from the packaged data and the pinned manifest)."""

    version: str
    platform: str
    requested: tuple[str, ...]
    components: dict[str, str]  # component -> its version (from the redist manifest), in install order
    folders: dict[str, tuple[str, ...]]  # component -> the installer's top-level folders it comes from
    added_by: dict[str, str]  # implied component -> the component that needs it
    installer: InstallerFile
    sha256: str | None  # the sha256 the .exe must have: pinned or explicit (None: refused at install)
    sha256_origin: str | None  # "pinned" | "explicit" | None
    shared_licenses: tuple[str, ...] = ()
    component_licenses: tuple[str, ...] = ("LICENSE", "LICENSE.txt")
    manifest_origin: str = ""

    @property
    def source(self) -> str:
        return SOURCE

    @property
    def all_folders(self) -> list[str]:
        return sorted({f for fs in self.folders.values() for f in fs})

    @property
    def pin(self) -> str:
        """The content address of an install: the installer's sha256 and what is taken from it."""
        return sha256_json({"installer": self.installer.file, "sha256": self.sha256,
                            "folders": {c: list(f) for c, f in self.folders.items()}, "components": self.components})

    def root(self, cache_dir: Path) -> Path:
        return layout.toolkit_root(cache_dir, version=self.version, platform=self.platform, source=SOURCE,
                                   components=list(self.components), pin=self.pin)

    def to_json(self, *, root: Path | None = None, installed: bool | None = None, local: Path | None = None,
                cached: bool = False, extractor: str | None = None) -> dict[str, Any]:
        return {"schema": 1, "toolkit": self.version, "platform": self.platform, "source": SOURCE,
                "installer": {"file": self.installer.file, "url": self.installer.url, "local": str(local) if local else None,
                              "size": self.installer.size, "sha256": self.sha256, "sha256_origin": self.sha256_origin,
                              "pinned_sha256": self.installer.sha256, "sha256_source": self.installer.sha256_source,
                              "cached": cached},
                "requested": list(self.requested),
                "components": [{"name": c, "version": v, "folders": list(self.folders[c]), "added_by": self.added_by.get(c)}
                               for c, v in self.components.items()],
                "folders": self.all_folders, "extractor": extractor,
                "root": str(root) if root is not None else None, "installed": installed}


def plan_installer(*, version: str, components: Sequence[str], platform: str = "windows-x86_64",
                   sha256: str | None = None, info: Mapping[str, Any] | None = None) -> InstallerPlan:
    """The folders to extract from CUDA `version`'s local installer for `components` (implied ones added).

    `sha256`, when given, is the user's explicit sha256 of the .exe: it must equal the pinned one when
    there is one. Raises ToolchainError (exit 3) for anything the installer cannot provide."""
    info = info if info is not None else installer_data()
    entry = info["installers"].get(version)
    if entry is None:
        raise ToolchainError(f"llamabundle knows no CUDA {version} local installer",
                             why=f"data/cuda_installers.json describes the installers of CUDA {', '.join(installer_versions(info)) or 'none'}",
                             fix="use one of those versions, or `cuda.source: redist`")
    if platform != entry["platform"]:
        raise ToolchainError(f"the CUDA {version} local installer ({entry['file']}) is for {entry['platform']}, not {platform}",
                             why="NVIDIA's .exe installer holds the Windows toolkit only",
                             fix="use `cuda.source: redist` (or pypi) for other platforms")
    check_components(components)
    if sha256 is not None:
        sha256 = sha256.strip().lower()
        if not _HEX64.match(sha256):
            raise ToolchainError(f"'{sha256}' is not a sha256", fix="pass the 64 hex digits `sha256sum` prints for the .exe")
    pinned = entry["sha256"]
    if sha256 is not None and pinned is not None and sha256 != pinned:
        raise ToolchainError(f"the sha256 given for {entry['file']} is not the pinned one",
                             why=f"given {sha256}; pinned {pinned} ({entry.get('sha256_source') or 'data/cuda_installers.json'})",
                             fix="drop --installer-sha256 (the pinned sha256 is checked), or check which file you have")
    manifest = load_manifest(version=version)
    major = version.split(".")[0]
    implied = IMPLIED_COMPONENTS.get(major, {})
    order: list[str] = []
    added_by: dict[str, str] = {}
    requested = tuple(dict.fromkeys(components))

    def add(comp: str, by: str | None) -> None:
        if comp in order:
            return
        order.append(comp)
        if by is not None and comp not in requested:
            added_by[comp] = by
        for dep in implied.get(comp, ()):
            add(dep, comp)

    for comp in requested:
        add(comp, None)
    known = entry["components"]
    unknown = [c for c in order if c not in known]
    if unknown:
        raise ToolchainError(f"the CUDA {version} local installer cannot provide {', '.join(unknown)}",
                             why=f"data/cuda_installers.json maps these components to installer folders: {', '.join(sorted(known))}",
                             fix="drop them from the components, or use `cuda.source: redist`")
    versions: dict[str, str] = {}
    for comp in order:
        versions[comp] = manifest.archive(comp, platform).version  # raises for a component the manifest lacks
    return InstallerPlan(version=version, platform=platform, requested=requested, components=versions,
                         folders={c: tuple(known[c]["folders"]) for c in order}, added_by=added_by,
                         installer=InstallerFile(file=entry["file"], url=entry["url"], size=entry["size"], sha256=pinned,
                                                 sha256_source=entry.get("sha256_source")),
                         sha256=sha256 or pinned, sha256_origin="explicit" if sha256 and not pinned else ("pinned" if pinned else None),
                         shared_licenses=tuple(entry.get("shared_licenses", ())),
                         component_licenses=tuple(info.get("component_licenses", ("LICENSE", "LICENSE.txt"))),
                         manifest_origin=manifest.origin)


def select_members(members: Sequence[sevenzip.Member], plan: InstallerPlan, exe: Path) -> list[sevenzip.Member]:
    """The files to extract: everything under the planned components' folders, and the installer-wide licenses."""
    folders = set(plan.all_folders)
    shared = set(plan.shared_licenses)
    present = {m.path.parts[0] for m in members if len(m.path.parts) > 1}
    missing = sorted(folders - present)
    if missing:
        comps = sorted(c for c, fs in plan.folders.items() if set(fs) & set(missing))
        raise ToolchainError(f"{exe.name} has no {', '.join(f + '/' for f in missing)} folder (for {', '.join(comps)})",
                             why=f"its top-level folders are: {', '.join(sorted(present)) or 'none'}",
                             fix="drop the component, use `cuda.source: redist`, or check that this is the CUDA "
                                 f"{plan.version} local installer")
    chosen: list[sevenzip.Member] = []
    seen: dict[str, str] = {}
    total = 0
    for m in members:
        top = m.path.parts[0]
        if not ((top in folders and len(m.path.parts) > 1) or m.path.as_posix() in shared):
            continue
        if m.is_link:
            raise ToolchainError(f"{exe.name}: member '{m.name}' is a symbolic link (or junction)",
                                 why="a toolkit from the installer holds regular files only", fix="do not use this installer")
        if m.is_dir:
            continue
        key = m.path.as_posix().lower()
        if key in seen:
            raise ToolchainError(f"{exe.name}: '{m.name}' is stored twice (as '{seen[key]}' too)",
                                 why="one of the two would silently replace the other", fix="do not use this installer")
        seen[key] = m.name
        total += m.size
        chosen.append(m)
        if total > MAX_TOTAL_BYTES or len(chosen) > MAX_MEMBERS:
            raise ToolchainError(f"{exe.name}: the selected folders expand beyond the limits "
                                 f"({MAX_TOTAL_BYTES:,} bytes, {MAX_MEMBERS:,} files)", fix="do not use this installer")
    return chosen


# ---------------------------------------------------------------------------------------- assemble


def parse_nvi(path: Path, label: str) -> tuple[list[PurePosixPath], int]:
    """The files a sub-package's .nvi copies (copyFile targets, relative to the sub-package folder),
    and how many entries were skipped (those with a `source` or an installer variable: not plain copies)."""
    raw = path.read_bytes()
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    try:
        root = ET.fromstring(raw)
    except ET.ParseError as e:
        raise ToolchainError(f"{label}: {path.name} is not readable XML", why=str(e),
                             fix="the installer is damaged; download it again") from None
    files: list[PurePosixPath] = []
    skipped = 0
    for std in root.findall("phases/standard"):
        if (std.get("phase") or "").lower() != "copyfiles":
            continue
        for cf in std.findall("copyFile"):
            target = cf.get("target")
            if not target or cf.get("source") is not None or "${" in target:
                skipped += 1
                continue
            norm = target.replace("\\", "/")
            p = PurePosixPath(norm)
            if not norm or norm.startswith("/") or ":" in norm or ".." in p.parts or p.is_absolute():
                raise ToolchainError(f"{label}: {path.name} copies to '{target}', outside the toolkit",
                                     fix="do not use this installer")
            files.append(p)
    return files, skipped


def _package_files(pkg: Path, label: str, log: Log | None) -> list[PurePosixPath]:
    """The files of one sub-package that belong in the toolkit root: those in its sub-directories,
    limited to what its .nvi lists when it has one (matched case-insensitively, as Windows does)."""
    inside = sorted(p.relative_to(pkg) for p in pkg.rglob("*") if p.is_file() and len(p.relative_to(pkg).parts) > 1)
    nvi = pkg / f"{pkg.name}.nvi"
    if not nvi.is_file():
        return [PurePosixPath(p.as_posix()) for p in inside]
    listed, _ = parse_nvi(nvi, label)
    listed = [p for p in listed if len(p.parts) > 1]
    if not listed:
        if log is not None:
            log.warn(f"{label}: {nvi.name} lists no files; taking the whole folder")
        return [PurePosixPath(p.as_posix()) for p in inside]
    by_key = {p.as_posix().lower(): PurePosixPath(p.as_posix()) for p in inside}
    out: list[PurePosixPath] = []
    missing: list[PurePosixPath] = []
    for p in dict.fromkeys(listed):
        real = by_key.get(p.as_posix().lower())
        (out if real is not None else missing).append(real if real is not None else p)
    if missing:
        raise ToolchainError(f"{label}: {nvi.name} lists {len(missing)} file(s) the installer does not hold",
                             why=", ".join(p.as_posix() for p in missing[:5]),
                             fix="the installer is damaged or not NVIDIA's; download it again")
    return out


def _program(name: str) -> bool:
    return name.lower().endswith(PROGRAM_SUFFIXES)


def _place(src: Path, tree: Path, rel: PurePosixPath, comp: str, owners: dict[PurePosixPath, str]) -> None:
    dst = tree.joinpath(*rel.parts)
    if dst.exists() or dst.is_symlink():
        if dst.is_file() and not dst.is_symlink() and filecmp.cmp(src, dst, shallow=False):
            return
        raise ToolchainError(f"components {owners.get(rel, 'another component')} and {comp} both ship {rel} with different content",
                             fix="drop one of the two components from the recipe")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ToolchainError(f"{comp} ships {rel}, but a parent of it is a file from another component",
                             fix="drop one of the two components from the recipe") from None
    os.replace(src, dst)
    dst.chmod(0o755 if _program(dst.name) else 0o644)
    owners[rel] = comp


def _license(plan: InstallerPlan, comp: str, xdir: Path) -> Path | None:
    for folder in plan.folders[comp]:
        top = xdir / folder
        dirs = [top, *sorted(d for d in top.iterdir() if d.is_dir())] if top.is_dir() else []
        for d in dirs:
            for name in plan.component_licenses:
                if (d / name).is_file():
                    return d / name
    for name in plan.shared_licenses:
        if (xdir / name).is_file():
            return xdir / name
    return None


def assemble(plan: InstallerPlan, exe: Path, tree: Path, *, log: Log, program: str | None = None) -> str:
    """Build the whole toolkit tree at `tree` (which must not exist) from the verified installer;
    returns what extracted it."""
    tree.mkdir(parents=True)
    xdir = tree.parent / f"{tree.name}.x"
    try:
        offset = sevenzip.find_7z_offset(exe, limit=int(installer_data()["sfx_scan_bytes"]))
        with sevenzip.open_7z(exe, offset) as ar:
            members = sevenzip.list_members(ar, exe)
        wanted = select_members(members, plan, exe)
        total = sum(m.size for m in wanted)
        log.info(f"    extract {len(wanted):,} files ({total:,} bytes) of {', '.join(f + '/' for f in plan.all_folders)} "
                 f"from {exe.name} (7z at offset {offset:,})")
        how = sevenzip.extract(exe, offset, wanted, xdir, log=log, program=program)
        owners: dict[PurePosixPath, str] = {}
        for comp in plan.components:
            placed = 0
            for folder in plan.folders[comp]:
                top = xdir / folder
                for pkg in sorted(d for d in top.iterdir() if d.is_dir()):
                    label = f"{comp} ({folder}/{pkg.name})"
                    for rel in _package_files(pkg, label, log):
                        _place(pkg.joinpath(*rel.parts), tree, rel, comp, owners)
                        placed += 1
            if placed == 0:
                raise ToolchainError(f"{comp}: the installer's {', '.join(f + '/' for f in plan.folders[comp])} holds no toolkit files",
                                     fix="check that this is the CUDA local installer; or use `cuda.source: redist`")
            lic = _license(plan, comp, xdir)
            if lic is not None:
                shutil.copyfile(lic, tree / f"LICENSE.{comp}")
                (tree / f"LICENSE.{comp}").chmod(0o644)
            else:
                log.warn(f"{comp}: no license file in the installer's {', '.join(plan.folders[comp])} folder")
        layout.write_version_json(tree, version=plan.version, components=plan.components)
        layout.write_marker(tree, version=plan.version, platform=plan.platform, source=SOURCE,
                            components=plan.components)  # last: its presence means "complete"
        return how
    finally:
        shutil.rmtree(xdir, ignore_errors=True)


# ----------------------------------------------------------------------------------------- obtain






def download_path(cache_dir: Path, plan: InstallerPlan) -> Path:
    assert plan.sha256 is not None
    return cache_dir / "downloads" / plan.sha256 / plan.installer.file


def is_cached(cache_dir: Path, plan: InstallerPlan) -> bool:
    if plan.sha256 is None:
        return False
    p = download_path(cache_dir, plan)
    try:
        return p.is_file() and (plan.installer.size is None or p.stat().st_size == plan.installer.size)
    except OSError:
        return False


def _refuse_unpinned(plan: InstallerPlan) -> ToolchainError:
    return ToolchainError(f"the CUDA {plan.version} installer {plan.installer.file} has no pinned sha256",
                          why="NVIDIA publishes only MD5 sums for its installers, and llamabundle never unpacks an .exe "
                              "it cannot verify",
                          fix="pass --installer-sha256 with the sha256 of the file you trust (LLAMABUNDLE_CUDA_INSTALLER_SHA256 "
                              "for builds), or use `cuda.source: redist`")


def verify_local(plan: InstallerPlan, path: Path) -> Path:
    """The user's local installer, once its size and sha256 are the expected ones."""
    if plan.sha256 is None:
        raise _refuse_unpinned(plan)
    if not path.is_file():
        raise ToolchainError(f"{path}: no such installer file", fix=f"pass the path of {plan.installer.file}")
    size = path.stat().st_size
    if plan.installer.size is not None and size != plan.installer.size:
        raise ToolchainError(f"{path} is {size:,} bytes, not the {plan.installer.size:,} of {plan.installer.file}",
                             fix=f"pass NVIDIA's {plan.installer.file}")
    got = sha256_file(path)
    if got != plan.sha256:
        raise ToolchainError(f"sha256 mismatch for {path}", why=f"expected {plan.sha256} ({plan.sha256_origin}), got {got}",
                             fix=f"this is not the {plan.installer.file} that was pinned; never run or unpack it")
    return path


def fetch(plan: InstallerPlan, *, cache_dir: Path, log: Log, http: requests.Session | None = None,
          connect_timeout: float = 10.0, retries: int = 4, backoff: float = 1.0) -> tuple[Path, bool]:
    """The verified installer in the download cache; (path, True) when it had to be downloaded."""
    if plan.sha256 is None:
        raise _refuse_unpinned(plan)
    path = download_path(cache_dir, plan)
    with layout.cache_lock(cache_dir, f"download-{plan.sha256}"):
        if path.is_file():
            if (plan.installer.size is None or path.stat().st_size == plan.installer.size) and sha256_file(path) == plan.sha256:
                return path, False
            log.warn(f"cached {plan.installer.file} does not match its sha256; downloading it again")
            path.unlink()
        size = f" ({plan.installer.size:,} bytes)" if plan.installer.size else ""
        log.info(f"    download {plan.installer.file}{size} from {plan.installer.url}")
        net.download(plan.installer.url, path, http=http or net.session(), log=log, sha256=plan.sha256,
                     size=plan.installer.size, retries=retries, backoff=backoff, mismatch_error=ToolchainError,
                     connect_timeout=connect_timeout)
        return path, True


# ---------------------------------------------------------------------------------------- install


@dataclass
class InstallResult:
    toolkit: layout.Toolkit
    reused: bool
    installer: Path | None = None
    downloaded: bool = False
    extractor: str | None = None
    notes: list[str] = field(default_factory=list)






def installed(plan: InstallerPlan, root: Path) -> layout.Toolkit | None:
    """The toolkit at root when it is this plan's and complete; None when absent. Raises when changed or foreign."""
    return layout.installed_as(root, layout.Wanted(version=plan.version, platform=plan.platform, source=SOURCE,
                                                 components=plan.components))


def install(plan: InstallerPlan, *, cache_dir: Path, log: Log, installer: Path | None = None, dest: Path | None = None,
            http: requests.Session | None = None, connect_timeout: float = 10.0, program: str | None = None) -> InstallResult:
    """Install the plan into `dest` (default: its content-addressed root under cache_dir) from the local
    `installer` file or the pinned URL; a complete install of the same plan is reused without the .exe."""
    if plan.sha256 is None:
        raise _refuse_unpinned(plan)
    own_root = dest is None
    root = (plan.root(cache_dir) if dest is None else dest).absolute()
    root.parent.mkdir(parents=True, exist_ok=True)
    wanted = layout.Wanted(version=plan.version, platform=plan.platform, source=SOURCE, components=plan.components)
    with layout.root_lock(cache_dir, root):
        tk, replace = layout.claim_root(root, wanted, own_root=own_root, warn=log.warn)
        if tk is not None:
            return InstallResult(toolkit=tk, reused=True)

        if installer is not None:
            exe, downloaded = verify_local(plan, Path(installer)), False
        else:
            exe, downloaded = fetch(plan, cache_dir=cache_dir, log=log, http=http, connect_timeout=connect_timeout)
        tk, how = layout.install_tree(root, replace=replace,
                                      assemble=lambda tree: assemble(plan, exe, tree, log=log, program=program))
        return InstallResult(toolkit=tk, reused=False, installer=exe, downloaded=downloaded, extractor=how)


def install_from_installer(*, version: str, platform: str, components: Sequence[str], settings: Settings, log: Log,
                           installer: Path | None = None, sha256: str | None = None, dest: Path | None = None,
                           http: requests.Session | None = None) -> layout.Toolkit:
    """The toolkit of `components` from CUDA `version`'s Windows local installer (the local file
    `installer`, or the pinned URL), in its content-addressed root under settings.cache_dir (or `dest`)."""
    plan = plan_installer(version=version, components=components, platform=platform, sha256=sha256)
    result = install(plan, cache_dir=settings.cache_dir, log=log, installer=installer, dest=dest, http=http,
                     connect_timeout=settings.connect_timeout)
    state = "installed" if result.reused else f"installed now (extracted by {os.path.basename(result.extractor or '?')})"
    log.info(f"    CUDA {version} (installer): {result.toolkit.root} {state}")
    return result.toolkit


