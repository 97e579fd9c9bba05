"""ggml backends: one module (or package) per backend behind the `Backend` protocol (CMake switch and
definitions, targets, the toolkit it needs, its bundle.json section, its verify checks, how the loader
names it), and the registry. Adding a backend is one module here, one entry in `REGISTRY`, and its name
in `recipe.Backend`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import proc
from .base import Backend, NoExtras, Prepared
from .cpu import CPU
from .cuda import CUDA
from .rpc import RPC
from .vulkan import VULKAN

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest
    from ..recipe import Recipe

REGISTRY: dict[str, Backend] = {b.name: b for b in (CPU, CUDA, VULKAN, RPC)}  # in build order: cpu first
NAMES: tuple[str, ...] = tuple(REGISTRY)

__all__ = ["NAMES", "REGISTRY", "Backend", "NoExtras", "Prepared", "bundle_schema", "get", "of", "read_sections"]


def get(name: str) -> Backend:
    return REGISTRY[name]


def of(backends: Recipe | tuple[str, ...] | list[str]) -> list[Backend]:
    """The backends a recipe (or a bundle.json's backend list) has, in registry order."""
    names = set(backends.backends if not isinstance(backends, (tuple, list)) else backends)
    return [b for name, b in REGISTRY.items() if name in names]


def run_keep(manifest: Manifest, *more: str) -> dict[str, str]:
    """The caller's variables a bundle keeps when it is run in a clean environment: those its backends' driver
    lookup reads (Backend.run_env), and `more`."""
    return proc.inherited([*(k for b in of(manifest.backends) for k in b.run_env), *more])


def read_sections(manifest: Manifest) -> None:
    """Every backend's section of a bundle.json read typed: a wrong field is a ManifestError (exit 5) naming it.
    The trust checks above the backends (verify, install) run it with manifest.trust."""
    for b in REGISTRY.values():
        b.read_section(manifest)


def bundle_schema() -> dict[str, Any]:
    """bundle.json's JSON schema with every backend's section (committed as data/schemas/bundle.schema.json)."""
    from ..bundle import manifest as manifest_mod

    sections = {b.manifest_key: s for b in REGISTRY.values() if b.manifest_key and (s := b.section_schema())}
    return manifest_mod.json_schema(sections, backends=NAMES)
