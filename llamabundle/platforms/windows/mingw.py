"""mingw-w64: cross-compiling Windows bundles on Linux (data/mingw.json): the CMake toolchain file and
compatibility header, where its runtime DLLs lie, and their licence texts."""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from ... import data, proc

TOOLCHAIN = "llamabundle-mingw-toolchain.cmake"
COMPAT = "llamabundle-mingw-compat.h"


def cmake_setup(build_dir: Path) -> tuple[dict[str, str], list[tuple[str, str]], list[str]]:
    """The toolchain file and compatibility header written into the build tree, the cache variable that
    points at the toolchain, and the project-include lines that set mingw's module names and definitions."""
    mingw = data.load("mingw.json")
    tc = mingw["toolchain"]
    toolchain = build_dir / TOOLCHAIN
    compat = build_dir / COMPAT
    files = [(str(toolchain), "\n".join([
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
        "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)", ""])),
        (str(compat), "\n".join(mingw["compat_header"]) + "\n")]
    include = ['set(CMAKE_SHARED_MODULE_PREFIX "")  # ggml loads ggml-<backend>*.dll',
               'set(CMAKE_SHARED_LIBRARY_PREFIX "")  # llama.dll, ggml.dll: the names MSVC bundles use',
               "if(CMAKE_CURRENT_SOURCE_DIR STREQUAL CMAKE_SOURCE_DIR)  # once; subdirectories inherit them",
               *(f"  add_compile_definitions({d})" for d in mingw["defines"]),
               f'  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-include{compat.as_posix()}>")',
               "endif()"]
    return {"CMAKE_TOOLCHAIN_FILE": str(toolchain)}, files, include


def runtime_dirs() -> list[Path]:
    """The directories the compiler names for its runtime DLLs (-print-file-name), then those of
    data/mingw.json that exist."""
    mingw = data.load("mingw.json")
    dirs: list[Path] = []
    for dll in mingw["runtime_dlls"]:
        try:
            out = proc.capture([mingw["toolchain"]["c_compiler"], f"-print-file-name={dll}"], timeout=30).stdout.strip()
        except OSError:
            break  # no compiler: only the listed directories
        if os.path.isabs(out) and Path(out).is_file():
            dirs.append(Path(out).parent)
    for pattern in mingw["runtime_dirs"]:
        dirs += sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_dir())
    return list(dict.fromkeys(d.resolve() for d in dirs))


def copy_licenses(stage: Path) -> Mapping[str, str]:
    """The licence texts of the mingw runtime DLLs, for a bundle that carries them."""
    roles: dict[str, str] = {}
    for name, src in data.load("mingw.json")["licenses"].items():
        if Path(src).is_file():
            shutil.copyfile(src, stage / name)
            roles[name] = "license"
    return roles
