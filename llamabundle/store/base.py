"""The store protocol (DESIGN §6): lookup(key) -> Entry | None, fetch(entry, dest), publish(bundle)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import UsageError


@dataclass(frozen=True, kw_only=True)
class Entry:
    key: str
    zip_name: str
    zip_sha256: str
    zip_size: int
    manifest: dict[str, Any]
    location: str  # where it lives, for messages


@dataclass(frozen=True, kw_only=True)
class Published:
    entry: Entry
    created: bool  # False: an identical entry was already there


class Store(Protocol):
    url: str

    def lookup(self, key: str) -> Entry | None: ...

    def fetch(self, entry: Entry, dest: Path) -> Path:
        """Download the entry's zip into dest (a directory); return the verified zip's path."""
        ...

    def publish(self, zip_path: Path, manifest: dict[str, Any]) -> Published: ...


def open_store(url: str) -> Store:
    """A path or file://… is a local directory store."""
    from .local import LocalStore

    if url.startswith("github:"):
        raise UsageError(f"store '{url}': the GitHub Releases store is not available in this version",
                         fix="use a local directory store (a path)")
    if "://" in url and not url.startswith("file://"):
        raise UsageError(f"store '{url}' has an unknown scheme", fix="use a directory path, file://PATH or github:OWNER/REPO")
    return LocalStore(Path(url.removeprefix("file://")).expanduser())
