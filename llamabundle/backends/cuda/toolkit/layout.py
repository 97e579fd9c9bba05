"""The one toolkit layout every source produces, and where installed toolkits live in the cache.

    <root>/bin/nvcc[.exe] …   <root>/include/ …   <root>/lib/ (Linux; lib64 -> lib) or lib/x64 (Windows)
    <root>/nvvm/ …            <root>/version.json  <root>/LICENSE.<component>
    <root>/.llamabundle-toolkit.json   (written last: what was installed, from where, file count)

A root is content-addressed: the same version, platform, source and component set (and the same
pinned manifest) always map to the same directory, so a second install is a no-op after a check.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import filelock

from .... import platforms, untrusted
from ....errors import ToolchainError

MARKER = ".llamabundle-toolkit.json"
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Toolkit:
    root: Path
    version: str  # e.g. "13.0.2" (the release label)
    source: str  # redist | installer | pypi | system
    platform: str  # linux-x86_64 | windows-x86_64

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / platforms.get(self.platform).program_file("nvcc")

    @property
    def lib_dirs(self) -> list[Path]:
        if platforms.get(self.platform).system == "windows":  # DLLs beside the programs, import libraries apart
            return [self.root / "bin", self.root / "lib" / "x64"]
        return [d for d in (self.root / "lib", self.root / "lib64", self.root / "targets" / "x86_64-linux" / "lib") if d.is_dir()]


def toolkit_id(*, version: str, platform: str, source: str, components: Sequence[str], pin: str) -> str:
    """Content address of an install: `pin` is the sha256 of the manifest (or wheel list) it came from."""
    blob = json.dumps({"version": version, "platform": platform, "source": source,
                       "components": sorted(components), "pin": pin}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def toolkit_root(cache_dir: Path, *, version: str, platform: str, source: str, components: Sequence[str], pin: str) -> Path:
    return cache_dir / "toolkits" / f"cuda-{version}-{platform}-{source}-" \
        f"{toolkit_id(version=version, platform=platform, source=source, components=components, pin=pin)}"


def write_version_json(root: Path, *, version: str, components: Mapping[str, str]) -> None:
    """version.json as a real CUDA install writes it: {"cuda": {"name", "version"}, "<comp>": {...}}."""
    data: dict[str, Any] = {"cuda": {"name": "CUDA SDK", "version": version}}
    for name, comp_version in sorted(components.items()):
        data[name] = {"name": name, "version": comp_version}
    (root / "version.json").write_text(json.dumps(data, indent=3, sort_keys=True) + "\n", encoding="utf-8")


def write_marker(root: Path, *, version: str, platform: str, source: str, components: Mapping[str, str]) -> None:
    files = sum(1 for p in root.rglob("*") if p.is_file() or p.is_symlink())
    (root / MARKER).write_text(json.dumps({"version": version, "platform": platform, "source": source,
                                           "components": dict(sorted(components.items())), "files": files},
                                          indent=1, sort_keys=True) + "\n", encoding="utf-8")


def read_installed(root: Path) -> Toolkit | None:
    """The toolkit at root if its install completed (marker present and consistent), else None."""
    marker = root / MARKER
    if not marker.is_file():
        return None
    try:
        info = untrusted.read(marker)  # past untrusted's limits: a ValueError, so not installed
    except (OSError, ValueError):
        return None
    tk = Toolkit(root=root, version=info["version"], source=info["source"], platform=info["platform"])
    files = sum(1 for p in root.rglob("*") if p.is_file() or p.is_symlink()) - 1  # minus the marker itself
    if files != info.get("files"):
        raise ToolchainError(f"the toolkit in {root} is incomplete or was changed",
                             why=f"{files} files on disk, {info.get('files')} installed",
                             fix=f"remove {root} and install it again (llamabundle toolkit install)")
    if not tk.nvcc.exists():  # every file there, but no compiler: it was installed from components without cuda_nvcc
        comps = info.get("components")
        held = ", ".join(sorted(comps)) if isinstance(comps, dict) and comps else "components"
        raise ToolchainError(f"the toolkit in {root} has no {tk.nvcc.name}: it holds {held}, without cuda_nvcc",
                             why=f"all its {files} files are there; a toolkit without nvcc cannot compile",
                             fix=f"remove {root} and install a set with cuda_nvcc (llamabundle toolkit install "
                                 "--components cuda_nvcc,…)")
    return tk


# --------------------------------------------------- installing into a root (shared by every source)

LOCK_TIMEOUT_S = 3600.0


def cache_lock(cache_dir: Path, name: str) -> filelock.FileLock:
    d = cache_dir / "locks"
    d.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(str(d / f"{name}.lock"), timeout=LOCK_TIMEOUT_S)


def root_lock(cache_dir: Path, root: Path) -> filelock.FileLock:
    return cache_lock(cache_dir, "toolkit-" + hashlib.sha256(str(root).encode()).hexdigest()[:16])


def read_marker(root: Path) -> dict[str, Any] | None:
    try:
        info = untrusted.read(root / MARKER)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


@dataclass(frozen=True, kw_only=True)
class Wanted:
    """What a root must hold to count as this plan's install."""

    version: str
    platform: str
    source: str
    components: Mapping[str, str]

    def matches(self, info: Mapping[str, Any]) -> bool:
        return (info.get("version"), info.get("platform"), info.get("source"), info.get("components")) == \
            (self.version, self.platform, self.source, dict(sorted(self.components.items())))


def installed_as(root: Path, wanted: Wanted) -> Toolkit | None:
    """The toolkit at root when it is `wanted` and complete; None when absent. Raises when changed or foreign."""
    tk = read_installed(root)
    if tk is None:
        return None
    info = read_marker(root)
    if info is None or not wanted.matches(info):
        raise ToolchainError(f"{root} holds a different toolkit",
                             why=f"installed: CUDA {tk.version} {tk.platform} {tk.source} "
                                 f"{sorted((info or {}).get('components', {}))}; planned: {sorted(wanted.components)}",
                             fix="choose another --dest, or remove that directory")
    return tk


def claim_root(root: Path, wanted: Wanted, *, own_root: bool, warn: Callable[[str], None]) -> tuple[Toolkit | None, bool]:
    """Under the root's lock: (the intact install to reuse, None) or (None, whether an old root must be replaced).
    Clears what a killed install left beside the root; never overwrites a foreign directory or another toolkit."""
    for pattern in (f".{root.name}.tmp-*", f".{root.name}.old-*"):  # the lock holder is the only writer
        for stale in root.parent.glob(pattern):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise ToolchainError(f"{root} exists and is not a directory", fix="choose another --dest")
    if not root.exists():
        return None, False
    info = read_marker(root)
    try:
        tk = installed_as(root, wanted)
    except ToolchainError as e:
        if info is not None and not wanted.matches(info):
            raise  # another toolkit: never overwrite it
        warn(f"{e.what}; installing it again")
        tk = None
    if tk is not None:
        return tk, False
    if info is None and not own_root and any(root.iterdir()):
        raise ToolchainError(f"{root} exists and is not a toolkit installed by llamabundle",
                             fix="choose a new or empty directory for --dest")
    return None, True


def install_tree(root: Path, *, replace: bool, assemble: Callable[[Path], T]) -> tuple[Toolkit, T]:
    """Under the root's lock: assemble a new tree beside root, then swap it in (an old root is moved
    aside first). A failure leaves root as it was and nothing beside it."""
    tree = root.with_name(f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        result = assemble(tree)
        if replace and (root.exists() or root.is_symlink()):
            if any(root.iterdir()):
                aside = root.with_name(f".{root.name}.old-{uuid.uuid4().hex[:8]}")
                os.rename(root, aside)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                root.rmdir()
        os.rename(tree, root)
    except BaseException:
        shutil.rmtree(tree, ignore_errors=True)
        raise
    tk = read_installed(root)
    assert tk is not None
    return tk, result
