"""Run-time companions: libraries a CUDA library loads by name (LoadLibrary, dlopen) that no import table
or DT_NEEDED entry names (cuBLASLt → NVRTC → NVRTC's builtins). The rules and the evidence for each are
data (data/cuda_runtime.json); the exact file a library loads is read from the library itself, where it
is written as ASCII or UTF-16LE, so a rule never guesses a version."""

from __future__ import annotations

import fnmatch
import mmap
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from ... import data
from ...deps import elf

Kind = Literal["required", "latent"]


@dataclass(frozen=True, kw_only=True)
class Rule:
    """A companion rule of data/cuda_runtime.json: which library loads which names."""

    library: str  # file-name pattern of the library that loads (cublasLt64_*.dll)
    names: str  # what it names: '#' is one or more digits (nvrtc64_#_#.dll)
    kind: Kind  # required: whenever the library is used; latent: it may
    component: str  # the redist component that provides it
    evidence: str

    @property
    def patterns(self) -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
        return _compiled(self.names)


@dataclass(frozen=True, kw_only=True)
class Named:
    """`name` is loaded at run time by `by`, under `rule`."""
    name: str
    by: str
    rule: Rule

    @property
    def why(self) -> str:
        return f"loaded by {self.by} at run time ({self.rule.kind} companion)"


@cache
def rules() -> tuple[Rule, ...]:
    out = tuple(Rule(**r) for r in data.cuda_runtime()["companions"])
    for r in out:
        assert r.kind in ("required", "latent") and "#" in r.names and r.evidence, r
    return out


@cache
def _compiled(names: str) -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    """The ASCII and the UTF-16LE form of a `names` pattern, bounded so that a longer name does not match."""
    ascii_parts, wide_parts = [], []
    for ch in names:
        if ch == "#":
            ascii_parts.append(b"[0-9]+")
            wide_parts.append(b"(?:[0-9]\x00)+")
        else:
            lit = re.escape(ch.encode())
            ascii_parts.append(lit)
            wide_parts.append(lit + b"\x00")
    edge = b"[A-Za-z0-9_.+-]"  # after the name; the byte before it is checked by names_in (a look-behind is slow)
    return (re.compile(b"".join(ascii_parts) + b"(?!" + edge + b")"),
            re.compile(b"".join(wide_parts) + b"(?!" + edge + b"\x00)"))


def _starts_name(m: mmap.mmap, start: int, width: int) -> bool:
    """The match is not the tail of a longer name: the character before it (one byte, or a UTF-16LE unit)
    is not one of the ASCII characters a file name is made of."""
    if start < width:
        return True
    before = m[start - width:start]
    if width == 2 and before[1] != 0:
        return True
    return bytes(before[:1]) not in _NAME_CHARS


_NAME_CHARS = {bytes([c]) for c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.+-"}


def rules_for(file_name: str) -> list[Rule]:
    low = file_name.lower()
    return [r for r in rules() if fnmatch.fnmatchcase(low, r.library.lower())]


def names_in(path: Path, rule: Rule) -> list[str]:
    """The file names matching `rule.names` that the library at `path` holds (sorted, each once). Read once
    per file as it is (collect asks again each round of the closure; cuBLASLt is hundreds of MB)."""
    st = path.stat()
    return list(_names_in(str(path.resolve()), st.st_size, st.st_mtime_ns, rule))


@cache
def _names_in(path: str, size: int, mtime_ns: int, rule: Rule) -> tuple[str, ...]:
    found: set[str] = set()
    narrow, wide = rule.patterns
    head = rule.names.split("#", 1)[0].encode("ascii")  # the literal the name starts with (rules() checks a '#')
    with open(path, "rb") as f:
        if (size := f.seek(0, 2)) == 0:
            return ()
        # an ELF library's data sections only (its code and GPU code are most of it: 163 of cuBLASLt's 542 MB are
        # read); a DLL, or an ELF file whose section headers cannot be read, whole
        ranges = elf.data_ranges(Path(path)) or [(0, size)]
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for start, length in ranges:
                end = min(start + length, size)
                found.update(x.group(0).decode("ascii") for x in _matches(m, head, narrow, start, end)
                             if _starts_name(m, x.start(), 1))
                found.update(x.group(0)[::2].decode("ascii") for x in _matches(m, _wide(head), wide, start, end)
                             if _starts_name(m, x.start(), 2))
    return tuple(sorted(found))


def _wide(text: bytes) -> bytes:
    return b"".join(bytes([c, 0]) for c in text)


def _matches(m: mmap.mmap, head: bytes, pattern: re.Pattern[bytes], start: int, end: int) -> Iterator[re.Match[bytes]]:
    """pattern's matches that start in m[start:end], tried only where its literal head is (mmap.find skips the rest
    at memory speed: a regex scan of cuBLASLt's 540 MB took 1.1 s on an H100 machine)."""
    if not head:
        yield from pattern.finditer(m, start, end)  # (a name that runs past `end` is cut there)
        return
    at = m.find(head, start, end)
    while at >= 0:
        x = pattern.match(m, at)
        if x is not None:
            yield x
        at = m.find(head, at + 1, end)


def named_by(files: Mapping[str, Path], *, latent: bool) -> list[Named]:
    """What the files (name in the bundle -> path) load at run time, by rule (latent rules only when `latent`)."""
    out: list[Named] = []
    for name, path in sorted(files.items()):
        for rule in rules_for(name):
            if rule.kind == "latent" and not latent:
                continue
            out += [Named(name=n, by=name, rule=rule) for n in names_in(path, rule)]
    return out


def find(name: str, dirs: Iterable[Path], *, case_insensitive: bool) -> Path | None:
    """`name` in the first directory that has it (Windows compares names without case)."""
    for d in dirs:
        if not d.is_dir():
            continue
        if not case_insensitive:
            if (d / name).is_file():
                return d / name
            continue
        hit = next((f for f in sorted(d.iterdir()) if f.name.lower() == name.lower() and f.is_file()), None)
        if hit is not None:
            return hit
    return None


def missing_in(present: Sequence[str], named: Iterable[Named], *, case_insensitive: bool) -> list[Named]:
    """What is named but not present (Windows compares names without case; Linux's dlopen does not)."""
    fold = str.lower if case_insensitive else str
    have = {fold(p) for p in present}
    return [n for n in named if fold(n.name) not in have]
