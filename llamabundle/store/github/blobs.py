"""A GitHub release's files by content (docs/store-layout.md): beside the zip (deflate, for whoever wants one
file), each file once as a zstd frame (store.codec), the frames of each part of the bundle (bundle.json `parts`)
concatenated into one asset `blobs.<part>.zst` (going on in `blobs.<part>.2.zst`, … before MAX_ASSET: GitHub
refuses assets of 2 GiB), and `blobs.json`, the index of where each file's frame lies (asset, offset, length, the
frame's sha256). An install reads one frame with one Range request (store.ranged), so a partial install or an
update downloads only the files it lacks. The index is untrusted input: every field is checked, every file of
bundle.json must have a frame inside an uploaded asset of the size the release gives, and the caller still checks
each decompressed file against bundle.json."""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...bundle import parts
from ...bundle.manifest import Manifest
from ...errors import StoreError, VerifyError
from .. import codec

INDEX = "blobs.json"
MAX_ASSET = 2_000_000_000  # GitHub: "each file included in a release must be under 2 GiB"
_ASSET = re.compile(r"blobs\.[a-z0-9_-]{1,32}(\.[0-9]{1,4})?\.zst")
_HEX = re.compile(r"[0-9a-f]{64}")


def is_blob_asset(name: str) -> bool:
    return name == INDEX or _ASSET.fullmatch(name) is not None


@dataclass(frozen=True, kw_only=True)
class Frame:
    asset: str
    offset: int
    length: int
    sha256: str  # of the frame's bytes


@dataclass(frozen=True, kw_only=True)
class Group:
    name: str
    path: Path
    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class Packed:
    groups: tuple[Group, ...]
    index: bytes  # blobs.json


def _part_of(m: Manifest) -> dict[str, str]:
    """Each file's group: the GPU backend whose part lists it, else the CPU part (`all` for a bundle without parts)."""
    if m.parts is None:
        return {f.path: "all" for f in m.files}
    owner = {p: b for b, listed in m.parts.items() for p in listed}
    return {f.path: owner.get(f.path, parts.CPU) for f in m.files}


class _Group:
    """A blob asset being written: frames appended, hashed as they go."""

    def __init__(self, path: Path) -> None:
        self.path, self.f, self.size, self.h = path, open(path, "xb"), 0, hashlib.sha256()  # noqa: SIM115 - close()

    def append(self, frame: Path) -> tuple[int, str]:
        """(offset, sha256) of the frame appended."""
        offset, fh = self.size, hashlib.sha256()
        with open(frame, "rb") as src:
            while chunk := src.read(codec.CHUNK):
                fh.update(chunk)
                self.h.update(chunk)
                self.f.write(chunk)
                self.size += len(chunk)
        return offset, fh.hexdigest()

    def close(self) -> Group:
        self.f.close()
        return Group(name=self.path.name, path=self.path, size=self.size, sha256=self.h.hexdigest())


def pack(zip_path: Path, m: Manifest, out_dir: Path, *, max_asset: int = MAX_ASSET) -> Packed:
    """The release's blob assets for the bundle zip, written into out_dir: each file read from the zip and checked
    against bundle.json as it is compressed, each content once (in the first part that holds it)."""
    part_of = _part_of(m)
    groups: list[Group] = []
    frames: dict[str, Frame] = {}
    scratch = out_dir / ".frame"
    try:
        z = zipfile.ZipFile(zip_path)
    except (OSError, zipfile.BadZipFile) as e:
        raise VerifyError(f"{zip_path} is not a readable zip", why=str(e)) from None
    with z:
        for part in [parts.CPU, "all", *sorted(m.parts or {})]:
            cur: _Group | None = None
            n = 0
            for f in (f for f in m.files if part_of[f.path] == part and f.sha256 not in frames):
                try:
                    src = z.open(f.path)
                except KeyError:
                    raise VerifyError(f"{zip_path.name}:{f.path} is listed in bundle.json but not in the zip") from None
                with src, open(scratch, "wb") as out:
                    got = codec.pack(codec.Bounded(src, f.size), out)
                if (got.sha256, got.size) != (f.sha256, f.size):
                    raise VerifyError(f"{zip_path.name}:{f.path} does not match its sha256 in bundle.json",
                                      why="the zip and its manifest disagree", fix="pack the bundle again")
                if got.packed_size > max_asset:
                    raise StoreError(f"{f.path} compresses to {got.packed_size} bytes, too large for one GitHub asset",
                                     why=f"GitHub keeps each release asset under {max_asset} bytes",
                                     fix="publish it to a directory or an OCI registry store")
                if cur is not None and cur.size + got.packed_size > max_asset:  # the part goes on in another asset
                    groups.append(cur.close())
                    cur = None
                if cur is None:
                    n += 1
                    cur = _Group(out_dir / (f"blobs.{part}.zst" if n == 1 else f"blobs.{part}.{n}.zst"))
                offset, sha = cur.append(scratch)
                frames[f.sha256] = Frame(asset=cur.path.name, offset=offset, length=got.packed_size, sha256=sha)
            if cur is not None:
                groups.append(cur.close())
    scratch.unlink(missing_ok=True)
    index = {"schema": 1, "codec": "zstd", "manifest_sha256": parts.published_sha256(m),
             "assets": [{"name": g.name, "size": g.size, "sha256": g.sha256} for g in groups],
             "blobs": {sha: {"asset": fr.asset, "offset": fr.offset, "length": fr.length, "sha256": fr.sha256}
                       for sha, fr in sorted(frames.items())}}
    return Packed(groups=tuple(groups), index=(json.dumps(index, indent=1, sort_keys=True) + "\n").encode())


def read_index(raw: bytes, m: Manifest, assets: Mapping[str, int], *, where: str) -> dict[str, Frame]:
    """The frames blobs.json gives for the files of m (file sha256 -> Frame), `assets` being the release's
    uploaded blob assets and their sizes. Anything else than the index above raises StoreError naming `where`."""
    def bad(why: str) -> StoreError:
        return StoreError(f"{where} is not an index of the release's blobs", why=why,
                          fix="delete the release and publish the bundle again (its zip still installs)")

    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"it is not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != 1 or data.get("codec") != "zstd":
        raise bad("it is not a schema 1 zstd index")
    if data.get("manifest_sha256") != parts.published_sha256(m):
        raise bad("it indexes another bundle.json than the release's")
    listed = data.get("assets")
    if not isinstance(listed, list) or not listed or len(listed) > 1000:
        raise bad("`assets` is not a list of 1 to 1000 assets")
    sizes: dict[str, int] = {}
    for a in listed:
        if not (isinstance(a, dict) and isinstance(a.get("name"), str) and _ASSET.fullmatch(a["name"])
                and _is_count(a.get("size")) and isinstance(a.get("sha256"), str) and _HEX.fullmatch(a["sha256"])):
            raise bad(f"an asset is not a blob asset with a size and sha256: {str(a)[:120]}")
        if assets.get(a["name"]) != a["size"]:
            raise bad(f"{a['name']} is not an uploaded asset of {a['size']} bytes in the release")
        sizes[a["name"]] = a["size"]
    blobs = data.get("blobs")
    if not isinstance(blobs, dict):
        raise bad("`blobs` is not an object")
    frames: dict[str, Frame] = {}
    for f in m.files:
        ent = blobs.get(f.sha256)
        if f.sha256 in frames:
            continue
        if not (isinstance(ent, dict) and ent.get("asset") in sizes and _is_count(ent.get("offset"))
                and _is_count(ent.get("length")) and ent["length"] > 0 and isinstance(ent.get("sha256"), str)
                and _HEX.fullmatch(ent["sha256"])):
            raise bad(f"it gives no frame for {f.path} ({f.sha256[:12]})")
        if ent["offset"] + ent["length"] > sizes[ent["asset"]]:
            raise bad(f"the frame of {f.path} lies past the end of {ent['asset']}")
        frames[f.sha256] = Frame(asset=ent["asset"], offset=ent["offset"], length=ent["length"], sha256=ent["sha256"])
    return frames


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 53


def sums_lines(groups: Sequence[Group], index: bytes) -> list[tuple[str, str]]:
    """(sha256, name) of each blob asset, for SHA256SUMS."""
    return [*((g.sha256, g.name) for g in groups), (hashlib.sha256(index).hexdigest(), INDEX)]
