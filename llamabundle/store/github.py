"""A GitHub Releases store (DESIGN §6): one release per cache key, tagged by the recipe's template
(`publish.tag`, e.g. `{name}-{key12}`; bundle.json records it).

A hit is a *published* release whose assets include `bundle.json` and exactly one uploaded `.zip`
(its `digest` is the Entry's sha256), and whose bundle.json is a manifest of the key asked for
(manifest.check_consistent): one that is not is refused (exit 5) with the advice to delete the release.
Small assets (bundle.json, SHA256SUMS) are downloaded like the zip: a short or dropped body is retried
and resumed (`Range` + `If-Range`) until it has the asset's size (and digest); only content that arrived
whole and is wrong condemns the release. Publishing takes the tag first (`POST /git/refs`: exactly one
concurrent publisher wins), then draft release → zip → SHA256SUMS → bundle.json → publish. A loser
waits for the winner's release; a tag whose release stays a draft longer than `stale_after` seconds
is taken over. Every request goes through one `requests` session with retries for connection errors,
5xx, 429 and rate-limit 403s. The token goes only to the API and upload hosts, never to the download
(CDN) host, and never into a message.
"""

from __future__ import annotations

import datetime as dt
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, urljoin, urlsplit

import requests
import urllib3

from .. import net
from ..bundle import MANIFEST
from ..bundle import manifest as manifest_mod
from ..bundle.manifest import Expect, Manifest, ManifestError
from ..digest import sha256_file
from ..errors import LlamaBundleError, StoreError, UsageError
from ..log import Log
from .base import Entry, Published

API_VERSION = "2022-11-28"
DEFAULT_API_URL = "https://api.github.com"
SUMS = "SHA256SUMS"
_REPO_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_DROPPED = (requests.RequestException, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, OSError)
_HOPELESS = (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema, requests.exceptions.InvalidSchema,
             requests.exceptions.InvalidHeader, urllib3.exceptions.LocationParseError)
MAX_MANIFEST = manifest_mod.MAX_MANIFEST_BYTES  # also the most a SHA256SUMS may hold
CHUNK = 64 << 10


# ----------------------------------------------------------------------------------- errors


class GitHubError(StoreError):
    """The GitHub API refused a request; carries the HTTP status and `x-github-request-id`."""

    def __init__(self, what: str, *, status: int | None = None, request_id: str | None = None,
                 errors: list[Any] | None = None, why: str = "", fix: str = "", details: str = "") -> None:
        if request_id:
            details = (details + "\n" if details else "") + f"  GitHub request id: {request_id}"
        super().__init__(what, why=why, fix=fix, details=details)
        self.status = status
        self.request_id = request_id
        self.errors = errors or []
        self.lost = False  # an earlier attempt's answer was lost (dropped, 5xx): GitHub may have applied it


class GitHubValidationError(GitHubError):
    """HTTP 422 (Validation Failed)."""


class RefExistsError(GitHubValidationError):
    """HTTP 422 `already_exists` on creating a ref."""


class AssetConflictError(GitHubError):
    """A release already holds an uploaded asset of that name with different content."""


class RateLimitError(GitHubError):
    """Rate limited for longer than we are willing to wait."""


@dataclass(frozen=True, kw_only=True)
class GitHubEntry(Entry):
    asset_url: str  # the zip's API asset URL (download with Accept: application/octet-stream)
    release_id: int


def manifest_tag(key: str, manifest: Manifest) -> str:
    """The release tag a bundle is published under: the one its recipe's template gave at build time
    (bundle.json `publish.tag`), else the schema's default template `{name}-{key12}`."""
    if manifest.publish_tag:
        return manifest.publish_tag
    return f"{manifest.name or 'llamabundle'}-{key[:12]}"


# ------------------------------------------------------------------------------------ store


class GitHubStore:
    def __init__(self, repo: str, *, api_url: str | None = None, token: str | None = None, log: Log | None = None,
                 tags: Mapping[str, str] | None = None,
                 stale_after: float = 1800.0, poll_interval: float = 5.0, wait_timeout: float | None = None,
                 sleep: Callable[[float], None] = time.sleep, max_attempts: int = 5, refused_attempts: int = 2,
                 max_wait: float = 300.0, max_total: float = 900.0, backoff: float = 1.0, max_backoff: float = 30.0,
                 connect_timeout: float = 10.0, read_timeout: float = 60.0, upload_timeout: float = 600.0,
                 http: requests.Session | None = None, on_step: Callable[[str], None] | None = None) -> None:
        if not _REPO_RE.match(repo):
            raise UsageError(f"store 'github:{repo}': '{repo}' is not OWNER/REPO", fix="e.g. github:ggml-org/bundles")
        self.repo = repo
        self.url = f"github:{repo}"
        self.api_url = (api_url or DEFAULT_API_URL).rstrip("/")
        self.token = token or None
        self.log = log or Log()
        self.tags = dict(tags or {})  # key -> tag, from the recipe when the command has one
        self.stale_after, self.poll_interval, self.sleep = stale_after, poll_interval, sleep
        # how long a loser waits in all before giving up (the holder's draft goes stale before that)
        self.wait_timeout = stale_after + 300.0 if wait_timeout is None else wait_timeout
        self.max_attempts, self.refused_attempts = max(1, max_attempts), max(1, refused_attempts)
        self.max_wait, self.max_total, self.backoff, self.max_backoff = max_wait, max_total, backoff, max_backoff
        self.timeout = (connect_timeout, read_timeout)
        self.upload_timeout = (connect_timeout, upload_timeout)
        self.http = http or net.session()
        self.on_step = on_step or (lambda _step: None)  # told "tag", "draft", "uploaded", "published" (tests)
        self._trusted = {net._origin(self.api_url)}  # origins that may see the token
        self._repo_api = f"{self.api_url}/repos/{repo}"

    # -------------------------------------------------------------------------- protocol

    def lookup(self, key: str) -> GitHubEntry | None:
        self._check_key(key)
        tag = self.tags.get(key)
        rel = self._release_by_tag(tag) if tag else self._release_by_key(key)
        if rel is None:
            return None
        return self._entry_from_release(rel, key)

    def fetch(self, entry: Entry, dest: Path, *, sink: net.Sink | None = None) -> Path:
        asset_url = getattr(entry, "asset_url", None)
        if not asset_url:
            found = self.lookup(entry.key)
            if found is None:
                raise StoreError(f"bundle {entry.key[:12]} is no longer in {self.url}", fix="build it again")
            asset_url = found.asset_url
        out = Path(dest) / entry.zip_name
        try:
            net.download(asset_url, out, http=self.http, log=self.log, sha256=entry.zip_sha256, size=entry.zip_size,
                         headers=self._headers(octet=True, auth=False), token=self.token,
                         connect_timeout=self.timeout[0], read_timeout=self.timeout[1], sink=sink)
        except StoreError as e:
            raise self._redacted(e) from None
        except OSError as e:
            raise StoreError(f"cannot write {out}", why=self._redact(str(e)), fix="check the destination") from None
        return out

    def publish(self, zip_path: Path, manifest: Manifest) -> Published:
        key = manifest.key
        self._check_key(key)
        manifest_mod.check_consistent(manifest)  # never store a bundle under a key that is not its own
        zip_path = Path(zip_path)
        if not zip_path.name.endswith(".zip") or zip_path.name in (MANIFEST, SUMS):
            raise StoreError(f"cannot publish {zip_path.name}", why="a bundle is published as one .zip file",
                             fix="publish the bundle zip")
        tag = self.tags.get(key) or manifest_tag(key, manifest)
        zip_sha = sha256_file(zip_path)
        sums = f"{zip_sha}  {zip_path.name}\n".encode()
        mbytes = manifest.text().encode("utf-8")
        ours = {zip_path.name: zip_sha, SUMS: _sha(sums), MANIFEST: _sha(mbytes)}
        for _round in range(4):
            existing = self.lookup(key)
            if existing is not None:
                return Published(entry=existing, created=False)
            if self._take_tag(tag):
                won = self._publish_as_winner(tag, key, zip_path, zip_sha, sums, mbytes)
                if won is not None:
                    return Published(entry=won, created=True)
            entry = self._wait_for_winner(tag, key, ours)
            if entry is not None:
                return Published(entry=entry, created=False)
            # the tag was given up (or found stale and cleared): try to take it again
        raise StoreError(f"cannot take the tag {tag} in {self.repo}", why="other publishers kept taking it over",
                         fix="retry later")

    def list_entries(self, *, per_page: int = 100, max_pages: int = 1000) -> list[GitHubEntry]:
        """Every published release that is a complete entry, one per key (the newest release of a key, as
        GitHub lists them newest first), sorted by key. The releases are listed `per_page` at a time until a
        page is short (or brings no release not seen before); a release without bundle.json or a single
        uploaded .zip is not an entry and is left out; one whose bundle.json is not a consistent manifest is
        refused as lookup refuses it."""
        seen: set[int] = set()
        found: dict[str, GitHubEntry] = {}
        for page in range(1, max_pages + 1):
            r = self._api("GET", f"{self._repo_api}/releases?per_page={per_page}&page={page}", ok=(200,),
                          what="list releases")
            listed = self._json(r, "the release list")
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
                entry = self._entry_from_release(rel, None)
                if entry is not None and entry.key not in found:
                    found[entry.key] = entry
            if len(listed) < per_page or not new:
                return [found[k] for k in sorted(found)]
        raise StoreError(f"{self.repo} has more than {max_pages * per_page} releases", why="listing stopped there",
                         fix="delete old releases, or list them with the GitHub API yourself")

    # --------------------------------------------------------------------------- lookup

    def _release_by_key(self, key: str, *, max_pages: int = 10) -> dict[str, Any] | None:
        """Without the recipe (a bare key) the tag is unknown: the newest published release whose tag ends
        with the key's first 12 digits (every tag template holds {key} or {key12}), 100 per request."""
        for page in range(1, max_pages + 1):
            r = self._api("GET", f"{self._repo_api}/releases?per_page=100&page={page}", ok=(200,))
            rels: list[dict[str, Any]] = r.json() if isinstance(r.json(), list) else []
            for rel in rels:
                tag = str(rel.get("tag_name") or "")
                if not rel.get("draft") and tag.endswith((key[:12], key)):
                    return rel
            if len(rels) < 100:
                return None
        return None

    def _release_by_tag(self, tag: str) -> dict[str, Any] | None:
        r = self._api("GET", f"{self._repo_api}/releases/tags/{quote(tag, safe='')}", ok=(200, 404),
                      what=f"look up the release {tag}")
        if r.status_code == 404:
            return None
        rel: dict[str, Any] = self._json(r, f"the release {tag}")
        if rel.get("draft"):
            return None
        self._trust_upload(rel)
        return rel

    def _entry_from_release(self, rel: dict[str, Any], key: str | None) -> GitHubEntry | None:
        """The release's entry; its bundle.json must be a manifest of `key` (None: of whatever key it names,
        still the sha256 of its inputs, as when listing)."""
        assets = [a for a in rel.get("assets") or [] if isinstance(a, dict)]
        manifest_asset = next((a for a in assets if a.get("name") == MANIFEST), None)
        zips = [a for a in assets if str(a.get("name", "")).endswith(".zip")]
        if (manifest_asset is None or manifest_asset.get("state") != "uploaded" or len(zips) != 1
                or zips[0].get("state") != "uploaded"):
            return None  # incomplete: not a hit
        tag = rel.get("tag_name", "?")
        condemn = f"delete the release {tag} in {self.repo}, then publish the bundle again"
        raw = self._download_bytes(manifest_asset, f"{MANIFEST} of release {tag}", error=ManifestError, fix=condemn)
        try:
            manifest = manifest_mod.loads(raw, where=f"{MANIFEST} of release {tag}")
            manifest_mod.check_consistent(manifest, Expect(key=key))
        except ManifestError as e:
            if str(tag) not in e.what:
                e.what = f"release {tag} in {self.repo}: {e.what}"
            e.fix, e.args = condemn, (e.what,)
            raise
        z = zips[0]
        zip_size = _size(z)
        if zip_size is None:
            raise StoreError(f"release {tag} in {self.repo} gives no size for {z.get('name')}",
                             why="GitHub lists every uploaded asset with its size",
                             fix=f"delete the release {tag} and publish again")
        sha = _digest(z)
        if sha is None:
            sums_asset = next((a for a in assets if a.get("name") == SUMS and a.get("state") == "uploaded"), None)
            if sums_asset is not None:
                sums = _parse_sums(self._download_bytes(sums_asset, f"{SUMS} of release {tag}").decode("utf-8", "replace"))
                sha = sums.get(z["name"])
            if sha is None:
                raise StoreError(f"release {tag} in {self.repo} gives no sha256 for {z['name']}",
                                 why=f"the asset has no digest and {SUMS} does not list it",
                                 fix=f"delete the release {tag} and publish again")
        return GitHubEntry(key=manifest.key, zip_name=z["name"], zip_sha256=sha, zip_size=zip_size,
                           manifest=manifest, location=z.get("browser_download_url") or z.get("url", ""),
                           asset_url=z["url"], release_id=int(rel["id"]))

    def _download_bytes(self, asset: dict[str, Any], what: str, *, error: type[LlamaBundleError] = StoreError,
                        fix: str = "") -> bytes:
        """A small asset's bytes. A body that ends early or drops is retried and resumed (Range + If-Range) until
        it holds the asset's `size` bytes (and matches its `digest`, when GitHub gives one); when the retries
        run out that is a NetworkError. Only content that arrived whole and is wrong raises `error` (with `fix`)."""
        fix = fix or f"delete the release holding it in {self.repo}, then publish again"
        size, want = _size(asset), _digest(asset)
        if size is not None and size > MAX_MANIFEST:
            raise error(f"{what} in {self.repo} is {size} bytes, more than {MAX_MANIFEST >> 20} MiB",
                        why="it is a few KiB when llamabundle publishes it", fix=fix)
        data = bytearray()
        validator: str | None = None
        spliced = False  # `data` was put together from more than one response
        why, dropped = "", False
        for attempt in range(1, self.max_attempts + 1):
            if attempt > 1:
                delay = self._backoff(attempt - 1)
                self.log.info(self._redact(f"    github: download {what}: {why}; retry {attempt - 1}/"
                                           f"{self.max_attempts - 1} in {delay:.1f}s"))
                self.sleep(delay)
            headers = {"Accept": "application/octet-stream"}
            if data:
                headers["Range"] = f"bytes={len(data)}-"
                if validator:
                    headers["If-Range"] = validator
            r = self._api("GET", asset["url"], headers=headers, follow=True, stream=True, ok=(200, 206, 416),
                          what=f"download {what}")
            with r:
                expected = size
                if r.status_code == 416:  # asked for the bytes after the end: whole already, or something changed
                    if not (data and size is not None and len(data) == size):
                        data.clear()
                        why = "the server refused to resume (HTTP 416)"
                        continue
                else:
                    offset = 0
                    if r.status_code == 206:
                        start, _end, total = net._content_range(r.headers.get("Content-Range"))
                        if start != len(data):
                            why = f"the server resumed at byte {start}, not {len(data)}"
                            data.clear()
                            continue
                        offset, spliced = len(data), True
                        expected = size if size is not None else total
                    else:
                        data.clear()
                        spliced, validator = False, None
                    validator = validator or net._validator(r.headers)
                    if expected is None:
                        n = r.headers.get("Content-Length", "")
                        expected = offset + int(n) if n.isdigit() else None
                    cap = (expected if expected is not None else MAX_MANIFEST) + 1
                    try:
                        for chunk in r.raw.stream(CHUNK, decode_content=False):  # the bytes as served
                            data += chunk
                            if len(data) >= cap:
                                break
                    except _DROPPED as e:
                        of = expected if expected is not None else "?"
                        why = f"the connection dropped after {len(data)} of {of} bytes ({net._short(e)})"
                        dropped = True
                        continue
            if len(data) > MAX_MANIFEST:
                raise error(f"{what} in {self.repo} is larger than {MAX_MANIFEST >> 20} MiB",
                            why="it is a few KiB when llamabundle publishes it", fix=fix)
            if expected is not None and len(data) < expected:
                why, dropped = f"the connection ended after {len(data)} of {expected} bytes", True
                continue
            dropped = False
            if expected is not None and len(data) > expected:
                why = f"the server sent more than the {expected} bytes GitHub lists"
                data.clear()
                continue
            if want is not None and _sha(bytes(data)) != want:
                if spliced:  # the pieces may be of different versions: once more, whole
                    why = "the resumed body does not match the asset's digest"
                    data.clear()
                    continue
                raise error(f"{what} in {self.repo} does not match its digest",
                            why=f"GitHub records sha256:{want}, the download has sha256:{_sha(bytes(data))}", fix=fix)
            return bytes(data)
        trouble = "the connection dropped before the end" if dropped else "the download kept failing"
        raise net.NetworkError(f"cannot download {what} from {self.repo}: {trouble}",
                               why=self._redact(f"{why} (gave up after {self.max_attempts} attempts)"),
                               fix="check the network and retry; nothing is known to be wrong with the release")

    # -------------------------------------------------------------------------- publish

    def _default_head(self) -> str:
        repo = self._json(self._api("GET", self._repo_api, what=f"read the repository {self.repo}"), self.repo)
        branch = repo.get("default_branch") or "main"
        ref = self._json(self._api("GET", f"{self._repo_api}/git/ref/heads/{quote(branch, safe='/')}",
                                   what=f"read the head of {branch}"), f"refs/heads/{branch}")
        sha = (ref.get("object") or {}).get("sha")
        if not isinstance(sha, str) or not sha:
            raise StoreError(f"cannot read the head of {branch} in {self.repo}", why="the answer has no object.sha")
        return sha

    def _take_tag(self, tag: str) -> bool:
        sha = self._default_head()
        try:
            self._api("POST", f"{self._repo_api}/git/refs", json_body={"ref": f"refs/tags/{tag}", "sha": sha},
                      ok=(201,), what=f"create the tag {tag}")
        except RefExistsError as e:
            # after a lost answer the tag may be our own: claim it, and let _first_claim settle it
            return e.lost
        return True

    def _publish_as_winner(self, tag: str, key: str, zip_path: Path, zip_sha: str, sums: bytes,
                           mbytes: bytes) -> GitHubEntry | None:
        """The entry, or None when another publisher turned out to hold the tag first (we stepped back)."""
        self.log.info(f"    github: took the tag {tag} in {self.repo}; creating a draft release")
        self.on_step("tag")
        rel_id: int | None = None
        publishing = False
        body = f"llamabundle bundle, cache key `{key}`"
        nonce = f"<!-- llamabundle publisher {random.getrandbits(64):016x} -->"
        try:
            try:
                rel = self._json(self._api("POST", f"{self._repo_api}/releases", ok=(201,),
                                           what=f"create the release {tag}",
                                           json_body={"tag_name": tag, "name": tag, "draft": True,
                                                      "make_latest": "false",  # never the repo's "Latest"
                                                      "body": f"{body}\n{nonce}"}), "the release")
            except GitHubValidationError as e:
                if not _already_exists(e.errors, e.why):
                    raise
                self.log.info(f"    github: the release {tag} was published meanwhile; stepping back")
                return None  # another publisher held the tag too, and published: its tag, not ours to delete
            rel_id = int(rel["id"])
            if not self._first_claim(tag, rel_id, nonce):
                self.log.info(f"    github: another publisher holds {tag} too, and came first; stepping back")
                self._api("DELETE", f"{self._repo_api}/releases/{rel_id}", ok=(204, 404), what="delete our draft")
                return None
            self.on_step("draft")
            upload = self._trust_upload(rel)
            zip_asset = self._upload(rel_id, upload, zip_path.name, "application/zip",
                                     lambda: open(zip_path, "rb"),  # noqa: SIM115 - _upload closes it
                                     zip_path.stat().st_size, zip_sha)
            self.on_step("uploaded")
            self._upload(rel_id, upload, SUMS, "text/plain", lambda: sums, len(sums), _sha(sums))
            self._upload(rel_id, upload, MANIFEST, "application/json", lambda: mbytes, len(mbytes), _sha(mbytes))
            publishing = True
            done = self._json(self._api("PATCH", f"{self._repo_api}/releases/{rel_id}",
                                        # GitHub recomputes "Latest" when a draft is published: say no again
                                        json_body={"draft": False, "make_latest": "false", "body": body},
                                        what=f"publish the release {tag}"), "the release")
        except AssetConflictError:
            raise  # never clean up an uploaded asset with a different digest
        except BaseException as e:
            # a publish whose answers were all lost may have been applied: never delete a published release
            done = self._published(rel_id) if publishing and isinstance(e, Exception) else None
            if done is None:
                self._give_up(tag, rel_id)
                raise
        self.on_step("published")
        if done.get("draft"):
            raise StoreError(f"the release {tag} in {self.repo} stayed a draft after publishing", fix="retry")
        z = next((a for a in done.get("assets") or [] if a.get("name") == zip_path.name), zip_asset)
        self.log.info(f"    github: published {tag} in {self.repo}")
        assert rel_id is not None  # the draft was created before anything here could succeed
        return GitHubEntry(key=key, zip_name=zip_path.name, zip_sha256=zip_sha, zip_size=zip_path.stat().st_size,
                           manifest=manifest_mod.loads(mbytes), location=z.get("browser_download_url") or z.get("url", ""),
                           asset_url=z["url"], release_id=int(rel_id))

    def _first_claim(self, tag: str, rel_id: int, nonce: str) -> bool:
        """Whether our new draft is the tag's first release. Two publishers can both believe they hold the tag (a
        takeover racing another one, or a tag claimed after a lost answer): the one whose release came first goes
        on, the other steps back. Our own older drafts (a create retried after a lost answer) are removed."""
        for x in self._tag_releases(tag):
            if x.get("id") == rel_id or (x.get("draft") and int(x["id"]) > rel_id):
                continue  # ours, or younger: its publisher steps back
            if not (x.get("draft") and nonce in str(x.get("body") or "")):
                return False
            self._api("DELETE", f"{self._repo_api}/releases/{x['id']}", ok=(204, 404),
                      what="delete a duplicate of our draft")
        return True

    def _published(self, rel_id: int | None) -> dict[str, Any] | None:
        """Our release as GitHub has it when it is published (best effort), else None."""
        try:
            r = self._api("GET", f"{self._repo_api}/releases/{rel_id}", ok=(200, 404), what="read our release")
            rel = r.json() if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - the original error is what matters
            return None
        return rel if isinstance(rel, dict) and rel.get("draft") is False else None

    def _give_up(self, tag: str, rel_id: int | None) -> None:
        """Best effort after a failed publish: remove our draft and the tag so that others need not wait."""
        try:
            if rel_id is not None:
                self._api("DELETE", f"{self._repo_api}/releases/{rel_id}", ok=(204, 404), attempts=1,
                          what="delete our draft release")
            self._delete_ref(tag, attempts=1)
        except Exception:  # noqa: BLE001, S110 - the original error is what matters
            pass

    def _upload(self, rel_id: int, upload_url: str, name: str, ctype: str, body: Callable[[], IO[bytes] | bytes],
                size: int, sha: str) -> dict[str, Any]:
        url = f"{upload_url}?name={quote(name, safe='')}"
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            if attempt > 1:
                done = self._reconcile(rel_id, name, sha)
                if done is not None:
                    return done
            data = body()
            try:
                headers = {**self._headers(), "Content-Type": ctype, "Content-Length": str(size)}
                why, delay = None, None
                try:
                    r = self.http.post(url, data=data, headers=headers, timeout=self.upload_timeout,
                                       allow_redirects=False)
                except _HOPELESS as e:
                    raise StoreError(f"cannot upload {name} to {self.repo}", why=self._redact(str(e))) from None
                except _DROPPED as e:
                    why = net._short(e)
                else:
                    with r:
                        if r.status_code == 201:
                            asset: dict[str, Any] = self._json(r, name)
                            got = _digest(asset)
                            if asset.get("state", "uploaded") == "uploaded" and (got is None or got == sha):
                                return asset
                            why = f"the uploaded {name} came back as {asset.get('state')} with digest {got}"
                            if "id" in asset:  # ours, and damaged: remove it before trying again
                                self._api("DELETE", f"{self._repo_api}/releases/assets/{asset['id']}", ok=(204, 404),
                                          what=f"delete the damaged asset {name}")
                        elif r.status_code == 422:
                            err = self._error(r, f"upload {name}")
                            if not _already_exists(err.errors, err.why):
                                raise err
                            why = "an asset of that name is already there"
                            delay = 0.0
                        else:
                            delay = self._retry_delay(r, attempt)
                            if delay is None:
                                raise self._error(r, f"upload {name}")
                            why = f"HTTP {r.status_code}"
            finally:
                if hasattr(data, "close"):
                    data.close()
            if delay is None:
                delay = self._backoff(attempt)
            if attempt >= self.max_attempts or time.monotonic() - start + delay > self.max_total:
                raise net.NetworkError(f"cannot upload {name} to {self.repo}",
                                       why=self._redact(f"{why} (gave up after {attempt} attempts)"),
                                       fix="check the network and retry; the publish cleans up its leftovers")
            self.log.info(self._redact(f"    github: upload {name}: {why}; retry in {delay:.1f}s"))
            if delay:
                self.sleep(delay)

    def _reconcile(self, rel_id: int, name: str, sha: str) -> dict[str, Any] | None:
        """Before re-uploading: an asset of that name that is complete with our digest is done; a partial one
        (state != uploaded) is deleted; a complete one with another digest is a conflict."""
        r = self._api("GET", f"{self._repo_api}/releases/{rel_id}/assets?per_page=100",
                      what="list the release's assets")
        for a in self._json(r, "the asset list"):
            if not isinstance(a, dict) or a.get("name") != name:
                continue
            if a.get("state") != "uploaded":
                self.log.info(f"    github: removing the incomplete asset {name} (state {a.get('state')})")
                self._api("DELETE", f"{self._repo_api}/releases/assets/{a['id']}", ok=(204, 404),
                          what=f"delete the incomplete asset {name}")
                return None
            got = _digest(a)
            if got == sha:
                return a
            raise AssetConflictError(f"the release in {self.repo} already holds a different {name}",
                                     why=f"its digest is {a.get('digest') or 'unknown'}, ours is sha256:{sha}",
                                     fix="delete that release (or asset) by hand if it is wrong, then retry")
        return None

    # ----------------------------------------------------------------------------- loser

    def _wait_for_winner(self, tag: str, key: str, ours: Mapping[str, str]) -> GitHubEntry | None:
        """Wait until the tag's release is published (its entry), or the tag is gone or stale (None). A stale
        draft is deleted only when none of its uploaded assets differs from ours (`ours`: name -> sha256)."""
        start = time.monotonic()
        last_note = -1e9
        while True:
            rel = self._release_by_tag(tag)
            if rel is not None:
                entry = self._entry_from_release(rel, key)
                if entry is None:
                    raise StoreError(f"release {tag} in {self.repo} is published but incomplete",
                                     why=f"it lacks {MANIFEST} or exactly one uploaded .zip",
                                     fix=f"delete the release {tag} (and its tag) and publish again")
                return entry
            r = self._api("GET", f"{self._repo_api}/git/ref/tags/{quote(tag, safe='')}", ok=(200, 404),
                          what=f"read the tag {tag}")
            if r.status_code == 404:
                return None  # the holder gave up
            rels = self._tag_releases(tag)
            published = any(not x.get("draft") for x in rels)  # since we looked: never untag a published release
            draft = min((x for x in rels if x.get("draft")), key=lambda x: x.get("created_at") or "", default=None)
            waited = time.monotonic() - start
            age = waited if draft is None else _age(draft.get("created_at"))
            if age > self.stale_after and not published:
                self.log.info(f"    github: the tag {tag} has had no published release for {age:.0f}s; taking it over")
                if draft is not None:
                    for a in draft.get("assets") or []:
                        if a.get("state") == "uploaded" and a.get("name") in ours and _digest(a) != ours[a["name"]]:
                            raise AssetConflictError(
                                f"the stale draft release {tag} in {self.repo} holds a different {a['name']}",
                                why=f"its digest is {a.get('digest') or 'unknown'}, ours is sha256:{ours[a['name']]}",
                                fix=f"delete the draft release {tag} and its tag by hand if it is wrong, then retry")
                    try:
                        self._api("DELETE", f"{self._repo_api}/releases/{draft['id']}", ok=(204,),
                                  what="delete a stale draft release")
                    except GitHubError as e:
                        if e.status != 404:
                            raise
                        if not e.lost:  # (after a lost answer the delete was ours)
                            continue  # someone else is taking it over: look again
                self._delete_ref(tag)
                return None
            if waited > self.wait_timeout:
                raise StoreError(f"timed out waiting for the release {tag} in {self.repo}",
                                 why=f"another publisher holds the tag (waited {waited:.0f}s)", fix="retry later")
            if waited - last_note >= 30 or last_note < 0:
                last_note = waited
                self.log.info(f"    github: another publisher holds {tag}; waiting for its release "
                              f"({waited:.0f}s so far)")
            self.sleep(self.poll_interval)

    def _tag_releases(self, tag: str) -> list[dict[str, Any]]:
        """The tag's releases, drafts included (the newest 100 releases; a publisher's are among them)."""
        r = self._api("GET", f"{self._repo_api}/releases?per_page=100", what="list releases")
        return [x for x in self._json(r, "the release list") if isinstance(x, dict) and x.get("tag_name") == tag]

    def _delete_ref(self, tag: str, *, attempts: int | None = None) -> None:
        # GitHub answers 422 "Reference does not exist" for a missing ref
        self._api("DELETE", f"{self._repo_api}/git/refs/tags/{quote(tag, safe='')}", ok=(204, 404, 422),
                  attempts=attempts, what=f"delete the tag {tag}")

    # ------------------------------------------------------------------------ HTTP client

    def _headers(self, *, octet: bool = False, auth: bool = True) -> dict[str, str]:
        h = {"Accept": "application/octet-stream" if octet else "application/vnd.github+json",
             "X-GitHub-Api-Version": API_VERSION}
        if auth and self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    def _trust_upload(self, rel: dict[str, Any]) -> str:
        upload = str(rel.get("upload_url") or "").split("{", 1)[0]
        if upload:
            self._trusted.add(net._origin(upload))
        return upload

    def _api(self, method: str, url: str, *, ok: tuple[int, ...] = (200,), json_body: Any = None,
             headers: dict[str, str] | None = None, follow: bool = False, stream: bool = False,
             attempts: int | None = None, what: str = "") -> requests.Response:
        """One API call with retries; a status outside `ok` raises a typed GitHubError."""
        what = what or f"{method} {url}"
        max_attempts = attempts or self.max_attempts
        start = time.monotonic()
        attempt = 0
        lost = False  # an attempt reached GitHub but its answer was lost: a mutation may have been applied
        while True:
            attempt += 1
            try:
                r = self._send(method, url, json_body=json_body, headers=headers, follow=follow, stream=stream)
            except _HOPELESS as e:
                raise net.NetworkError(f"cannot {what} in {self.repo}", why=self._redact(str(e)),
                                       fix="check GITHUB_API_URL (or LLAMABUNDLE_GITHUB_API_URL)") from None
            except _DROPPED as e:
                refused = net._refused(e)
                lost = lost or not refused
                why = net._short(e)
                delay = self._backoff(attempt)
                limit = min(max_attempts, self.refused_attempts) if refused else max_attempts
                if attempt >= limit or time.monotonic() - start + delay > self.max_total:
                    raise net.NetworkError(f"cannot {what} in {self.repo}: {self.api_url} is unreachable",
                                           why=self._redact(f"{why} (gave up after {attempt} attempts)"),
                                           fix="check the network, or GITHUB_API_URL (or LLAMABUNDLE_GITHUB_API_URL)") from None
                self.log.info(self._redact(f"    github: {what}: {why}; retry {attempt}/{limit - 1} in {delay:.1f}s"))
                self.sleep(delay)
                continue
            if r.status_code in ok:
                return r
            retry = self._retry_delay(r, attempt)
            if retry is None:
                err = self._error(r, what)
                err.lost = lost
                r.close()
                raise err
            delay = retry
            if delay > self.max_wait:
                err = self._error(r, what)
                r.close()
                raise RateLimitError(f"cannot {what} in {self.repo}: GitHub asks to wait {delay:.0f}s",
                                     status=err.status, request_id=err.request_id, why=err.why,
                                     fix="wait and retry, or use a token with a higher rate limit (GITHUB_TOKEN)")
            if attempt >= max_attempts or time.monotonic() - start + delay > self.max_total:
                err = self._error(r, what)
                r.close()
                err.why = self._redact(f"{err.why} (gave up after {attempt} attempts)".strip())
                raise err
            self.log.info(f"    github: {what}: HTTP {r.status_code}; retry {attempt}/{max_attempts - 1} "
                          f"in {delay:.1f}s")
            lost = lost or r.status_code >= 500
            r.close()
            self.sleep(delay)

    def _send(self, method: str, url: str, *, json_body: Any, headers: dict[str, str] | None, follow: bool,
              stream: bool) -> requests.Response:
        cur = url
        for _hop in range(net.MAX_REDIRECTS + 1):
            h: dict[str, str | None] = {**self._headers(auth=False), **(headers or {})}
            if self.token and net._origin(cur) in self._trusted:
                h["Authorization"] = f"Bearer {self.token}"
            else:
                h["Authorization"] = None  # None drops a session-level header too
            r = self.http.request(method, cur, headers=h,  # type: ignore[arg-type]  # stubs: no None values
                                  json=json_body, timeout=self.timeout, stream=stream, allow_redirects=False)
            if not (follow and method == "GET" and r.is_redirect):
                return r
            cur = urljoin(cur, r.headers["Location"])
            r.close()
            if urlsplit(cur).scheme not in ("http", "https"):
                raise requests.exceptions.InvalidSchema("redirected to a non-http(s) URL")
        raise requests.exceptions.TooManyRedirects(f"more than {net.MAX_REDIRECTS} redirects")

    def _retry_delay(self, r: requests.Response, attempt: int) -> float | None:
        """Seconds to wait before retrying this answer, or None when it is final."""
        code = r.status_code
        h = r.headers
        rate_limited = code == 429 or (code == 403 and (
            h.get("x-ratelimit-remaining") == "0" or "retry-after" in h or "rate limit" in _body_text(r).lower()))
        if not (rate_limited or 500 <= code <= 599):
            return None
        ra = h.get("retry-after", "").strip()
        if ra.isdigit():
            return float(ra)
        reset = h.get("x-ratelimit-reset", "").strip()
        if h.get("x-ratelimit-remaining") == "0" and reset.isdigit():
            return max(0.0, int(reset) - time.time()) + 1.0
        return self._backoff(attempt)

    def _backoff(self, attempt: int) -> float:
        return min(self.max_backoff, self.backoff * 2.0 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    def _error(self, r: requests.Response, what: str) -> GitHubError:
        rid = r.headers.get("x-github-request-id")
        try:
            body = r.json()
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        msg = str(body.get("message") or r.reason or "")
        listed = body.get("errors")
        errors: list[Any] = listed if isinstance(listed, list) else []
        detail = "; ".join(str(e.get("message") or e.get("code") or e) if isinstance(e, dict) else str(e)
                           for e in errors)
        why = self._redact(f"HTTP {r.status_code}: {msg}" + (f" ({detail})" if detail else ""))
        fix = {401: "check GITHUB_TOKEN / GH_TOKEN",
               403: "the token needs contents: write on the repository (or wait for the rate limit)",
               404: f"check that {self.repo} exists and the token can see it"}.get(r.status_code, "retry later")
        cls: type[GitHubError] = GitHubError
        if r.status_code == 422:
            cls = GitHubValidationError
            if "/git/refs" in r.url and _already_exists(errors, msg):
                cls = RefExistsError
            fix = "see GitHub's message"
        return cls(self._redact(f"cannot {what} in {self.repo}"), status=r.status_code, request_id=rid,
                   errors=errors, why=why, fix=fix)

    def _json(self, r: requests.Response, what: str) -> Any:
        try:
            return r.json()
        except ValueError:
            raise StoreError(f"GitHub answered something that is not JSON for {what}",
                             why=f"HTTP {r.status_code}", fix="check GITHUB_API_URL (or LLAMABUNDLE_GITHUB_API_URL)") from None

    def _redact(self, text: str) -> str:
        return text.replace(self.token, "***") if self.token else text

    def _redacted(self, e: StoreError) -> StoreError:
        e.what, e.why, e.fix, e.details = (self._redact(x) for x in (e.what, e.why, e.fix, e.details))
        e.args = (e.what,)
        return e

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise StoreError(f"'{key}' is not a cache key", fix="a key is 64 hex digits (llamabundle key RECIPE)")


# ---------------------------------------------------------------------------------- helpers


def _size(asset: dict[str, Any]) -> int | None:
    n = asset.get("size")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def _digest(asset: dict[str, Any]) -> str | None:
    d = asset.get("digest")
    if isinstance(d, str) and d.lower().startswith("sha256:"):
        return d[7:].lower()
    return None


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _parse_sums(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2:
            out[parts[1].strip().lstrip("*")] = parts[0].lower()
    return out


def _already_exists(errors: list[Any], message: str) -> bool:
    return (any(isinstance(e, dict) and e.get("code") == "already_exists" for e in errors)
            or "already exists" in message.lower())


def _age(created_at: Any) -> float:
    try:
        when = dt.datetime.fromisoformat(str(created_at))  # a trailing Z is UTC (Python 3.11)
    except ValueError:
        return 0.0
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return max(0.0, (dt.datetime.now(dt.UTC) - when).total_seconds())


def _body_text(r: requests.Response) -> str:
    try:
        return r.text[:2000]
    except Exception:  # noqa: BLE001
        return ""
