"""A directory store: `<root>/<key>/` holds the zip, SHA256SUMS and bundle.json (written last), and
`<root>/blobs/sha256/<hex>.zst` each file of every bundle once, by the sha256 of its bytes, as a zstd frame
(store.codec; written before the entry appears).
Entries are assembled in an owned temporary directory (`.publish-<pid>-<start>-…`, scratch) and renamed
into place under a per-key file lock, so a reader never sees a partial entry and two publishers leave
exactly one. The first lookup or publish of a store object removes the leftovers of killed publishers.

A lookup trusts nothing unchecked: bundle.json is parsed into a typed manifest whose key must be the
sha256 of its inputs and the key asked for (manifest.check_consistent), and the zip must have the digest
SHA256SUMS records. SHA256SUMS is UTF-8 whatever the locale."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from .. import scratch, untrusted
from ..bundle import MANIFEST
from ..bundle.manifest import Expect, FileEntry, Manifest, check_consistent
from ..digest import file_state
from ..errors import StoreError, UsageError, VerifyError, disk_fix, in_whose
from . import codec
from . import sums as sums_grammar
from .base import Entry, Published, Unpacked, entry_manifest

if TYPE_CHECKING:
    from ..net import Sink

SUMS = sums_grammar.NAME
LOCK_TIMEOUT = 600
PUBLISH_PREFIX = ".publish-"
BLOBS = ("blobs", "sha256")
BLOB_PREFIX = ".blob-"
CHUNK = 1 << 20
_KEY_DIR = re.compile(r"[0-9a-f]{64}")


class LocalStore:
    blob_workers = 8  # blobs read from a disk: one core each (store.blobcache.workers)
    on_this_disk = True  # a hit may read both its blobs and its zip (pipeline._hit): nothing crosses a network

    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()
        self.url = str(self.root)
        self._swept = False
        self._check_root()

    def _check_root(self) -> None:
        """A store is a directory (created when missing): a regular file on the way is a usage error."""
        for p in (self.root, *self.root.parents):
            if p.exists():
                if not p.is_dir():
                    raise UsageError(f"store {self.root} is not a directory" + ("" if p == self.root else f": {p} is a file"),
                                     why="a local store is a directory of bundles (created when missing)",
                                     fix="pass a directory to --store (or LLAMABUNDLE_STORE), file://DIR or github:OWNER/REPO")
                return

    def _sweep(self) -> None:
        """Remove the staging directories of publishers that were killed (never a live one's); once per object."""
        if not self._swept:
            self._swept = True
            scratch.sweep(self.root, [PUBLISH_PREFIX])
            scratch.sweep(self.root.joinpath(*BLOBS), [BLOB_PREFIX])

    def _blob_path(self, sha256: str) -> Path:
        return self.root.joinpath(*BLOBS, sha256 + codec.SUFFIX)

    def has_blobs(self, entry: Entry) -> bool:
        """Whether every file of the entry is kept by content (a bundle published before the store kept files
        by content is not: its zip is downloaded)."""
        return all(_KEY_DIR.fullmatch(f.sha256) and self._blob_path(f.sha256).is_file() for f in entry.manifest.files)

    def fetch_blob(self, entry: Entry, file: FileEntry, dest: Path) -> Unpacked:
        """Decompress the file's blob into the new file dest (at most file.size + 1 bytes), hashing what is written."""
        src = self._blob_path(file.sha256)
        with _open_read(src, fix="check that the store still holds the bundle (llamabundle check)") as f, \
                _open_new(dest, dest) as out:
            try:
                return codec.unpack(f, out, limit=file.size)
            except codec.CodecError as e:
                raise VerifyError(f"{src} is not a blob of {file.path}", why=str(e), fix="publish the bundle again") from None
            except OSError as e:  # the store's file was opened: what fails now is writing the copy
                raise _write_error(dest, e) from None

    def _store_blobs(self, zip_path: Path, manifest: Manifest) -> None:
        """Each file of the bundle as a zstd blob named by its sha256, read from the zip and checked against the
        manifest as it is written; a blob already there is kept (blobs are written before the entry appears)."""
        blobs = self.root.joinpath(*BLOBS)
        blobs.mkdir(parents=True, exist_ok=True)
        try:
            z = zipfile.ZipFile(zip_path)
        except (OSError, zipfile.BadZipFile) as e:
            raise VerifyError(f"{zip_path} is not a readable zip", why=str(e)) from None
        with z:
            for f in manifest.files:
                final = self._blob_path(f.sha256)
                if final.is_file():
                    continue
                tmp = scratch.owned(blobs, BLOB_PREFIX, ".part")
                try:
                    try:
                        src = z.open(f.path)
                    except KeyError:
                        raise VerifyError(f"{zip_path.name}:{f.path} is listed in bundle.json but not in the zip") from None
                    with src, _open_new(tmp, final) as out:
                        try:
                            packed = codec.pack(codec.Bounded(src, f.size), out)
                            out.flush()
                            os.fsync(out.fileno())
                        except OSError as e:
                            raise _write_error(final, e) from None
                    if (packed.sha256, packed.size) != (f.sha256, f.size):
                        raise VerifyError(f"{zip_path.name}:{f.path} does not match its sha256 in bundle.json",
                                          why="the zip and its manifest disagree", fix="pack the bundle again")
                    os.replace(tmp, final)
                except BaseException:
                    _unlink(tmp)
                    raise

    def _entry_dir(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise StoreError(f"'{key}' is not a cache key", fix="a key is 64 hex digits (llamabundle key RECIPE)")
        return self.root / key

    def lookup(self, key: str) -> Entry | None:
        d = self._entry_dir(key)
        self._check_root()
        self._sweep()
        manifest_path = d / MANIFEST
        if not manifest_path.is_file():
            return None  # no manifest: nothing, or a partial entry that is not a hit
        damaged = f"remove {d} and publish the bundle again"
        try:
            raw = manifest_path.read_bytes()
            sums_raw = (d / SUMS).read_bytes()
        except OSError as e:
            raise StoreError(f"store entry {d} is damaged", why=f"{e.strerror or e}: {e.filename or d}", fix=damaged) from None
        m = entry_manifest(raw, key=key, entry=str(d), where=str(manifest_path), fix=damaged)
        sums = _parse_sums(sums_raw, d / SUMS, fix=damaged)
        zips = [n for n in sums if n.endswith(".zip")]
        if len(zips) != 1:
            raise StoreError(f"store entry {d} is inconsistent", why=f"{SUMS} lists {len(zips)} zips, not one", fix=damaged)
        zip_name = zips[0]
        zip_path = d / zip_name
        if not zip_path.is_file():
            return None
        try:
            digest, size = _verified_digest(zip_path, sums[zip_name]), zip_path.stat().st_size
        except OSError as e:
            raise StoreError(f"cannot read {zip_path}", why=e.strerror or str(e), fix="check the store's permissions") from None
        if digest != sums[zip_name]:
            raise VerifyError(f"{zip_path} does not match its SHA256SUMS", why="the stored zip was changed or damaged",
                              fix=damaged)
        return Entry(key=key, zip_name=zip_name, zip_sha256=digest, zip_size=size, manifest=m, location=str(zip_path))

    def list_entries(self) -> list[Entry]:
        """Every complete entry, sorted by key: each `<key>/` directory looked up as lookup(key) does (a partial
        one is left out, a damaged one raises). A store directory that does not exist is an error here: listing
        it is asking what it holds, and a mistyped path must not read as an empty store."""
        self._check_root()
        if not self.root.is_dir():
            raise StoreError(f"store {self.root} does not exist", why="a local store is a directory (publish creates it)",
                             fix="check --store; an empty store is an empty directory")
        self._sweep()
        try:
            names = sorted(os.listdir(self.root))
        except OSError as e:
            raise StoreError(f"cannot list the store {self.root}", why=e.strerror or str(e),
                             fix="check the store's permissions") from None
        found = (self.lookup(n) for n in names if _KEY_DIR.fullmatch(n) and (self.root / n).is_dir())
        return [e for e in found if e is not None]

    def fetch(self, entry: Entry, dest: Path, *, sink: Sink | None = None) -> Path:
        """Copy the zip into dest under a name of this process's own, check it, and rename it into place: any
        number of processes may fetch the same entry into the same dest at once."""
        src = self._entry_dir(entry.key) / entry.zip_name
        out = dest / entry.zip_name
        try:
            dest.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _write_error(dest, e, what=f"cannot create {dest}") from None
        scratch.sweep(dest, [f".{entry.zip_name}."])
        tmp = scratch.owned(dest, f".{entry.zip_name}.", ".part")
        try:
            if sink is not None:
                sink.reset()
            vouched = _stamped(src, entry.zip_sha256)  # this file state was read and found right: not hashed again
            with _open_read(src, fix="check that the store entry still exists (llamabundle check)") as f:
                digest = _copy(f, src, tmp, out, sink=sink, hashing=vouched is None)
                if vouched is not None:  # unchanged while it was copied (its ctime too): the bytes it was found with
                    same = file_state(os.fstat(f.fileno())) == vouched
                    digest = entry.zip_sha256 if same else _digest(tmp)
            if digest != entry.zip_sha256:
                raise VerifyError(f"{src} does not match its sha256 in the store", why="it changed or was damaged "
                                  "after it was published", fix="publish the bundle again")
            try:
                os.replace(tmp, out)
            except OSError as e:
                raise _write_error(out, e) from None
        except BaseException:
            _unlink(tmp)
            raise
        return out

    def publish(self, zip_path: Path, manifest: Manifest) -> Published:
        """Store the zip under manifest.key; an existing complete entry is kept (created=False)."""
        key = manifest.key
        final = self._entry_dir(key)
        check_consistent(manifest, Expect(key=key))
        self._check_root()
        existing = self.lookup(key)  # entries appear in one rename: a hit needs no lock (nor a writable store)
        if existing is not None:
            return Published(entry=existing, created=False)
        from filelock import FileLock, Timeout  # here: reading the store (a hit) does not load it

        locks = self.root / ".locks"
        at = locks
        try:
            locks.mkdir(parents=True, exist_ok=True)
            at = locks / f"{key}.lock"
            with FileLock(str(at), timeout=LOCK_TIMEOUT):
                existing = self.lookup(key)
                if existing is not None:
                    return Published(entry=existing, created=False)
                at = self.root
                stage_dir = scratch.make_dir(self.root, PUBLISH_PREFIX)
                try:
                    stage = at = stage_dir / key
                    stage.mkdir()
                    name = zip_path.name
                    try:
                        sums_name = os.fsencode(name).decode("utf-8")
                    except UnicodeDecodeError:
                        raise UsageError(f"the zip's name {name!r} is not UTF-8", why=f"{SUMS} is UTF-8 text",
                                         fix="rename the zip") from None
                    with _open_read(zip_path, fix="check the path") as f:
                        at = stage / name
                        digest = _copy(f, zip_path, stage / name, final / name, durable=True)
                    at = self.root
                    self._store_blobs(stage / name, manifest)  # before the entry appears: a seen entry has all of them
                    at = stage / SUMS
                    _write_text(stage / SUMS, sums_grammar.line(digest, sums_name))
                    at = stage / MANIFEST
                    _write_text(stage / MANIFEST, manifest.text())  # last: the entry is complete once this is in
                    at = final
                    shutil.rmtree(final, ignore_errors=True)  # leftovers of a crashed publish (no manifest)
                    os.replace(stage, final)
                finally:
                    shutil.rmtree(stage_dir, ignore_errors=True)
        except Timeout:
            raise StoreError(f"another process holds the lock on {key[:12]} in {self.root}",
                             why=f"waited {LOCK_TIMEOUT}s", fix="wait for the other build to finish, then retry") from None
        except OSError as e:
            raise _write_error(Path(e.filename) if e.filename else at, e, what=f"cannot publish {key[:12]} to the store {self.root}") from None
        entry = self.lookup(key)
        if entry is None:
            raise StoreError(f"the entry {final} vanished right after it was published",
                             why="another process removed it", fix="publish again")
        return Published(entry=entry, created=True)


class _Reader(Protocol):
    def read(self, n: int, /) -> bytes: ...


def _parse_sums(raw: bytes, path: Path, *, fix: str) -> dict[str, str]:
    """name -> sha256 of a SHA256SUMS file (UTF-8, `<sha256>  <name>` lines); names as the filesystem spells them."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StoreError(f"store entry {path.parent} is damaged", why=f"{path} is not UTF-8 text ({e.reason})", fix=fix) from None
    sums: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        read = sums_grammar.read_line(line)
        if read is None:
            raise StoreError(f"store entry {path.parent} is damaged", why=f"{path}:{n} is not '<sha256>  <file name>'", fix=fix)
        sums[os.fsdecode(read[1].encode("utf-8"))] = read[0]
    return sums


STAMPS = ".verified"  # <store>/.verified/<key>.json: the zip's file state when its sha256 was last found right


def _stamp(path: Path) -> Path:
    return path.parent.parent / STAMPS / f"{path.parent.name}.json"


def _stamped(path: Path, listed: str) -> list[int] | None:
    """The zip's file state when the entry's stamp says that this very state was found to have the sha256
    SHA256SUMS lists (None: no stamp, or one of another state or digest)."""
    stamp = _stamp(path)
    try:
        st = path.stat()
        said = untrusted.loads(stamp.read_bytes(), max_bytes=4096)
        if isinstance(said, dict) and said.get("state") == file_state(st) and said.get("sha256") == listed:
            return file_state(st)
    except (OSError, ValueError):
        pass
    return None


def _verified_digest(path: Path, listed: str) -> str:
    """The zip's sha256: read from the file, unless the entry's stamp says that this very file state was found to
    have the sha256 SHA256SUMS lists (a lookup of a large bundle then reads no zip: `check` of the CUDA bundle
    hashed 480 MB each time). The stamp is written after a full read that matched, where the store can be
    written (a read-only share reads the zip every time); a stamp that does not match the file is ignored."""
    if _stamped(path, listed) is not None:
        return listed
    stamp, st = _stamp(path), path.stat()
    digest = _digest(path)
    if digest == listed and file_state(path.stat()) == file_state(st):  # unchanged while it was read
        with contextlib.suppress(OSError):  # a store that cannot be written reads the zip every time
            stamp.parent.mkdir(exist_ok=True)
            scratch.replace_text(stamp, json.dumps({"sha256": digest, "state": file_state(st)}) + "\n",
                                 prefix=f".{stamp.name}.")
    return digest


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _copy(src: _Reader, src_path: Path, tmp: Path, final: Path, *, sink: Sink | None = None,
          durable: bool = False, hashing: bool = True) -> str:
    """Copy src into the new file tmp in one pass (hashing it, feeding sink); returns the sha256 ("" when not
    `hashing`: with no sink either, the kernel copies it, the bytes never read here). A failure to read is about
    src, a failure to write about final (the path the user knows); the sink's own errors pass. `durable`: on disk
    (fsync) before this returns."""
    h, done = hashlib.sha256(), False
    w = _open_new(tmp, final)
    try:
        copied = not hashing and sink is None and hasattr(src, "fileno") and _kernel_copy(src, w, final)
        if not copied:
            _copy_chunks(src, w, src_path, final, h if hashing else None, sink)
        try:
            w.flush()
            if durable:
                os.fsync(w.fileno())
        except OSError as e:
            raise _write_error(final, e) from None
        done = True
    finally:
        try:
            w.close()
        except OSError as e:  # a write that failed only when flushed on close
            if done:
                raise _write_error(final, e) from None
    return h.hexdigest() if hashing else ""


def _kernel_copy(src: Any, w: BinaryIO, final: Path) -> bool:
    """src copied into w by the kernel (sendfile), from where src stands; False where sendfile cannot (another
    platform, a file system without it) and nothing was copied."""
    if not hasattr(os, "sendfile"):
        return False
    fin, fout, offset = src.fileno(), w.fileno(), 0
    while True:
        try:
            n = os.sendfile(fout, fin, offset, CHUNK * 8)
        except OSError as e:
            if offset == 0 and e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                return False
            raise _write_error(final, e) from None
        if n == 0:
            return True
        offset += n


def _copy_chunks(src: _Reader, w: BinaryIO, src_path: Path, final: Path, h: Any, sink: Sink | None) -> None:
    while True:
        try:
            chunk = src.read(CHUNK)
        except OSError as e:
            raise StoreError(f"cannot read {src_path}", why=e.strerror or str(e), fix="check the file and retry") from None
        if not chunk:
            break
        try:
            w.write(chunk)
        except OSError as e:
            raise _write_error(final, e) from None
        if h is not None:
            h.update(chunk)
        if sink is not None:
            sink.update(chunk)


def _open_read(path: Path, *, fix: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as e:
        raise StoreError(f"cannot read {path}", why=e.strerror or str(e), fix=fix) from None


def _open_new(path: Path, final: Path) -> BinaryIO:
    try:
        return open(path, "xb")
    except OSError as e:
        raise _write_error(final, e) from None


def _write_text(path: Path, text: str) -> None:
    with open(path, "x", encoding="utf-8", newline="\n") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_error(path: Path, e: OSError, *, what: str = "") -> StoreError:
    return StoreError((what or f"cannot write {path}") + in_whose(path),
                      why=f"{e.strerror or e} ({path})" if what else (e.strerror or str(e)), fix=disk_fix(e))


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
