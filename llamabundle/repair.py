"""`llamabundle bundle`: a verified bundle from the output of a llama.cpp build made elsewhere (as auditwheel
and delvewheel repair wheels). The build directory is read, never written: CMake's cache names the source
tree and the compilers, llama.cpp's build-info names the commit; then the same collect, bundle.json, pack
and verify as `build` runs after compiling (pipeline.assemble)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import backends, cache, keys, platforms
from .backends import Prepared
from .build import MEMORY_PROGRAM, OWN_PROGRAMS, BuildResult, BuildTools, compiler_record, plan_build
from .compilers import CMAKE_CACHE, read_cmake_cache, version_matches
from .errors import ToolchainError, UsageError
from .log import Log
from .package import Made
from .pipeline import BuildOutcome, assemble, check_out, expect_for, making, sweep_cache, unpack_to
from .recipe import HostFacts, Recipe
from .settings import Settings
from .source import SourceTree


@dataclass(frozen=True, kw_only=True)
class BuildTree:
    """What CMake's cache and llama.cpp's build-info say about a build directory."""
    build_dir: Path
    source_dir: Path
    cmake: str
    cmake_version: str  # the CMakeFiles/<version> directory CMake wrote its compiler records in
    commit: str | None  # the short commit llama.cpp's build-info records
    compiler: str  # "GNU 12.2.0", "MSVC 19.44.35207.1"
    compiler_path: str  # CMake's CMAKE_CXX_COMPILER ("" where not recorded): MSVC's names its toolset


def read_build_tree(build_dir: Path) -> BuildTree:
    if not (build_dir / CMAKE_CACHE).is_file():
        raise UsageError(f"{build_dir} is not a CMake build directory", why=f"it has no {CMAKE_CACHE}",
                         fix="pass the directory you ran `cmake -B` with")
    entries = read_cmake_cache(build_dir)
    source = entries.get("CMAKE_HOME_DIRECTORY") or entries.get("llama.cpp_SOURCE_DIR")
    if not source or not Path(source).is_dir():
        raise UsageError(f"the source tree of {build_dir} is not here",
                         why=f"CMakeCache.txt names {source or 'no source directory'}",
                         fix="run `llamabundle bundle` where the build's source tree is (its licences go into the bundle)")
    commit = None
    for f in sorted(build_dir.glob("common/build-info.cpp")):
        m = re.search(r'LLAMA_COMMIT\s*=\s*"([0-9a-f]+)"', f.read_text(encoding="utf-8", errors="replace"))
        commit = m.group(1) if m else None
    versions = sorted(f.parent.name for f in build_dir.glob("CMakeFiles/*/CMakeCXXCompiler.cmake"))
    compiler, compiler_path = compiler_record(build_dir)
    return BuildTree(build_dir=build_dir, source_dir=Path(source), cmake=entries.get("CMAKE_COMMAND", "cmake"),
                     cmake_version=versions[-1] if versions else "", commit=commit, compiler=compiler,
                     compiler_path=compiler_path)


def check_ui(recipe: Recipe, build_dir: Path) -> None:
    """The build embeds the web UI exactly when the recipe has one (built or pinned; llama.cpp's generated ui.h says
    whether it embedded assets): the key holds it."""
    header = build_dir / "tools" / "ui" / "ui.h"
    try:
        embedded = "#define LLAMA_UI_HAS_ASSETS 1" in header.read_text(encoding="utf-8", errors="replace")
    except OSError:
        embedded = False
    if embedded != recipe.embeds_ui:
        raise UsageError(f"{build_dir} {'embeds no' if not embedded else 'embeds a'} web UI, the recipe says ui: {recipe.ui_said}",
                         why=f"{header} {'says it embedded assets' if embedded else 'is missing or names no assets'}, "
                             "and the web UI is part of the bundle's key",
                         fix="bundle it with a recipe that says so, or build with the recipe's ui (llamabundle build)")


def check_msvc_record(recipe: Recipe, tree: BuildTree) -> None:
    """A build made with MSVC is inside the recipe's toolset pin: the toolset in cl.exe's path
    (VC/Tools/MSVC/<toolset>/bin/...) where CMake recorded it, else cl's version series (19.44 for 14.44)."""
    pin = recipe.toolchain.toolset
    if not pin:
        return
    from .platforms.windows.msvc import cl_of_toolset

    m = re.search(r"[/\\]MSVC[/\\](14\.\d+\.\d+)[/\\]", tree.compiler_path, re.I)
    cl = tree.compiler.rpartition(" ")[2]
    ok = m.group(1) == pin if m else cl == cl_of_toolset(pin) or cl.startswith(cl_of_toolset(pin) + ".")
    if not ok:
        made = f"toolset {m.group(1)} ({tree.compiler})" if m else tree.compiler
        raise ToolchainError(f"{tree.build_dir} was built with MSVC {made}, outside the recipe's toolchain.toolset {pin} "
                             f"(cl {cl_of_toolset(pin)})",
                             why="the toolset changes the bundle's bytes, so the key holds the recipe's pin; a bundle "
                                 "of another toolset under that key would lie",
                             fix=f"rebuild with the pinned toolset (vcvars64.bat -vcvars_ver={pin}), or bundle it with "
                                 "a recipe that pins the toolset it was built with (a new key)")


CMAKE_IDS = {"gcc": "GNU", "mingw": "GNU", "clang": "Clang", "msvc": "MSVC"}  # toolchain.compiler -> CMake's id


def _host(recipe: Recipe, tree: BuildTree, *, env: Mapping[str, str]) -> HostFacts:
    """What the key holds of the machine: the compiler that made the build (not one found here), of the
    recipe's family and inside its pin; the backends' tools as found here."""
    tools = keys.host_facts(recipe, env=env).tools
    family, _, found = tree.compiler.rpartition(" ")
    want = CMAKE_IDS[recipe.toolchain.compiler]
    if family != want:
        raise ToolchainError(f"{tree.build_dir} was built with {tree.compiler}, not {recipe.toolchain.compiler}",
                             why=f"the recipe's toolchain.compiler is {recipe.toolchain.compiler} (CMake calls it {want}), "
                                 "and the compiler is part of the bundle's key",
                             fix="bundle it with a recipe of that compiler, or rebuild with the recipe's")
    if recipe.toolchain.compiler == "msvc":
        check_msvc_record(recipe, tree)
        return HostFacts(tools=tools)
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)*", found):
        raise UsageError(f"CMake's record in {tree.build_dir} names no compiler version", why=f"found {tree.compiler!r}",
                         fix="pass a configured and built directory")
    if recipe.toolchain.version and not version_matches(recipe.toolchain.version, found):
        raise ToolchainError(f"the build was made with {tree.compiler}, outside the recipe's toolchain.version "
                             f"{recipe.toolchain.version}", fix="bundle it with a recipe that pins that compiler")
    return HostFacts(compiler=found, tools=tools)


def bundle_build(recipe: Recipe, build_dir: Path, *, out: Path, toolkit_root: Path | None, msvc_redist: Path | None,
                 settings: Settings, log: Log, env: Mapping[str, str]) -> BuildOutcome:
    """Collect, describe, pack and verify the build in `build_dir` as the recipe's bundle; `out` is a
    directory (new or empty: the bundle unpacked) or a .zip path. Nothing is written unless all passed."""
    as_zip = out.suffix.lower() == ".zip"
    if as_zip:
        if out.exists():
            raise UsageError(f"--out {out} exists", fix="pass a new file name, or remove it")
        if not out.parent.is_dir():
            raise UsageError(f"--out {out}: {out.parent} is not a directory", fix="create it first")
    else:
        check_out(out)
    sweep_cache(settings)
    tree = read_build_tree(build_dir)
    if tree.commit and not recipe.llama_cpp.commit.startswith(tree.commit):
        raise UsageError(f"{build_dir} is a build of llama.cpp {tree.commit}, the recipe pins {recipe.llama_cpp.commit[:12]}",
                         why="common/build-info.cpp records the commit the build was configured from",
                         fix="bundle it with a recipe of that commit, or build the pinned commit")
    keyed = keys.resolve(recipe, host=_host(recipe, tree, env=env))
    platform = platforms.get(recipe.platform)
    prepared: dict[str, Prepared] = {}
    for backend in backends.of(recipe):  # the toolkit the build used (CUDA's, from --toolkit-root), checked
        if (given := backend.given_toolkit(recipe, build_dir=build_dir, toolkit_root=toolkit_root)) is not None:
            prepared[backend.name] = given
    toolchain = platform.given_toolchain(recipe, redist=msvc_redist)
    src = SourceTree(path=tree.source_dir, commit=recipe.llama_cpp.commit, origin=f"build directory {build_dir}")
    tools = BuildTools(cmake=tree.cmake, ninja="", cmake_version=tree.cmake_version)
    made = Made(keyed=keyed, src=src, tools=tools, prepared=prepared, sde=settings.source_date_epoch)
    if made.sde is None:  # the build tree does not prove its commit's date, as a fetched source does
        log.warn("SOURCE_DATE_EPOCH is not set: built_at and the zip's timestamps are the time of this run, so the "
                 "zip is not reproducible; set it (e.g. to the llama.cpp commit's date, `git log -1 --format=%ct`)")
    plan = plan_build(recipe, keyed.host, source_dir=tree.source_dir, build_dir=build_dir, tools=tools,
                      toolkit_roots=made.toolkit_roots)
    for program, _, _ in OWN_PROGRAMS:
        own = platform.program_file(program)
        if not (plan.output_dir / own).is_file():  # a tree configured without llamabundle's project include
            plan = dataclasses.replace(plan, programs=tuple(p for p in plan.programs if p != own))
            log.info(f"    {build_dir} has no {own} (it was configured without llamabundle): " + (
                "`plan` sizes its rungs with the closed-form estimate for this bundle" if program == MEMORY_PROGRAM
                else "the bundle cannot answer for its backends itself"))
    absent = [n for n in plan.programs + plan.backends if not (plan.output_dir / n).is_file()]
    if absent:
        raise UsageError(f"{build_dir} lacks {', '.join(absent)}", why=f"the recipe's programs and backends are "
                         f"looked for in {plan.output_dir}", fix="build the recipe's targets there first")
    check_ui(recipe, build_dir)
    result = BuildResult(plan=plan, log_path=build_dir / CMAKE_CACHE, compiler=tree.compiler, compiled=0)
    zip_path = cache.out_zip(settings.cache_dir, recipe.name, keyed.key)
    with making(settings, keyed.key, log):  # out/'s zip is this process's until it is copied or unpacked
        with log.step(f"bundle {build_dir} as {recipe.name} ({made.key[:12]})"):
            manifest, collected, report = assemble(made, plan, result, zip_path, toolchain=toolchain,
                                                   settings=settings, log=log)
        outcome = BuildOutcome(key=made.key, hit=False, zip_path=zip_path, manifest=manifest, verify=report,
                               bundled_libs={k: str(v) for k, v in collected.bundled.items()})
        if as_zip:
            tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
            shutil.copyfile(zip_path, tmp)
            os.replace(tmp, out)
            outcome.zip_path = out
            log.info(f"bundle written to {out}")
        else:
            outcome.out_dir = unpack_to(zip_path, out, expect_for(keyed))
            log.info(f"bundle unpacked in {out}")
    return outcome
