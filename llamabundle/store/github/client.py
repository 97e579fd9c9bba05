"""The GitHub REST client of the GitHub store: one `requests` session, every call retried for dropped
connections (net's classification), 5xx, 429 and rate-limit 403s, typed errors carrying the status and
GitHub's request id, small assets fetched and resumed through net.fetch_small, and uploads that reconcile
with what an earlier attempt left. The token goes only to the API and upload hosts, never to the download
(CDN) host, and never into a message."""

from __future__ import annotations

import datetime as dt
import hashlib
import random
import time
from collections.abc import Callable
from typing import IO, Any
from urllib.parse import quote

import requests

from ... import net, untrusted
from ...bundle.manifest import MAX_MANIFEST_BYTES
from ...errors import LlamaBundleError, StoreError
from ...log import Log

API_VERSION = "2022-11-28"
DEFAULT_API_URL = "https://api.github.com"
MAX_SMALL = MAX_MANIFEST_BYTES  # the most a bundle.json or SHA256SUMS asset may hold


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


class GitHubClient:
    """Calls to one repository's API, with the retry policy and the token rules above."""

    def __init__(self, repo: str, *, api_url: str, token: str | None, log: Log, http: requests.Session,
                 sleep: Callable[[float], None], max_attempts: int, refused_attempts: int, max_wait: float,
                 max_total: float, backoff: float, max_backoff: float, timeout: tuple[float, float],
                 upload_timeout: tuple[float, float]) -> None:
        self.repo, self.api_url, self.token, self.log, self.http, self.sleep = repo, api_url, token, log, http, sleep
        self.max_attempts, self.refused_attempts = max(1, max_attempts), max(1, refused_attempts)
        self.max_wait, self.max_total, self.backoff, self.max_backoff = max_wait, max_total, backoff, max_backoff
        self.timeout, self.upload_timeout = timeout, upload_timeout
        self.repo_api = f"{api_url}/repos/{repo}"
        self.trusted = {net.origin(api_url)}  # origins that may see the token

    # ------------------------------------------------------------------------------------------ calls

    def headers(self, *, octet: bool = False, auth: bool = True) -> dict[str, str]:
        h = {"Accept": "application/octet-stream" if octet else "application/vnd.github+json",
             "X-GitHub-Api-Version": API_VERSION}
        if auth and self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    def trust_upload(self, rel: dict[str, Any]) -> str:
        """The release's upload URL (its host may see the token from now on)."""
        upload = str(rel.get("upload_url") or "").split("{", 1)[0]
        if upload:
            self.trusted.add(net.origin(upload))
        return upload

    def api(self, method: str, url: str, *, ok: tuple[int, ...] = (200,), json_body: Any = None,
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
            except net.HOPELESS as e:
                raise net.NetworkError(f"cannot {what} in {self.repo}", why=self.redact(str(e)),
                                       fix="check GITHUB_API_URL (or LLAMABUNDLE_GITHUB_API_URL)") from None
            except net.DROPPED as e:
                refused = net.refused(e)
                lost = lost or not refused
                why = net.short_reason(e)
                delay = self.delay(attempt)
                limit = min(max_attempts, self.refused_attempts) if refused else max_attempts
                if attempt >= limit or time.monotonic() - start + delay > self.max_total:
                    raise net.NetworkError(f"cannot {what} in {self.repo}: {self.api_url} is unreachable",
                                           why=self.redact(f"{why} (gave up after {attempt} attempts)"),
                                           fix="check the network, or GITHUB_API_URL (or LLAMABUNDLE_GITHUB_API_URL)") from None
                self.log.info(self.redact(f"    github: {what}: {why}; retry {attempt}/{limit - 1} in {delay:.1f}s"))
                self.sleep(delay)
                continue
            if r.status_code in ok:
                return r
            retry = self._retry_delay(r, attempt)
            if retry is None:
                err = self.error(r, what)
                err.lost = lost
                r.close()
                raise err
            delay = retry
            if delay > self.max_wait:
                err = self.error(r, what)
                r.close()
                raise RateLimitError(f"cannot {what} in {self.repo}: GitHub asks to wait {delay:.0f}s",
                                     status=err.status, request_id=err.request_id, why=err.why,
                                     fix="wait and retry, or use a token with a higher rate limit (GITHUB_TOKEN)")
            if attempt >= max_attempts or time.monotonic() - start + delay > self.max_total:
                err = self.error(r, what)
                r.close()
                err.why = self.redact(f"{err.why} (gave up after {attempt} attempts)".strip())
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
            h: dict[str, str | None] = {**self.headers(auth=False), **(headers or {})}
            if self.token and net.origin(cur) in self.trusted:
                h["Authorization"] = f"Bearer {self.token}"
            else:
                h["Authorization"] = None  # None drops a session-level header too
            r = self.http.request(method, cur, headers=h,  # type: ignore[arg-type]  # stubs: no None values
                                  json=json_body, timeout=self.timeout, stream=stream, allow_redirects=False)
            if not (follow and method == "GET" and r.is_redirect):
                return r
            cur = net.redirected(cur, r)
        raise net.too_many_redirects()

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
        return self.delay(attempt)

    def delay(self, attempt: int) -> float:
        """The backoff before retry `attempt` (jittered, at most max_backoff)."""
        return min(self.max_backoff, self.backoff * 2.0 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    def error(self, r: requests.Response, what: str) -> GitHubError:
        rid = r.headers.get("x-github-request-id")
        try:
            body = untrusted.loads(r.content)
        except ValueError:  # not JSON, or past the limits: the status alone
            body = {}
        body = body if isinstance(body, dict) else {}
        msg = str(body.get("message") or r.reason or "")
        listed = body.get("errors")
        errors: list[Any] = listed if isinstance(listed, list) else []
        detail = "; ".join(str(e.get("message") or e.get("code") or e) if isinstance(e, dict) else str(e)
                           for e in errors)
        why = self.redact(f"HTTP {r.status_code}: {msg}" + (f" ({detail})" if detail else ""))
        fix = {401: "check GITHUB_TOKEN / GH_TOKEN",
               403: "the token needs contents: write on the repository (or wait for the rate limit)",
               404: f"check that {self.repo} exists and the token can see it"}.get(r.status_code, "retry later")
        cls: type[GitHubError] = GitHubError
        if r.status_code == 422:
            cls = GitHubValidationError
            if "/git/refs" in r.url and already_exists(errors, msg):
                cls = RefExistsError
            fix = "see GitHub's message"
        return cls(self.redact(f"cannot {what} in {self.repo}"), status=r.status_code, request_id=rid,
                   errors=errors, why=why, fix=fix)

    def json(self, r: requests.Response, what: str) -> Any:
        """The answer's JSON; one that is not JSON (or past untrusted's limits) is a NetworkError (exit 6) that
        says what came back: URL, status, content type, first bytes."""
        return net.answer_json(r, what=f"GitHub's answer for {what}", redact=self.redact,
                               fix="check GITHUB_API_URL (or LLAMABUNDLE_GITHUB_API_URL)")

    def redact(self, text: str) -> str:
        return text.replace(self.token, "***") if self.token else text

    def redacted(self, e: StoreError) -> StoreError:
        e.what, e.why, e.fix, e.details = (self.redact(x) for x in (e.what, e.why, e.fix, e.details))
        e.args = (e.what,)
        return e

    # ------------------------------------------------------------------------------------------ assets

    def asset_bytes(self, asset: dict[str, Any], what: str, *, error: type[LlamaBundleError] = StoreError,
                    fix: str = "") -> bytes:
        """A small asset's bytes (net.fetch_small: resumed until it has the asset's size and digest)."""
        def get(headers: dict[str, str]) -> requests.Response:
            return self.api("GET", asset["url"], headers=headers, follow=True, stream=True, ok=(200, 206, 416),
                            what=f"download {what}")

        return net.fetch_small(get, what=what, source=self.repo, size=asset_size(asset), sha256=asset_digest(asset),
                               max_bytes=MAX_SMALL, attempts=self.max_attempts, delay=self.delay, sleep=self.sleep,
                               log=self.log, label="github: download", redact=self.redact, error=error,
                               fix=fix or f"delete the release holding it in {self.repo}, then publish again")

    def upload(self, rel_id: int, upload_url: str, name: str, ctype: str, body: Callable[[], IO[bytes] | bytes],
               size: int, sha: str) -> dict[str, Any]:
        """Upload one asset to a draft release; a retry first reconciles with what an earlier attempt left."""
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
                headers = {**self.headers(), "Content-Type": ctype, "Content-Length": str(size)}
                why, delay = None, None
                try:
                    r = self.http.post(url, data=data, headers=headers, timeout=self.upload_timeout,
                                       allow_redirects=False)
                except net.HOPELESS as e:
                    raise StoreError(f"cannot upload {name} to {self.repo}", why=self.redact(str(e))) from None
                except net.DROPPED as e:
                    why = net.short_reason(e)
                else:
                    with r:
                        if r.status_code == 201:
                            asset: dict[str, Any] = self.json(r, name)
                            got = asset_digest(asset)
                            if asset.get("state", "uploaded") == "uploaded" and (got is None or got == sha):
                                return asset
                            why = f"the uploaded {name} came back as {asset.get('state')} with digest {got}"
                            if "id" in asset:  # ours, and damaged: remove it before trying again
                                self.api("DELETE", f"{self.repo_api}/releases/assets/{asset['id']}", ok=(204, 404),
                                         what=f"delete the damaged asset {name}")
                        elif r.status_code == 422:
                            err = self.error(r, f"upload {name}")
                            if not already_exists(err.errors, err.why):
                                raise err
                            why = "an asset of that name is already there"
                            delay = 0.0
                        else:
                            delay = self._retry_delay(r, attempt)
                            if delay is None:
                                raise self.error(r, f"upload {name}")
                            why = f"HTTP {r.status_code}"
            finally:
                if hasattr(data, "close"):
                    data.close()
            if delay is None:
                delay = self.delay(attempt)
            if attempt >= self.max_attempts or time.monotonic() - start + delay > self.max_total:
                raise net.NetworkError(f"cannot upload {name} to {self.repo}",
                                       why=self.redact(f"{why} (gave up after {attempt} attempts)"),
                                       fix="check the network and retry; the publish cleans up its leftovers")
            self.log.info(self.redact(f"    github: upload {name}: {why}; retry in {delay:.1f}s"))
            if delay:
                self.sleep(delay)

    def _reconcile(self, rel_id: int, name: str, sha: str) -> dict[str, Any] | None:
        """Before re-uploading: an asset of that name that is complete with our digest is done; a partial one
        (state != uploaded) is deleted; a complete one with another digest is a conflict."""
        r = self.api("GET", f"{self.repo_api}/releases/{rel_id}/assets?per_page=100",
                     what="list the release's assets")
        for a in self.json(r, "the asset list"):
            if not isinstance(a, dict) or a.get("name") != name:
                continue
            if a.get("state") != "uploaded":
                self.log.info(f"    github: removing the incomplete asset {name} (state {a.get('state')})")
                self.api("DELETE", f"{self.repo_api}/releases/assets/{a['id']}", ok=(204, 404),
                         what=f"delete the incomplete asset {name}")
                return None
            got = asset_digest(a)
            if got == sha:
                return a
            raise AssetConflictError(f"the release in {self.repo} already holds a different {name}",
                                     why=f"its digest is {a.get('digest') or 'unknown'}, ours is sha256:{sha}",
                                     fix="delete that release (or asset) by hand if it is wrong, then retry")
        return None


# ---------------------------------------------------------------------------------- what GitHub says


def asset_size(asset: dict[str, Any]) -> int | None:
    n = asset.get("size")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def asset_digest(asset: dict[str, Any]) -> str | None:
    """The sha256 of an asset's `digest` (`sha256:…`), or None when GitHub gives none."""
    d = asset.get("digest")
    if isinstance(d, str) and d.lower().startswith("sha256:"):
        return d[7:].lower()
    return None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def already_exists(errors: list[Any], message: str) -> bool:
    return (any(isinstance(e, dict) and e.get("code") == "already_exists" for e in errors)
            or "already exists" in message.lower())


def age(created_at: Any) -> float:
    """Seconds since a GitHub timestamp (0 when it is not one)."""
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
