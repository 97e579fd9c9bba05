"""ggml backends: one module (or package) per backend behind the `Backend` protocol (CMake switch and
definitions, targets, the toolkit it needs, its bundle.json section, its verify checks, how the loader
names it), and the registry. Adding a backend is one module here, one entry in `REGISTRY`, and its name
in `recipe.Backend`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Backend, NoExtras, Prepared
from .cpu import CPU
from .cuda import CUDA
from .vulkan import VULKAN

if TYPE_CHECKING:
    from ..recipe import Recipe

REGISTRY: dict[str, Backend] = {b.name: b for b in (CPU, CUDA, VULKAN)}  # in build order: cpu first
NAMES: tuple[str, ...] = tuple(REGISTRY)

__all__ = ["NAMES", "REGISTRY", "Backend", "NoExtras", "Prepared", "get", "of"]


def get(name: str) -> Backend:
    return REGISTRY[name]


def of(backends: Recipe | tuple[str, ...] | list[str]) -> list[Backend]:
    """The backends a recipe (or a bundle.json's backend list) has, in registry order."""
    names = set(backends.backends if not isinstance(backends, (tuple, list)) else backends)
    return [b for name, b in REGISTRY.items() if name in names]
