"""The bundle contract (DESIGN §5): flat layout, bundle.json, deterministic zip, unpack + validate."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__
from . import zipstream
from .archive import _tmp_beside, extract_zip
from .errors import VerifyError

MANIFEST = "bundle.json"
FORMAT = 1
ROLES = ("exe", "backend", "runtime", "license")
ZIP_EPOCH_DEFAULT = (1980, 1, 1, 0, 0, 0)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_entries(root: Path, roles: dict[str, str]) -> list[dict[str, Any]]:
    """Every file under root except bundle.json, sorted, with sha256, size and role."""
    entries = []
    for path in sorted(_walk(root)):
        if path == MANIFEST:
            continue
        role = roles.get(path)
        if role not in ROLES:
            raise ValueError(f"{path}: no role given (one of {ROLES})")
        f = root / path
        entries.append({"path": path, "sha256": sha256_file(f), "size": f.stat().st_size, "role": role})
    return entries


def _walk(root: Path) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            out.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return out


def built_at(source_date_epoch: int | None) -> str:
    when = dt.datetime.fromtimestamp(source_date_epoch, dt.UTC) if source_date_epoch is not None else dt.datetime.now(dt.UTC)
    return when.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def write_manifest(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    manifest = {"format": FORMAT, **manifest, "tool": f"llamabundle {__version__}"}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise VerifyError(f"{root} has no {MANIFEST}", why="every bundle carries its manifest at the root",
                          fix="this is not a llamabundle bundle, or it is incomplete")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise VerifyError(f"{MANIFEST} is not valid JSON", why=str(e)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise VerifyError(f"{MANIFEST} has unknown format {manifest.get('format') if isinstance(manifest, dict) else '?'}",
                          why=f"this llamabundle reads format {FORMAT}", fix="upgrade llamabundle")
    for k in ("key", "platform", "files", "llama_cpp"):
        if k not in manifest:
            raise VerifyError(f"{MANIFEST} lacks '{k}'")
    return manifest


@dataclass(frozen=True, kw_only=True)
class ContentCheck:
    files: int
    bytes: int


def check_contents(root: Path, manifest: dict[str, Any], *, hashes: dict[str, str] | None = None) -> ContentCheck:
    """Every listed file exists with its size and sha256; no file outside the list. `hashes` (path → sha256)
    are the digests of files just written (by an unpack that hashed them as it went), so they are not read again."""
    listed = {}
    for entry in manifest["files"]:
        path = entry.get("path", "")
        if not isinstance(path, str) or path.startswith("/") or ".." in path.split("/") or path == MANIFEST:
            raise VerifyError(f"{MANIFEST} lists an invalid path {path!r}")
        listed[path] = entry
    present = set(_walk(root)) - {MANIFEST}
    extra = sorted(present - set(listed))
    if extra:
        raise VerifyError(f"{extra[0]} is in the bundle but not in {MANIFEST}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""),
                          why="a bundle holds exactly the files its manifest lists", fix="do not use this bundle")
    total = 0
    for path, entry in sorted(listed.items()):
        f = root / path
        if not f.is_file():
            raise VerifyError(f"{path} is listed in {MANIFEST} but missing", fix="fetch or rebuild the bundle")
        size = f.stat().st_size
        if size != entry.get("size"):
            raise VerifyError(f"{path} has size {size}, {MANIFEST} says {entry.get('size')}",
                              why="the file was changed after the bundle was made", fix="fetch or rebuild the bundle")
        got = hashes[path] if hashes is not None and path in hashes else sha256_file(f)
        if got != entry.get("sha256"):
            raise VerifyError(f"{path} does not match its sha256 in {MANIFEST}",
                              why="the file was changed after the bundle was made", fix="fetch or rebuild the bundle")
        total += size
    return ContentCheck(files=len(listed), bytes=total)


def pack(root: Path, zip_path: Path, *, source_date_epoch: int | None = None) -> Path:
    """Deterministic zip of root: sorted entries, fixed timestamps, normalised modes, bundle.json first."""
    when = ZIP_EPOCH_DEFAULT
    if source_date_epoch is not None:
        t = dt.datetime.fromtimestamp(max(source_date_epoch, 315532800), dt.UTC)
        when = (t.year, t.month, t.day, t.hour, t.minute, t.second)
    names = sorted(_walk(root), key=lambda n: (n != MANIFEST, n))
    tmp = zip_path.with_name(zip_path.name + ".part")
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
            for name in names:
                info = zipfile.ZipInfo(name, date_time=when)
                info.create_system = 3
                executable = os.access(root / name, os.X_OK)
                info.external_attr = (0o100755 if executable else 0o100644) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                with open(root / name, "rb") as src, zf.open(info, "w") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, zip_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return zip_path


def unpack(zip_path: Path, dest: Path) -> tuple[dict[str, Any], ContentCheck]:
    """Safely extract a bundle zip into dest (new directory) and check it against its manifest, in one read
    of the zip (zipstream), or with archive.extract_zip for zips that cannot be streamed.
    On any failure dest is not left behind."""
    tmp = _tmp_beside(dest)
    try:
        try:
            members = zipstream.unpack_file(zip_path, tmp)
            hashes: dict[str, str] | None = {m.name: m.sha256 for m in members}
        except zipstream.NotStreamable:
            extract_zip(zip_path, tmp)
            hashes = None
        manifest, check = check_unpacked(tmp, hashes=hashes)
        os.replace(tmp, dest)
        return manifest, check
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_unpacked(root: Path, *, hashes: dict[str, str] | None) -> tuple[dict[str, Any], ContentCheck]:
    """The manifest of a freshly unpacked bundle, and its contents checked against it."""
    manifest = read_manifest(root)
    return manifest, check_contents(root, manifest, hashes=hashes)


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
