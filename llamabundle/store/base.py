"""The store protocol (DESIGN §6): lookup(key) -> Entry | None, fetch(entry, dest), publish(bundle)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import UsageError

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest
    from ..log import Log
    from ..net import Sink
    from ..recipe import Settings


@dataclass(frozen=True, kw_only=True)
class Entry:
    key: str
    zip_name: str
    zip_sha256: str
    zip_size: int
    manifest: Manifest  # parsed and checked against the key (manifest.check_consistent) by lookup
    location: str  # where it lives, for messages


@dataclass(frozen=True, kw_only=True)
class Published:
    entry: Entry
    created: bool  # False: an identical entry was already there


class Store(Protocol):
    url: str

    def lookup(self, key: str) -> Entry | None: ...

    def fetch(self, entry: Entry, dest: Path, *, sink: Sink | None = None) -> Path:
        """Download the entry's zip into dest (a directory); return the verified zip's path. `sink`, when
        given, is fed the zip's bytes in order as they arrive (net.Sink), to unpack while downloading."""
        ...

    def publish(self, zip_path: Path, manifest: Manifest) -> Published:
        """Store the zip under manifest.key. The caller has checked the zip against the manifest (manifest.trust)."""
        ...


def open_store(url: str, *, settings: "Settings | None" = None, log: "Log | None" = None,
               tags: "dict[str, str] | None" = None) -> Store:
    """A path or file://… is a local directory store; github:OWNER/REPO the GitHub Releases store
    (API URL and token from `settings`)."""
    from .local import LocalStore

    if url.startswith("github:"):
        from .github import GitHubStore

        return GitHubStore(url.removeprefix("github:"),
                           api_url=settings.github_api_url if settings is not None else None,
                           token=settings.github_token if settings is not None else None,
                           connect_timeout=settings.connect_timeout if settings is not None else 10.0,
                           log=log, tags=tags)
    if "://" in url and not url.startswith("file://"):
        raise UsageError(f"store '{url}' has an unknown scheme", fix="use a directory path, file://PATH or github:OWNER/REPO")
    return LocalStore(Path(url.removeprefix("file://")).expanduser())
