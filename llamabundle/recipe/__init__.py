"""Recipes (DESIGN §4): the frozen model (model.py), its strict YAML loader (loader.py) and its JSON schema
(schema.py). Only the loader reads recipe YAML; everything downstream gets frozen values. The key, the host
facts it needs and the rules that need a platform or a backend are in keys.py."""

from __future__ import annotations

from .loader import MAX_RECIPE_BYTES, find_recipe, load_recipe, parse_recipe, shipped_recipes
from .model import (
    BUNDLE_FORMAT,
    NO_HOST,
    SCHEMA_VERSION,
    Backend,
    Compiler,
    Cuda,
    GithubSource,
    GitSource,
    HostFacts,
    OpenMP,
    PathSource,
    Platform,
    PypiSource,
    Recipe,
    Source,
    ToolFound,
    Vulkan,
    VulkanHeaders,
)

__all__ = ["BUNDLE_FORMAT", "MAX_RECIPE_BYTES", "NO_HOST", "SCHEMA_VERSION", "Backend", "Compiler", "Cuda",
           "GitSource", "GithubSource", "HostFacts", "OpenMP", "PathSource", "Platform", "PypiSource", "Recipe",
           "Source", "ToolFound", "Vulkan", "VulkanHeaders", "find_recipe", "load_recipe", "parse_recipe",
           "shipped_recipes"]
