"""Packaging a build: its programs and backends and the runtime libraries they need collected into a
stage directory (asked of the platform and the backends), llama.cpp's licences, bundle.json assembled
from what was staged, and the deterministic zip."""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import backends, cache, platforms, scratch, webui
from .backends import Prepared
from .build import BuildPlan, BuildResult, BuildTools
from .bundle import built_at, bundle_time, file_entries, pack, write_manifest
from .bundle import parts as parts_mod
from .bundle.manifest import Manifest
from .errors import VerifyError
from .keys import Keyed
from .log import Log
from .platforms import Collected, RuntimeSources
from .platforms.base import Extra, HostToolchain
from .recipe import Recipe
from .source import SourceTree
from .webui import Assets

LICENSE_FILES = {"LICENSE": "LICENSE", "licenses/LICENSE-jsonhpp": "LICENSE-jsonhpp"}


@dataclass(frozen=True, kw_only=True)
class Made:
    """What a build of one recipe was made with: enough to package it, or to build it again elsewhere."""
    keyed: Keyed
    src: SourceTree
    tools: BuildTools
    prepared: Mapping[str, Prepared]  # backend name -> its toolkit
    sde: int | None  # SOURCE_DATE_EPOCH: the commit's date unless the environment sets it
    ui: Assets | None = None  # the web UI laid into the build (ui: build)

    def lay(self, build_dir: Path, log: Log) -> None:
        """What the build takes from its directory: the web UI's assets (nothing without one)."""
        if self.ui is not None:
            webui.place(self.ui, build_dir, log)

    @property
    def recipe(self) -> Recipe:
        return self.keyed.recipe

    @property
    def key(self) -> str:
        return self.keyed.key

    @property
    def toolkit_roots(self) -> dict[str, Path]:
        return {name: p.root for name, p in self.prepared.items()}


def package(made: Made, plan: BuildPlan, result: BuildResult, out_zip: Path, *, toolchain: HostToolchain,
            cache_dir: Path, log: Log) -> tuple[Manifest, Collected]:
    """Collect the build's products and their runtime libraries (from the build, the backends' toolkits and
    the toolchain's runtime directories), write bundle.json with each file's origin and reason, pack the zip."""
    recipe = made.recipe
    platform = platforms.get(recipe.platform)
    have = backends.of(recipe)
    when = bundle_time(made.sde)  # built_at and the zip's entries: one time (docs/bundle-format.md)
    tmp = scratch.make_dir(cache.tmp_dir(cache_dir), cache.STAGE_PREFIX)
    try:
        stage = tmp / "bundle"
        stage.mkdir()
        with log.step("collect runtime libraries"):
            own: dict[str, set[str]] = {b.name: {platform.library_file(t) for t in b.targets(recipe)} for b in have}

            def extras(bundled: Mapping[str, Path], dirs: Sequence[Path]) -> list[Extra]:
                asked = [(b, e) for b in have for e in b.runtime_extras(recipe, bundled, dirs, platform=platform)]
                for b, e in asked:  # a companion a backend asks for is that backend's own (parts)
                    own[b.name].add(e.path.name)
                return [e for _b, e in asked]

            sources = RuntimeSources(
                lib_dirs=(*((d, "toolkit") for p in made.prepared.values() for d in p.lib_dirs), *toolchain.runtime_dirs),
                extras=extras, openmp=recipe.runtime.openmp)
            collected = platform.collect(plan.products, stage, log=log, sources=sources)
            about = {n: (collected.origins.get(n, "build"), collected.why.get(n, "")) for n in collected.bundled}
            about |= {n: ("source", "llama.cpp's licence") for n in copy_licenses(made.src.path, stage)}
            about |= platform.licenses(collected, stage)
            for b in have:
                mine = b.licenses(collected.bundled, made.prepared.get(b.name), stage)
                own[b.name] |= set(mine)
                about |= mine
            roles = dict(collected.roles) | {n: "license" for n in about if n not in collected.roles}
            parts = bundle_parts(stage, roles, own, fold_case=platform.system == "windows")
        fields: dict[str, Any] = {
            "name": recipe.name,
            "key": made.key,
            "inputs": dict(made.keyed.inputs),
            "llama_cpp": {"commit": recipe.llama_cpp.commit, "version": llama_version(plan.build_dir),
                          "source": made.src.origin},
            "platform": recipe.platform,
            "backends": sorted(recipe.backends),
            # a tool whose version is not known (`bundle` of a build made elsewhere: its ninja) is null, never ""
            "toolchain": {"cmake": made.tools.cmake_version or None, "ninja": made.tools.ninja_version or None,
                          "compiler": result.compiler or None,
                          **toolchain.record,
                          **{k: v for p in made.prepared.values() for k, v in p.toolchain.items()},
                          **({"ui": made.ui.digest, "ui_source": made.ui.source} if made.ui else {})},
            "system_deps": collected.system_deps,
            "glibc_floor": collected.glibc_floor,
            "files": file_entries(stage, roles, about),
            "parts": parts,
            "built_at": built_at(when),
            "publish": {"tag": made.keyed.tag},
        }
        for b in backends.REGISTRY.values():  # every backend's section: null when the bundle lacks it
            if b.manifest_key:
                fields[b.manifest_key] = b.manifest_section(recipe, made.keyed.host, stage, platform=platform,
                                                            prepared=made.prepared.get(b.name)) if b in have else None
        manifest = write_manifest(stage, fields)
        with log.step("pack"):
            pack(stage, out_zip, source_date_epoch=when,  # every entry dated built_at
                 cache=cache.deflated_dir(cache_dir))  # large members' streams kept for the next build
            log.info(f"    {out_zip} ({out_zip.stat().st_size / 1e6:.1f} MB, {len(manifest.files)} files)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest, collected


def bundle_parts(stage: Path, roles: Mapping[str, str], own: Mapping[str, set[str]], *,
                 fold_case: bool) -> dict[str, list[str]]:
    """bundle.json's `parts` (bundle.parts.split): the CPU part is rooted at the programs, the CPU backend's own
    files and every licence no other backend claims; each GPU backend at its modules, companions and licences."""
    claimed = {n for b, files in own.items() if b != parts_mod.CPU for n in files}
    roots = {b: sorted(n for n in files if n in roles) for b, files in own.items()}
    roots[parts_mod.CPU] = sorted({*roots.get(parts_mod.CPU, ()), *(n for n, r in roles.items()
                                                                   if r == "exe" or (r == "license" and n not in claimed))})
    return parts_mod.split(roles, roots=roots, imports=lambda n: parts_mod.imports_of(stage / n), fold_case=fold_case)


def copy_licenses(source_dir: Path, stage: Path) -> dict[str, str]:
    """llama.cpp's own licence texts from the source tree (its LICENSE must be there)."""
    roles: dict[str, str] = {}
    for src_rel, name in LICENSE_FILES.items():
        if (source_dir / src_rel).is_file():
            shutil.copyfile(source_dir / src_rel, stage / name)
            roles[name] = "license"
    if "LICENSE" not in roles:
        raise VerifyError("llama.cpp's LICENSE file is missing from the source tree", fix="check the source")
    return roles


def llama_version(build_dir: Path) -> str | None:
    """'b<N>' from the build's generated build-info, when llama.cpp knew its build number."""
    for f in build_dir.glob("common/build-info.cpp"):
        m = re.search(r"LLAMA_BUILD_NUMBER\s*=\s*(\d+)", f.read_text(encoding="utf-8", errors="replace"))
        if m and int(m.group(1)) > 0:
            return f"b{m.group(1)}"
    return None
