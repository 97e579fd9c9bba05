"""BuildPlan (pure: recipe + paths + tools → argv) and the thin executor that runs cmake and ninja."""

from __future__ import annotations

import json
import re
import shutil
import sysconfig
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from . import data, proc
from .compilers import EXECUTABLES
from .errors import BuildError, ToolchainError
from .log import Log
from .recipe import Recipe

STAMP = "llamabundle-configure.json"
LOG_NAME = "llamabundle-build.log"
_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


@dataclass(frozen=True, kw_only=True)
class BuildTools:
    cmake: str
    ninja: str
    ccache: str | None = None
    cmake_version: str = ""
    ninja_version: str = ""


@dataclass(frozen=True, kw_only=True)
class BuildPlan:
    source_dir: Path
    build_dir: Path
    configure: tuple[str, ...]
    build: tuple[str, ...]
    targets: tuple[str, ...]
    programs: tuple[str, ...]  # file names of the recipe's programs in the output dir
    backends: tuple[str, ...]  # file names of the backend modules (loaded at run time, not linked)
    output_dir: Path
    files: tuple[tuple[str, str], ...] = ()  # (path, text) the executor writes before configuring

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["files"] = dict(self.files)
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def cpu_variants(recipe: Recipe) -> tuple[str, ...]:
    return tuple(v for v in recipe.all_cpu_variants() if v not in recipe.cpu_variants.exclude)


def backend_targets(recipe: Recipe) -> tuple[str, ...]:
    opts = recipe.cmake_options
    targets: list[str] = []
    if opts.get("GGML_CPU_ALL_VARIANTS") == "ON":
        targets += [f"ggml-cpu-{v}" for v in cpu_variants(recipe)]
    else:
        targets.append("ggml-cpu")
    if "cuda" in recipe.backends:
        targets.append("ggml-cuda")
    return tuple(targets)


def library_file(recipe: Recipe, target: str) -> str:
    return f"{target}.dll" if recipe.platform.startswith("windows") else f"lib{target}.so"


def program_file(recipe: Recipe, target: str) -> str:
    return f"{target}.exe" if recipe.platform.startswith("windows") else target


def plan_build(recipe: Recipe, *, source_dir: Path, build_dir: Path, tools: BuildTools, jobs: int | None = None,
               cuda_root: Path | None = None) -> BuildPlan:
    """Pure: the exact commands that build this recipe. Shown by `llamabundle show`."""
    cc, cxx = EXECUTABLES[recipe.toolchain.compiler]
    defs: dict[str, str] = {
        "CMAKE_BUILD_TYPE": "Release",
        "CMAKE_C_COMPILER": cc,
        "CMAKE_CXX_COMPILER": cxx,
        "LLAMA_BUILD_COMMIT": recipe.llama_cpp.commit[:8],
        "LLAMA_BUILD_NUMBER": str(data.llama_builds().get(recipe.llama_cpp.commit, 0)),
        "CMAKE_BUILD_RPATH_USE_ORIGIN": "ON",
        **recipe.cmake_options,
        "GGML_CUDA": "ON" if "cuda" in recipe.backends else "OFF",
    }
    defs.update(_prefix_map_flags(recipe, defs, source_dir=source_dir, build_dir=build_dir))
    if recipe.cuda is not None:
        defs["CMAKE_CUDA_ARCHITECTURES"] = ";".join(recipe.cuda.archs)
        if data.cuda_toolkits()[recipe.cuda.toolkit].get("compression") and "GGML_CUDA_COMPRESSION_MODE" not in defs:
            defs["GGML_CUDA_COMPRESSION_MODE"] = "size"  # nvcc --compress-mode (12.8+): a 6x smaller ggml-cuda
        if cuda_root is not None:
            nvcc = "nvcc.exe" if recipe.platform.startswith("windows") else "nvcc"
            defs["CUDAToolkit_ROOT"] = str(cuda_root)
            defs["CMAKE_CUDA_COMPILER"] = str(cuda_root / "bin" / nvcc)
    project_defs, files = _project_files(recipe, build_dir)
    defs.update(project_defs)
    if tools.ccache:
        for lang in ("C", "CXX") + (("CUDA",) if recipe.cuda else ()):
            defs[f"CMAKE_{lang}_COMPILER_LAUNCHER"] = tools.ccache
    configure = (tools.cmake, "-S", str(source_dir), "-B", str(build_dir), "-G", "Ninja",
                 f"-DCMAKE_MAKE_PROGRAM={tools.ninja}", *(f"-D{k}={v}" for k, v in defs.items()))
    backends = backend_targets(recipe)
    targets = tuple(recipe.targets) + backends
    build = (tools.cmake, "--build", str(build_dir), "--target", *targets)
    if jobs:
        build += ("--parallel", str(jobs))
    return BuildPlan(
        source_dir=source_dir, build_dir=build_dir, configure=configure, build=build, targets=targets,
        programs=tuple(program_file(recipe, t) for t in recipe.targets),
        backends=tuple(library_file(recipe, t) for t in backends),
        output_dir=build_dir / "bin",
        files=files,
    )


PROJECT_INCLUDE = "llamabundle-project.cmake"
MINGW_TOOLCHAIN = "llamabundle-mingw-toolchain.cmake"
MINGW_COMPAT = "llamabundle-mingw-compat.h"


def _project_files(recipe: Recipe, build_dir: Path) -> tuple[dict[str, str], tuple[tuple[str, str], ...]]:
    """CMake files the tool writes into the build tree (and the cache variables that point at them): the
    mingw toolchain file and compatibility header, and a project include (CMAKE_PROJECT_INCLUDE, read
    after every project() call) that leaves out the recipe's excluded CPU variants and sets mingw's
    compile definitions and module names. ggml has no switch for one variant: each variant is a MODULE
    that `add_dependencies(ggml …)` ties to every program, so the include wraps add_dependencies to drop
    the excluded ones from ggml's dependencies and from the default build; their sources are never
    compiled. Nothing in the source tree is touched."""
    defs: dict[str, str] = {}
    files: list[tuple[str, str]] = []
    include: list[str] = ["# Written by llamabundle (build.py): read after every project() call."]
    if recipe.toolchain.compiler == "mingw":
        mingw = data.load("mingw.json")
        tc = mingw["toolchain"]
        toolchain = build_dir / MINGW_TOOLCHAIN
        compat = build_dir / MINGW_COMPAT
        files.append((str(toolchain), "\n".join([
            "# Written by llamabundle (data/mingw.json): cross-compile for Windows x86-64 with mingw-w64.",
            f"set(CMAKE_SYSTEM_NAME {tc['system_name']})",
            f"set(CMAKE_SYSTEM_PROCESSOR {tc['system_processor']})",
            f"set(CMAKE_C_COMPILER {tc['c_compiler']})",
            f"set(CMAKE_CXX_COMPILER {tc['cxx_compiler']})",
            f"set(CMAKE_RC_COMPILER {tc['rc_compiler']})",
            f"set(CMAKE_FIND_ROOT_PATH {tc['find_root_path']})",
            "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)",
            "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)",
            "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)",
            "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)", ""])))
        files.append((str(compat), "\n".join(mingw["compat_header"]) + "\n"))
        defs["CMAKE_TOOLCHAIN_FILE"] = str(toolchain)
        include += ['set(CMAKE_SHARED_MODULE_PREFIX "")  # ggml loads ggml-<backend>*.dll',
                    'set(CMAKE_SHARED_LIBRARY_PREFIX "")  # llama.dll, ggml.dll: the names MSVC bundles use',
                    "if(CMAKE_CURRENT_SOURCE_DIR STREQUAL CMAKE_SOURCE_DIR)  # once; subdirectories inherit them",
                    *(f"  add_compile_definitions({d})" for d in mingw["defines"]),
                    f'  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-include{compat.as_posix()}>")',
                    "endif()"]
    excluded = [f"ggml-cpu-{v}" for v in recipe.cpu_variants.exclude]
    if excluded:
        include += [
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
    if len(include) > 1:
        files.append((str(build_dir / PROJECT_INCLUDE), "\n".join(include) + "\n"))
        defs["CMAKE_PROJECT_INCLUDE"] = str(build_dir / PROJECT_INCLUDE)
    return defs, tuple(files)


def _prefix_map_flags(recipe: Recipe, defs: dict[str, str], *, source_dir: Path, build_dir: Path) -> dict[str, str]:
    """Where the source and the build tree lie must not show in the binaries (__FILE__, debug info): map
    them to fixed names, so that two builds in different places give the same bytes (gcc, clang, and
    nvcc's host compiler; MSVC has no such switch and its builds are not claimed reproducible)."""
    if recipe.toolchain.compiler == "msvc":
        return {}
    maps = f"-ffile-prefix-map={source_dir}=/llama.cpp -ffile-prefix-map={build_dir}=/build"
    out = {f"CMAKE_{lang}_FLAGS": f"{defs[f'CMAKE_{lang}_FLAGS']} {maps}".strip() if f"CMAKE_{lang}_FLAGS" in defs
           else maps for lang in ("C", "CXX")}
    if recipe.cuda is not None:
        cuda = " ".join(f"-Xcompiler={m}" for m in maps.split())
        out["CMAKE_CUDA_FLAGS"] = f"{defs.get('CMAKE_CUDA_FLAGS', '')} {cuda}".strip()
    return out


# ------------------------------------------------------------------------------------- tools


def resolve_tools(*, path: str | None, use_ccache: bool = True) -> BuildTools:
    """Find cmake and ninja: the system ones when new enough, else those of the PyPI packages."""
    min_cmake = data.build_knowledge()["min_cmake"]
    cmake = _pick("cmake", path, min_cmake, "cmake")
    ninja = _pick("ninja", path, "1.10", "ninja")
    ccache = shutil.which("ccache", path=path) if use_ccache else None
    return BuildTools(cmake=cmake[0], cmake_version=cmake[1], ninja=ninja[0], ninja_version=ninja[1], ccache=ccache)


def locate_tools(*, path: str | None) -> BuildTools:
    """The build tools a build would most likely use, found without running anything (for `show`):
    the first candidate that exists, or the bare name."""
    found = {p: next((c for c in _candidates(p, path, p) if c and Path(c).is_file()), p) for p in ("cmake", "ninja")}
    return BuildTools(cmake=found["cmake"], ninja=found["ninja"], ccache=shutil.which("ccache", path=path))


def _candidates(program: str, path: str | None, pypi: str) -> list[str | None]:
    candidates = [shutil.which(program, path=path)]
    try:  # the PyPI package's binary (pip install cmake / ninja)
        mod = __import__(pypi)
        candidates.append(str(Path(getattr(mod, "CMAKE_BIN_DIR", getattr(mod, "BIN_DIR", ""))) / program))
    except ImportError:
        pass
    candidates.append(str(Path(sysconfig.get_path("scripts")) / program))
    return candidates


def _pick(program: str, path: str | None, minimum: str, pypi: str) -> tuple[str, str]:
    candidates = _candidates(program, path, pypi)
    seen = []
    for exe in candidates:
        if not exe or not Path(exe).is_file():
            continue
        version = _version_of(exe)
        seen.append(f"{exe} ({version or 'unknown version'})")
        try:
            if version and Version(version) >= Version(minimum):
                return exe, version
        except InvalidVersion:
            continue
    raise ToolchainError(f"no usable {program} (>= {minimum}) found",
                         why="found: " + ", ".join(seen) if seen else f"{program} is not on PATH",
                         fix=f"pip install '{pypi}>={minimum}' (or install {program} from your package manager)")


def _version_of(exe: str) -> str:
    try:
        out = proc.capture([exe, "--version"], timeout=30).stdout
    except OSError:
        return ""
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", out)
    return m.group(1) if m else ""


# ---------------------------------------------------------------------------------- executor


@dataclass(frozen=True, kw_only=True)
class BuildResult:
    plan: BuildPlan
    log_path: Path
    compiler: str
    compiled: int  # ninja edges run (0 = everything was up to date)


def run_build(plan: BuildPlan, *, log: Log, env: Mapping[str, str], clean: bool = False,
              timeout: float | None = None) -> BuildResult:
    """Configure (when the stamp says so) and build; each step is stopped after `timeout` seconds."""
    bd = plan.build_dir
    stamp = bd / STAMP
    wanted = list(plan.configure) if not plan.files else {"configure": list(plan.configure), "files": dict(plan.files)}
    configured = stamp.is_file() and (bd / "build.ninja").is_file() and json.loads(stamp.read_text()) == wanted
    if clean or (bd.exists() and not configured):
        shutil.rmtree(bd, ignore_errors=True)
    bd.mkdir(parents=True, exist_ok=True)
    for name, text in plan.files:  # rewritten only when changed: a new mtime would rerun cmake and recompile
        f = Path(name)
        if not f.is_file() or f.read_text(encoding="utf-8") != text:
            f.write_text(text, encoding="utf-8")
    log_path = bd / LOG_NAME
    log_path.write_text("")
    fix = f"read the full log at {log_path}; fix the toolchain or the recipe's cmake: options"
    if not configured:
        with log.step("configure (cmake)"):
            proc.run(plan.configure, log=log, error=BuildError, what="cmake configure failed", fix=fix,
                     env=env, log_path=log_path, timeout=timeout)
        stamp.write_text(json.dumps(wanted))
    compiled = 0
    with log.step(f"build {len(plan.targets)} targets (ninja)"), log.progress("compile") as bar:
        def on_line(line: str) -> None:
            nonlocal compiled
            m = _NINJA_PROGRESS.match(line)
            if m:
                compiled = int(m.group(1))
                bar.update(compiled, int(m.group(2)))
        proc.run(plan.build, log=log, error=BuildError, what="the build failed", fix=fix, env=env,
                 log_path=log_path, on_line=on_line, timeout=timeout)
    for name in plan.programs + plan.backends:
        if not (plan.output_dir / name).is_file():
            raise BuildError(f"the build did not produce {name}", why=f"expected it in {plan.output_dir}",
                             fix="check that the recipe's targets and cmake options build it")
    return BuildResult(plan=plan, log_path=log_path, compiler=compiler_of(bd), compiled=compiled)


def compiler_of(build_dir: Path) -> str:
    """'GNU 12.2.0' from CMake's own record of the C++ compiler it used."""
    for f in sorted(build_dir.glob("CMakeFiles/*/CMakeCXXCompiler.cmake")):
        text = f.read_text()
        cid = re.search(r'set\(CMAKE_CXX_COMPILER_ID "([^"]*)"\)', text)
        ver = re.search(r'set\(CMAKE_CXX_COMPILER_VERSION "([^"]*)"\)', text)
        if cid and ver:
            return f"{cid.group(1)} {ver.group(1)}"
    return "unknown"
