"""Which GPUs a recipe's bundle runs on, and how: per GPU generation and compute capability (CC), from
SASS, from PTX through the driver's JIT, or not at all (`llamabundle archs`). Pure: recipe + data → report.

CUDA's rules (NVIDIA compatibility guides; "family-specific architecture features", CUDA 12.9):
- SASS sm_XY runs on CC X.Z for Z ≥ Y (same major); sm_XYa only on X.Y; sm_XYf on its family (X.Z, Z ≥ Y).
- PTX compute_XY is JIT-compiled for any CC ≥ X.Y; compute_XYf only within its family; compute_XYa only on X.Y.
- A device runs the best matching SASS; without one, the best matching PTX through the JIT; else nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Any

from ... import data
from ...recipe import Recipe
from .archs import parse_arch, split_archs

SCHEMA = 1
_JIT_COST = ("slower kernels than native SASS and a long first start (tens of seconds) until the JIT cache "
             "(CUDA_CACHE_PATH) is warm")


class Status(StrEnum):
    SASS = "sass"
    PTX_JIT = "ptx-jit"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True, kw_only=True)
class Device:
    cc: str  # "8.6"
    examples: tuple[str, ...]
    only_with_arch: str | None = None  # listed only when the toolkit knows this arch (Thor: 101 → 110)

    @property
    def version(self) -> tuple[int, int]:
        major, minor = self.cc.split(".")
        return int(major), int(minor)


@dataclass(frozen=True, kw_only=True)
class Generation:
    name: str
    devices: tuple[Device, ...]
    last_driver_branch: str | None = None  # the last driver branch that supports it (R580: Maxwell … Volta)


@cache
def gpu_generations() -> tuple[Generation, ...]:
    """llamabundle/data/gpu_generations.json, oldest first, with its invariants checked."""
    raw = data.load("gpu_generations.json")["generations"]
    gens = tuple(Generation(name=g["name"], last_driver_branch=g.get("last_driver_branch"),
                            devices=tuple(Device(cc=d["cc"], examples=tuple(d["examples"]), only_with_arch=d.get("only_with_arch"))
                                          for d in g["ccs"])) for g in raw)
    ccs = [d.version for g in gens for d in g.devices]
    assert all(re.fullmatch(r"[0-9]+\.[0-9]", d.cc) and d.examples for g in gens for d in g.devices)
    assert ccs == sorted(set(ccs)), "compute capabilities must be unique and in ascending order"
    return gens


@dataclass(frozen=True, kw_only=True)
class Code:
    """One piece of code in the fatbin: SASS (sm_XY) or PTX (compute_XY), with its 'a'/'f' suffix."""

    name: str  # "90a"
    ptx: bool

    @property
    def version(self) -> tuple[int, int]:
        num = int(re.sub(r"\D", "", self.name))
        return num // 10, num % 10

    @property
    def suffix(self) -> str:
        return re.sub(r"\d", "", self.name)

    @property
    def label(self) -> str:
        return ("compute_" if self.ptx else "sm_") + self.name

    def runs_on(self, cc: tuple[int, int]) -> bool:
        if self.suffix == "a":
            return cc == self.version
        if self.ptx and not self.suffix:
            return cc >= self.version
        return cc[0] == self.version[0] and cc[1] >= self.version[1]

    def rank(self) -> tuple[int, int, int]:
        return (*self.version, {"": 0, "f": 1, "a": 2}[self.suffix])


@dataclass(frozen=True, kw_only=True)
class Row:
    generation: str
    cc: str
    examples: tuple[str, ...]
    status: Status
    via: str | None  # "sm_90", "compute_80"; None when unsupported
    notes: str
    driver_floor: str | None

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "cc": self.cc, "examples": list(self.examples), "status": str(self.status),
                "via": self.via, "notes": self.notes, "driver_floor": self.driver_floor}


@dataclass(frozen=True, kw_only=True)
class ArchReport:
    recipe: str
    key: str
    platform: str
    toolkit: str | None  # None: no CUDA backend
    archs: tuple[str, ...]
    driver_floor: str | None
    rows: tuple[Row, ...]

    def generations(self) -> dict[str, str]:
        """Generation → its status when all its CCs agree, else "mixed"."""
        out: dict[str, set[str]] = {}
        for r in self.rows:
            out.setdefault(r.generation, set()).add(str(r.status))
        return {g: s.pop() if len(s) == 1 else "mixed" for g, s in out.items()}

    def summary(self) -> str:
        if self.toolkit is None:
            return "no CUDA backend: the bundle runs on the CPU only"
        gens = self.generations()
        jit = [g for g, s in gens.items() if s == Status.PTX_JIT]
        partly = [f"{g} ({', '.join(r.cc for r in self.rows if r.generation == g and r.status == Status.PTX_JIT)})"
                  for g, s in gens.items() if s == "mixed" and any(r.generation == g and r.status == Status.PTX_JIT for r in self.rows)]
        none = [g for g, s in gens.items() if s == Status.UNSUPPORTED]
        parts = [f"only through the PTX JIT (slow first start, slower kernels): {', '.join(jit) or 'none'}"]
        if partly:
            parts.append(f"partly through the JIT: {', '.join(partly)}")
        parts.append(f"not at all: {', '.join(none) or 'none'}")
        parts.append(f"driver >= {self.driver_floor} ({self.platform})")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        split = split_archs(self.archs) if self.archs else {"sass": [], "ptx": []}
        return {"schema": SCHEMA, "recipe": self.recipe, "key": self.key, "platform": self.platform, "toolkit": self.toolkit,
                "archs": list(self.archs), "sass": split["sass"], "ptx": split["ptx"], "driver_floor": self.driver_floor,
                "rows": [r.to_json() for r in self.rows],
                "generations": [{"name": g, "status": s} for g, s in self.generations().items()],
                "summary": self.summary()}


def arch_report(recipe: Recipe, *, key: str, toolkits: Mapping[str, Any] | None = None,
                generations: Sequence[Generation] | None = None) -> ArchReport:
    """Per GPU generation and CC: how the recipe's bundle (of `key`) runs there (data defaults: cuda.json,
    gpu_generations.json)."""
    toolkits = data.cuda_toolkits() if toolkits is None else toolkits
    generations = gpu_generations() if generations is None else generations
    cuda = recipe.cuda
    # Without CUDA, list the GPUs as the newest toolkit numbers them (Thor: 11.0, not 10.1).
    newest = max(toolkits, key=lambda v: tuple(map(int, v.split("."))))
    supported: list[str] = list(toolkits[cuda.toolkit if cuda else newest]["archs"])
    rows = []
    for gen in generations:
        for dev in gen.devices:
            if dev.only_with_arch and dev.only_with_arch not in supported:
                continue
            if cuda is None:
                row = _row(gen, dev, Status.UNSUPPORTED, None, "the bundle has no CUDA backend (CPU only)", None)
            else:
                row = _classify(gen, dev, recipe, supported)
            rows.append(row)
    return ArchReport(recipe=recipe.name, key=key, platform=recipe.platform, toolkit=cuda.toolkit if cuda else None,
                      archs=cuda.archs if cuda else (), driver_floor=recipe.driver_floor, rows=tuple(rows))


def _row(gen: Generation, dev: Device, status: Status, via: str | None, notes: str, floor: str | None) -> Row:
    return Row(generation=gen.name, cc=dev.cc, examples=dev.examples, status=status, via=via, notes=notes, driver_floor=floor)


def _classify(gen: Generation, dev: Device, recipe: Recipe, supported: Sequence[str]) -> Row:
    assert recipe.cuda is not None
    toolkit, floor, cc = recipe.cuda.toolkit, recipe.driver_floor, dev.version
    lowest = min((Code(name=s, ptx=False) for s in supported), key=Code.rank)
    if cc < lowest.version:
        return _row(gen, dev, Status.UNSUPPORTED, None, f"CUDA {toolkit} cannot target {gen.name}: it dropped compute "
                    f"capability < {lowest.version[0]}.{lowest.version[1]} (nothing below sm_{lowest.name}); "
                    "a recipe on an older toolkit can", None)
    if gen.last_driver_branch and floor and int(floor.split(".")[0]) > int(gen.last_driver_branch):
        return _row(gen, dev, Status.UNSUPPORTED, None, f"the driver floor {floor} is past R{gen.last_driver_branch}, the last "
                    f"driver branch for {gen.name}", None)
    codes = [Code(name=a.name, ptx=ptx) for a in map(parse_arch, recipe.cuda.archs) for ptx in (False, True)
             if (a.ptx if ptx else a.sass)]
    sass = max((c for c in codes if not c.ptx and c.runs_on(cc)), key=Code.rank, default=None)
    ptx = max((c for c in codes if c.ptx and c.runs_on(cc)), key=Code.rank, default=None)
    # Code of this major that does not run here: say why ('a' is exact, 'f' is family, sm_XY needs minor ≥ Y).
    misses = [f"{c.label} runs only on {c.version[0]}.{c.version[1]}" if c.suffix == "a" else f"{c.label} needs {c.version[0]}.{c.version[1]} or later"
              for c in codes if c.version[0] == cc[0] and not c.runs_on(cc)]
    fix = _fix(cc, supported, toolkit)
    legacy = (f"; needs a driver of branch R{gen.last_driver_branch} or older (the last for {gen.name})"
              if gen.last_driver_branch else "")
    if sass is not None:
        how = "its family" if sass.suffix == "f" else "binary compatibility"
        note = "" if sass.version == cc else f"{sass.label} SASS runs here by {how} within {cc[0]}.x; {fix} for code built for {dev.cc}"
        return _row(gen, dev, Status.SASS, sass.label, (note + legacy).lstrip("; "), floor)
    if ptx is not None:
        note = "; ".join([*misses, f"runs {ptx.label} PTX through the driver's JIT: {_JIT_COST}; {fix}",
                          f"the driver must know the PTX ISA of CUDA {toolkit}: >= {floor}, the bundle's floor"])
        return _row(gen, dev, Status.PTX_JIT, ptx.label, note + legacy, floor)
    ptxs = [c for c in codes if c.ptx]
    lowest_ptx = min(ptxs, key=Code.rank).label if ptxs else None
    why = [*misses, f"no SASS for {cc[0]}.x at or below {dev.cc}",
           f"no PTX that runs on {dev.cc}" + (f" (lowest PTX: {lowest_ptx})" if lowest_ptx else " (the list has no -virtual arch)"),
           fix.replace("-real to the recipe", "-real (or a -virtual arch at or below it) to the recipe")]
    return _row(gen, dev, Status.UNSUPPORTED, None, "; ".join(why), None)


def _fix(cc: tuple[int, int], supported: Sequence[str], toolkit: str) -> str:
    """The arch to add for native SASS on `cc`: its own, else its major's X.0 (runs on all X.y), else the best below it."""
    fits = [c for c in (Code(name=s, ptx=False) for s in supported if not re.search(r"[af]$", s)) if c.runs_on(cc)]
    if not fits:
        return f"CUDA {toolkit} cannot build SASS for {cc[0]}.{cc[1]}; a newer toolkit can"
    best = next((c for c in fits if c.version == cc), None) or next((c for c in fits if c.version[1] == 0), None)
    return f"add {(best or max(fits, key=Code.rank)).name}-real to the recipe"


def serving(cc: tuple[int, int], *, sass: Sequence[str], ptx: Sequence[str]) -> tuple[Status, str | None]:
    """How a GPU of compute capability `cc` runs code with these SASS and PTX arch names (bundle.json's
    cuda.archs): the best matching SASS, else the best matching PTX through the driver's JIT, else nothing.
    (status, the code's label: "sm_90", "compute_75"; None when unsupported.)"""
    for codes, status in (([Code(name=s, ptx=False) for s in sass], Status.SASS),
                          ([Code(name=p, ptx=True) for p in ptx], Status.PTX_JIT)):
        best = max((c for c in codes if c.runs_on(cc)), key=Code.rank, default=None)
        if best is not None:
            return status, best.label
    return Status.UNSUPPORTED, None


def arch_fix(cc: tuple[int, int], toolkit: str, *, toolkits: Mapping[str, Any] | None = None) -> str:
    """What a recipe on `toolkit` adds for native SASS on `cc` (as `llamabundle archs` says it), or that the
    toolkit cannot (data: cuda.json)."""
    toolkits = data.cuda_toolkits() if toolkits is None else toolkits
    if toolkit not in toolkits:
        return f"a recipe whose CUDA archs include {cc[0]}{cc[1]}-real"
    supported = list(toolkits[toolkit]["archs"])
    lowest = min((Code(name=s, ptx=False) for s in supported), key=Code.rank)
    if cc < lowest.version:
        return (f"CUDA {toolkit} cannot target it (nothing below sm_{lowest.name}); "
                f"a recipe on an older toolkit with {cc[0]}{cc[1]}-real can")
    return _fix(cc, supported, toolkit)
