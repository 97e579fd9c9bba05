"""The cache key (DESIGN §4), computed above the backends: the recipe's inputs in canonical form, what this
machine contributes (the exact compiler of an unpinned toolchain, an unpinned backend tool such as glslc) and each
backend's own part (`Backend.key_inputs`); and the rules of a recipe that need a platform or a backend
(`Backend.check_recipe`). The key is the sha256 of the canonical JSON of the inputs; `--explain` prints it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import backends, compilers, data, platforms
from .digest import sha256_json
from .errors import ToolchainError
from .recipe import HostFacts, Recipe, ToolFound, load_recipe, parse_recipe
from .recipe import model as recipe_model

# What the tool itself derives from a recipe (the CMake flags and files of build.py, the CPU-variant sets, the
# mingw compatibility header, the collection of runtime libraries): a new llamabundle that builds differently
# must never serve an old bundle as a hit. Bump DERIVATION with any change to that code; the knowledge files'
# digest follows their data by itself. tests/unit/test_key.py records the flags each version derives and fails
# when they change without a bump. The history of the versions is in docs/key.md.
DERIVATION = 12
DERIVATION_DATA = ("build.json", "mingw.json", "msvc.json", "cuda_runtime.json")


PLATFORM_TOOLCHAIN_FIELDS = ("build_host", "glibc")  # toolchain fields a platform takes only if it says so


def derivation() -> dict[str, Any]:
    return {"version": DERIVATION, "data": sha256_json({name: data.load(name) for name in DERIVATION_DATA})[:16]}


# ------------------------------------------------------------------------------------------ checks


def check(recipe: Recipe) -> Recipe:
    """The rules that need a platform or a backend (the model's own were checked when it was loaded): the
    compiler can target the platform, then each backend's (CUDA's toolkit, components and archs; the CPU
    variants left out; where Vulkan builds). Raises RecipeError at the line the problem is on."""
    platform = platforms.get(recipe.platform)
    allowed = platform.compilers
    if recipe.toolchain.compiler not in allowed:
        raise recipe.error("toolchain.compiler", f"compiler '{recipe.toolchain.compiler}' cannot target {recipe.platform}",
                           fix="use one of: " + ", ".join(allowed))
    for name in PLATFORM_TOOLCHAIN_FIELDS:
        if getattr(recipe.toolchain, name) is not None and name not in platform.toolchain_fields:
            takes = [p.name for p in platforms.REGISTRY.values() if name in p.toolchain_fields]
            raise recipe.error(f"toolchain.{name}", f"{recipe.platform} recipes do not take toolchain.{name}",
                               fix=f"remove it (only {', '.join(takes)} recipes take it)")
    platform.check_recipe(recipe)
    for b in backends.of(recipe):
        b.check_recipe(recipe)
    return recipe


def load(path: str | Path) -> Recipe:
    """A recipe file (or a shipped recipe's name), loaded and checked: model, platform and backends."""
    return check(load_recipe(path))


def parse(text: str, *, file: str = "<recipe>") -> Recipe:
    """A recipe from YAML text, loaded and checked."""
    return check(parse_recipe(text, file=file))


# -------------------------------------------------------------------------------------------- key


def host_facts(recipe: Recipe, *, env: Mapping[str, str] | None = None) -> HostFacts:
    """What this machine contributes to the key, found on env's PATH (default: the system's default search
    path): the exact version of the compiler when the recipe does not pin it, and the tools its backends
    build with (glslc). Each is asked once per environment in a process."""
    compiler = None if recipe.pins_compiler else compilers.detect_version(recipe.toolchain.compiler, env=env)
    return HostFacts(compiler=compiler, tools=_tools(recipe, env, building=False))


def _tools(recipe: Recipe, env: Mapping[str, str] | None, *, building: bool) -> dict[str, ToolFound]:
    """Each backend's tool found on env's PATH, by backend name (pinned ones only when `building`)."""
    return {b.name: t for b in backends.of(recipe) if (t := b.host_tool(recipe, env=env, building=building)) is not None}


def unpinned(recipe: Recipe) -> list[str]:
    """What of the recipe's key a machine must supply (so a machine without that tool cannot compute it), or
    what the key leaves open (MSVC's toolset within a Visual Studio range): one sentence each."""
    t, out = recipe.toolchain, []
    if t.compiler == "msvc" and not t.toolset:
        out.append("toolchain.toolset is not set: any MSVC toolset of a Visual Studio in "
                   f"{t.msvc_version or 'any version'} builds under one key; pin one, e.g. toolset: \"14.44.35207\"")
    elif not recipe.pins_compiler:
        out.append(f"toolchain.version is not set: the key holds the exact {compilers.cxx_program(t.compiler)} found where "
                   "it is computed, so a machine without it cannot compute the key; pin it, e.g. version: \"=12.2.0\"")
    out += [w for b in backends.of(recipe) if (w := b.pin_warning(recipe)) is not None]
    return out


def for_build(keyed: Keyed, *, env: Mapping[str, str]) -> Keyed:
    """Before a build: the tools a build runs, found here even where the recipe pins them, must be the ones
    the key holds (a backend's check names the pin; ToolchainError). Returns the keyed recipe with them."""
    recipe = keyed.recipe
    host = HostFacts(compiler=keyed.host.compiler, tools=_tools(recipe, env, building=True))
    inputs = key_inputs(recipe, host)
    if inputs != keyed.inputs:
        raise ToolchainError(f"the tools here would give {recipe.name} another key than {keyed.key[:12]}",
                             why="differing inputs: " + ", ".join(k for k in sorted(inputs) if inputs[k] != keyed.inputs.get(k)),
                             fix="run the command again with one set of tools on PATH")
    return Keyed(recipe=recipe, host=host, inputs=inputs, key=keyed.key)


def compiler_key(recipe: Recipe, host: HostFacts) -> str | None:
    """The compiler's part of the key: the recipe's pin (`=12.2.0` exactly, or a range), else `=<exact version
    found here>`, the same value as the exact pin of that version (None for MSVC, whose toolset and Visual
    Studio range are in the key themselves)."""
    if recipe.toolchain.version:
        return recipe.toolchain.version
    if recipe.toolchain.compiler == "msvc" and (recipe.toolchain.msvc_version or recipe.toolchain.toolset):
        return None
    if host.compiler:
        return "=" + host.compiler
    raise ToolchainError(f"{recipe.origin or recipe.name}: the cache key needs the version of "
                         f"{compilers.cxx_program(recipe.toolchain.compiler)}",
                         why="the recipe does not pin toolchain.version, so its key holds the exact version of the "
                             "compiler that builds it, and there is no such compiler on PATH here",
                         fix="pin the compiler in the recipe (toolchain: {compiler: "
                             f"{recipe.toolchain.compiler}, version: \"12.2\"}}), or install it here")


def key_inputs(recipe: Recipe, host: HostFacts) -> dict[str, Any]:
    """Every input that changes the bundle's files, in canonical form (DESIGN §4): the recipe's, the
    compiler's, and each registered backend's entries (a backend adds entries whether or not the recipe has
    it: CUDA's `"cuda": null` keeps the keys of every recipe without CUDA as they were)."""
    toolchain: dict[str, Any] = {"compiler": recipe.toolchain.compiler}
    if (pin := compiler_key(recipe, host)) is not None:
        toolchain["version"] = pin
    if recipe.toolchain.msvc_version:
        toolchain["msvc_version"] = recipe.toolchain.msvc_version
    if recipe.toolchain.toolset:
        toolchain["toolset"] = recipe.toolchain.toolset
    inputs: dict[str, Any] = {
        "recipe": recipe.recipe,
        "bundle_format": recipe_model.BUNDLE_FORMAT,
        "derivation": derivation(),
        "platform": recipe.platform,
        "commit": recipe.llama_cpp.commit,
        "backends": sorted(recipe.backends),
        "toolchain": toolchain,
        "cmake": dict(sorted(recipe.cmake)),
        "targets": sorted(recipe.targets),
        "runtime": {"openmp": recipe.runtime.openmp},
    }
    if recipe.embeds_ui:  # only then (the keys of recipes without the UI stay as they were)
        # built: the commit pins its source (and its lockfile every package); pinned: the archive's bytes (not
        # where they are published)
        inputs["ui"] = recipe.ui if isinstance(recipe.ui, str) else {"archive_sha256": recipe.ui.sha256}
    inputs.update(platforms.get(recipe.platform).key_inputs(recipe))  # nothing for most platforms
    for b in backends.REGISTRY.values():
        inputs.update(b.key_inputs(recipe, host))
    return inputs


@dataclass(frozen=True, kw_only=True)
class Keyed:
    """A checked recipe with its key: the host facts it was computed with, the inputs and their sha256."""
    recipe: Recipe
    host: HostFacts
    inputs: Mapping[str, Any]
    key: str

    @property
    def tag(self) -> str:
        """The release tag of its bundle (publish.tag filled in)."""
        r, commit = self.recipe, self.recipe.llama_cpp.commit
        return r.publish.tag.format(name=r.name, key=self.key, key12=self.key[:12], commit=commit,
                                    commit12=commit[:12], platform=r.platform)


def resolve(recipe: Recipe, *, env: Mapping[str, str] | None = None, host: HostFacts | None = None) -> Keyed:
    """The recipe's key on this machine (`host`: facts found elsewhere, e.g. a build tree's CMake cache)."""
    host = host_facts(recipe, env=env) if host is None else host
    inputs = key_inputs(recipe, host)
    return Keyed(recipe=recipe, host=host, inputs=inputs, key=sha256_json(inputs))
