"""The CPU backend: ggml-cpu, or with GGML_CPU_ALL_VARIANTS one module per CPU variant (the recipe may
leave some out: `cpu_variants.exclude`). Every bundle has it."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from .base import NoExtras

if TYPE_CHECKING:
    from ..recipe import HostFacts, Recipe


def variants(recipe: Recipe) -> tuple[str, ...]:
    """The CPU variants the recipe builds (all of llama.cpp's at its commit, less those excluded)."""
    return tuple(v for v in recipe.all_cpu_variants() if v not in recipe.cpu_variants.exclude)


class Cpu(NoExtras):
    name = "cpu"
    loader_name = "CPU"
    gpu = False

    def check_recipe(self, recipe: Recipe) -> None:
        """The variants left out (cpu_variants.exclude) are variants of this compiler's build, not all of them."""
        exclude, known = recipe.cpu_variants.exclude, recipe.all_cpu_variants()
        if not exclude:
            return
        if recipe.cmake_options.get("GGML_CPU_ALL_VARIANTS") != "ON":
            raise recipe.error("cpu_variants.exclude", "variants can be left out only of a GGML_CPU_ALL_VARIANTS build",
                               fix="set cmake: {GGML_CPU_ALL_VARIANTS: ON, GGML_BACKEND_DL: ON}, or remove cpu_variants:")
        for i, name in enumerate(exclude):
            if name not in known:
                hint = difflib.get_close_matches(name, known, n=1)
                raise recipe.error(f"cpu_variants.exclude[{i}]",
                                   f"'{name}' is not a CPU variant ggml builds with {recipe.toolchain.compiler}",
                                   fix=f"did you mean '{hint[0]}'?" if hint else "use some of: " + ", ".join(known))
        if len(set(exclude)) != len(exclude):
            raise recipe.error("cpu_variants.exclude", "a variant is listed twice")
        if set(known) <= set(exclude):
            raise recipe.error("cpu_variants.exclude", "every CPU variant is excluded: the bundle would have no CPU "
                               "backend", fix="keep at least one (x64 runs on every x86-64 CPU)")

    def key_inputs(self, recipe: Recipe, host: HostFacts) -> dict[str, Any]:
        """The variants left out, only when some are: the keys of recipes without it stay as they were."""
        if not recipe.cpu_variants.exclude:
            return {}
        return {"cpu_variants": {"exclude": sorted(recipe.cpu_variants.exclude)}}

    def targets(self, recipe: Recipe) -> tuple[str, ...]:
        if recipe.cmake_options.get("GGML_CPU_ALL_VARIANTS") == "ON":
            return tuple(f"ggml-cpu-{v}" for v in variants(recipe))
        return ("ggml-cpu",)

    def project_include(self, recipe: Recipe) -> list[str]:
        """ggml has no switch for one variant: each variant is a MODULE that `add_dependencies(ggml …)` ties
        to every program, so the include wraps add_dependencies to drop the excluded ones from ggml's
        dependencies and from the default build; their sources are never compiled."""
        excluded = [f"ggml-cpu-{v}" for v in recipe.cpu_variants.exclude]
        if not excluded:
            return []
        return [
            "get_property(_llamabundle_wrapped GLOBAL PROPERTY LLAMABUNDLE_ADD_DEPENDENCIES)",
            "if(NOT _llamabundle_wrapped)  # wrap once: a second wrapper would call itself",
            "  set_property(GLOBAL PROPERTY LLAMABUNDLE_ADD_DEPENDENCIES ON)",
            "  function(add_dependencies target)  # cpu_variants.exclude",
            "    set(_deps ${ARGN})",
            '    if(target STREQUAL "ggml")',
            f"      foreach(_dep {' '.join(excluded)})",
            "        list(FIND _deps ${_dep} _at)",
            "        if(NOT _at EQUAL -1)",
            "          list(REMOVE_ITEM _deps ${_dep})",
            "          set_target_properties(${_dep} PROPERTIES EXCLUDE_FROM_ALL ON)",
            '          message(STATUS "llamabundle: CPU variant ${_dep} left out (cpu_variants.exclude)")',
            "        endif()",
            "      endforeach()",
            "    endif()",
            "    if(_deps)",
            "      _add_dependencies(${target} ${_deps})",
            "    endif()",
            "  endfunction()",
            "endif()"]


CPU = Cpu()
