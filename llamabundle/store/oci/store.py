"""The OCI registry store (DESIGN §6): a bundle is one image manifest (image.py) tagged `k-<key>` (and the
recipe's release tag), pushed blobs first, config next, manifest last; lookup reads the key tag once and pins
the manifest's digest, and everything after (fetch_blob, fetch) pulls by that digest, so a tag moved meanwhile
cannot mix two bundles. Installs download only the layers their blob cache lacks; `fetch` rebuilds the zip from
the layers with the bundle's own pack and checks it against the published zip's sha256."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from ... import net, scratch
from ...bundle import MANIFEST, ZIP_EPOCH_DEFAULT, bundle_time, pack
from ...bundle.manifest import MAX_MANIFEST_BYTES, Expect, FileEntry, Manifest, check_consistent
from ...digest import sha256_file
from ...errors import StoreError, UsageError, VerifyError, disk_fix
from ...log import Log, ProgressHandle
from .. import codec
from ..base import Entry, Published, Unpacked, entry_manifest
from . import image
from .client import DIGEST_RE, REPO_RE, TAG_RE, RegistryClient, RegistryError, parse_url

BIG = 1 << 20  # a blob at least this large gets a line of its own in the log
BAR = 32 << 20  # and from this size a progress bar
FETCH_PREFIX = ".oci-fetch-"
PUBLISH_PREFIX = "llamabundle-oci-publish-"
_KEY_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, kw_only=True)
class OciEntry(Entry):
    digest: str  # of the OCI manifest the lookup read: every later pull names it, never the tag


class BlobMismatch(VerifyError):
    """A layer whose bytes are not the ones its digest names: the store's copy changed or was damaged (exit 5;
    an install refuses the bundle, bundle_invalid, and installs nothing)."""


class OciStore:
    def __init__(self, url: str, *, user: str | None = None, password: str | None = None, insecure: bool = False,
                 log: Log | None = None, tags: Mapping[str, str] | None = None, mount_from: Sequence[str] = (),
                 connect_timeout: float = 10.0, read_timeout: float = 60.0, upload_timeout: float = 600.0,
                 max_attempts: int = 5, backoff: float = 0.5, sleep: Callable[[float], None] = time.sleep,
                 http: requests.Session | None = None) -> None:
        self.ref = parse_url(url, insecure=insecure)
        self.url = self.ref.url
        self.log = log or Log()
        self.tags = dict(tags or {})  # key -> release tag, from the recipe when the command has one
        bad = [m for m in mount_from if not REPO_RE.fullmatch(m)]
        if bad:
            raise UsageError(f"{bad[0]!r} is not a repository name to mount blobs from", why="a repository name is "
                             "lower-case path components of letters, digits and . _ -", fix="correct LLAMABUNDLE_REGISTRY_MOUNT_FROM")
        self.mount_from = [m for m in mount_from if m != self.ref.repo]  # repositories of the registry to mount from
        self.client = RegistryClient(self.ref, user=user, password=password, log=self.log, http=http or net.session(),
                                     timeout=(connect_timeout, read_timeout),
                                     upload_timeout=(connect_timeout, upload_timeout), max_attempts=max_attempts,
                                     backoff=backoff, sleep=sleep)
        self._images: dict[str, image.Image] = {}  # manifest digest -> the manifest, as lookup read and checked it
        self._configs: dict[str, bytes] = {}  # manifest digest -> its config (bundle.json) bytes

    # -------------------------------------------------------------------------------------- lookup

    def lookup(self, key: str) -> OciEntry | None:
        """The entry the key tag names, pinned by digest: the manifest, then its config by digest, each checked
        against its digest; bundle.json parsed and checked against the key as a directory store checks it."""
        self._check_key(key)
        tag = image.key_tag(key)
        got = self.client.get_manifest(tag, accept=image.MANIFEST_TYPE, max_bytes=image.MAX_MANIFEST,
                                       what=f"look up {key[:12]} (tag {tag})")
        if got is None:
            return None
        raw, digest = got
        return self._entry(raw, digest, key)

    def _damaged_fix(self, key: str) -> str:
        return (f"publish the bundle again (it replaces the tag {image.key_tag(key)} in {self.url}), or delete that "
                "tag")

    def _entry(self, raw: bytes, digest: str, key: str) -> OciEntry:
        fix = self._damaged_fix(key)
        where = self.ref.location(digest)
        img = image.parse(raw, digest=digest, where=f"the manifest of {key[:12]} ({where})", fix=fix)
        if img.key != key:
            raise image.ImageError(f"the tag {image.key_tag(key)} in {self.url} names a manifest of another key",
                                   why=f"its {image.KEY} is {img.key}", fix=fix)
        config = self._config(img, key=key, fix=fix)
        m = entry_manifest(config, key=key, entry=where, where=f"the bundle.json of {where}", fix=fix)
        gap = img.covers(m)
        if gap is None and img.name != m.name:
            gap = f"its {image.NAME} is {img.name!r}, bundle.json's name {m.name!r}"
        if gap is not None:
            raise image.ImageError(f"the manifest {where} does not match its bundle.json", why=gap, fix=fix)
        self._images[digest], self._configs[digest] = img, config
        return OciEntry(key=key, zip_name=img.zip_name, zip_sha256=img.zip_sha256, zip_size=img.zip_size, manifest=m,
                        location=where, digest=digest)

    def _config(self, img: image.Image, *, key: str, fix: str) -> bytes:
        config = self.client.get_small_blob(img.config_digest, img.config_size, max_bytes=MAX_MANIFEST_BYTES,
                                            what=f"download the bundle.json of {key[:12]}")
        got = image.sha256_digest(config)
        if got != img.config_digest or len(config) != img.config_size:
            raise VerifyError(f"the bundle.json of {self.ref.location(img.digest)} does not match its digest",
                              why=f"the registry served {got} ({len(config)} bytes) for {img.config_digest} "
                                  f"({img.config_size} bytes)", fix=fix)
        return config

    def list_entries(self) -> list[OciEntry]:
        """Every `k-<key>` tag of the repository looked up as lookup(key) does, sorted by key (a damaged one
        raises, as its lookup does). A repository the registry does not know is an error, not an empty store."""
        names = self.client.tags(what="list the tags")
        keys = sorted({k for k in map(image.key_of_tag, names) if k is not None})
        found = (self.lookup(k) for k in keys)
        return [e for e in found if e is not None]

    # -------------------------------------------------------------------------------------- blobs

    def _image(self, entry: Entry) -> image.Image | None:
        """The manifest of an entry of this store, by the digest its lookup pinned (read again by digest when
        this store object did not look it up); None for an entry of another store."""
        digest = getattr(entry, "digest", None)
        if digest is None and entry.location.startswith(self.url + "@"):
            digest = entry.location.rpartition("@")[2]
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
            return None
        img = self._images.get(digest)
        if img is not None:
            return img
        fix = self._damaged_fix(entry.key)
        got = self.client.get_manifest(digest, accept=image.MANIFEST_TYPE, max_bytes=image.MAX_MANIFEST,
                                       what=f"read the manifest {digest[:19]} of {entry.key[:12]}")
        if got is None:
            raise StoreError(f"{self.ref.location(digest)} is no longer in {self.url}", why="its manifest was deleted",
                             fix="look the bundle up again")
        raw, served = got
        if served != digest:
            raise VerifyError(f"{self.ref.location(digest)} does not match its digest", why=f"its bytes have {served}",
                              fix=fix)
        img = image.parse(raw, digest=digest, where=f"the manifest {self.ref.location(digest)}", fix=fix)
        config = entry.manifest.text().encode("utf-8")
        gap = img.covers(entry.manifest)
        if img.key != entry.key or image.sha256_digest(config) != img.config_digest or gap is not None:
            raise image.ImageError(f"the manifest {self.ref.location(digest)} is not that of the entry's bundle.json",
                                   why=gap or "its key or config differs", fix=fix)
        self._images[digest], self._configs[digest] = img, config
        return img

    def _image_of(self, entry: Entry) -> image.Image:
        img = self._image(entry)
        if img is None:
            raise StoreError(f"the entry {entry.location} is not one of {self.url}", why="it names no manifest digest "
                             "of this registry", fix="look the bundle up in this store")
        return img

    def has_blobs(self, entry: Entry) -> bool:
        """Whether every file of the entry has a layer (true of every entry this store's lookup gives)."""
        try:
            img = self._image(entry)
        except StoreError:
            return False
        return img is not None and all(img.layer_for(f) is not None for f in entry.manifest.files)

    def fetch_blob(self, entry: Entry, file: FileEntry, dest: Path) -> Unpacked:
        """The file's layer, pulled by digest (following the registry's redirect to its storage, without the
        credentials), hashed as it streams and decompressed into the new file dest (at most file.size + 1
        bytes). Bytes that are not the layer's digest are a BlobMismatch naming the file."""
        img = self._image_of(entry)
        layer = img.layer_for(file)
        if layer is None:
            raise StoreError(f"{entry.location} holds no layer for {file.path}", fix=self._damaged_fix(entry.key))
        what = f"download {file.path} ({layer.digest[7:19]})"

        def mismatch(why: str) -> BlobMismatch:
            return BlobMismatch(f"the layer {layer.digest[:19]}… of {file.path} does not match its digest",
                                why=f"{why}: the registry's copy changed or was damaged",
                                fix=f"publish the bundle again (its blobs are pushed anew); nothing was installed from "
                                    f"{self.ref.location(img.digest)}")

        with self._progress(what, layer.size) as bar, \
                self.client.blob(layer.digest, layer.size, what=what, mismatch=mismatch, progress=bar) as stream:
            got = codec.unpack_new(stream, dest, limit=file.size, not_frame=lambda why: VerifyError(
                f"the layer {layer.digest[:19]}… of {file.path} is not a zstd frame of the file", why=why,
                fix=self._damaged_fix(entry.key)))
        if layer.size >= BIG:
            self.log.info(f"    oci: downloaded {file.path} ({got.packed_size / 1e6:.1f} MB)")
        return got

    @contextlib.contextmanager
    def _progress(self, what: str, size: int) -> Iterator[ProgressHandle | None]:
        if size < BAR:
            yield None
            return
        with self.log.progress(what, size, unit="bytes") as bar:
            yield bar

    # -------------------------------------------------------------------------------------- the zip

    def fetch(self, entry: Entry, dest: Path, *, sink: net.Sink | None = None) -> Path:
        """The published zip, rebuilt: every layer pulled by digest and checked against bundle.json as it
        streams into a stage, packed as the pipeline packs a bundle (every entry dated built_at), and the result
        checked against the published zip's sha256 before it is renamed into dest."""
        img = self._image_of(entry)
        m = entry.manifest
        out = Path(dest) / entry.zip_name
        try:
            Path(dest).mkdir(parents=True, exist_ok=True)
            scratch.sweep(Path(dest), [FETCH_PREFIX])
            work = scratch.make_dir(Path(dest), FETCH_PREFIX)
        except OSError as e:
            raise StoreError(f"cannot write {dest}", why=e.strerror or str(e), fix=disk_fix(e)) from None
        try:
            stage = work / "bundle"
            for layer in img.layers:
                paths = list(layer.paths)
                first = _inside(stage, paths[0])
                f = m.file(paths[0])
                assert f is not None  # img.covers(m): every layer path is a file of the manifest
                got = self.fetch_blob(entry, f, first)
                if (got.sha256, got.size) != (f.sha256, f.size):
                    raise VerifyError(f"{f.path} ({f.sha256[:12]}) from {self.url} does not match its sha256 in "
                                      "bundle.json", why="the registry's copy changed or was damaged",
                                      fix=self._damaged_fix(entry.key))
                for p in paths[1:]:
                    shutil.copyfile(first, _inside(stage, p))
                for p, mode in layer.paths.items():
                    os.chmod(_inside(stage, p), 0o755 if mode == "0755" else 0o644)
            (stage / MANIFEST).write_bytes(self._configs.get(img.digest) or m.text().encode("utf-8"))
            built = pack(stage, work / entry.zip_name, source_date_epoch=zip_epoch(m.built_at))
            sha, size = sha256_file(built), built.stat().st_size
            if (sha, size) != (entry.zip_sha256, entry.zip_size):
                raise VerifyError(f"the zip rebuilt from {entry.location} differs from the published {entry.zip_name}",
                                  why=f"it has sha256 {sha} ({size} bytes), the published one {entry.zip_sha256} "
                                      f"({entry.zip_size} bytes); every file matched bundle.json, so the difference is in "
                                      "how the zip was packed: deflate output differs between zlib versions (and a zip "
                                      "not packed by llamabundle's pack differs anyway)",
                                  fix="install it (an install needs no zip), or keep the zip itself in a directory or "
                                      "github: store")
            if sink is not None:
                sink.reset()
                with open(built, "rb") as z:
                    while chunk := z.read(codec.CHUNK):
                        sink.update(chunk)
            os.replace(built, out)
        except OSError as e:
            raise StoreError(f"cannot rebuild {entry.zip_name} in {dest}", why=f"{e.strerror or e}"
                             + (f" ({e.filename})" if e.filename else ""), fix=disk_fix(e)) from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return out

    # -------------------------------------------------------------------------------------- publish

    def publish(self, zip_path: Path, manifest: Manifest) -> Published:
        """Push the bundle: every file's zstd blob (checked against bundle.json first: a disagreement pushes
        nothing), then the config, then the manifest under the release tag and last under the key tag. A key
        tag already naming a complete entry is kept (created=False); a damaged one is replaced."""
        key = manifest.key
        self._check_key(key)
        check_consistent(manifest, Expect(key=key))
        zip_path = Path(zip_path)
        if not zip_path.name.endswith(".zip") or zip_path.name.startswith("."):
            raise StoreError(f"cannot publish {zip_path.name}", why="a bundle is published as one .zip file",
                             fix="publish the bundle zip")
        release = self._release_tag(key, manifest)
        try:
            existing = self.lookup(key)
        except VerifyError as e:
            self.log.warn(f"replacing the damaged entry of {key[:12]} in {self.url}: {e.what}")
            existing = None
        if existing is not None:
            if release is not None:
                self._ensure_tag(release, existing.digest, key)
            return Published(entry=existing, created=False)
        tmp = self._scratch()
        try:
            layers, blobs, config = self._prepare(zip_path, manifest, tmp)  # nothing is pushed before this
            raw = image.build(manifest, config, layers, zip_name=zip_path.name, zip_sha256=sha256_file(zip_path),
                              zip_size=zip_path.stat().st_size)
            digest = image.sha256_digest(raw)
            pushes: list[tuple[str, int, Path | bytes, str]] = [
                (la.digest, la.size, blobs[la.digest], next(iter(la.paths))) for la in layers]
            pushes.append((image.sha256_digest(config), len(config), config, MANIFEST))
            for d, size, body, title in pushes:
                self._push(d, size, body, title=title)
            for tag in ([release] if release else []) + [image.key_tag(key)]:  # the key tag last: it makes the entry
                self._put_manifest(tag, raw, digest, key=key, pushes=pushes)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.log.info(f"    oci: pushed {self.ref.location(digest)} as {image.key_tag(key)}"
                      + (f" and {release}" if release else ""))
        return Published(entry=self._read_back(key), created=True)

    def _put_manifest(self, tag: str, raw: bytes, digest: str, *, key: str,
                      pushes: Sequence[tuple[str, int, Path | bytes, str]]) -> None:
        """PUT the manifest; a registry that does not see one of its blobs yet (MANIFEST_BLOB_UNKNOWN: another
        publisher was committing the same blob, or the storage is eventually consistent) is given the blobs
        again (HEAD, then an upload of what is missing) and asked again, a few times."""
        attempt = 0
        while True:
            attempt += 1
            try:
                self.client.put_manifest(tag, raw, media_type=image.MANIFEST_TYPE, digest=digest,
                                         what=f"tag {key[:12]} as {tag}")
                return
            except RegistryError as e:
                unseen = e.status == 400 and bool(set(e.codes) & {"MANIFEST_BLOB_UNKNOWN", "BLOB_UNKNOWN", "DIGEST_INVALID"})
                if not unseen or attempt >= self.client.max_attempts:
                    raise
                delay = self.client.delay(attempt)
                self.log.info(f"    oci: tag {tag}: {e.why}; checking the blobs and retrying in {delay:.1f}s")
                self.client.sleep(delay)
                for d, size, body, title in pushes:
                    self._push(d, size, body, title=title)

    def _read_back(self, key: str) -> OciEntry:
        """The entry just pushed, looked up as any reader would (a registry that lags is asked again)."""
        for attempt in range(1, self.client.max_attempts + 1):
            try:
                entry = self.lookup(key)
            except RegistryError as e:
                if not (e.status == 404 and attempt < self.client.max_attempts):
                    raise
                entry = None
            if entry is not None:
                return entry
            self.client.sleep(self.client.delay(attempt))
        raise StoreError(f"the tag {image.key_tag(key)} vanished from {self.url} right after it was pushed",
                         why="another client deleted it", fix="publish again")

    def _scratch(self) -> Path:
        """A directory of this process's own for the compressed blobs (in the system's temporary directory);
        those of publishers that were killed are removed first."""
        where = Path(tempfile.gettempdir())
        try:
            scratch.sweep(where, [PUBLISH_PREFIX])
            return scratch.make_dir(where, PUBLISH_PREFIX)
        except OSError as e:
            raise StoreError(f"cannot make a directory in {where}", why=e.strerror or str(e), fix=disk_fix(e)) from None

    def _release_tag(self, key: str, manifest: Manifest) -> str | None:
        tag = self.tags.get(key) or manifest.publish_tag
        if not tag:
            return None
        if not TAG_RE.fullmatch(tag) or (image.key_of_tag(tag) not in (None, key)):
            self.log.warn(f"the release tag {tag!r} is not a tag an OCI registry takes (or looks like another key's): "
                          f"{key[:12]} is tagged {image.key_tag(key)} only")
            return None
        return tag

    def _ensure_tag(self, tag: str, digest: str, key: str) -> None:
        """Point the release tag at the entry when it names nothing yet (an existing tag is left as it is)."""
        if self.client.get_manifest(tag, accept=image.MANIFEST_TYPE, max_bytes=image.MAX_MANIFEST,
                                    what=f"look up the tag {tag}") is None:
            self.client.put_manifest(tag, self._images[digest].raw, media_type=image.MANIFEST_TYPE, digest=digest,
                                     what=f"tag {key[:12]} as {tag}")

    def _prepare(self, zip_path: Path, manifest: Manifest, tmp: Path) -> tuple[list[image.Layer], dict[str, Path], bytes]:
        """Each unique file content of the zip as a zstd blob in tmp, its raw bytes checked against bundle.json
        as they are read (other paths of the same content are hashed too); the layers, their blob files and
        the config (bundle.json as the tool writes it)."""
        try:
            z = zipfile.ZipFile(zip_path)
        except (OSError, zipfile.BadZipFile) as e:
            raise VerifyError(f"{zip_path} is not a readable zip", why=str(e)) from None
        config = manifest.text().encode("utf-8")
        groups: dict[str, list[FileEntry]] = {}
        for f in manifest.files:
            groups.setdefault(f.sha256, []).append(f)
        layers: list[image.Layer] = []
        blobs: dict[str, Path] = {}
        with z:
            infos = {i.filename: i for i in z.infolist()}
            for n, (sha, files) in enumerate(groups.items()):
                for f in files:
                    if f.path not in infos:
                        raise VerifyError(f"{zip_path.name}:{f.path} is listed in bundle.json but not in the zip")
                blob = tmp / f"{n}{codec.SUFFIX}"
                try:
                    with z.open(files[0].path) as src, open(blob, "xb") as out:
                        packed = codec.pack(codec.Bounded(src, files[0].size), out)
                    extra = [(f, _hash_member(z, f)) for f in files[1:]]
                except OSError as e:
                    raise StoreError(f"cannot compress {zip_path.name}:{files[0].path} into {tmp}",
                                     why=e.strerror or str(e), fix=disk_fix(e)) from None
                except (zipfile.BadZipFile, EOFError) as e:
                    raise VerifyError(f"cannot read {zip_path.name}:{files[0].path}", why=str(e)) from None
                for f, got in [(files[0], (packed.sha256, packed.size)), *extra]:
                    if got != (f.sha256, f.size):
                        raise VerifyError(f"{zip_path.name}:{f.path} does not match its sha256 in bundle.json",
                                          why="the zip and its manifest disagree", fix="pack the bundle again")
                digest = "sha256:" + sha256_file(blob)
                blobs[digest] = blob
                layers.append(image.Layer(digest=digest, size=packed.packed_size, sha256=sha, raw_size=files[0].size,
                                          paths={f.path: _mode(infos[f.path]) for f in files}))
            gap = _pack_gap(z, manifest, config)
        if gap is not None:
            self.log.warn(f"{zip_path.name} is not packed as llamabundle packs a bundle ({gap}): `fetch` from {self.url} "
                          "will not rebuild it byte for byte (installs are not affected)")
        return layers, blobs, config

    def _push(self, digest: str, size: int, body: Path | bytes, *, title: str) -> None:
        what = f"push {title} ({digest[7:19]})"
        with self._progress(what, size) as bar:
            done = self.client.push_blob(digest, size, (lambda: open(body, "rb")) if isinstance(body, Path) else body,
                                         what=what, mount_from=self.mount_from,
                                         progress=(lambda n: bar.update(n, size)) if bar is not None else None)
        if size >= BIG:
            said = {"present": "already in the registry", "mounted": "mounted from another repository",
                    "uploaded": "uploaded"}[done]
            self.log.info(f"    oci: {title} ({size / 1e6:.1f} MB): {said}")

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise StoreError(f"'{key}' is not a cache key", fix="a key is 64 hex digits (llamabundle key RECIPE)")


# ------------------------------------------------------------------------------------------ helpers


def zip_epoch(built_at: str | None) -> int | None:
    """The Unix time of bundle.json's built_at (what the pipeline dated every zip entry by); None without one."""
    if not built_at:
        return None
    try:
        when = dt.datetime.fromisoformat(built_at)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp())


def _zip_when(built_at: str | None) -> tuple[int, int, int, int, int, int]:
    epoch = zip_epoch(built_at)
    if epoch is None:
        return ZIP_EPOCH_DEFAULT
    t = dt.datetime.fromtimestamp(bundle_time(epoch), dt.UTC)
    return (t.year, t.month, t.day, t.hour, t.minute, t.second)


def _pack_gap(z: zipfile.ZipFile, manifest: Manifest, config: bytes) -> str | None:
    """How the zip differs from what bundle.pack makes of its files (None: it does not, as far as its directory
    and bundle.json tell; the deflate streams themselves are not compared)."""
    infos = z.infolist()
    want = [MANIFEST, *sorted(f.path for f in manifest.files)]
    if [i.filename for i in infos] != want:
        return "its members are not bundle.json and then the files, sorted"
    when = _zip_when(manifest.built_at)
    for i in infos:
        if i.date_time != when:
            return f"{i.filename} is dated {i.date_time}, not by bundle.json's built_at"
        if i.compress_type != zipfile.ZIP_DEFLATED or (i.external_attr >> 16) not in (0o100755, 0o100644):
            return f"{i.filename} is not deflated with a normalised mode"
    if z.read(MANIFEST) != config:
        return "its bundle.json is not written as llamabundle writes it"
    return None


def _mode(info: zipfile.ZipInfo) -> str:
    return "0755" if (info.external_attr >> 16) & 0o111 else "0644"


def _hash_member(z: zipfile.ZipFile, f: FileEntry) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with z.open(f.path) as src:
        reader = codec.Bounded(src, f.size)
        while chunk := reader.read(codec.CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def _inside(stage: Path, path: str) -> Path:
    target = stage.joinpath(*path.split("/"))
    target.parent.mkdir(parents=True, exist_ok=True)
    return target
