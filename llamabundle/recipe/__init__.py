"""Recipes (DESIGN §4): the frozen model (model.py), its strict YAML loader (loader.py) and its JSON schema
(schema.py). Only the loader reads recipe YAML; everything downstream gets frozen values. The key, the host
facts it needs and the rules that need a platform or a backend are in keys.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..names import Backend, Platform
from .model import (
    BUNDLE_FORMAT,
    NO_HOST,
    SCHEMA_VERSION,
    Compiler,
    Cuda,
    GithubSource,
    GitSource,
    HostFacts,
    OpenMP,
    PathSource,
    PypiSource,
    Recipe,
    Source,
    ToolFound,
    Vulkan,
    VulkanHeaders,
)

if TYPE_CHECKING:
    from .loader import MAX_RECIPE_BYTES, find_recipe, load_recipe, parse_recipe, shipped_recipes

_LOADER = ("MAX_RECIPE_BYTES", "find_recipe", "load_recipe", "parse_recipe", "shipped_recipes")


def __getattr__(name: str) -> Any:
    """The loader's names, imported when first asked for: the model alone (what a bundle.json names) needs no
    YAML parser, so a fetch or an install starts without one."""
    if name in _LOADER:
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BUNDLE_FORMAT", "MAX_RECIPE_BYTES", "NO_HOST", "SCHEMA_VERSION", "Backend", "Compiler", "Cuda",
           "GitSource", "GithubSource", "HostFacts", "OpenMP", "PathSource", "Platform", "PypiSource", "Recipe",
           "Source", "ToolFound", "Vulkan", "VulkanHeaders", "find_recipe", "load_recipe", "parse_recipe",
           "shipped_recipes"]
