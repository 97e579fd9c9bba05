"""Builds without a network: after the source and toolkit steps nothing a build runs may reach it (what it would
download is in no key). On Linux the configure and build commands run in a network namespace of their own
where the machine allows one (`unshare --net`, as root or in a user namespace), so a download fails there
and the build stops naming why; `recipe lint` warns about the CMake settings known to download."""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Mapping, Sequence

from . import proc

# CMake settings of llama.cpp that download at build time: name -> (the value that does not, why it matters)
DOWNLOADING = {
    "LLAMA_USE_PREBUILT_UI": ("OFF", "llama.cpp's web UI is then fetched from a Hugging Face bucket at build time "
                                     "(scripts/ui-assets.cmake); it defaults to ON"),
}
# What a build's output says when it tries the network (llama.cpp's ui-assets.cmake as it starts, with or without
# one): the words -> the setting that did it (None: unknown)
TRIED = (("UI: download", "LLAMA_USE_PREBUILT_UI"), ("UI: HF download", "LLAMA_USE_PREBUILT_UI"), ("Could not resolve host", None),
         ("Couldn't resolve host", None), ("Network is unreachable", None), ("Temporary failure in name resolution", None))


def downloading(cmake: Mapping[str, str]) -> list[tuple[str, str]]:
    """The settings of a recipe's `cmake:` (or their llama.cpp defaults, where it leaves them out) that make a
    build download: (name, what to set and why)."""
    found = []
    for name, (safe, why) in DOWNLOADING.items():
        value = str(cmake.get(name, "ON")).upper()
        if value != safe:
            found.append((name, f"{name} is {value if name in cmake else 'not set (ON)'}: {why}; set it to {safe}"))
    return found


def tried(line: str) -> tuple[str, str | None] | None:
    """(the words, the setting) when a build's output line says it tried the network."""
    for words, setting in TRIED:
        if words in line:
            return words, setting
    return None


@functools.cache
def _prefix() -> tuple[str, ...]:
    if not sys.platform.startswith("linux"):
        return ()
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    tries = [[unshare, "--net"], [unshare, "--net", "--map-root-user"]]
    if os.geteuid() != 0:
        tries.reverse()
    for argv in tries:
        try:
            if proc.capture([*argv, "true"], timeout=30).returncode == 0:
                return tuple(argv)
        except (OSError, proc.Timeout):
            continue
    return ()


def wrap(argv: Sequence[str]) -> list[str]:
    """argv, run without a network where this machine can cut it (else as it is)."""
    return [*_prefix(), *argv]


def available() -> bool:
    """Whether builds here run without a network."""
    return bool(_prefix())
