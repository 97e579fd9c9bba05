"""The store protocol (DESIGN §6) and the values stores hand back: `Store` (lookup(key) -> Entry | None,
list_entries(), fetch(entry, dest), publish(zip, manifest)), `Entry` and `Published`, and what a store that
keeps each file of a bundle once by content adds (`BlobStore`: has_blobs(entry), fetch_blob(entry, file, dest)).

Only the protocol lives here: the concrete stores (store.local, store.github) import this module, and it
imports none of them; the factory that picks one for a URL is `llamabundle.store.open_store`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..bundle.manifest import FileEntry, Manifest
    from ..net import Sink


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A bundle in a store: its zip and its manifest."""

    key: str
    zip_name: str
    zip_sha256: str
    zip_size: int
    manifest: Manifest  # parsed and checked against the key (manifest.check_consistent) by lookup
    location: str  # where it lives, for messages


@dataclass(frozen=True, kw_only=True)
class Published:
    """What a publish put in a store."""

    entry: Entry
    created: bool  # False: an identical entry was already there


class Store(Protocol):
    url: str

    def lookup(self, key: str) -> Entry | None: ...

    def list_entries(self) -> Sequence[Entry]:
        """Every complete entry of the store (what lookup would hit), each checked as lookup checks it, one per
        key, sorted by key. An incomplete entry is left out; a damaged one raises, as its lookup does."""
        ...

    def fetch(self, entry: Entry, dest: Path, *, sink: Sink | None = None) -> Path:
        """Download the entry's zip into dest (a directory); return the verified zip's path. `sink`, when
        given, is fed the zip's bytes in order as they arrive (net.Sink), to unpack while downloading."""
        ...

    def publish(self, zip_path: Path, manifest: Manifest) -> Published:
        """Store the zip under manifest.key. The caller has checked the zip against the manifest (manifest.trust)."""
        ...


@dataclass(frozen=True)
class Unpacked:
    """A blob decompressed into a file (store.codec.unpack): what was written and what was read."""
    sha256: str  # of the raw bytes written
    size: int  # raw bytes written (at most the limit plus one)
    packed_size: int  # compressed bytes read


class BlobStore(Store, Protocol):
    """A store that also keeps each file of a bundle once, by the sha256 of its bytes, compressed (store.codec):
    installs download only the files their blob cache lacks (runtime/install.py)."""

    def has_blobs(self, entry: Entry) -> bool:
        """Whether every file of the entry can be fetched by content (an entry published before the store kept
        files by content cannot: its zip is downloaded)."""
        ...

    def fetch_blob(self, entry: Entry, file: FileEntry, dest: Path) -> Unpacked:
        """Download the file's blob, decompress it into the new file dest (at most file.size + 1 bytes) and say
        what was written (its sha256 and size: the caller compares) and how many bytes came from the store."""
        ...


_REFUSED = re.compile(r"^bundle [0-9a-f]{1,12} refused: ")  # check_consistent's prefix, said once by the entry


def entry_manifest(raw: bytes, *, key: str, entry: str, where: str, fix: str) -> Manifest:
    """A store entry's bundle.json (`where` names it in messages) parsed and checked against the key it is stored
    under (manifest.check_consistent), as every store's lookup checks it; a failure names the entry and says `fix`."""
    from ..bundle.manifest import Expect, ManifestError, check_consistent, loads

    try:
        m = loads(raw, where=where)
    except ManifestError as e:
        raise ManifestError(e.what, field=e.field, why=e.why, fix=fix) from None
    try:
        check_consistent(m, Expect(key=key))
    except ManifestError as e:
        raise ManifestError(f"store entry {entry}: {_REFUSED.sub('', e.what, count=1)}", field=e.field, why=e.why,
                            fix=fix) from None
    return m


def blob_source(store: Store, entry: Entry) -> BlobStore | None:
    """The store, where it is a BlobStore holding every file of the entry by content; else None (the zip is read)."""
    if not (hasattr(store, "has_blobs") and hasattr(store, "fetch_blob")):
        return None
    src: BlobStore = store  # type: ignore[assignment]  # checked just above
    return src if src.has_blobs(entry) else None
