"""Target platforms: one module per platform behind the `Platform` protocol (how files are named, which
compilers build for it, where runtime libraries come from and how they are collected, how a bundle is
checked statically and loaded), the registry, and host detection. Adding a platform is one module here,
one entry in `REGISTRY`, and its name in `recipe.Platform`."""

from __future__ import annotations

import platform as _host

from ..errors import UsageError
from .base import Collected, Platform, RuntimeSources
from .linux import LINUX
from .linux_aarch64 import LINUX_AARCH64
from .load import Loaded
from .windows import WINDOWS

REGISTRY: dict[str, Platform] = {p.name: p for p in (LINUX, LINUX_AARCH64, WINDOWS)}
NAMES: tuple[str, ...] = tuple(REGISTRY)

__all__ = ["NAMES", "REGISTRY", "Collected", "Loaded", "Platform", "RuntimeSources", "get", "host_name"]


def get(name: str) -> Platform:
    """The platform called `name` (a name from a recipe or a bundle.json, already validated there)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UsageError(f"unknown platform {name!r}", why=f"known platforms: {', '.join(NAMES)}",
                         fix="upgrade llamabundle") from None


def host_name() -> str:
    """This machine as a platform name: `linux-x86_64`, `linux-aarch64`, `windows-x86_64` (others as Python names
    them)."""
    system = {"Linux": "linux", "Windows": "windows"}.get(_host.system(), _host.system().lower())
    machine = {"AMD64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "ARM64": "aarch64",
               "aarch64": "aarch64"}.get(_host.machine(), _host.machine())
    return f"{system}-{machine}"
