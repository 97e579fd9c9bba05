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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ToolchainError

MARKER = ".llamabundle-toolkit.json"


@dataclass(frozen=True, kw_only=True)
class Toolkit:
    root: Path
    version: str  # e.g. "13.0.2" (the release label)
    source: str  # redist | installer | pypi | system
    platform: str  # linux-x86_64 | windows-x86_64

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / ("nvcc.exe" if self.platform.startswith("windows") else "nvcc")

    @property
    def lib_dirs(self) -> list[Path]:
        if self.platform.startswith("windows"):
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
    (root / "version.json").write_text(json.dumps(data, indent=3, sort_keys=True) + "\n")


def write_marker(root: Path, *, version: str, platform: str, source: str, components: Mapping[str, str]) -> None:
    files = sum(1 for p in root.rglob("*") if p.is_file() or p.is_symlink())
    (root / MARKER).write_text(json.dumps({"version": version, "platform": platform, "source": source,
                                           "components": dict(sorted(components.items())), "files": files},
                                          indent=1, sort_keys=True) + "\n")


def read_installed(root: Path) -> Toolkit | None:
    """The toolkit at root if its install completed (marker present and consistent), else None."""
    marker = root / MARKER
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except ValueError:
        return None
    tk = Toolkit(root=root, version=info["version"], source=info["source"], platform=info["platform"])
    files = sum(1 for p in root.rglob("*") if p.is_file() or p.is_symlink()) - 1  # minus the marker itself
    if files != info.get("files") or not tk.nvcc.exists():
        raise ToolchainError(f"the toolkit in {root} is incomplete or was changed",
                             why=f"{files} files on disk, {info.get('files')} installed",
                             fix=f"remove {root} and install it again (llamabundle toolkit install)")
    return tk
