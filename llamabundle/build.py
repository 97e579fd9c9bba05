"""BuildPlan (pure: recipe + paths + tools → argv) and the thin executor that runs cmake and ninja."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from . import backends, compiler_cache, data, offline, platforms, proc, untrusted
from .backends import Backend
from .compilers import EXECUTABLES
from .errors import BuildError, ToolchainError
from .log import Log
from .platforms import Platform
from .platforms.base import Products
from .recipe import HostFacts, Recipe

STAMP = "llamabundle-configure.json"
LOG_NAME = "llamabundle-build.log"
_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


@dataclass(frozen=True, kw_only=True)
class BuildTools:
    cmake: str
    ninja: str
    compiler_cache: str | None = None  # the launcher after the tool's own for C, C++ and CUDA (compiler_cache.py)
    cmake_version: str = ""
    ninja_version: str = ""

    @property
    def ids(self) -> tuple[str | None, ...]:
        """What names a build tree of these tools (cache.build_dir)."""
        return (self.cmake, self.ninja, self.compiler_cache)


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
    env: tuple[tuple[str, str], ...] = ()  # laid over the environment configure and build run in (MSVC's vcvars)
    links: tuple[tuple[str, str], ...] = ()  # (fixed-length path, the real directory): made before configuring
    commands: tuple[tuple[str, ...], ...] = ()  # run before configuring (a compiler launcher's helper)

    @property
    def products(self) -> Products:
        """What the build makes that goes into the bundle (what a platform collects)."""
        return Products(output_dir=self.output_dir, programs=self.programs, backends=self.backends)

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["files"] = dict(self.files)
        d["env"] = dict(self.env)
        d["links"] = dict(self.links)
        d["commands"] = [list(c) for c in self.commands]
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def backend_targets(recipe: Recipe) -> tuple[str, ...]:
    """The CMake targets of the recipe's backend modules, backend by backend (cpu first)."""
    return tuple(t for b in backends.of(recipe) for t in b.targets(recipe))


COMPILER_CACHE_SWITCH = "GGML_CCACHE"  # ggml's pick of ccache or sccache, when no launcher is set: always off
FIXED_LENGTH = 120  # of the paths a build with a compiler launcher is configured at


def max_fixed_root(tag: str = "s") -> int:
    """The longest `root` fixed_path still pads to FIXED_LENGTH characters."""
    return FIXED_LENGTH - 1 - len(tag) - 16 - 1


def fixed_path(real: Path, root: Path, tag: str) -> Path:
    """A path of FIXED_LENGTH characters under `root` for the directory `real` (a symbolic link the build
    makes; its name is a digest of `real`, padded): nvcc's output follows the lengths of the paths it is
    given, so two builds in different directories compile through paths of one length. A `root` too long to
    pad gives the shortest such path (and two builds agree only if their roots have the same length)."""
    digest = hashlib.sha256(str(real).encode()).hexdigest()[:16]
    pad = max(1, FIXED_LENGTH - len(str(root)) - 1 - len(tag) - len(digest))
    return root / f"{tag}{'_' * pad}{digest}"


def plan_build(recipe: Recipe, host: HostFacts, *, source_dir: Path, build_dir: Path, tools: BuildTools, jobs: int | None = None,
               toolkit_roots: Mapping[str, Path] | None = None, env: Mapping[str, str] | None = None,
               fixed_root: Path | None = None, compilers: tuple[str, str] | None = None) -> BuildPlan:
    """Pure: the exact commands that build this recipe, asked of its platform and backends. Shown by
    `llamabundle show`. `host`: what the key found on this machine (a backend's tool); `toolkit_roots`: backend name -> the root of the toolkit prepared for it; `env`: the
    variables the platform's toolchain set up (laid over the build's environment); `fixed_root`: where the
    fixed-length paths of a build whose backends bring a compiler launcher lie (None: the real paths): the
    source, the build tree and those backends' toolkits are then configured through links there."""
    platform = platforms.get(recipe.platform)
    have = backends.of(recipe)
    roots = toolkit_roots or {}
    links: tuple[tuple[str, str], ...] = ()
    launchers = []
    if fixed_root is not None:
        src_fixed, build_fixed = fixed_path(source_dir, fixed_root, "s"), fixed_path(build_dir, fixed_root, "b")
        with_launcher = {b.name: x for b in have if (x := b.launcher(recipe, platform=platform, source_dir=src_fixed,
                                                                    build_dir=build_fixed)) is not None}
        launchers = list(with_launcher.values())
        if launchers:  # the toolkit of a backend with a launcher too: its header paths reach that compiler
            fixed_toolkits = {name: fixed_path(roots[name], fixed_root, "t") for name in with_launcher if name in roots}
            links = ((str(src_fixed), str(source_dir)), (str(build_fixed), str(build_dir)),
                     *((str(fixed_toolkits[name]), str(roots[name])) for name in sorted(fixed_toolkits)))
            roots = {**roots, **fixed_toolkits}
    real_source, real_build = source_dir, build_dir
    if links:  # the commands name the fixed-length paths; the plan's directories stay the real ones
        source_dir, build_dir = Path(links[0][0]), Path(links[1][0])
    cc, cxx = compilers or EXECUTABLES[recipe.toolchain.compiler]  # the platform's choice (clang-19), else the family's
    defs: dict[str, str] = {
        "CMAKE_BUILD_TYPE": "Release",
        "CMAKE_C_COMPILER": cc,
        "CMAKE_CXX_COMPILER": cxx,
        "LLAMA_BUILD_COMMIT": recipe.llama_cpp.commit[:8],
        "LLAMA_BUILD_NUMBER": str(data.llama_builds().get(recipe.llama_cpp.commit, 0)),
        "CMAKE_BUILD_RPATH_USE_ORIGIN": "ON",
        **recipe.cmake_options,
        **{b.cmake_switch: "ON" if b in have else "OFF" for b in backends.REGISTRY.values() if b.cmake_switch},
    }
    map_flags, toolkit_maps = _prefix_map_flags(recipe, defs, have, source_dir=source_dir, build_dir=build_dir,
                                                toolkits=roots)
    defs.update(map_flags)
    for b in have:
        defs.update(b.cmake_definitions(recipe, host, platform=platform, toolkit_root=roots.get(b.name)))
    project_defs, files = _project_files(recipe, platform, have, build_dir, more=toolkit_maps)
    defs.update(project_defs)
    by_lang = {x.language: x.argv for x in launchers}
    for lang in ("C", "CXX", *(lang for b in have for lang in b.languages)):
        chain = [*by_lang.get(lang, ()), *([tools.compiler_cache] if tools.compiler_cache else [])]
        if chain:
            defs[f"CMAKE_{lang}_COMPILER_LAUNCHER"] = ";".join(chain)
    defs[COMPILER_CACHE_SWITCH] = "OFF"  # the tool's launchers are the only ones (ggml's own would add ccache or sccache)
    files = files + tuple(f for x in launchers for f in x.files)
    configure = (tools.cmake, "-S", str(source_dir), "-B", str(build_dir), "-G", "Ninja",
                 f"-DCMAKE_MAKE_PROGRAM={tools.ninja}", *(f"-D{k}={v}" for k, v in defs.items()))
    modules = backend_targets(recipe)
    programs = tuple(dict.fromkeys((*recipe.targets, *(p for b in have for p in b.programs(recipe)),
                                    *(p for p, _, _ in OWN_PROGRAMS))))
    targets = programs + modules
    build = (tools.cmake, "--build", str(build_dir), "--target", *targets)
    if jobs:
        build += ("--parallel", str(jobs))
    return BuildPlan(
        source_dir=real_source, build_dir=real_build, configure=configure, build=build, targets=targets,
        programs=tuple(platform.program_file(t) for t in programs),
        backends=tuple(platform.library_file(t) for t in modules),
        output_dir=real_build / "bin",
        files=files,
        env=tuple(sorted((env or {}).items())),
        links=links,
        commands=tuple(c for x in launchers for c in x.commands),
    )


PROJECT_INCLUDE = "llamabundle-project.cmake"
MEMORY_PROGRAM = data.MEMORY_PROGRAM  # llama.cpp's dry run of a llama-server launch, built into every bundle
PROBE_PROGRAM = data.PROBE_PROGRAM  # which backends load here and why not, and their devices: in every bundle
# Programs of llamabundle's own (data/programs/NAME.cpp), built beside llama-server in every bundle: the name,
# what it is, and the llama.cpp targets it links
OWN_PROGRAMS: tuple[tuple[str, str, str], ...] = (
    (MEMORY_PROGRAM, "llama.cpp's memory figures for a llama-server launch (runtime/dryrun.py)", "llama-common llama"),
    (PROBE_PROGRAM, "the backends that load on this machine, why the others do not, and their devices",
     "ggml ${CMAKE_DL_LIBS} $<$<PLATFORM_ID:Windows>:ws2_32>"),  # Winsock: --rpc asks RPC servers
)
_PROGRAM_CMAKE = """# {program}: {what}, built beside llama-server
if(PROJECT_NAME STREQUAL "llama.cpp" AND NOT COMMAND {function})
  function({function})
    add_executable({program} "{source}")
    target_link_libraries({program} PRIVATE {libs})
    target_compile_features({program} PRIVATE cxx_std_17)
  endfunction()
  cmake_language(DEFER CALL {function})
endif()"""


def _project_files(recipe: Recipe, platform: Platform, have: Sequence[Backend], build_dir: Path, *,
                   more: Sequence[str] = ()) -> tuple[dict[str, str], tuple[tuple[str, str], ...]]:
    """CMake files the tool writes into the build tree (and the cache variables that point at them): what
    the platform's toolchain needs (the mingw toolchain file and compatibility header), and a project
    include (CMAKE_PROJECT_INCLUDE, read after every project() call) with the platform's and the backends'
    lines (mingw's module names and definitions; the recipe's excluded CPU variants). Nothing in the
    source tree is touched."""
    defs, files, lines = platform.cmake_setup(recipe, build_dir)
    include = ["# Written by llamabundle (build.py): read after every project() call.", *lines]
    for b in have:
        include += b.project_include(recipe)
    include += more
    files = list(files)
    for program, what, libs in OWN_PROGRAMS:
        source = build_dir / f"{program}.cpp"  # CMake paths take forward slashes on Windows too
        include.append(_PROGRAM_CMAKE.format(program=program, what=what, libs=libs, source=source.as_posix(),
                                             function=program.replace("-", "_") + "_program"))
        files.append((str(source), data.text(f"programs/{program}.cpp")))
    files.append((str(build_dir / PROJECT_INCLUDE), "\n".join(include) + "\n"))
    defs = {**defs, "CMAKE_PROJECT_INCLUDE": str(build_dir / PROJECT_INCLUDE)}
    return defs, tuple(files)


_TOOLKIT_MAPS_CMAKE = """# the path of {what} mapped where its headers are read: the C and C++ compiles of {targets} only
if(PROJECT_NAME STREQUAL "llama.cpp" AND NOT COMMAND {function})
  function({function})
    foreach(_target {targets})
      if(NOT TARGET ${{_target}})
        message(FATAL_ERROR "llamabundle: no target ${{_target}} to map the path of {what} for")
      endif()
      target_compile_options(${{_target}} PRIVATE "$<$<COMPILE_LANGUAGE:C,CXX>:{flag}>")
    endforeach()
  endfunction()
  cmake_language(DEFER CALL {function})
endif()"""


def _prefix_map_flags(recipe: Recipe, defs: dict[str, str], have: Sequence[Backend], *, source_dir: Path,
                      build_dir: Path, toolkits: Mapping[str, Path]) -> tuple[dict[str, str], list[str]]:
    """Where the source, the build tree and a backend's toolkit lie must not show in the binaries (__FILE__
    of the toolkit's headers too: CUB's asserts name them): map them to fixed names, so that two builds in
    different places give the same bytes (gcc, clang, and nvcc's host compiler; MSVC has no such switch
    and its builds are not claimed reproducible). The source and build maps go to every C and C++ compile
    (CMAKE_<LANG>_FLAGS); a toolkit's only to its backend's targets (lines for the project include), so that
    the other compiles are those of a recipe without that backend, and a compiler cache serves both (the CPU
    part of a Vulkan build from a CPU build's cache). nvcc's host compiles get every map (the backend's flags)."""
    if recipe.toolchain.compiler == "msvc":
        return {}, []
    maps = [f"-ffile-prefix-map={source_dir}=/llama.cpp", f"-ffile-prefix-map={build_dir}=/build"]
    joined = " ".join(maps)
    out = {f"CMAKE_{lang}_FLAGS": f"{defs[f'CMAKE_{lang}_FLAGS']} {joined}".strip() if f"CMAKE_{lang}_FLAGS" in defs
           else joined for lang in ("C", "CXX")}
    toolkit_maps = {name: f"-ffile-prefix-map={root}=/{name}" for name, root in sorted(toolkits.items())}
    lines = []
    for b in have:
        out.update(b.prefix_map_flags(defs, [*maps, *toolkit_maps.values()]))
        if b.name in toolkit_maps:
            lines.append(_TOOLKIT_MAPS_CMAKE.format(what=f"the {b.name} toolkit", targets=" ".join(b.targets(recipe)),
                                                    function=f"_llamabundle_{b.name}_toolkit_map",
                                                    flag=toolkit_maps[b.name]))
    return out, lines


# ------------------------------------------------------------------------------------- tools


def resolve_tools(*, path: str | None, compiler_cache: str | None = None) -> BuildTools:
    """Find cmake and ninja: the system ones when new enough, else those of the PyPI packages; `compiler_cache`:
    the program of the cache compiler_cache.choose picked (None: none)."""
    min_cmake = data.build_knowledge()["min_cmake"]
    cmake = _pick("cmake", path, min_cmake, "cmake")
    ninja = _pick("ninja", path, "1.10", "ninja")
    return BuildTools(cmake=cmake[0], cmake_version=cmake[1], ninja=ninja[0], ninja_version=ninja[1],
                      compiler_cache=compiler_cache)


def locate_tools(*, path: str | None, compiler_cache_choice: str = "auto") -> BuildTools:
    """The build tools a build would most likely use, found without running anything (for `show`):
    the first candidate that exists, or the bare name; the compiler cache `compiler_cache_choice` names (auto: the
    first of compiler_cache.AUTO_ORDER found)."""
    found = {p: next((c for c in _candidates(p, path, p) if c and Path(c).is_file()), p) for p in ("cmake", "ninja")}
    cache = next((p for kind in compiler_cache.kinds(compiler_cache_choice) if (p := compiler_cache.find(kind, path=path))),
                 None)
    return BuildTools(cmake=found["cmake"], ninja=found["ninja"], compiler_cache=cache)


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


def _read_stamp(stamp: Path) -> object:
    """What the build directory's stamp records (None: unreadable or damaged, so the build reconfigures)."""
    try:
        return untrusted.read(stamp)
    except (OSError, ValueError):
        return None


def run_build(plan: BuildPlan, *, log: Log, env: Mapping[str, str], clean: bool = False,
              timeout: float | None = None, lay: Callable[[Path], object] | None = None) -> BuildResult:
    """Configure (when the stamp says so) and build; each step is stopped after `timeout` seconds. `lay` puts
    what the build takes from the build directory there (the web UI), once the directory is ready."""
    bd = plan.build_dir
    stamp = bd / STAMP
    wanted: list[str] | dict[str, object] = list(plan.configure)
    if plan.files or plan.env or plan.links:
        wanted = {"configure": list(plan.configure), "files": dict(plan.files), **({"env": dict(plan.env)} if plan.env else {}),
                  **({"links": dict(plan.links), "commands": [list(c) for c in plan.commands]} if plan.links else {})}
    env = {**env, **dict(plan.env)}
    configured = stamp.is_file() and (bd / "build.ninja").is_file() and _read_stamp(stamp) == wanted
    if clean or (bd.exists() and not configured):
        shutil.rmtree(bd, ignore_errors=True)
        configured = False  # a removed tree is configured again (--clean of an up-to-date tree once skipped it)
    bd.mkdir(parents=True, exist_ok=True)
    if lay is not None:
        lay(bd)
    make_links(plan.links)
    if (warning := unpadded(plan.links)) is not None:
        log.warn(warning)
    for name, text in plan.files:  # rewritten only when changed: a new mtime would rerun cmake and recompile
        f = Path(name)
        if not f.is_file() or f.read_text(encoding="utf-8") != text:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text, encoding="utf-8")
    log_path = bd / LOG_NAME
    log_path.write_text("", encoding="utf-8")
    fix = f"read the full log at {log_path}; fix the toolchain or the recipe's cmake: options"
    log.info("    configure and build run without a network (a network namespace of their own)" if offline.available()
             else "    configure and build run with this machine's network (no network namespace can be made here)")
    for command in plan.commands:  # cheap (a launcher's helper): made every time, so it is never missing
        proc.run(offline.wrap(command), log=log, error=BuildError, what="a compiler launcher's helper did not compile",
                 label=Path(command[0]).name, fix=fix, env=env, log_path=log_path, timeout=timeout)
    if not configured:
        with log.step("configure (cmake)"):
            proc.run(offline.wrap(plan.configure), log=log, error=BuildError, what="cmake configure failed",
                     label="cmake configure", fix=fix, env=env, log_path=log_path, timeout=timeout,
                     on_line=no_network(plan, log_path))
        stamp.write_text(json.dumps(wanted), encoding="utf-8")
    compiled = 0
    with log.step(f"build {len(plan.targets)} targets (ninja)"), log.progress("compile") as bar:
        refuse = no_network(plan, log_path)

        def on_line(line: str) -> None:
            nonlocal compiled
            refuse(line)
            m = _NINJA_PROGRESS.match(line)
            if m:
                compiled = int(m.group(1))
                bar.update(compiled, int(m.group(2)))
        proc.run(offline.wrap(plan.build), log=log, error=BuildError, what="the build failed", label="the build (ninja)",
                 fix=fix, env=env, log_path=log_path, on_line=on_line, timeout=timeout)
    for name in plan.programs + plan.backends:
        if not (plan.output_dir / name).is_file():
            raise BuildError(f"the build did not produce {name}", why=f"expected it in {plan.output_dir}",
                             fix="check that the recipe's targets and cmake options build it")
    return BuildResult(plan=plan, log_path=log_path, compiler=compiler_of(bd), compiled=compiled)


def unpadded(links: Sequence[tuple[str, str]]) -> str | None:
    """Why a build through these fixed paths gives other CUDA objects than one with another cache directory
    (None: they are all FIXED_LENGTH characters long)."""
    longer = [fixed for fixed, _ in links if len(fixed) != FIXED_LENGTH]
    if not longer:
        return None
    root = Path(longer[0]).parent
    return (f"the fixed-length paths this build compiles through are longer than {FIXED_LENGTH} characters "
            f"(under {root}, {len(str(root))} characters): its CUDA objects follow the length of that directory, "
            f"so only a build with a cache directory of the same length gives the same bytes; a cache directory "
            f"of at most {max_fixed_root() - len(root.name) - 1} characters (LLAMABUNDLE_CACHE_DIR) makes them the same everywhere")


def make_links(links: Sequence[tuple[str, str]]) -> None:
    """The plan's fixed-length paths, each a symbolic link to its real directory (replaced atomically when it
    points elsewhere, e.g. left by a removed tree)."""
    for fixed, real in links:
        link = Path(fixed)
        if link.is_symlink() and os.readlink(link) == real:
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f".{link.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        os.symlink(real, tmp)
        try:
            os.replace(tmp, link)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise BuildError(f"cannot make {link}", why=f"{e.strerror}: it should be a link to {real}",
                             fix=f"remove {link} and build again") from e


def remove_links(links: Sequence[tuple[str, str]]) -> None:
    for fixed, _ in links:
        if Path(fixed).is_symlink():
            Path(fixed).unlink(missing_ok=True)


OPS_TOOL = "test-backend-ops"


def no_network(plan: BuildPlan, log_path: Path) -> Callable[[str], None]:
    """A build output line's check: a line saying the build tried the network stops it (BuildError, naming the
    recipe's setting that downloads, where known), rather than let it go on without (or with unkeyed) bytes."""
    def check(line: str) -> None:
        if (hit := offline.tried(line)) is None:
            return
        words, setting = hit
        value = next((a.split("=", 1)[1] for a in plan.configure if a.startswith(f"-D{setting}=")), None) if setting else None
        raise BuildError(f"the build tried to download: {line.strip()}",
                         why="a build runs without a network after the source and toolkit steps: what it would "
                             "download is covered by no key" + (f" ({setting} is {value or 'not set, so ON'})" if setting else ""),
                         fix=(f"set {setting}: {offline.DOWNLOADING[setting][0]} in the recipe's cmake:" if setting else
                              f"find the CMake setting that downloads in {log_path} and turn it off in the recipe's cmake:"))
    return check


def build_ops_tool(plan: BuildPlan, dest: Path, *, log: Log, env: Mapping[str, str], timeout: float | None = None) -> Path:
    """llama.cpp's test-backend-ops from the bundle's own build tree (for verify --level ops; never in the
    bundle): the tree is configured again with LLAMA_BUILD_TESTS=ON, which adds the tests and changes no
    flag of what the bundle holds (nothing of it is recompiled), and the tool is copied to `dest`."""
    configure = [a for a in plan.configure if not a.startswith("-DLLAMA_BUILD_TESTS=")] + ["-DLLAMA_BUILD_TESTS=ON"]
    env = {**env, **dict(plan.env)}
    log_path = plan.build_dir / LOG_NAME
    fix = f"read the full log at {log_path}"
    with log.step(f"{OPS_TOOL} (for verify --level ops; not in the bundle)"):
        proc.run(offline.wrap(configure), log=log, error=BuildError, what="cmake configure (with the tests) failed",
                 label="cmake configure", fix=fix, env=env, log_path=log_path, timeout=timeout,
                 on_line=no_network(plan, log_path))
        build = [plan.build[0], "--build", str(plan.build_dir), "--target", OPS_TOOL]
        if "--parallel" in plan.build:  # the jobs the bundle's build was given
            build += plan.build[plan.build.index("--parallel"):][:2]
        proc.run(offline.wrap(build), log=log, error=BuildError, what=f"building {OPS_TOOL} failed",
                 label=f"build {OPS_TOOL}", fix=fix, env=env, log_path=log_path, timeout=timeout,
                 on_line=no_network(plan, log_path))
        exe = plan.output_dir / (OPS_TOOL + (".exe" if plan.programs and plan.programs[0].endswith(".exe") else ""))
        if not exe.is_file():
            raise BuildError(f"the build did not produce {exe.name}", why=f"expected it in {plan.output_dir}")
        tmp = dest.with_name(dest.name + ".partial")
        shutil.copy2(exe, tmp)
        tmp.replace(dest)
        log.info(f"    {dest} ({dest.stat().st_size / 1e6:.1f} MB)")
    return dest


def compiler_record(build_dir: Path) -> tuple[str, str]:
    """CMake's own record of the C++ compiler it used: ('GNU 12.2.0', its path) ('unknown' and '' where there
    is none; '' where the record names no path)."""
    for f in sorted(build_dir.glob("CMakeFiles/*/CMakeCXXCompiler.cmake")):
        found = dict(re.findall(r'set\((CMAKE_CXX_COMPILER(?:_ID|_VERSION)?) "([^"]*)"\)',
                                f.read_text(encoding="utf-8", errors="replace")))
        if "CMAKE_CXX_COMPILER_ID" in found and "CMAKE_CXX_COMPILER_VERSION" in found:
            return f"{found['CMAKE_CXX_COMPILER_ID']} {found['CMAKE_CXX_COMPILER_VERSION']}", found.get("CMAKE_CXX_COMPILER", "")
    return "unknown", ""


def compiler_of(build_dir: Path) -> str:
    """'GNU 12.2.0' from CMake's own record of the C++ compiler it used."""
    return compiler_record(build_dir)[0]
