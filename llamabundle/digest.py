"""The ground floor's hashing: a file's sha256, the files under a directory, and the canonical JSON that keys
and pins are the sha256 of. Every room may use it; it imports nothing of the package."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_state(st: os.stat_result) -> list[int]:
    """What changes whenever a file's bytes can have changed, for remembering that a file was found to have its
    sha256: the kernel sets ctime on every write (and every link, unlink or metadata change) and no call sets it
    back, so a file in the same state has the same bytes."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def sha256_json(value: Any) -> str:
    """The sha256 of a value's canonical JSON (a cache key, a pin)."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def walk(root: Path) -> list[str]:
    """Every file under root, as '/'-separated paths relative to it (unsorted)."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            out.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return out
