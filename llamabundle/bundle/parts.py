"""Which files each backend needs, and a bundle cut down to some of its backends (partial installs).

bundle.json's `parts` maps each GPU backend to the files only it needs (its module, what only it imports, its
companions and licences); every other file is the CPU part, which every install holds. `split` computes them
at packing from the staged binaries' own imports (ELF DT_NEEDED, PE imports and delay-imports). `cut` makes
the manifest of a subset: the chosen backends, their files, sections (the others null) and parts, and a `cut`
record of what it was cut from. Key and inputs stay the published bundle's; check_consistent accepts a cut
whose backends are some of its inputs' and that keeps the CPU part."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .manifest import MANIFEST, SECTIONS, Manifest, parse

CPU = "cpu"  # the part every install holds


def imports_of(path: Path) -> tuple[str, ...]:
    """The libraries a binary of the bundle names (ELF DT_NEEDED; PE imports and delay-imports); () for a file
    that is neither."""
    from ..deps import elf, pe

    if elf.is_elf(path):
        return elf.read_elf(path).needed
    if pe.is_pe(path):
        info = pe.read_pe(path, require_x64=False)
        return (*info.imports, *info.delay_imports)
    return ()


def split(names: Iterable[str], *, roots: Mapping[str, Iterable[str]], imports: Callable[[str], Sequence[str]],
          fold_case: bool = False) -> dict[str, list[str]]:
    """The files only GPU backends need: backend -> sorted paths, for every backend of `roots` but the CPU.
    `roots` gives each backend the files that are its own (modules, companions, licences; CPU: also the
    programs and the licences no backend claims); every file reached from a root through `imports` (names as
    the binaries spell them, matched without case where the platform's loader does) belongs to it. A file the
    CPU part reaches belongs to no GPU part, nor does one that no root reaches (every install keeps it)."""
    names = list(names)
    fold = str.lower if fold_case else (lambda s: s)
    by = {fold(n): n for n in names}

    def reach(start: Iterable[str]) -> set[str]:
        seen: set[str] = set()
        todo = [n for n in start if n in names]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo += [by[fold(d)] for d in imports(n) if fold(d) in by]
        return seen

    cpu = reach(roots.get(CPU, ()))
    return {b: sorted(reach(files) - cpu) for b, files in sorted(roots.items()) if b != CPU}


def files_of(m: Manifest, keep: Iterable[str]) -> set[str]:
    """The paths an install of these backends holds: the CPU part and the kept backends' parts."""
    keep = set(keep)
    gpu_only = {p for b, paths in (m.parts or {}).items() for p in paths}
    kept = {p for b, paths in (m.parts or {}).items() if b in keep for p in paths}
    return {f.path for f in m.files if f.path not in gpu_only or f.path in kept}


@dataclass(frozen=True)
class Choice:
    """The backends an install holds, and why each GPU backend of the bundle is in or out."""
    backends: tuple[str, ...]
    why: Mapping[str, str]  # backend -> reason
    by: str  # "auto" or "list"


def published_sha256(m: Manifest) -> str:
    """The sha256 of the published bundle.json (as llamabundle writes it) that m is, or was cut from: what a pin of
    the manifest (install --expect-sha256 of bundle.json) names."""
    if m.cut is not None:
        return str(m.cut["from_manifest_sha256"])
    return hashlib.sha256(m.text().encode("utf-8")).hexdigest()


def cut(m: Manifest, choice: Choice) -> Manifest:
    """The manifest of the subset of m holding choice.backends (m itself when that is all of them)."""
    keep = [b for b in m.backends if b in choice.backends]
    if sorted(keep) == sorted(m.backends):
        return m
    data: dict[str, Any] = m.to_json()
    paths = files_of(m, keep)
    data["files"] = [f for f in data["files"] if f["path"] in paths]
    data["backends"] = keep
    for section in SECTIONS:
        if section in data and section not in keep:
            data[section] = None
    data["parts"] = {b: p for b, p in (m.parts or {}).items() if b in keep}
    data["cut"] = {"from_backends": sorted(m.backends), "dropped": sorted(set(m.backends) - set(keep)),
                   "by": choice.by, "why": dict(sorted(choice.why.items())),
                   "from_manifest_sha256": published_sha256(m)}
    return parse(json.loads(json.dumps(data)))


__all__ = ["CPU", "MANIFEST", "Choice", "cut", "files_of", "imports_of", "published_sha256", "split"]
