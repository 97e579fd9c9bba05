"""A GitHub-compatible HTTP server for tests: the REST endpoints the GitHub store uses, on 127.0.0.1, and a
"CDN" on another host (127.0.0.2) that asset downloads redirect to, as on github.com.

- API (127.0.0.1): repos/{o}/{r}, git/ref(s) (create: 422 already_exists on a duplicate; delete), releases
  (create, get by tag — drafts are not visible by tag —, list, get, patch, delete, `latest`), release assets (list,
  get, delete, download: `Accept: application/octet-stream` answers 302 to the CDN), uploads on
  `/uploads/repos/{o}/{r}/releases/{id}/assets?name=…` (the release's `upload_url` template).
- CDN (127.0.0.2): the asset bytes, with ETag, Accept-Ranges, Range and If-Range.
- Both are tests/loopback.py servers. Every request is recorded in `requests` (host "api" or "cdn", method,
  path, lower-cased headers).
- Fault injection: `faults` is a list of callables `(req, exchange) -> bool` tried before normal handling; one
  that returns True has handled the request (answered through the Exchange's reply methods, or left it
  unanswered: the connection closes) and is removed when `once`. Helpers below add the usual ones. For asset
  bodies on the CDN:
  `drop_asset` (announce the whole length, hang up after N bytes) and `short_asset` (a complete-looking
  answer that holds only the first N bytes), for one named asset, for its next K downloads or every one.
- Time: `backdate(seconds)` makes every release and asset that many seconds older (stale-lock tests).
- "Latest" as GitHub keeps it: a release that is created published, or published from a draft (PATCH
  draft false), or patched, with `make_latest` "true" or absent becomes the repo's latest; "false" leaves
  the latest as it is; "legacy" makes the most recently created published non-prerelease one latest.
  Drafts and prereleases are never latest; deleting the latest one falls back to "legacy".
  `GET /repos/{o}/{r}/releases/latest` answers it (404 when there is none); `latest` holds its id.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Self
from urllib.parse import parse_qs, unquote, urlsplit

from tests import loopback
from tests.loopback import Loopback, Reply

CDN_HOST = "127.0.0.2"
METHODS = ("GET", "POST", "PATCH", "DELETE")


@dataclass
class Request:
    host: str  # "api" or "cdn"
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Fault:
    fn: Callable[[Request, Exchange], bool]
    once: bool = True


@dataclass
class Asset:
    id: int
    release_id: int
    name: str
    data: bytes
    state: str = "uploaded"
    content_type: str = "application/octet-stream"
    digest: str | None = None
    created_at: str = ""


@dataclass
class Release:
    id: int
    tag_name: str
    name: str
    draft: bool
    created_at: str
    published_at: str | None = None
    assets: list[int] = field(default_factory=list)
    body: str = ""
    prerelease: bool = False


def iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeGitHub:
    def __init__(self, repo: str = "acme/bundles", *, token: str | None = None, default_branch: str = "main") -> None:
        self.repo = repo
        self.token = token  # when set, API requests must carry it as a bearer token
        self.default_branch = default_branch
        self.head_sha = "c0ffee" + "0" * 34
        self.refs: dict[str, str] = {f"refs/heads/{default_branch}": self.head_sha}
        self.releases: dict[int, Release] = {}
        self.latest: int | None = None  # the id of the repo's "Latest" release (see the module docstring)
        self.assets: dict[int, Asset] = {}
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.lock = threading.RLock()
        self._ids = itertools.count(1000)
        self.rate_remaining = 5000
        self.cdn_rate: float | None = None  # bytes per second of CDN downloads; None: as fast as loopback goes
        self.api = Loopback(lambda req: self._answer("api", req), methods=METHODS).start()
        self.cdn = Loopback(lambda req: self._answer("cdn", req), host=CDN_HOST, methods=METHODS).start()
        self.api_url = self.api.url
        self.cdn_url = self.cdn.url

    def close(self) -> None:
        self.api.close()
        self.cdn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state helpers for tests

    def add_ref(self, tag: str) -> None:
        with self.lock:
            self.refs[f"refs/tags/{tag}"] = self.head_sha

    def add_release(self, tag: str, *, draft: bool, created_at: float | None = None,
                    assets: dict[str, bytes] | None = None, state: str = "uploaded",
                    prerelease: bool = False, make_latest: str | None = None) -> Release:
        """A release as someone else made it; a published one becomes latest as `make_latest` says."""
        with self.lock:
            rel = Release(id=next(self._ids), tag_name=tag, name=tag, draft=draft, created_at=iso(created_at),
                          published_at=None if draft else iso(), prerelease=prerelease)
            self.releases[rel.id] = rel
            for name, data in (assets or {}).items():
                self._add_asset(rel, name, data, state=state)
            if not draft:
                self.set_latest(rel, make_latest)
            return rel

    def set_latest(self, rel: Release, make_latest: object) -> None:
        """What GitHub does with `make_latest` when `rel` is published (or patched while published)."""
        with self.lock:
            choice = "true" if make_latest is None else str(make_latest).lower()
            if choice == "legacy":
                self.latest = self._legacy_latest()
            elif choice == "true" and not rel.draft and not rel.prerelease:
                self.latest = rel.id
            elif choice == "false" and self.latest == rel.id:
                self.latest = self._legacy_latest(but=rel.id)

    def latest_release(self) -> Release | None:
        with self.lock:
            rel = self.releases.get(self.latest) if self.latest is not None else None
            return rel if rel is not None and not rel.draft and not rel.prerelease else None

    def _legacy_latest(self, but: int | None = None) -> int | None:
        rels = [r for r in self.releases.values() if not r.draft and not r.prerelease and r.id != but]
        return max(rels, key=lambda r: (r.created_at, r.id)).id if rels else None

    def release_by_tag(self, tag: str, *, drafts: bool = True) -> list[Release]:
        with self.lock:
            return [r for r in self.releases.values() if r.tag_name == tag and (drafts or not r.draft)]

    def asset_names(self, rel: Release) -> list[str]:
        with self.lock:
            return sorted(self.assets[a].name for a in rel.assets)

    def backdate(self, seconds: float) -> None:
        """Make every release and asset there now `seconds` older, as if created that long ago."""
        def older(stamp: str) -> str:
            return iso(datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp() - seconds)

        with self.lock:
            for x in [*self.releases.values(), *self.assets.values()]:
                x.created_at = older(x.created_at)

    def count(self, method: str | None = None, path_part: str = "", host: str = "api") -> int:
        return sum(1 for r in self.requests if r.host == host and (method is None or r.method == method)
                   and path_part in r.path)

    # ------------------------------------------------------------------------------ faults

    def add_fault(self, fn: Callable[[Request, Exchange], bool], *, once: bool = True) -> None:
        with self.lock:
            self.faults.append(Fault(fn, once))

    def fail_upload_once(self, name: str, *, status: int = 502, keep: int = 10) -> None:
        """The next upload of `name` stores its first `keep` bytes as a `starter` asset and answers `status`."""
        def fault(req: Request, h: Exchange) -> bool:
            if not (req.host == "api" and req.method == "POST" and req.path.startswith("/uploads/")
                    and parse_qs(urlsplit(req.path).query).get("name") == [name]):
                return False
            data = h.read_body()
            rel = self.releases[int(urlsplit(req.path).path.split("/")[-2])]
            self._add_asset(rel, name, data[:keep], state="starter", digest=False)
            h.reply_json(status, {"message": "Bad Gateway"})
            return True

        self.add_fault(fault)

    def conflict_upload_once(self, name: str, other: bytes) -> None:
        """The next upload of `name` finds that an uploaded asset with other content got there first (and
        the upload itself answers 502, as if the connection had been lost)."""
        def fault(req: Request, h: Exchange) -> bool:
            if not (req.host == "api" and req.method == "POST" and req.path.startswith("/uploads/")
                    and parse_qs(urlsplit(req.path).query).get("name") == [name]):
                return False
            h.read_body()
            rel = self.releases[int(urlsplit(req.path).path.split("/")[-2])]
            self._add_asset(rel, name, other)
            h.reply_json(502, {"message": "Bad Gateway"})
            return True

        self.add_fault(fault)

    def rate_limit_once(self, reset_in: int = 3, *, path_part: str = "") -> None:
        """The next API request (whose path contains `path_part`) answers 403 with x-ratelimit-remaining 0."""
        def fault(req: Request, h: Exchange) -> bool:
            if req.host != "api" or path_part not in req.path:
                return False
            h.reply_json(403, {"message": "API rate limit exceeded for user ID 1.",
                               "documentation_url": "https://docs.github.com/rest/rate-limit"},
                         headers={"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(int(time.time()) + reset_in)})
            return True

        self.add_fault(fault)

    def status_once(self, status: int, *, path_part: str = "", method: str | None = None, times: int = 1,
                    headers: dict[str, str] | None = None) -> None:
        for _ in range(times):
            def fault(req: Request, h: Exchange) -> bool:
                if req.host != "api" or path_part not in req.path or (method and req.method != method):
                    return False
                h.reply_json(status, {"message": f"fault {status}"}, headers=headers)
                return True

            self.add_fault(fault)

    def lose_answer_once(self, method: str, path_part: str, *, status: int | None = 502) -> None:
        """The next API `method` request whose path contains `path_part` is applied, but its answer is lost: the
        client gets `status` instead, or (None) the connection closes without an answer, as after a timeout."""
        def fault(req: Request, h: Exchange) -> bool:
            if not (req.host == "api" and req.method == method and path_part in req.path):
                return False
            h._api(method, req)  # applied; its answer is replaced by what the client gets instead
            if status is None:
                h.hang_up()
            else:
                h.reply_json(status, {"message": "Bad Gateway"})
            return True

        self.add_fault(fault)

    def drop_asset(self, name: str, *, after: int, times: int | None = 1) -> None:
        """The next `times` CDN downloads of the asset `name` (None: every one) announce the whole body but hang
        up after `after` of its bytes (counted from where a Range starts)."""
        self._asset_fault(name, times, lambda h: h.serve_cdn(cut=after))

    def short_asset(self, name: str, *, keep: int, times: int | None = 1) -> None:
        """The next `times` CDN downloads of `name` (None: every one) answer as if the asset held only its first
        `keep` bytes: a complete-looking answer (Content-Length and all), with the asset's own ETag."""
        self._asset_fault(name, times, lambda h: h.serve_cdn(short=keep))

    def _asset_fault(self, name: str, times: int | None, serve: Callable[[Exchange], Reply]) -> None:
        def fault(req: Request, h: Exchange) -> bool:
            parts = urlsplit(req.path).path.split("/")
            if not (req.host == "cdn" and len(parts) > 3 and parts[1] == "cdn" and unquote(parts[3]) == name):
                return False
            serve(h)
            return True

        for _ in range(1 if times is None else times):
            self.add_fault(fault, once=times is not None)

    def downloads(self, name: str) -> list[Request]:
        """The CDN requests for the asset `name`, in order."""
        return [r for r in self.requests if r.host == "cdn" and unquote(urlsplit(r.path).path).endswith(f"/{name}")]

    def drop_download_once(self, after: int) -> None:
        """The next CDN download announces the full length but hangs up after `after` bytes."""
        def fault(req: Request, h: Exchange) -> bool:
            if req.host != "cdn":
                return False
            h.serve_cdn(cut=after)
            return True

        self.add_fault(fault)

    # ---------------------------------------------------------------------------- internals

    def _answer(self, host: str, request: loopback.Request) -> Reply:
        """The handler of both servers: record, try the faults, then the CDN or the API."""
        req = Request(host, request.method, request.path, dict(request.headers))
        h = Exchange(self, request)
        with self.lock:
            self.requests.append(req)
            fault = next((f for f in self.faults if f.fn(req, h)), None)
            if fault is not None:
                if fault.once:
                    self.faults.remove(fault)
                return h.answer if h.answer is not None else loopback.hang_up()
        if req.host == "cdn":
            return h.serve_cdn()
        if self.token is not None and req.headers.get("authorization") != f"Bearer {self.token}":
            return h.reply_json(401, {"message": "Bad credentials", "documentation_url": "https://docs.github.com/rest"})
        with self.lock:
            return h._api(req.method, req)

    def _add_asset(self, rel: Release, name: str, data: bytes, *, state: str = "uploaded",
                   content_type: str = "application/octet-stream", digest: bool = True) -> Asset:
        with self.lock:
            a = Asset(id=next(self._ids), release_id=rel.id, name=name, data=data, state=state,
                      content_type=content_type, created_at=iso(),
                      digest=f"sha256:{hashlib.sha256(data).hexdigest()}" if digest else None)
            self.assets[a.id] = a
            rel.assets.append(a.id)
            return a

    def asset_json(self, a: Asset) -> dict[str, Any]:
        rel = self.releases.get(a.release_id)
        tag = rel.tag_name if rel else "untagged"
        return {"id": a.id, "name": a.name, "label": None, "state": a.state, "size": len(a.data),
                "digest": a.digest, "content_type": a.content_type, "created_at": a.created_at,
                "url": f"{self.api_url}/repos/{self.repo}/releases/assets/{a.id}",
                "browser_download_url": f"{self.cdn_url}/{self.repo}/releases/download/{tag}/{a.name}"}

    def release_json(self, rel: Release) -> dict[str, Any]:
        return {"id": rel.id, "tag_name": rel.tag_name, "name": rel.name, "body": rel.body, "draft": rel.draft,
                "prerelease": rel.prerelease,
                "created_at": rel.created_at, "published_at": rel.published_at,
                "url": f"{self.api_url}/repos/{self.repo}/releases/{rel.id}",
                "html_url": f"{self.cdn_url}/{self.repo}/releases/tag/{rel.tag_name}",
                "upload_url": f"{self.api_url}/uploads/repos/{self.repo}/releases/{rel.id}/assets{{?name,label}}",
                "assets": [self.asset_json(self.assets[i]) for i in rel.assets if i in self.assets]}


class Exchange:
    """One request to the fake being answered: the fault or endpoint that handles it calls one of the reply
    methods (the last call wins); `answer` is what goes back, None: the connection closes unanswered."""

    def __init__(self, gh: FakeGitHub, req: loopback.Request) -> None:
        self.gh = gh
        self.request = req
        self.path = req.path
        self.headers = req.headers  # lower-case names
        self.answer: Reply | None = None

    # ------------------------------------------------------------------------------ replies

    def read_body(self) -> bytes:
        return self.request.body

    def reply(self, reply: Reply) -> Reply:
        self.answer = reply
        return reply

    def hang_up(self) -> Reply:
        return self.reply(loopback.hang_up())

    def reply_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> Reply:
        data = b"" if body is None else json.dumps(body).encode()
        hdrs = {"x-github-request-id": uuid.uuid4().hex[:16].upper(), "x-ratelimit-limit": "5000",
                "x-ratelimit-remaining": str(self.gh.rate_remaining), "x-ratelimit-reset": str(int(time.time()) + 3600),
                **(headers or {})}
        return self.reply(Reply(status, {"Content-Type": "application/json; charset=utf-8", **hdrs}, data))

    def not_found(self) -> Reply:
        return self.reply_json(404, {"message": "Not Found", "documentation_url": "https://docs.github.com/rest",
                                     "status": "404"})

    def validation(self, code: str, message: str, resource: str, field_: str) -> Reply:
        return self.reply_json(422, {"message": message, "errors": [{"resource": resource, "code": code, "field": field_}],
                                     "documentation_url": "https://docs.github.com/rest", "status": "422"})

    # -------------------------------------------------------------------------------- API

    def _api(self, method: str, req: Request) -> Reply:
        gh = self.gh
        path = urlsplit(self.path).path
        query = parse_qs(urlsplit(self.path).query)
        uploads = path.startswith("/uploads/")
        if uploads:
            path = path[len("/uploads"):]
        prefix = f"/repos/{gh.repo}"
        if not path.startswith(prefix):
            return self.not_found()
        rest = path[len(prefix):]
        parts = [unquote(p) for p in rest.split("/") if p]

        if uploads:
            if method == "POST" and len(parts) == 3 and parts[0] == "releases" and parts[2] == "assets":
                return self._upload(int(parts[1]), query.get("name", [""])[0])
            return self.not_found()
        if method == "GET" and not parts:
            return self.reply_json(200, {"full_name": gh.repo, "default_branch": gh.default_branch})
        if parts[:2] == ["git", "ref"] and method == "GET":
            ref = "refs/" + "/".join(parts[2:])
            if ref not in gh.refs:
                return self.not_found()
            return self.reply_json(200, {"ref": ref, "object": {"sha": gh.refs[ref], "type": "commit"}})
        if parts[:2] == ["git", "refs"]:
            if method == "POST" and len(parts) == 2:
                body = json.loads(self.read_body() or b"{}")
                ref, sha = body.get("ref", ""), body.get("sha", "")
                if not ref.startswith("refs/") or ref.count("/") < 2 or not sha:
                    return self.reply_json(422, {"message": "Reference name invalid"})
                if ref in gh.refs:
                    return self.reply_json(422, {
                        "message": "Reference already exists",
                        "errors": [{"resource": "Reference", "code": "already_exists", "field": "ref"}],
                        "documentation_url": "https://docs.github.com/rest/git/refs#create-a-reference",
                        "status": "422"})
                gh.refs[ref] = sha
                return self.reply_json(201, {"ref": ref, "object": {"sha": sha, "type": "commit"}})
            if method == "DELETE" and len(parts) > 2:
                ref = "refs/" + "/".join(parts[2:])
                if ref not in gh.refs:
                    return self.reply_json(422, {"message": "Reference does not exist"})
                del gh.refs[ref]
                return self.reply_json(204, None)
        if parts and parts[0] == "releases":
            return self._releases(method, parts[1:])
        return self.not_found()

    def _releases(self, method: str, parts: list[str]) -> Reply:
        gh = self.gh
        if not parts:
            if method == "GET":
                rels = sorted(gh.releases.values(), key=lambda r: -r.id)
                return self.reply_json(200, [gh.release_json(r) for r in rels])
            if method == "POST":
                body = json.loads(self.read_body() or b"{}")
                tag = body.get("tag_name") or ""
                if any(r.tag_name == tag and not r.draft for r in gh.releases.values()):
                    return self.validation("already_exists", "Validation Failed", "Release", "tag_name")
                rel = gh.add_release(tag, draft=True, prerelease=bool(body.get("prerelease")))
                rel.name = body.get("name") or tag
                rel.body = str(body.get("body") or "")
                if not body.get("draft"):
                    rel.draft, rel.published_at = False, iso()
                    gh.refs.setdefault(f"refs/tags/{tag}", gh.head_sha)
                    gh.set_latest(rel, body.get("make_latest"))
                return self.reply_json(201, gh.release_json(rel))
            return self.not_found()
        if parts == ["latest"] and method == "GET":
            latest = gh.latest_release()
            return self.reply_json(200, gh.release_json(latest)) if latest else self.not_found()
        if parts[0] == "tags" and len(parts) == 2 and method == "GET":
            rels = [r for r in gh.releases.values() if r.tag_name == parts[1] and not r.draft]
            return self.reply_json(200, gh.release_json(rels[0])) if rels else self.not_found()
        if parts[0] == "assets" and len(parts) == 2:
            a = gh.assets.get(int(parts[1])) if parts[1].isdigit() else None
            if a is None:
                return self.not_found()
            if method == "DELETE":
                del gh.assets[a.id]
                rel = gh.releases.get(a.release_id)
                if rel and a.id in rel.assets:
                    rel.assets.remove(a.id)
                return self.reply_json(204, None)
            if method == "GET":
                if "application/octet-stream" in self.headers.get("accept", ""):
                    return self.reply(Reply(302, {"Location": f"{gh.cdn_url}/cdn/{a.id}/{a.name}?sig=abc"}))
                return self.reply_json(200, gh.asset_json(a))
            return self.not_found()
        if not parts[0].isdigit() or int(parts[0]) not in gh.releases:
            return self.not_found()
        rel = gh.releases[int(parts[0])]
        if len(parts) == 1:
            if method == "GET":
                return self.reply_json(200, gh.release_json(rel))
            if method == "PATCH":
                body = json.loads(self.read_body() or b"{}")
                if "body" in body:
                    rel.body = str(body["body"] or "")
                if "prerelease" in body:
                    rel.prerelease = bool(body["prerelease"])
                publishing = "draft" in body and rel.draft and not body["draft"]
                if "draft" in body:
                    if publishing:
                        rel.published_at = iso()
                        gh.refs.setdefault(f"refs/tags/{rel.tag_name}", gh.head_sha)
                    rel.draft = bool(body["draft"])
                if publishing or (not rel.draft and "make_latest" in body):
                    gh.set_latest(rel, body.get("make_latest"))  # absent on publishing: "true", as on GitHub
                if gh.latest == rel.id and (rel.draft or rel.prerelease):
                    gh.latest = gh._legacy_latest(but=rel.id)
                return self.reply_json(200, gh.release_json(rel))
            if method == "DELETE":
                for a in rel.assets:
                    gh.assets.pop(a, None)
                del gh.releases[rel.id]
                if gh.latest == rel.id:
                    gh.latest = gh._legacy_latest()
                return self.reply_json(204, None)
        if len(parts) == 2 and parts[1] == "assets" and method == "GET":
            return self.reply_json(200, [gh.asset_json(gh.assets[i]) for i in rel.assets if i in gh.assets])
        return self.not_found()

    def _upload(self, rel_id: int, name: str) -> Reply:
        gh = self.gh
        rel = gh.releases.get(rel_id)
        data = self.read_body()
        if rel is None:
            return self.not_found()
        if not name:
            return self.validation("missing_field", "Validation Failed", "ReleaseAsset", "name")
        if any(gh.assets[i].name == name for i in rel.assets if i in gh.assets):
            return self.validation("already_exists", "Validation Failed", "ReleaseAsset", "name")
        a = gh._add_asset(rel, name, data, content_type=self.headers.get("content-type", ""))
        return self.reply_json(201, gh.asset_json(a))

    # -------------------------------------------------------------------------------- CDN

    def serve_cdn(self, cut: int | None = None, short: int | None = None) -> Reply:
        """The asset's bytes (from a Range's start): `cut` hangs up after that many of them, the full length
        announced; `short` serves the asset as if it ended after its first `short` bytes. Paced at the fake's
        `cdn_rate`."""
        gh = self.gh
        parts = urlsplit(self.path).path.split("/")
        with gh.lock:
            a = gh.assets.get(int(parts[2])) if len(parts) > 2 and parts[1] == "cdn" and parts[2].isdigit() else None
            body = a.data if a else None
        if body is None:
            return self.reply(Reply(404))
        etag = f'"{hashlib.sha256(body).hexdigest()[:16]}"'
        if short is not None:
            body = body[:short]
        return self.reply(loopback.ranged(self.request, body, etag=etag,
                                          headers={"Content-Type": "application/octet-stream"}, cut=cut,
                                          rate=gh.cdn_rate))
