"""Read a git index file (versions 2-4) and check a work tree against it, without git.

The index comes from a download (an sdist's vendored submodule): it is believed only after its checksum
matches, and every path in it must be one git itself would check out (relative, no `.`, `..` or `.git`
component), so that checking a tree against it never reads outside that tree."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class IndexEntry:
    path: str
    mode: int
    sha1: str


class IndexFormatError(ValueError):
    pass


def read_index(data: bytes) -> list[IndexEntry]:
    try:
        return _read_index(data)
    except (ValueError, IndexError, struct.error, UnicodeDecodeError) as e:
        if isinstance(e, IndexFormatError):
            raise
        raise IndexFormatError(f"git index is malformed: {e}") from None


def _read_index(data: bytes) -> list[IndexEntry]:
    if len(data) < 32 or data[:4] != b"DIRC":
        raise IndexFormatError("not a git index (no DIRC signature)")
    version, count = struct.unpack(">II", data[4:12])
    if version not in (2, 3, 4):
        raise IndexFormatError(f"unsupported git index version {version}")
    if hashlib.sha1(data[:-20]).digest() != data[-20:]:
        raise IndexFormatError("git index checksum does not match its contents")
    pos, prev = 12, b""
    entries: list[IndexEntry] = []
    for _ in range(count):
        start = pos
        if pos + 62 > len(data):
            raise IndexFormatError("git index is truncated")
        mode = struct.unpack(">I", data[pos + 24 : pos + 28])[0]
        sha1 = data[pos + 40 : pos + 60].hex()
        flags = struct.unpack(">H", data[pos + 60 : pos + 62])[0]
        pos += 62
        if flags & 0x4000 and version >= 3:
            pos += 2
        if version == 4:
            strip, n = _varint(data, pos)
            pos = n
            end = data.index(b"\0", pos)
            name = prev[: len(prev) - strip] + data[pos:end]
            pos = end + 1
        else:
            end = data.index(b"\0", pos)
            name = data[pos:end]
            pos = start + ((end - start + 8) // 8) * 8
        prev = name
        if not safe_path(name):
            raise IndexFormatError(f"git index has an entry with an unsafe path {name.decode(errors='replace')[:200]!r}")
        if (flags >> 12) & 0x3:  # merge stages: not a clean checkout
            raise IndexFormatError(f"git index has an unmerged entry {name.decode(errors='replace')}")
        entries.append(IndexEntry(path=name.decode("utf-8", "surrogateescape"), mode=mode, sha1=sha1))
    return entries


def safe_path(name: bytes | str) -> bool:
    """A path git would check out: relative, no empty, `.`, `..` or `.git` component (git's verify_path)."""
    if isinstance(name, str):
        name = name.encode("utf-8", "surrogateescape")
    if not name or name.startswith(b"/"):
        return False
    return all(part not in (b"", b".", b"..") and part.lower() != b".git" for part in name.split(b"/"))


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    # git's offset encoding for v4 path prefix compression
    byte = data[pos]
    value = byte & 0x7F
    pos += 1
    while byte & 0x80:
        byte = data[pos]
        value = ((value + 1) << 7) | (byte & 0x7F)
        pos += 1
    return value, pos


def blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass(frozen=True, kw_only=True)
class TreeCheck:
    checked: int
    missing: tuple[str, ...]
    modified: tuple[str, ...]
    extra: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return not (self.missing or self.modified or self.extra)


def check_tree(root: Path, entries: list[IndexEntry], *, ignore: tuple[str, ...] = (".git",)) -> TreeCheck:
    """Compare every file under root with the index: same blob hash, nothing missing, nothing extra."""
    missing: list[str] = []
    modified: list[str] = []
    listed: set[str] = set()
    for e in entries:
        listed.add(e.path)
        kind = e.mode >> 12
        if kind == 0o16:  # gitlink (submodule): its directory is not part of this tree
            continue
        p = root / e.path
        if kind == 0o12:
            if not p.is_symlink():
                (missing if not p.exists() else modified).append(e.path)
                continue
            content = os.readlink(p).encode("utf-8", "surrogateescape")
        else:
            if p.is_symlink() or not p.is_file():
                missing.append(e.path)
                continue
            content = p.read_bytes()
        if blob_sha1(content) != e.sha1:
            modified.append(e.path)
    gitlinks = tuple(e.path + "/" for e in entries if e.mode >> 12 == 0o16)
    extra = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in ignore]
            filenames = [f for f in filenames if f not in ignore]
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            if rel not in listed and not rel.startswith(gitlinks):
                extra.append(rel)
    return TreeCheck(checked=len(entries), missing=tuple(sorted(missing)), modified=tuple(sorted(modified)),
                     extra=tuple(sorted(extra)))


def loose_commit_time(gitdir: Path, commit: str) -> int | None:
    """The committer time of `commit` from its loose object in `gitdir` (a shallow clone keeps it loose),
    after checking that the object really hashes to `commit`. None when it is not there as a loose object."""
    path = gitdir / "objects" / commit[:2] / commit[2:]
    try:
        raw = zlib.decompress(path.read_bytes())
    except (OSError, zlib.error):
        return None
    if hashlib.sha1(raw).hexdigest() != commit or not raw.startswith(b"commit "):
        return None
    body = raw.split(b"\0", 1)[1]
    for line in body.split(b"\n"):
        if not line:
            break  # end of the headers
        if line.startswith(b"committer "):
            parts = line.rsplit(b" ", 2)
            return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
    return None
