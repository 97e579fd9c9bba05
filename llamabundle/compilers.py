"""Host compilers: the programs each `toolchain.compiler` names, their exact version, and whether a
version satisfies the recipe's pin (`toolchain.version`).

The version of the compiler is an input of the bundle's bytes, so it is part of the cache key: the
recipe's pin when it has one (a range declares the compilers in it interchangeable), else the exact
version of the compiler found on this machine. A build tree's CMakeCache.txt says which compiler CMake took
(read_cmake_cache).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from . import proc
from .errors import RecipeError, ToolchainError

# compiler family -> (C compiler, C++ compiler) as CMake is told to use them
EXECUTABLES: dict[str, tuple[str, str]] = {
    "gcc": ("gcc", "g++"),
    "clang": ("clang", "clang++"),
    "msvc": ("cl", "cl"),
    "mingw": ("x86_64-w64-mingw32-gcc-posix", "x86_64-w64-mingw32-g++-posix"),
}
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)*$")


def cxx_program(compiler: str) -> str:
    return EXECUTABLES[compiler][1]


def versioned(programs: tuple[str, str], pin: str | None, *, path: str | None) -> tuple[str, str]:
    """The (C, C++) programs to run: their versioned names (clang-19 and clang++-19, aarch64-linux-gnu-g++-12), as
    Debian and Ubuntu install a compiler beside the default one, when `pin` names one major version (=19.1.7, 19,
    19.1) and both are on PATH; else `programs` as they are."""
    m = re.fullmatch(r"=?([0-9]+)(\.[0-9]+)*", pin or "")
    if m is None:
        return programs
    named = (f"{programs[0]}-{m.group(1)}", f"{programs[1]}-{m.group(1)}")
    search = path or os.defpath
    return named if all(shutil.which(n, path=search) for n in named) else programs


def detect_version(compiler: str, *, env: Mapping[str, str] | None = None, program: str | None = None) -> str | None:
    """The exact version of this family's C++ compiler (`program`, default the family's) first on env's PATH (else
    the system's default search path), "12.2.0", or None when there is none. The compiler is asked with `env`.
    Asked once per compiler and environment in a process (every recipe load needs it for an unpinned key)."""
    return _detect(compiler, program or cxx_program(compiler), tuple(sorted((env or {}).items())))


@functools.lru_cache(maxsize=16)
def _detect(compiler: str, program: str, env_items: tuple[tuple[str, str], ...]) -> str | None:
    path = dict(env_items).get("PATH") or os.defpath
    exe = shutil.which(program, path=path)
    if exe is None:
        return None
    env = {**dict(env_items), "LC_ALL": "C", "PATH": path}
    try:
        if compiler == "msvc":
            res = proc.capture([exe], env=env, timeout=60)
            return cl_version(res.stderr + res.stdout)
        # The compiler's own macros, as CMake reads them (gcc -dumpfullversion says "12-posix" for some builds)
        res = proc.capture([exe, "-dM", "-E", "-x", "c++", os.devnull], env=env, timeout=60)
    except (OSError, proc.Timeout):
        return None
    if res.returncode != 0:
        return None
    macros = dict(re.findall(r"^#define (__\w+__) (\d+)$", res.stdout, re.M))
    names = (("__clang_major__", "__clang_minor__", "__clang_patchlevel__") if compiler == "clang"
             else ("__GNUC__", "__GNUC_MINOR__", "__GNUC_PATCHLEVEL__"))
    if not all(n in macros for n in names):
        return None
    return ".".join(macros[n] for n in names)


def cl_version(banner: str) -> str | None:
    """The version cl.exe's banner states, "… Compiler Version 19.44.35207.1 for x64" -> "19.44.35207"
    (_MSC_VER is the first two parts: 1944). The one reader of that banner."""
    m = re.search(r"Version (\d+\.\d+\.\d+)", banner)
    return m.group(1) if m else None


def _parts(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def version_matches(spec: str, version: str) -> bool:
    """`=12.2.0` matches exactly 12.2.0; `12.2` matches 12.2 and 12.2.x (every leading component equal);
    `[12.2,13)`, `(11,]`, `[12,14]` are intervals, brackets inclusive, parentheses exclusive, an empty end
    unbounded."""
    v = _parts(version)
    spec = spec.strip()
    if spec.startswith("=") and _VERSION.match(spec[1:]):
        return v == _parts(spec[1:])
    if _VERSION.match(spec):
        want = _parts(spec)
        return v[:len(want)] == want
    m = re.fullmatch(r"([\[(])\s*([0-9.]*)\s*,\s*([0-9.]*)\s*([\])])", spec)
    if not m:
        raise RecipeError(f"{spec!r} is not a version or a version range",
                          fix='write "=12.2.0" (exactly), "12.2" (any 12.2.x) or a range such as "[12.2,13)"')
    lo_inc, lo, hi, hi_inc = m.group(1) == "[", m.group(2), m.group(3), m.group(4) == "]"

    def cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = max(len(a), len(b))
        a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
        return (a > b) - (a < b)

    if lo and (cmp(v, _parts(lo)) < 0 or (cmp(v, _parts(lo)) == 0 and not lo_inc)):
        return False
    if hi and (cmp(v, _parts(hi)) > 0 or (cmp(v, _parts(hi)) == 0 and not hi_inc)):
        return False
    return True


def check_host(compiler: str, *, pin: str | None, keyed: str | None, env: Mapping[str, str],
               program: str | None = None) -> str:
    """Before a build: the compiler that will build (`program`, default the family's C++ compiler) is the one the
    key names. Returns its version.

    With a pin, the compiler found must satisfy it; without one, it must be exactly the version the
    key was computed with (`keyed`, found when the recipe was loaded)."""
    exe = program or cxx_program(compiler)
    found = detect_version(compiler, env=env, program=exe)
    if found is None:
        raise ToolchainError(f"cannot find the version of {exe}",
                             why=f"toolchain.compiler is {compiler}; {exe} is not on PATH or did not say its version",
                             fix=f"install {exe} and put it on PATH")
    if pin is not None and not version_matches(pin, found):
        raise ToolchainError(f"{exe} {found} is outside the recipe's toolchain.version {pin}",
                             why="the compiler is pinned because it changes the bundle's bytes, and so its cache key",
                             fix=f"put a {compiler} matching {pin} first on PATH, or change toolchain.version "
                                 "(a new key)")
    if pin is None and keyed is not None and keyed != found:
        raise ToolchainError(f"{exe} is {found} now, but the cache key was computed for {keyed}",
                             fix="run the command again with one compiler on PATH")
    return found


CMAKE_CACHE = "CMakeCache.txt"


def read_cmake_cache(build_dir: Path) -> dict[str, str]:
    """NAME -> value of a build tree's CMakeCache.txt ({} where there is none)."""
    try:
        text = (build_dir / CMAKE_CACHE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    return dict(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*):[A-Z]+=(.*)$", text, re.M))
