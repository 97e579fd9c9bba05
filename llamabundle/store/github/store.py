"""A GitHub Releases store (DESIGN §6): one release per cache key, tagged by the recipe's template
(`publish.tag`, e.g. `{name}-{key12}`; bundle.json records it). Lookups read releases (releases.py),
publishing follows the tag-first protocol (publish.py), and every call goes through one client (client.py)."""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import requests

from ... import net
from ...bundle import MANIFEST
from ...bundle import manifest as manifest_mod
from ...bundle.manifest import FileEntry, Manifest
from ...digest import sha256_file
from ...errors import StoreError, UsageError, VerifyError
from ...log import Log
from .. import codec, sums
from ..base import Entry, Published, Unpacked
from ..ranged import RangedStream, Retry, Window
from . import blobs
from .client import DEFAULT_API_URL, GitHubClient, sha256_bytes
from .publish import Extra, Publisher
from .releases import GitHubEntry, Releases, manifest_tag

_REPO_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
BAR = 8 << 20  # a blob this large downloads with a progress bar


class GitHubStore:
    blob_workers = 4  # frames read with Range requests at once (store.blobcache.workers)

    def __init__(self, repo: str, *, api_url: str | None = None, token: str | None = None, log: Log | None = None,
                 tags: Mapping[str, str] | None = None,
                 stale_after: float = 1800.0, poll_interval: float = 5.0, wait_timeout: float | None = None,
                 sleep: Callable[[float], None] = time.sleep, max_attempts: int = 5, refused_attempts: int = 2,
                 max_wait: float = 300.0, max_total: float = 900.0, backoff: float = 1.0, max_backoff: float = 30.0,
                 connect_timeout: float = 10.0, read_timeout: float = 60.0, upload_timeout: float = 600.0,
                 http: requests.Session | None = None, on_step: Callable[[str], None] | None = None,
                 max_asset: int = blobs.MAX_ASSET) -> None:
        if not _REPO_RE.match(repo):
            raise UsageError(f"store 'github:{repo}': '{repo}' is not OWNER/REPO", fix="e.g. github:ggml-org/bundles")
        self.repo = repo
        self.url = f"github:{repo}"
        self.api_url = (api_url or DEFAULT_API_URL).rstrip("/")
        self.token = token or None
        self.log = log or Log()
        self.tags = dict(tags or {})  # key -> tag, from the recipe when the command has one
        self.client = GitHubClient(repo, api_url=self.api_url, token=self.token, log=self.log,
                                   http=http or net.session(), sleep=sleep, max_attempts=max_attempts,
                                   refused_attempts=refused_attempts, max_wait=max_wait, max_total=max_total,
                                   backoff=backoff, max_backoff=max_backoff, timeout=(connect_timeout, read_timeout),
                                   upload_timeout=(connect_timeout, upload_timeout))
        self.releases = Releases(self.client)
        self.max_asset = max_asset
        self._indexes: dict[int, dict[str, blobs.Frame]] = {}
        # how long a loser waits in all before giving up (the holder's draft goes stale before that)
        self.publisher = Publisher(self.client, self.releases, stale_after=stale_after, poll_interval=poll_interval,
                                   wait_timeout=stale_after + 300.0 if wait_timeout is None else wait_timeout,
                                   on_step=on_step or (lambda _step: None))  # "tag", "draft", … (tests)

    def lookup(self, key: str) -> GitHubEntry | None:
        self._check_key(key)
        tag = self.tags.get(key)
        rel = self.releases.by_tag(tag) if tag else self.releases.by_key(key)
        if rel is None:
            return None
        return self.releases.entry(rel, key)

    def fetch(self, entry: Entry, dest: Path, *, sink: net.Sink | None = None) -> Path:
        asset_url = getattr(entry, "asset_url", None)
        if not asset_url:
            found = self.lookup(entry.key)
            if found is None:
                raise StoreError(f"bundle {entry.key[:12]} is no longer in {self.url}", fix="build it again")
            asset_url = found.asset_url
        out = Path(dest) / entry.zip_name
        try:
            net.download(asset_url, out, http=self.client.http, log=self.log, sha256=entry.zip_sha256,
                         size=entry.zip_size, headers=self.client.headers(octet=True, auth=False), token=self.token,
                         connect_timeout=self.client.timeout[0], read_timeout=self.client.timeout[1], sink=sink)
        except StoreError as e:
            raise self.client.redacted(e) from None
        except OSError as e:
            raise StoreError(f"cannot write {out}", why=self.client.redact(str(e)), fix="check the destination") from None
        return out

    def publish(self, zip_path: Path, manifest: Manifest) -> Published:
        key = manifest.key
        self._check_key(key)
        manifest_mod.check_consistent(manifest)  # never store a bundle under a key that is not its own
        zip_path = Path(zip_path)
        if not zip_path.name.endswith(".zip") or zip_path.name in (MANIFEST, sums.NAME):
            raise StoreError(f"cannot publish {zip_path.name}", why="a bundle is published as one .zip file",
                             fix="publish the bundle zip")
        tag = self.tags.get(key) or manifest_tag(key, manifest)
        existing = self.lookup(key)
        if existing is not None:
            return Published(entry=existing, created=False)
        zip_sha = sha256_file(zip_path)
        with tempfile.TemporaryDirectory(prefix=".blobs-", dir=zip_path.parent) as tmp:
            with self.log.step(f"compress the files of {zip_path.name} by content (zstd {codec.LEVEL}), a GitHub asset "
                               f"per part"):
                packed = blobs.pack(zip_path, manifest, Path(tmp), max_asset=self.max_asset)
            index = packed.index
            extra = [*(Extra(g.name, codec.MEDIA_TYPE, _reader(g.path), g.size, g.sha256)
                       for g in packed.groups),
                     Extra(blobs.INDEX, "application/json", lambda: index, len(index), sha256_bytes(index))]
            entry, created = self.publisher.publish(zip_path, zip_sha, manifest.text().encode("utf-8"), tag=tag,
                                                    key=key, lookup=self.lookup, extra=extra)
        return Published(entry=entry, created=created)

    # ------------------------------------------------------------------------------------ by content

    def _frames(self, entry: Entry) -> dict[str, blobs.Frame] | None:
        """The frames of the entry's files (its release's blobs.json), None for a release without them; read once."""
        assets: Mapping[str, Any] = getattr(entry, "blob_assets", {})
        index = assets.get(blobs.INDEX)
        if index is None:
            return None
        rid = getattr(entry, "release_id", 0)
        if rid not in self._indexes:
            where = f"{blobs.INDEX} of {entry.location.rsplit('/', 1)[0] or self.url}"
            raw = self.client.asset_bytes(index, where)
            sizes = {n: a.get("size") for n, a in assets.items() if n != blobs.INDEX}
            self._indexes[rid] = blobs.read_index(raw, entry.manifest, sizes, where=where)
        return self._indexes[rid]

    def has_blobs(self, entry: Entry) -> bool:
        """Whether the entry's release holds its files by content (blobs.json and its assets): one published before
        this store kept them, or whose index is unusable (said once), is read as its zip."""
        try:
            return self._frames(entry) is not None
        except StoreError as e:
            self.log.warn(f"{e.what} ({e.why}); its zip is downloaded instead")
            return False

    def fetch_blob(self, entry: Entry, file: FileEntry, dest: Path) -> Unpacked:
        """The file's frame, read with a Range request from the asset that holds it (resumed where it drops,
        checked against the frame's sha256 from the index) and decompressed into the new file dest."""
        frames = self._frames(entry)
        fr = frames.get(file.sha256) if frames else None
        if fr is None:
            raise StoreError(f"{entry.location} holds no blob of {file.path}", fix="publish the bundle again")
        asset = entry.blob_assets[fr.asset]  # type: ignore[attr-defined]  # _frames found them
        what = f"download {file.path} ({fr.length / 1e6:.1f} MB from {fr.asset})"

        def get(headers: dict[str, str]) -> requests.Response:
            return self.client.api("GET", asset["url"], headers={**self.client.headers(octet=True), **headers},
                                   follow=True, stream=True, ok=(200, 206), what=what)

        def mismatch(why: str) -> VerifyError:
            return VerifyError(f"the bytes of {file.path} in {fr.asset} are not its frame", why=why,
                               fix="publish the bundle again")

        c = self.client
        retry = Retry(tries=c.max_attempts, delay=c.delay, sleep=c.sleep, redact=c.redact,
                      note=lambda line: self.log.info(f"    github: {line}"))
        window = Window(start=fr.offset, size=fr.length, total=int(asset.get("size") or 0), sha256=fr.sha256)
        try:
            with contextlib.ExitStack() as stack:
                bar = stack.enter_context(self.log.progress(what, fr.length, unit="bytes")) if fr.length >= BAR else None
                stream = stack.enter_context(RangedStream(window, get, what=what, where=self.url, mismatch=mismatch,
                                                          retry=retry, progress=bar))
                return codec.unpack_new(stream, dest, limit=file.size, not_frame=lambda why: VerifyError(
                    f"the blob of {file.path} in {fr.asset} is not a zstd frame of the file", why=why,
                    fix="publish the bundle again"))
        except StoreError as e:
            raise c.redacted(e) from None

    def list_entries(self, *, per_page: int = 100, max_pages: int = 1000) -> list[GitHubEntry]:
        """Every published release that is a complete entry, one per key (the newest release of a key, as
        GitHub lists them newest first), sorted by key. The releases are listed `per_page` at a time until a
        page is short (or brings no release not seen before); a release without bundle.json or a single
        uploaded .zip is not an entry and is left out; one whose bundle.json is not a consistent manifest is
        refused as lookup refuses it."""
        c = self.client
        seen: set[int] = set()
        found: dict[str, GitHubEntry] = {}
        for page in range(1, max_pages + 1):
            r = c.api("GET", f"{c.repo_api}/releases?per_page={per_page}&page={page}", ok=(200,),
                      what="list releases")
            listed = c.json(r, "the release list")
            if not isinstance(listed, list):
                raise StoreError(f"GitHub answered something that is not a release list for {self.repo}",
                                 why=f"HTTP {r.status_code}: a JSON {type(listed).__name__}",
                                 fix="check GITHUB_API_URL (or LLAMABUNDLE_GITHUB_API_URL)")
            rels = [x for x in listed if isinstance(x, dict) and isinstance(x.get("id"), int)]
            new = [x for x in rels if x["id"] not in seen]
            seen.update(x["id"] for x in new)
            for rel in new:
                if rel.get("draft"):
                    continue
                entry = self.releases.entry(rel, None)
                if entry is not None and entry.key not in found:
                    found[entry.key] = entry
            if len(listed) < per_page or not new:
                return [found[k] for k in sorted(found)]
        raise StoreError(f"{self.repo} has more than {max_pages * per_page} releases", why="listing stopped there",
                         fix="delete old releases, or list them with the GitHub API yourself")

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise StoreError(f"'{key}' is not a cache key", fix="a key is 64 hex digits (llamabundle key RECIPE)")


def _reader(path: Path) -> Callable[[], IO[bytes]]:
    return lambda: open(path, "rb")  # noqa: SIM115 - the upload closes it
