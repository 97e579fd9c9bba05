"""What proves a cached source tree: a record of the tree as it was proven (every file's path, type and mode,
size and mtime; their count, total size and a digest of that listing) in a marker written last, and the
re-proof before a cached tree is used: a stat walk compared with the record (no file is read)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import untrusted

MARKER = ".llamabundle-source.json"
MARKER_FORMAT = 2  # 1 (no "format" field): commit, origin and commit_time only, trusted alone
_HEX64 = re.compile(r"[0-9a-f]{64}")


Listing = dict[str, tuple[int, int, int]]  # path ("/"-separated, from the root) -> (st_mode, size, mtime_ns)


@dataclass(frozen=True, kw_only=True)
class TreeRecord:
    """What a stat walk of a source tree finds: every non-directory entry (files, symlinks) but the marker."""
    listing: Listing

    @property
    def files(self) -> int:
        return len(self.listing)

    @property
    def bytes(self) -> int:
        return sum(size for _mode, size, _mtime in self.listing.values())

    @property
    def digest(self) -> str:
        return listing_digest(self.listing)

    def to_json(self) -> dict[str, Any]:
        return {"files": self.files, "bytes": self.bytes, "digest": self.digest}


def listing_digest(listing: Listing) -> str:
    """sha256 of the sorted `path NUL mode NUL size NUL mtime_ns LF` lines."""
    h = hashlib.sha256()
    for path in sorted(listing):
        mode, size, mtime = listing[path]
        h.update(f"{path}\0{mode}\0{size}\0{mtime}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def record_tree(root: Path) -> TreeRecord:
    """A stat walk of root (nothing is read, symlinks are not followed): what the marker records, and what a
    cached tree is compared with before it is used. Raises OSError when root cannot be walked."""
    listing: Listing = {}
    stack = [(str(root), "")]
    while stack:
        where, rel = stack.pop()
        with os.scandir(where) as it:
            for e in it:
                name = e.name if not rel else f"{rel}/{e.name}"
                if not rel and e.name == MARKER:
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append((e.path, name))
                    continue
                st = e.stat(follow_symlinks=False)
                listing[name] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return TreeRecord(listing=listing)


def _describe_entry(mode: int, size: int) -> str:
    kind = "a symlink" if stat.S_ISLNK(mode) else "a file" if stat.S_ISREG(mode) else "a special file"
    return f"{kind} of {size} bytes"


def tree_difference(recorded: TreeRecord, found: TreeRecord, *, sample: int = 3) -> str | None:
    """None when the trees are the same; else what differs, in one line (counts, then a few examples)."""
    if recorded.listing == found.listing:
        return None
    was, now = recorded.listing, found.listing
    missing = sorted(was.keys() - now.keys())
    added = sorted(now.keys() - was.keys())
    changed = []
    for path in sorted(was.keys() & now.keys()):
        (m0, s0, t0), (m1, s1, t1) = was[path], now[path]
        if (m0, s0, t0) == (m1, s1, t1):
            continue
        if stat.S_IFMT(m0) != stat.S_IFMT(m1):
            changed.append(f"{path} (was {_describe_entry(m0, s0)}, is {_describe_entry(m1, s1)})")
        elif s0 != s1:
            changed.append(f"{path} (size {s0} -> {s1})")
        elif m0 != m1:
            changed.append(f"{path} (mode {stat.S_IMODE(m0):o} -> {stat.S_IMODE(m1):o})")
        else:
            changed.append(f"{path} (modified: mtime {t0} -> {t1} ns)")
    counts = (f"{recorded.files} files ({recorded.bytes} bytes) were proven, {found.files} ({found.bytes} bytes) "
              f"are there: {len(missing)} missing, {len(added)} added, {len(changed)} changed")
    examples = [*(f"missing {p}" for p in missing[:sample]), *(f"added {p}" for p in added[:sample]),
                *(f"changed {p}" for p in changed[:sample])]
    return counts + (" (" + "; ".join(examples) + ")" if examples else "")


# ------------------------------------------------------------------------------------- the marker


class MarkerDamaged(ValueError):
    """The marker is not one this version wrote: the cached tree is not trusted."""


@dataclass(frozen=True, kw_only=True)
class Marker:
    commit: str
    origin: str
    commit_time: int | None
    proof: Mapping[str, Any]  # how the commit was proven (method, digests): for people and for the record
    tree: TreeRecord

    def to_json(self) -> dict[str, Any]:
        return {"format": MARKER_FORMAT, "commit": self.commit, "origin": self.origin, "commit_time": self.commit_time,
                "proof": dict(self.proof), "tree": self.tree.to_json(),
                "listing": {p: list(v) for p, v in sorted(self.tree.listing.items())}}


def _int(value: Any, field: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MarkerDamaged(f"'{field}' is {str(value)[:40]!r}, not a non-negative integer")
    return value


def parse_marker(text: str) -> Marker:
    """A marker from its JSON text; raises MarkerDamaged naming what is wrong."""
    try:
        data = untrusted.loads(text)
    except untrusted.Untrusted as e:  # past the limits: refused before json.loads recurses
        raise MarkerDamaged(f"it is {e}") from None
    except ValueError as e:
        raise MarkerDamaged(f"it is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise MarkerDamaged("it is not a JSON object")
    fmt = data.get("format")
    if fmt != MARKER_FORMAT or isinstance(fmt, bool):
        raise MarkerDamaged("it was written by an older llamabundle, which did not record the tree" if fmt is None
                            else f"it has format {repr(fmt)[:20]}, not {MARKER_FORMAT}")
    for k in ("commit", "origin", "proof", "tree", "listing"):
        if k not in data:
            raise MarkerDamaged(f"it lacks '{k}'")
    commit, origin, proof, tree, listing = (data[k] for k in ("commit", "origin", "proof", "tree", "listing"))
    if not isinstance(commit, str) or not isinstance(origin, str):
        raise MarkerDamaged("'commit' and 'origin' must be strings")
    if not isinstance(proof, dict) or not isinstance(tree, dict) or not isinstance(listing, dict):
        raise MarkerDamaged("'proof', 'tree' and 'listing' must be objects")
    files, total = _int(tree.get("files"), "tree.files"), _int(tree.get("bytes"), "tree.bytes")
    digest = tree.get("digest")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise MarkerDamaged("'tree.digest' is not a sha256")
    entries: Listing = {}
    for path, v in listing.items():
        if not path or not isinstance(v, list) or len(v) != 3:
            raise MarkerDamaged(f"listing entry {path[:80]!r} is not [mode, size, mtime_ns]")
        mode, size, mtime = (_int(x, f"listing[{path[:80]!r}]") for x in v)
        entries[path] = (mode or 0, size or 0, mtime or 0)
    record = TreeRecord(listing=entries)
    try:
        consistent = record.files == files and record.bytes == total and record.digest == digest
    except UnicodeEncodeError:
        consistent = False
    if not consistent:
        raise MarkerDamaged("its listing does not add up to its own file count, size and digest")
    return Marker(commit=commit, origin=origin, commit_time=_int(data.get("commit_time"), "commit_time", optional=True),
                  proof=proof, tree=record)


def write_marker(tree: Path, marker: Marker) -> None:
    (tree / MARKER).write_text(json.dumps(marker.to_json(), indent=None, separators=(",", ":")) + "\n", encoding="utf-8")


def reprove(path: Path, commit: str) -> tuple[Marker | None, str | None]:
    """(the marker, None) when the tree at `path` is still the one proven for `commit`; else (None, why),
    why being None when there is nothing there at all."""
    marker_path = path / MARKER
    if not marker_path.is_file():
        return None, ("it has no marker (an interrupted fetch)" if os.path.lexists(path) else None)
    try:
        with open(marker_path, "rb") as f:  # never more than the limit is read (parse_marker refuses that much)
            marker = parse_marker(f.read(untrusted.MAX_BYTES + 1).decode("utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return None, f"its marker cannot be read ({e})"
    except MarkerDamaged as e:
        return None, f"its marker {MARKER} is damaged: {e}"
    if marker.commit != commit:
        return None, f"its marker names commit {marker.commit[:40]!r}"
    try:
        found = record_tree(path)
    except OSError as e:
        return None, f"it cannot be walked ({e.strerror or e})"
    differs = tree_difference(marker.tree, found)
    if differs is not None:
        return None, f"the tree changed since it was proven: {differs}"
    return marker, None
