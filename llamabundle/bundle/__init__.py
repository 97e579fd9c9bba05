"""The bundle contract (DESIGN §5): flat layout, bundle.json, deterministic zip, unpack + validate."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import time
import zipfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .. import __version__, scratch
from ..archive import UnsafeArchive, check_zip, extract_zip, tmp_beside
from ..digest import sha256_file, walk
from ..errors import VerifyError
from ..settings import ZIP_EPOCH_FIRST, ZIP_EPOCH_LAST
from . import deflate, zipstream
from . import manifest as manifest_mod
from .manifest import (
    ANYTHING,
    FORMAT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    ROLES,
    ContentCheck,
    Expect,
    Manifest,
    ManifestError,
)

__all__ = ["FORMAT", "MANIFEST", "ROLES", "ContentCheck", "Expect", "Manifest"]

ZIP_EPOCH_DEFAULT = (1980, 1, 1, 0, 0, 0)


def file_entries(root: Path, roles: Mapping[str, str],
                 about: Mapping[str, tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """Every file under root except bundle.json, sorted, with sha256, size and role, and (from `about`:
    name -> (origin, why)) where it came from and why it is there."""
    entries = []
    for path in sorted(walk(root)):
        if path == MANIFEST:
            continue
        role = roles.get(path)
        if role not in ROLES:
            raise ValueError(f"{path}: no role given (one of {ROLES})")
        f = root / path
        entry: dict[str, Any] = {"path": path, "sha256": sha256_file(f), "size": f.stat().st_size, "role": role}
        if about and path in about:
            entry["origin"], entry["why"] = about[path]
        entries.append(entry)
    return entries


def bundle_time(source_date_epoch: int | None) -> int:
    """The one time of a bundle, as Unix seconds: `built_at` and every zip entry's date. SOURCE_DATE_EPOCH (a
    build's default: the pinned commit's date), else the time of the run in whole even seconds (what a zip's
    date holds, so that built_at and the entries then agree to the second); held to 1980-01-01 to 2107-12-31,
    the dates a zip can hold (a commit's date past 2107 does not stop the pack)."""
    when = source_date_epoch if source_date_epoch is not None else int(time.time()) & ~1
    return min(max(when, ZIP_EPOCH_FIRST), ZIP_EPOCH_LAST)


def built_at(source_date_epoch: int | None) -> str:
    """bundle.json's built_at: bundle_time() as ISO 8601 UTC."""
    when = dt.datetime.fromtimestamp(bundle_time(source_date_epoch), dt.UTC)
    return when.isoformat().replace("+00:00", "Z")


def write_manifest(root: Path, fields: dict[str, Any]) -> Manifest:
    """Write bundle.json (format and tool added) into root; returns it parsed, so a malformed one is never written."""
    m = manifest_mod.parse(json.loads(json.dumps({"format": FORMAT, **fields, "tool": f"llamabundle {__version__}"})))
    (root / MANIFEST).write_text(m.text(), encoding="utf-8")
    return m


def read_manifest(root: Path) -> Manifest:
    """The typed manifest at the root of an unpacked bundle (manifest.read)."""
    return manifest_mod.read(root)


class _Given:
    """zipfile's compressor for a member whose deflate stream is made already (bundle.deflate): zipfile is fed
    nothing (the stream's CRC-32 and size are set on its writer) and it gives the stream when flushed."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def compress(self, data: bytes) -> bytes:
        return b""

    def flush(self) -> bytes:
        data, self.data = self.data, b""
        return data


def pack(root: Path, zip_path: Path, *, source_date_epoch: int | None = None, cache: Path | None = None) -> Path:
    """Deterministic zip of root: sorted entries, fixed timestamps (`source_date_epoch` held to what a zip can
    date, as bundle_time() holds it: a packaged bundle passes its bundle_time(), so that every entry is dated
    its built_at; None: 1980-01-01), normalised modes, bundle.json first. The members are deflated ahead in worker
    threads, the large ones from `cache` where it holds them (bundle.deflate): the bytes are zipfile's."""
    when = ZIP_EPOCH_DEFAULT
    if source_date_epoch is not None:
        t = dt.datetime.fromtimestamp(bundle_time(source_date_epoch), dt.UTC)
        when = (t.year, t.month, t.day, t.hour, t.minute, t.second)
    names = sorted(walk(root), key=lambda n: (n != MANIFEST, n))
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    part = f".{zip_path.name}.part-"  # named by its owner: a killed pack's is removed by the next pack
    scratch.sweep(zip_path.parent, [part])
    tmp = scratch.owned(zip_path.parent, part)
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=deflate.LEVEL) as zf:
            for name, stream in deflate.streams(root, names, cache=cache):
                info = zipfile.ZipInfo(name, date_time=when)
                info.create_system = 3
                executable = os.access(root / name, os.X_OK)
                info.external_attr = (0o100755 if executable else 0o100644) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                with zf.open(info, "w") as dst:
                    if all(hasattr(dst, a) for a in ("_compressor", "_crc", "_file_size")):
                        # CPython's writer (3.8 and later): the stream, its CRC-32 and size as deflate read them
                        vars(dst).update(_compressor=_Given(stream.data), _crc=stream.crc, _file_size=stream.size)
                    else:  # another writer: it deflates and counts the member itself
                        with open(root / name, "rb") as src:
                            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, zip_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return zip_path


def listed_sizes(root: Path) -> dict[str, int]:
    """path -> size of every file the bundle.json just unpacked at `root` lists (and its own)."""
    m = manifest_mod.read(root)
    return {MANIFEST: (root / MANIFEST).stat().st_size, **{f.path: f.size for f in m.files}}


SIZES_FROM = (MANIFEST, listed_sizes)  # zipstream: bundle.json first, then every member as it lists it


def stream(dest: Path, *, label: str) -> zipstream.ZipStream:
    """The streaming reader of a bundle zip arriving into `dest` (a fetch): by the rules extract() applies."""
    return zipstream.ZipStream(dest, label=label, sizes_from=SIZES_FROM)


def extract(zip_path: Path, dest: Path) -> dict[str, str] | None:
    """The one reader of a bundle zip on disk (verify, publish, install, a cache hit; a fetch streams it and
    comes here only for what it could not stream): every member checked before it is read (stored or
    deflated, unencrypted, no data descriptor, local and central headers agreeing, listed in bundle.json with
    its size), then written into dest (which must not exist; left only on success). Returns path -> sha256 of
    each file when the zip was streamed in one pass (None: extracted from its central directory)."""
    try:
        return {m.name: m.sha256 for m in zipstream.unpack_file(zip_path, dest, sizes_from=SIZES_FROM)}
    except zipstream.NotStreamable:
        extract_unstreamed(zip_path, dest)
        return None


def extract_unstreamed(zip_path: Path, dest: Path) -> None:
    """A bundle zip read from its central directory (a layout zipstream does not stream: zip64, bundle.json
    not first, a member it does not list): its members (archive.check_zip), then bundle.json's sizes checked
    before any other member is read."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            infos = {i.filename: i for i in check_zip(zf, zip_path, descriptors=False) if not i.is_dir()}
            info = infos.get(MANIFEST)
            if info is None:  # extracted by the rules above; the check of the unpacked tree then says it has none
                extract_zip(zip_path, dest, descriptors=False)
                return
            if info.file_size > MAX_MANIFEST_BYTES:
                raise ManifestError(f"{zip_path.name}: its {MANIFEST} is larger than {MAX_MANIFEST_BYTES >> 20} MiB",
                                    why="a bundle.json is a few KiB")
            m = manifest_mod.loads(zf.read(info), where=f"{zip_path.name}:{MANIFEST}")
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error, ValueError) as e:  # ValueError: a name not UTF-8
        raise VerifyError(f"{zip_path.name} is not a readable zip", why=str(e),
                                       fix="download it again; if it persists the published file is damaged") from None
    sizes = {f.path: f.size for f in m.files}
    for name, i in infos.items():
        if name != MANIFEST and sizes.get(name) != i.file_size:
            raise UnsafeArchive(f"{zip_path.name}: " + (f"member '{name}' is {i.file_size} bytes; {MANIFEST} says {sizes[name]}"
                                if name in sizes else f"{name} is in the bundle but not in {MANIFEST}"),
                                why=f"a bundle holds exactly the files its {MANIFEST} lists", fix="do not use this archive")
    extract_zip(zip_path, dest, descriptors=False)


def unpack(zip_path: Path, dest: Path, expect: Expect = ANYTHING, *,
           name: Callable[[str], str] | None = None) -> tuple[Manifest, ContentCheck]:
    """Safely extract a bundle zip into dest (new directory) by extract()'s rules and check it against its
    manifest (`name`: how its messages name a member, manifest.check_files). On any failure dest is not left
    behind."""
    tmp = tmp_beside(dest)
    try:
        hashes = extract(zip_path, tmp)
        manifest, check = check_unpacked(tmp, hashes=hashes, expect=expect, name=name)
        os.replace(tmp, dest)
        return manifest, check
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_unpacked(root: Path, *, hashes: Mapping[str, str] | None, expect: Expect = ANYTHING,
                   name: Callable[[str], str] | None = None) -> tuple[Manifest, ContentCheck]:
    """The manifest of a freshly unpacked bundle, trusted (manifest.trust) against `expect` and its files."""
    manifest = read_manifest(root)
    check = manifest_mod.trust(manifest, root, expect, hashes=hashes, name=name)
    assert check is not None
    return manifest, check


def diff_zips(a: Path, b: Path) -> list[str]:
    """Members that differ between two bundle zips: missing on one side, or the first differing byte offset."""
    out: list[str] = []
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        ia, ib = {i.filename: i for i in za.infolist()}, {i.filename: i for i in zb.infolist()}
        for name in sorted(ia.keys() | ib.keys()):
            if name not in ib or name not in ia:
                out.append(f"{name}: only in the {'first' if name in ia else 'second'} build")
                continue
            if (ia[name].CRC, ia[name].file_size) == (ib[name].CRC, ib[name].file_size):
                if (ia[name].date_time, ia[name].external_attr) != (ib[name].date_time, ib[name].external_attr):
                    out.append(f"{name}: same bytes, other timestamp or mode")
                continue
            offset = _first_difference(za, zb, name)
            out.append(f"{name}: differs from byte {offset} (sizes {ia[name].file_size} and {ib[name].file_size})")
    return out


def _first_difference(za: zipfile.ZipFile, zb: zipfile.ZipFile, name: str) -> int:
    offset = 0
    with za.open(name) as fa, zb.open(name) as fb:
        while True:
            ca, cb = fa.read(1 << 20), fb.read(1 << 20)
            if ca != cb:
                n = min(len(ca), len(cb))
                return offset + next((i for i in range(n) if ca[i] != cb[i]), n)
            if not ca:
                return offset
            offset += len(ca)
