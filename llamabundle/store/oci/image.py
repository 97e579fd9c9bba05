"""How a bundle is laid out as one OCI image manifest (docs/store-layout.md): bundle.json is its config, each
unique file content a zstd layer annotated with the file's raw sha256, size and paths (with their modes), and
the manifest's annotations carry the key, the name and the published zip's name, sha256 and size. `build` writes
the manifest as canonical JSON (sorted keys, no whitespace, no timestamps of its own), so two publishers of one
bundle write the same bytes and the same digest; `parse` reads one back, trusting nothing it has not checked."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ... import untrusted
from ...bundle.manifest import FileEntry, Manifest
from ...digest import canonical_json
from ...errors import VerifyError

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.llamabundle.bundle.v1+json"
CONFIG_TYPE = ARTIFACT_TYPE  # the config blob is bundle.json, as Manifest.text() writes it
LAYER_TYPE = "application/vnd.llamabundle.file.v1+zstd"  # one file's bytes as one zstd frame (store.codec)
MAX_MANIFEST = 4 << 20  # what registries accept as a manifest

TITLE = "org.opencontainers.image.title"
CREATED = "org.opencontainers.image.created"
FILE_SHA256 = "dev.llamabundle.file.sha256"
FILE_SIZE = "dev.llamabundle.file.size"
FILE_PATHS = "dev.llamabundle.file.paths"  # canonical JSON: {path: "0755" | "0644"}, every path of this content
KEY = "dev.llamabundle.key"
NAME = "dev.llamabundle.name"
ZIP_NAME = "dev.llamabundle.zip.name"
ZIP_SHA256 = "dev.llamabundle.zip.sha256"
ZIP_SIZE = "dev.llamabundle.zip.size"
KEY_TAG_PREFIX = "k-"

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]{64}")
_KEY_TAG = re.compile(r"k-([0-9a-f]{64})")
_MODES = ("0755", "0644")


def key_tag(key: str) -> str:
    """The tag every bundle is found by: `k-<key>` (66 characters of the 128 a tag may hold)."""
    return KEY_TAG_PREFIX + key


def key_of_tag(tag: str) -> str | None:
    m = _KEY_TAG.fullmatch(tag)
    return m.group(1) if m else None


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Layer:
    """One file content of a bundle: its zstd blob (digest and size as stored) and the file it unpacks to."""

    digest: str  # sha256:<hex> of the compressed bytes
    size: int  # compressed bytes
    sha256: str  # of the file's own bytes
    raw_size: int
    paths: Mapping[str, str]  # every path of the bundle with this content -> "0755" or "0644" (its mode in the zip)

    def annotations(self) -> dict[str, str]:
        return {TITLE: next(iter(self.paths)), FILE_SHA256: self.sha256, FILE_SIZE: str(self.raw_size),
                FILE_PATHS: canonical_json(dict(self.paths))}


@dataclass(frozen=True)
class Image:
    """An OCI manifest of a bundle, as read from a registry (or about to be pushed)."""

    digest: str  # of `raw`
    raw: bytes
    config_digest: str
    config_size: int
    layers: tuple[Layer, ...]
    key: str
    name: str
    zip_name: str
    zip_sha256: str
    zip_size: int

    def layer_for(self, file: FileEntry) -> Layer | None:
        """The layer holding the file: its content (sha256 and size) and its path."""
        return next((la for la in self.layers if la.sha256 == file.sha256 and la.raw_size == file.size
                     and file.path in la.paths), None)

    def covers(self, manifest: Manifest) -> str | None:
        """Why the layers are not exactly the manifest's files (None: they are)."""
        by_path = {f.path: f for f in manifest.files}
        seen: set[str] = set()
        for la in self.layers:
            for p in la.paths:
                f = by_path.get(p)
                if f is None:
                    return f"a layer names {p!r}, which bundle.json does not list"
                if (f.sha256, f.size) != (la.sha256, la.raw_size):
                    return f"the layer of {p} holds other content than bundle.json lists"
                if p in seen:
                    return f"two layers name {p}"
                seen.add(p)
        missing = [p for p in by_path if p not in seen]
        return f"no layer holds {missing[0]}" + (f" (and {len(missing) - 1} more files)" if len(missing) > 1 else "") \
            if missing else None


def build(manifest: Manifest, config: bytes, layers: Sequence[Layer], *, zip_name: str, zip_sha256: str,
          zip_size: int) -> bytes:
    """The OCI image manifest of a bundle, canonical: the same bundle gives the same bytes."""
    notes = {KEY: manifest.key, NAME: manifest.name, ZIP_NAME: zip_name, ZIP_SHA256: zip_sha256, ZIP_SIZE: str(zip_size)}
    if manifest.built_at:
        notes[CREATED] = manifest.built_at  # the bundle's own time: the same for every publisher
    doc = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": sha256_digest(config), "size": len(config)},
        "layers": [{"mediaType": LAYER_TYPE, "digest": la.digest, "size": la.size, "annotations": la.annotations()}
                   for la in layers],
        "annotations": notes,
    }
    return canonical_json(doc).encode("ascii")


class ImageError(VerifyError):
    """A tag of the store names a manifest that is not a well-formed llamabundle bundle (exit 5)."""


def parse(raw: bytes, *, digest: str, where: str, fix: str) -> Image:
    """The manifest's bytes as an Image; anything not as `build` writes it is an ImageError naming the field."""
    def bad(why: str) -> ImageError:
        return ImageError(f"{where} is not a llamabundle bundle manifest", why=why, fix=fix)

    try:
        doc = untrusted.loads(raw, max_bytes=MAX_MANIFEST)
    except ValueError as e:
        raise bad(f"it is not JSON ({str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise bad("it is not a JSON object")
    if doc.get("schemaVersion") != 2 or isinstance(doc.get("schemaVersion"), bool):
        raise bad(f"schemaVersion is {doc.get('schemaVersion')!r}, not 2")
    if doc.get("mediaType", MANIFEST_TYPE) != MANIFEST_TYPE:
        raise bad(f"its mediaType is {str(doc.get('mediaType'))[:100]!r}, not {MANIFEST_TYPE}")
    config = _descriptor(doc.get("config"), "config", bad)
    if config["mediaType"] != CONFIG_TYPE:
        raise bad(f"its config is a {config['mediaType'][:100]!r}, not {CONFIG_TYPE} (another kind of image)")
    listed = doc.get("layers")
    if not isinstance(listed, list):
        raise bad("layers is not a list")
    layers = []
    for i, item in enumerate(listed):
        d = _descriptor(item, f"layers[{i}]", bad)
        if d["mediaType"] != LAYER_TYPE:
            raise bad(f"layers[{i}] is a {d['mediaType'][:100]!r}, not {LAYER_TYPE}")
        notes = _notes(d.get("annotations"), f"layers[{i}].annotations", bad)
        sha, size = notes.get(FILE_SHA256, ""), notes.get(FILE_SIZE, "")
        if not _HEX.fullmatch(sha) or not size.isdigit() or len(size) > 15:
            raise bad(f"layers[{i}] does not record its file's sha256 and size ({FILE_SHA256}, {FILE_SIZE})")
        try:
            paths = untrusted.loads(notes.get(FILE_PATHS, ""), max_bytes=1 << 20)
        except ValueError:
            paths = None
        if not (isinstance(paths, dict) and paths and all(isinstance(p, str) and m in _MODES for p, m in paths.items())):
            raise bad(f"layers[{i}].annotations[{FILE_PATHS!r}] is not a JSON object of paths and modes")
        layers.append(Layer(digest=d["digest"], size=d["size"], sha256=sha, raw_size=int(size), paths=paths))
    notes = _notes(doc.get("annotations"), "annotations", bad)
    for k in (KEY, NAME, ZIP_NAME, ZIP_SHA256, ZIP_SIZE):
        if not notes.get(k):
            raise bad(f"its annotations lack {k}")
    zip_name, zip_size = notes[ZIP_NAME], notes[ZIP_SIZE]
    if (not zip_name.endswith(".zip") or "/" in zip_name or "\\" in zip_name or zip_name.startswith(".")
            or any(ord(c) < 32 for c in zip_name) or len(zip_name) > 255):
        raise bad(f"the zip's name {zip_name[:100]!r} is not a plain *.zip file name")
    if not _HEX.fullmatch(notes[ZIP_SHA256]) or not zip_size.isdigit() or len(zip_size) > 15:
        raise bad(f"{ZIP_SHA256} / {ZIP_SIZE} are not a sha256 and a size")
    if not _HEX.fullmatch(notes[KEY]):
        raise bad(f"{KEY} is not a cache key")
    return Image(digest=digest, raw=raw, config_digest=config["digest"], config_size=config["size"],
                 layers=tuple(layers), key=notes[KEY], name=notes[NAME], zip_name=zip_name,
                 zip_sha256=notes[ZIP_SHA256], zip_size=int(zip_size))


def _descriptor(value: Any, where: str, bad: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(f"{where} is not an object")
    media, digest, size = value.get("mediaType"), value.get("digest"), value.get("size")
    if not isinstance(media, str):
        raise bad(f"{where}.mediaType is not a string")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise bad(f"{where}.digest is not sha256:<64 hex digits>")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad(f"{where}.size is not a size")
    return value


def _notes(value: Any, where: str, bad: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise bad(f"{where} is not an object of strings")
    return value
