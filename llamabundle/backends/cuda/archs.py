"""CUDA architecture lists: parse `NN[a|f][-real|-virtual]` and check them against a toolkit."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...names import ARCH_PATTERN

_ARCH = re.compile(ARCH_PATTERN)


@dataclass(frozen=True, kw_only=True)
class Arch:
    """One CUDA architecture of a recipe's list."""

    name: str  # "86", "120a"
    sass: bool  # real: machine code for this arch
    ptx: bool  # virtual: PTX that the driver can JIT for newer GPUs


def parse_arch(text: str) -> Arch:
    m = _ARCH.fullmatch(text)
    if not m:
        raise ValueError(f"'{text}' is not a CUDA architecture (NN[a|f][-real|-virtual], e.g. 86-real)")
    kind = m[4]
    return Arch(name=m[1] + m[2], sass=kind in (None, "real"), ptx=kind in (None, "virtual"))


def split_archs(archs: Sequence[str]) -> dict[str, list[str]]:
    """{'sass': [...], 'ptx': [...]} in numeric order, as bundle.json records them."""
    parsed = [parse_arch(a) for a in archs]
    order = lambda n: (int(re.sub(r"\D", "", n)), n)  # noqa: E731
    return {
        "sass": sorted({a.name for a in parsed if a.sass}, key=order),
        "ptx": sorted({a.name for a in parsed if a.ptx}, key=order),
    }


def check_archs(archs: Sequence[str], supported: Sequence[str], *, toolkit: str,
                fail: Callable[[int, str, str], Exception]) -> None:
    if not archs:
        raise fail(0, "the arch list is empty", "list at least one architecture, e.g. 86-real")
    seen: set[str] = set()
    lowest = min(int(re.sub(r"\D", "", s)) for s in supported)
    for i, text in enumerate(archs):
        try:
            arch = parse_arch(text)
        except ValueError as e:
            raise fail(i, str(e), "use e.g. 75-virtual, 86-real or 120a-real; 'native' and 'all' are not reproducible") from None
        if text in seen:
            raise fail(i, f"'{text}' is listed twice", "remove one")
        seen.add(text)
        if arch.name not in supported:
            num = int(re.sub(r"\D", "", arch.name))
            why = f"CUDA {toolkit} dropped sm_{arch.name} (it supports nothing below sm_{lowest})" if num < lowest else f"CUDA {toolkit} does not know sm_{arch.name}"
            raise fail(i, f"'{text}': {why}", "supported: " + ", ".join(supported))
