"""Library classes as data (system / driver / bundle), for ELF and PE alike."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import StrEnum

from .. import data


class LibClass(StrEnum):
    SYSTEM = "system"  # on every target machine; never bundled
    DRIVER = "driver"  # the GPU driver's own; never bundled, recorded in system_deps
    OTHER = "other"  # must be inside the bundle


@dataclass(frozen=True, kw_only=True)
class Policy:
    """A platform's library classes: the system's, the driver's, and where they are found."""

    system: tuple[str, ...]
    driver: tuple[str, ...]
    system_dirs: tuple[str, ...] = ()

    def classify(self, name: str) -> LibClass:
        if any(fnmatch.fnmatchcase(name, p) for p in self.driver):
            return LibClass.DRIVER
        if any(fnmatch.fnmatchcase(name, p) for p in self.system):
            return LibClass.SYSTEM
        return LibClass.OTHER


def linux_policy() -> Policy:
    p = data.elf_policy()
    return Policy(system=tuple(p["system"]), driver=tuple(p["driver"]), system_dirs=tuple(p["system_dirs"]))
