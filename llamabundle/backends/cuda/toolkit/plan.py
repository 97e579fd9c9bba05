"""What a toolkit install needs (pure: no I/O beyond reading the pinned manifest): the components,
the archive of each for the platform, their sizes and sha256, and the content-addressed root."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....errors import RecipeError, ToolchainError, UsageError
from ....recipe import Recipe
from . import layout
from .manifest import PLATFORMS, Archive, Manifest, load_manifest

SOURCES = ("redist",)  # the sources `toolkit install` can use today
REQUIRED = "cuda_nvcc"  # every toolkit root has bin/nvcc (layout.read_installed checks it)

# Components a major release split out of another one: asking for the key in that major version
# brings in the values. In 12.x nvcc carried its crt headers and nvvm; 13.x ships them separately.
IMPLIED_COMPONENTS: dict[str, dict[str, tuple[str, ...]]] = {
    "13": {"cuda_nvcc": ("cuda_crt", "libnvvm")},
}


@dataclass(frozen=True, kw_only=True)
class PlannedArchive:
    archive: Archive
    added_by: str | None = None  # the component that needs it (None: asked for)
    major: str = ""

    @property
    def component(self) -> str:
        return self.archive.component

    @property
    def note(self) -> str:
        return f"added: needed by {self.added_by} in {self.major}.x" if self.added_by else ""


@dataclass(frozen=True, kw_only=True)
class ToolkitPlan:
    version: str
    platform: str
    source: str
    requested: tuple[str, ...]
    archives: tuple[PlannedArchive, ...]
    pin: str  # sha256 of the manifest
    manifest_origin: str

    @property
    def components(self) -> dict[str, str]:
        """component -> its own version (what version.json records)."""
        return {a.component: a.archive.version for a in self.archives}

    @property
    def total_bytes(self) -> int:
        return sum(a.archive.size for a in self.archives)

    def root(self, cache_dir: Path) -> Path:
        return layout.toolkit_root(cache_dir, version=self.version, platform=self.platform, source=self.source,
                                   components=list(self.components), pin=self.pin)

    def to_json(self, *, base_url: str, cached: Mapping[str, bool] | None = None, root: Path | None = None,
                installed: bool | None = None) -> dict[str, Any]:
        cached = cached or {}
        comps = []
        for a in self.archives:
            comps.append({
                "name": a.component, "version": a.archive.version, "archive": a.archive.name,
                "url": a.archive.url(base_url), "size": a.archive.size, "sha256": a.archive.sha256,
                "cached": bool(cached.get(a.component, False)), "added_by": a.added_by, "note": a.note or None,
            })
        to_download = sum(a.archive.size for a in self.archives if not cached.get(a.component, False))
        return {"schema": 1, "toolkit": self.version, "platform": self.platform, "source": self.source,
                "manifest": {"origin": self.manifest_origin, "sha256": self.pin},
                "requested": list(self.requested), "components": comps, "total_bytes": self.total_bytes,
                "download_bytes": 0 if installed else to_download,
                "root": str(root) if root is not None else None, "installed": installed}


def plan_toolkit(*, version: str, components: Sequence[str], platform: str, source: str = "redist",
                 manifest: Manifest | str | Path | Mapping[str, Any] | None = None) -> ToolkitPlan:
    """The archives to fetch for `components` of CUDA `version` on `platform`, implied ones added."""
    if source not in SOURCES:
        raise ToolchainError(f"toolkit source '{source}' cannot be installed by this llamabundle",
                             why=f"supported sources: {', '.join(SOURCES)}", fix="use --source redist (cuda.source: redist)")
    if platform not in PLATFORMS:
        raise ToolchainError(f"unknown platform '{platform}'", fix="use one of: " + ", ".join(PLATFORMS))
    check_components(components)
    m = manifest if isinstance(manifest, Manifest) else load_manifest(manifest, version=version)
    if m.release != version:
        raise ToolchainError(f"the manifest {m.origin} is for CUDA {m.release}, not {version}")
    major = version.split(".")[0]
    implied = IMPLIED_COMPONENTS.get(major, {})
    order: list[tuple[str, str | None]] = []
    seen: set[str] = set()

    def add(comp: str, by: str | None) -> None:
        if comp in seen:
            return
        seen.add(comp)
        order.append((comp, by))
        for dep in implied.get(comp, ()):
            add(dep, comp)

    requested = tuple(dict.fromkeys(components))
    for comp in requested:
        add(comp, None)
    archives = tuple(PlannedArchive(archive=m.archive(c, platform), added_by=by if c not in requested else None, major=major)
                     for c, by in order)
    return ToolkitPlan(version=version, platform=platform, source=source, requested=requested, archives=archives,
                       pin=m.pin, manifest_origin=m.origin)


def plan_for_recipe(recipe: Recipe, *, source: str | None = None,
                    manifest: Manifest | str | Path | Mapping[str, Any] | None = None) -> ToolkitPlan:
    if recipe.cuda is None:
        raise RecipeError(f"{recipe.origin or recipe.name}: the recipe has no cuda: section",
                          why="a toolkit is only needed for the cuda backend",
                          fix="use a recipe with backends [cpu, cuda] and a cuda: section, or pass --version/--components")
    return plan_toolkit(version=recipe.cuda.toolkit, components=recipe.cuda.components, platform=recipe.platform,
                        source=source or recipe.cuda.source, manifest=manifest)


def check_components(components: Sequence[str]) -> None:
    """Every toolkit source installs a usable toolkit: at least its compiler. Asked before anything is planned
    or downloaded, of every source: the component set is what the command line or the recipe asked for (exit 2)."""
    if not components:
        raise UsageError("no CUDA components to install", fix="list components, e.g. cuda_nvcc,cuda_cudart")
    if REQUIRED not in components:
        listed = ", ".join(components)
        raise UsageError(f"the components {listed} have no {REQUIRED}: a toolkit without nvcc cannot compile",
                         why="every toolkit llamabundle installs is a compiler, and it checks bin/nvcc once installed "
                             "(headers such as cuda_crt and cuda_cccl are what nvcc compiles with)",
                         fix=f"add {REQUIRED}: --components {REQUIRED},{','.join(components)} (in a recipe: "
                             f"cuda.components), or leave --components out and install a recipe's toolkit")
