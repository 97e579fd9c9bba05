"""The OCI distribution (v2) client of the `oci://` store: the store URL parsed strictly (`Ref`), one `requests`
session, each call retried for dropped connections, 5xx and 429, the auth handshake (anonymous first; on a 401 a
Bearer token from the challenge's realm, with Basic credentials when configured, cached per scope; or Basic
itself), typed errors carrying the status and the registry's error codes, blob uploads (HEAD, mount, one
streamed PUT) and blob downloads checked against their digest as they stream, resumed with Range. Credentials
and tokens go only to the registry's origin (and the password to its token realm), never into a message."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import quote, urljoin, urlsplit

import requests

from ... import net, untrusted
from ...errors import StoreError, UsageError
from ...log import Log, ProgressHandle
from ..ranged import RangedStream, Retry, Window

CHUNK = 1 << 20
MAX_ERROR_BODY = 64 << 10  # the most of an error answer read for its message
MAX_WAIT = 60.0  # seconds: the longest Retry-After honoured
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


class Stream(Protocol):
    """A request body read as it is sent (a file)."""

    def read(self, n: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


Body = bytes | Callable[[], Stream] | None  # a request body: bytes, or a function opening a file (once per attempt)

_HOST_RE = re.compile(r"(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*")
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
REPO_RE = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")  # the distribution spec's <name>
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")  # the distribution spec's <reference> as a tag
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_SCHEME_AT = re.compile(rf"[\s,]*({_TOKEN})")
_PARAM_AT = re.compile(rf'[\s,]*({_TOKEN})\s*=\s*("(?:[^"\\]|\\.)*"|{_TOKEN})')
_NEXT_LINK = re.compile(r'<([^>]*)>\s*;[^,]*\brel="?next"?', re.IGNORECASE)
URL_FORM = "oci://HOST[:PORT]/REPO"
CREDENTIALS_FIX = ("set LLAMABUNDLE_REGISTRY_USER and LLAMABUNDLE_REGISTRY_PASSWORD (for ghcr.io: GITHUB_TOKEN, a token "
                   "with read:packages, and write:packages to publish)")


# ---------------------------------------------------------------------------------------- the store URL


@dataclass(frozen=True)
class Ref:
    """A registry repository: `oci://HOST[:PORT]/REPO`, and the scheme its API is reached by."""

    host: str  # lower case; an IPv6 address without its brackets
    port: int | None
    repo: str
    scheme: str  # "https", or "http" for a loopback address (or LLAMABUNDLE_REGISTRY_INSECURE=1)
    insecure: bool = False

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"oci://{self.netloc}/{self.repo}"

    @property
    def base(self) -> str:
        return f"{self.scheme}://{self.netloc}"

    def location(self, digest: str) -> str:
        return f"{self.url}@{digest}"


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_url(url: str, *, insecure: bool = False) -> Ref:
    """`oci://HOST[:PORT]/REPO` (REPO: lower-case components of [a-z0-9._-] joined by `/`, as the distribution
    spec names repositories); anything else is a UsageError saying what is wrong."""
    def bad(why: str, fix: str = f"write the store as {URL_FORM}, e.g. oci://ghcr.io/OWNER/bundles") -> UsageError:
        return UsageError(f"store '{shown}' is not an OCI repository URL", why=why, fix=fix)

    rest = url.removeprefix("oci://")
    authority, slash, path = rest.partition("/")
    shown = url if "@" not in authority else f"oci://***@{authority.rpartition('@')[2]}/{path}"
    if not url.startswith("oci://"):
        raise bad("it does not start with oci://")
    if "@" in authority:
        raise bad("it holds a user name or password", fix="remove them from the URL; set LLAMABUNDLE_REGISTRY_USER and "
                                                          "LLAMABUNDLE_REGISTRY_PASSWORD instead")
    if "?" in url or "#" in url:
        raise bad("it has a query or a fragment")
    if authority.startswith("["):
        literal, close, after = authority[1:].partition("]")
        try:
            ipaddress.IPv6Address(literal)
        except ValueError:
            raise bad(f"[{literal}] is not an IPv6 address") from None
        if not close or (after and not after.startswith(":")):
            raise bad(f"'{authority}' is not HOST[:PORT]")
        host, port_text = literal.lower(), after[1:] if after else None
    else:
        host, colon, port_text_ = authority.partition(":")
        port_text = port_text_ if colon else None
        host = host.lower()
        if not _HOST_RE.fullmatch(host) or len(host) > 253:
            raise bad(f"'{host or authority}' is not a host name" if authority else "it names no host")
    port = None
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536 or len(port_text) > 5:
            raise bad(f"'{port_text}' is not a port (1-65535)")
        port = int(port_text)
    if not slash or not path:
        raise bad("it names no repository", fix=f"add the repository: {URL_FORM}")
    if path.endswith("/"):
        raise bad("it ends with '/'", fix=f"drop the trailing slash: oci://{authority}/{path.rstrip('/')}")
    tail = path.rpartition("/")[2]
    if ":" in tail or "@" in path:
        raise bad("it names an image (a :tag or @digest), not a repository",
                  fix=f"name the repository only: oci://{authority}/{path.split('@')[0].rsplit(':', 1)[0]}")
    if not REPO_RE.fullmatch(path):
        why = ("a repository name is lower case" if REPO_RE.fullmatch(path.lower()) else
               f"'{path}' is not a repository name: components of lower-case letters, digits and single '.', '_', "
               "'__' or '-' runs between them, joined by '/'")
        raise bad(why)
    ref = Ref(host=host, port=port, repo=path, scheme="http" if insecure or is_loopback(host) else "https",
              insecure=insecure)
    if len(f"{ref.netloc}/{path}") > 255:
        raise bad("HOST[:PORT]/REPO is longer than 255 characters")
    return ref


# --------------------------------------------------------------------------------------------- errors


class RegistryError(StoreError):
    """The registry refused a request (exit 6); carries the HTTP status and the registry's error codes."""

    def __init__(self, what: str, *, status: int | None = None, codes: Sequence[str] = (), why: str = "",
                 fix: str = "") -> None:
        super().__init__(what, why=why, fix=fix)
        self.status = status
        self.codes = tuple(codes)


def error_codes(body: bytes) -> tuple[list[str], str]:
    """The codes and the first message of a registry's error answer (`{"errors": [{"code", "message"}]}`)."""
    try:
        data = untrusted.loads(body, max_bytes=MAX_ERROR_BODY)
    except ValueError:
        return [], ""
    errors = data.get("errors") if isinstance(data, dict) else None
    if not isinstance(errors, list):
        detail = data.get("details") or data.get("message") if isinstance(data, dict) else None
        return [], str(detail)[:300] if isinstance(detail, str) else ""
    codes = [str(e.get("code"))[:60] for e in errors if isinstance(e, dict) and e.get("code")]
    messages = [str(e.get("message"))[:300] for e in errors if isinstance(e, dict) and e.get("message")]
    return codes, messages[0] if messages else ""


# --------------------------------------------------------------------------------------------- auth


@dataclass(frozen=True)
class Challenge:
    """One challenge of a WWW-Authenticate header: its scheme (lower case) and its parameters."""

    scheme: str
    params: Mapping[str, str] = field(default_factory=dict)


def parse_challenges(header: str) -> list[Challenge]:
    """The challenges of a WWW-Authenticate header (RFC 9110 §11.6.1): `Bearer realm="…",service="…",scope="…"`,
    `Basic realm="…"`, several separated by commas. Parameter names are lower-cased; quoted values unescaped."""
    out: list[Challenge] = []
    i, n = 0, len(header)
    while i < n:
        m = _SCHEME_AT.match(header, i)
        if m is None:
            break
        scheme, i = m.group(1).lower(), m.end()
        params: dict[str, str] = {}
        while (p := _PARAM_AT.match(header, i)) is not None:
            value = p.group(2)
            if value.startswith('"'):
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            params[p.group(1).lower()] = value
            i = p.end()
        if not params:  # a token68 (`Bearer abc=`) or nothing: skip to the next comma
            j = header.find(",", i)
            i = n if j < 0 else j + 1
        out.append(Challenge(scheme, params))
    return out


# --------------------------------------------------------------------------------------------- client


class RegistryClient:
    """Calls to one repository of one registry, with the retry policy and the credential rules above."""

    def __init__(self, ref: Ref, *, user: str | None, password: str | None, log: Log, http: requests.Session,
                 timeout: tuple[float, float], upload_timeout: tuple[float, float], max_attempts: int = 5,
                 backoff: float = 0.5, max_backoff: float = 10.0, sleep: Callable[[float], None] = time.sleep) -> None:
        self.ref, self.log, self.http, self.sleep = ref, log, http, sleep
        self.user, self.password = (user or ("llamabundle" if password else None)), password or None
        self.timeout, self.upload_timeout = timeout, upload_timeout
        self.max_attempts, self.backoff, self.max_backoff = max(1, max_attempts), backoff, max_backoff
        self.origin = net.origin(ref.base)
        self._secrets: list[str] = [s for s in (password,) if s]
        self._tokens: dict[str, str] = {}  # scope -> bearer token
        self._basic = False  # the registry asked for Basic credentials: sent with every request from then on
        self._api_checked = False  # GET /v2/ answered as a registry does

    # ------------------------------------------------------------------------------------ helpers

    def url(self, tail: str) -> str:
        return f"{self.ref.base}/v2/{self.ref.repo}/{tail}"

    def redact(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def scope(self, *, push: bool) -> str:
        return f"repository:{self.ref.repo}:pull" + (",push" if push else "")

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff, self.backoff * 2.0 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    @property
    def has_credentials(self) -> bool:
        return bool(self.user and self.password)

    # ------------------------------------------------------------------------------------ calls

    def request(self, method: str, url: str, *, what: str, ok: tuple[int, ...] = (200,), push: bool = False,
                headers: Mapping[str, str] | None = None, body: Body = None, stream: bool = False,
                follow: bool = False, attempts: int | None = None,
                timeout: tuple[float, float] | None = None) -> requests.Response:
        """One call, retried for dropped connections, 5xx and 429, authenticating on a 401; a status outside `ok`
        raises RegistryError (a connection that cannot be made: net.NetworkError)."""
        limit = attempts or self.max_attempts
        attempt = 0
        while True:
            attempt += 1
            try:
                r = self._authed(method, url, push=push, headers=headers or {}, body=body, stream=stream,
                                 follow=follow, timeout=timeout or self.timeout, what=what)
            except requests.exceptions.SSLError as e:
                raise net.NetworkError(f"cannot {what} in {self.ref.url}: the TLS handshake with {self.ref.netloc} failed",
                                       why=self.redact(net.short_reason(e)),
                                       fix="check the host; a registry that speaks plain http needs "
                                           "LLAMABUNDLE_REGISTRY_INSECURE=1") from None
            except net.HOPELESS as e:
                raise RegistryError(f"cannot {what} in {self.ref.url}", why=self.redact(net.short_reason(e)),
                                    fix=f"check the store URL ({URL_FORM})") from None
            except net.DROPPED as e:
                if net.refused(e) or attempt >= limit:
                    raise self.unreachable(e, what, attempt) from None
                delay = self.delay(attempt)
                self.log.info(self.redact(f"    oci: {what}: {net.short_reason(e)}; retry {attempt}/{limit - 1} "
                                          f"in {delay:.1f}s"))
                self.sleep(delay)
                continue
            if r.status_code in ok:
                return r
            if (r.status_code == 429 or 500 <= r.status_code <= 599) and attempt < limit:
                ra = r.headers.get("Retry-After", "").strip()
                delay = min(float(ra), MAX_WAIT) if ra.isdigit() else self.delay(attempt)
                self.log.info(f"    oci: {what}: HTTP {r.status_code}; retry {attempt}/{limit - 1} in {delay:.1f}s")
                r.close()
                self.sleep(delay)
                continue
            err = self.error(r, what)
            r.close()
            raise err

    def unreachable(self, e: BaseException, what: str, attempts: int) -> net.NetworkError:
        reason = net.short_reason(e)
        if net.refused(e):
            why = f"{reason}: nothing answers at {self.ref.base}" if "refused" in reason else reason
        else:
            why = f"{reason} (gave up after {attempts} attempts)"
        return net.NetworkError(f"cannot {what} in {self.ref.url}: the registry {self.ref.netloc} is unreachable",
                                why=self.redact(why), fix=f"check the store URL ({URL_FORM}), the network, and that "
                                                          "the registry is running")

    def error(self, r: requests.Response, what: str) -> RegistryError:
        """The answer as a RegistryError: the status, the registry's codes and message, what to do."""
        body = b""
        if r.request is not None and r.request.method != "HEAD":
            try:  # the first 64 KiB, whether the answer was streamed or already read
                body = next(r.iter_content(MAX_ERROR_BODY), b"")
            except Exception:  # noqa: BLE001 - only the message suffers
                body = b""
        codes, message = error_codes(body)
        status = r.status_code
        why = f"HTTP {status}" + (f" {', '.join(codes)}" if codes else "") + (
            f": {message}" if message else (f" {r.reason}" if r.reason else ""))
        return RegistryError(self.redact(f"cannot {what} in {self.ref.url}"), status=status, codes=codes,
                             why=self.redact(why), fix=self._fix(status, codes))

    def _fix(self, status: int, codes: Sequence[str]) -> str:
        if status == 401 or "UNAUTHORIZED" in codes:
            if self.has_credentials:
                return ("the registry refused the credentials: check LLAMABUNDLE_REGISTRY_USER and "
                        "LLAMABUNDLE_REGISTRY_PASSWORD (for ghcr.io: GITHUB_TOKEN)")
            return CREDENTIALS_FIX
        if status == 403 or "DENIED" in codes:
            return ("the credentials lack the permission: give the user (or token) access to "
                    f"{self.ref.repo} (to publish: push; for ghcr.io: write:packages)")
        if "NAME_UNKNOWN" in codes:
            return f"check the repository in the store URL ({self.ref.url}); it appears with the first publish"
        if "BLOB_UNKNOWN" in codes or "MANIFEST_UNKNOWN" in codes or "MANIFEST_BLOB_UNKNOWN" in codes:
            return "the registry lost part of the entry: publish the bundle again"
        if status == 413 or "SIZE_INVALID" in codes:
            return "the registry refuses a blob this large: check its upload limits"
        if status == 404:
            return f"check the store URL ({self.ref.url}): is {self.ref.base} an OCI registry?"
        return "retry later; if it persists, see the registry's message"

    # ------------------------------------------------------------------------------------ auth

    def _authed(self, method: str, url: str, *, push: bool, headers: Mapping[str, str], body: Body, stream: bool,
                follow: bool, timeout: tuple[float, float], what: str) -> requests.Response:
        scope = self.scope(push=push)
        r = self._send(method, url, scope=scope, headers=headers, body=body, stream=stream, follow=follow,
                       timeout=timeout)
        if r.status_code != 401:
            return r
        challenges = parse_challenges(r.headers.get("WWW-Authenticate", ""))
        by_scheme = {c.scheme: c for c in challenges}
        if "bearer" in by_scheme:
            r.close()
            self._token(by_scheme["bearer"], scope, what)
        elif "basic" in by_scheme and not self._basic:
            if not self.has_credentials:
                return r  # the 401 stands: error() says to set the credentials
            r.close()
            self._basic = True
        else:
            return r
        return self._send(method, url, scope=scope, headers=headers, body=body, stream=stream, follow=follow,
                          timeout=timeout)

    def _auth_header(self, scope: str) -> str | None:
        if self._basic and self.user and self.password:
            return basic_header(self.user, self.password)
        token = self._tokens.get(scope) or (self._tokens.get(scope + ",push") if not scope.endswith(",push") else None)
        return f"Bearer {token}" if token else None

    def _token(self, ch: Challenge, scope: str, what: str) -> None:
        """A bearer token for `scope` from the challenge's realm (with Basic credentials when configured)."""
        realm = ch.params.get("realm", "")
        parts = urlsplit(realm)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RegistryError(f"cannot {what} in {self.ref.url}: the registry asks for a token from "
                                f"'{realm[:200]}', which is not an http(s) URL", status=401,
                                why="its WWW-Authenticate header names no usable realm",
                                fix=f"check the store URL ({self.ref.url})")
        creds = self.has_credentials
        if creds and parts.scheme == "http" and not (is_loopback(parts.hostname) or self.ref.insecure):
            raise RegistryError(f"cannot {what} in {self.ref.url}: its token service {realm} is plain http",
                                status=401, why="the password is never sent unencrypted",
                                fix="use a registry whose token service speaks https (or set "
                                    "LLAMABUNDLE_REGISTRY_INSECURE=1 on a network you trust)")
        params = [("service", ch.params["service"])] if ch.params.get("service") else []
        params += [("scope", s) for s in (ch.params.get("scope") or scope).split()]
        service = f"the token service of {self.ref.netloc} ({parts.scheme}://{parts.netloc})"
        try:
            r = self.http.get(realm, params=params, auth=(self.user, self.password) if creds else None,  # type: ignore[arg-type]
                              timeout=self.timeout, allow_redirects=False)
        except (*net.HOPELESS, *net.DROPPED) as e:
            raise net.NetworkError(f"cannot {what} in {self.ref.url}: {service} is unreachable",
                                   why=self.redact(net.short_reason(e)), fix="check the network and retry") from None
        with r:
            if r.status_code != 200:
                codes, message = error_codes(r.content[:MAX_ERROR_BODY])
                who = "refused the credentials" if creds else "gave no anonymous token"
                why = f"HTTP {r.status_code}" + (f" {', '.join(codes)}" if codes else "") + (
                    f": {message}" if message else (f" {r.reason}" if r.reason else ""))
                raise RegistryError(self.redact(f"cannot {what} in {self.ref.url}: {service} {who}"),
                                    status=r.status_code, codes=codes or (["UNAUTHORIZED"] if r.status_code == 401 else []),
                                    why=self.redact(why), fix=self._fix(401 if r.status_code in (401, 403) else r.status_code, codes))
            try:
                data = untrusted.loads(r.content, max_bytes=MAX_ERROR_BODY)
            except ValueError:
                data = None
        token = (data.get("token") or data.get("access_token")) if isinstance(data, dict) else None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"cannot {what} in {self.ref.url}: {service} answered no token", status=r.status_code,
                                why="its answer is not JSON with a `token`", fix="check the store URL")
        self._secrets.append(token)
        self._tokens[scope] = token

    def _send(self, method: str, url: str, *, scope: str, headers: Mapping[str, str], body: Body, stream: bool,
              follow: bool, timeout: tuple[float, float]) -> requests.Response:
        """One request; GET and HEAD follow redirects by hand, so that credentials never leave the registry's origin."""
        cur = url
        for _hop in range(net.MAX_REDIRECTS + 1):
            h: dict[str, str | None] = dict(headers)
            h["Authorization"] = self._auth_header(scope) if net.origin(cur) == self.origin else None
            data = body() if callable(body) else body
            try:
                # requests drops a header whose value is None (merge_setting); its annotations allow no None
                r = self.http.request(method, cur, headers=h, data=data, timeout=timeout,  # type: ignore[arg-type]
                                      stream=stream, allow_redirects=False)
            finally:
                if data is not None and not isinstance(data, bytes):
                    data.close()
            if not (follow and method in ("GET", "HEAD") and r.is_redirect):
                return r
            cur = net.redirected(cur, r)
        raise net.too_many_redirects()

    # ------------------------------------------------------------------------------------ the v2 API

    def get_manifest(self, reference: str, *, accept: str, max_bytes: int, what: str) -> tuple[bytes, str] | None:
        """A manifest's bytes and its digest (the sha256 of those bytes, which the registry's
        Docker-Content-Digest must agree with), or None when the registry does not know it."""
        r = self.request("GET", self.url(f"manifests/{reference}"), what=what, ok=(200, 404), stream=True,
                         follow=True, headers={"Accept": accept})
        with r:
            if r.status_code == 404:
                codes, _message = error_codes(r.raw.read(MAX_ERROR_BODY, decode_content=True))
                if codes and not set(codes) & {"MANIFEST_UNKNOWN", "NAME_UNKNOWN", "NOT_FOUND"}:
                    raise RegistryError(f"cannot {what} in {self.ref.url}", status=404, codes=codes,
                                        why=f"HTTP 404 {', '.join(codes)}", fix=self._fix(404, codes))
                if not codes:
                    self.check_api(what)  # a bare 404: a miss only if a registry said it
                return None
            body = self.read_limited(r, max_bytes, what=what)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        said = r.headers.get("Docker-Content-Digest")
        if said and said != digest and said.startswith("sha256:"):
            raise RegistryError(f"cannot {what} in {self.ref.url}: the manifest's bytes do not match its digest",
                                why=f"the registry says {said}, the bytes have {digest}",
                                fix="retry; if it persists, publish the bundle again")
        return body, digest

    def check_api(self, what: str) -> None:
        """That an OCI registry answers at the store's host (`GET /v2/`: 200, or 401 asking for credentials),
        once per client: a web server that is not one answers every manifest with a plain 404."""
        if self._api_checked:
            return
        r = self.request("GET", f"{self.ref.base}/v2/", what=what, ok=(200, 401, 403, 404), follow=True)
        r.close()
        if r.status_code == 404:
            raise RegistryError(f"cannot {what} in {self.ref.url}: {self.ref.base} is not an OCI registry", status=404,
                                why="GET /v2/ answered HTTP 404 (a registry answers 200, or 401 asking for credentials)",
                                fix=f"check the store URL ({URL_FORM})")
        self._api_checked = True

    def read_limited(self, r: requests.Response, max_bytes: int, *, what: str) -> bytes:
        try:
            body = r.raw.read(max_bytes + 1, decode_content=True)
        except net.DROPPED as e:
            raise net.NetworkError(f"cannot {what} in {self.ref.url}", why=self.redact(net.short_reason(e)),
                                   fix="check the network and retry") from None
        if len(body) > max_bytes:
            raise RegistryError(f"cannot {what} in {self.ref.url}: the answer is larger than {max_bytes} bytes",
                                why="what llamabundle publishes there is a few KiB", fix="check the store URL")
        return bytes(body)

    def get_small_blob(self, digest: str, size: int, *, max_bytes: int, what: str) -> bytes:
        """A small blob (a config) in memory; its digest and size are checked by the caller."""
        if size > max_bytes:
            raise RegistryError(f"cannot {what} in {self.ref.url}: it is {size} bytes", why=f"more than {max_bytes}",
                                fix="publish the bundle again")
        r = self.request("GET", self.url(f"blobs/{digest}"), what=what, stream=True, follow=True)
        with r:
            return self.read_limited(r, max_bytes, what=what)

    def put_manifest(self, reference: str, body: bytes, *, media_type: str, digest: str, what: str) -> None:
        r = self.request("PUT", self.url(f"manifests/{reference}"), what=what, ok=(200, 201, 202), push=True,
                         headers={"Content-Type": media_type}, body=body)
        with r:
            said = r.headers.get("Docker-Content-Digest")
        if said and said != digest:
            raise RegistryError(f"cannot {what} in {self.ref.url}: the registry stored it as {said}",
                                why=f"its bytes have {digest}; the registry changed them", fix="use another registry")

    def has_blob(self, digest: str, *, what: str) -> bool:
        r = self.request("HEAD", self.url(f"blobs/{digest}"), what=what, ok=(200, 404), push=True, follow=True)
        r.close()
        return r.status_code == 200

    def push_blob(self, digest: str, size: int, body: Callable[[], Stream] | bytes, *, what: str,
                  mount_from: Sequence[str] = (), progress: Callable[[int], None] | None = None) -> str:
        """Put a blob in the repository unless it is there: "present" (HEAD found it), "mounted" (from another
        repository of the registry) or "uploaded" (POST, then one streamed PUT of the whole blob). A dropped
        upload starts again with a new upload session."""
        if self.has_blob(digest, what=what):
            return "present"
        for src in mount_from:
            query = f"?mount={quote(digest, safe=':')}&from={quote(src, safe='/')}"
            r = self.request("POST", self.url(f"blobs/uploads/{query}"), what=what, ok=(201, 202), push=True)
            r.close()
            if r.status_code == 201:
                return "mounted"
            self._cancel(r)  # 202: the registry opened an upload session instead; abandon it
        attempt = 0
        while True:
            attempt += 1
            r = self.request("POST", self.url("blobs/uploads/"), what=what, ok=(201, 202), push=True,
                             headers={"Content-Length": "0"})
            r.close()
            location = r.headers.get("Location")
            if not location:
                raise RegistryError(f"cannot {what} in {self.ref.url}", status=r.status_code,
                                    why="the registry opened an upload session without a Location", fix="use another registry")
            target = urljoin(r.url, location)
            target += ("&" if "?" in target else "?") + f"digest={quote(digest, safe=':')}"
            opened = (lambda: _Counting(body(), progress)) if callable(body) else body
            try:
                r = self.request("PUT", target, what=what, ok=(201, 204), push=True, attempts=1, body=opened,
                                 headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                                 timeout=self.upload_timeout)
                r.close()
                return "uploaded"
            except StoreError as e:
                lost = isinstance(e, net.NetworkError) or (isinstance(e, RegistryError) and (e.status or 0) >= 500)
                if not lost or attempt >= self.max_attempts:
                    raise
                if self.has_blob(digest, what=what):
                    return "uploaded"
                delay = self.delay(attempt)
                self.log.info(self.redact(f"    oci: {what}: {e.what} ({e.why}); starting the upload again in {delay:.1f}s"))
                self.sleep(delay)

    def _cancel(self, r: requests.Response) -> None:
        location = r.headers.get("Location")
        if location:
            try:
                self.request("DELETE", urljoin(r.url, location), what="cancel an upload", ok=(200, 202, 204, 404),
                             push=True, attempts=1).close()
            except StoreError:
                pass  # the registry expires it

    def tags(self, *, what: str, page: int = 1000, max_pages: int = 1000) -> list[str]:
        """Every tag of the repository (the tags list API, following its Link header)."""
        url: str | None = self.url(f"tags/list?n={page}")
        found: list[str] = []
        for _ in range(max_pages):
            if url is None:
                return found
            r = self.request("GET", url, what=what, stream=True)
            with r:
                data = net.answer_json(r, what=f"the tag list of {self.ref.url}", error=RegistryError,
                                       redact=self.redact, fix="check the store URL", max_bytes=64 << 20)
                link = r.headers.get("Link", "")
            tags = data.get("tags") if isinstance(data, dict) else None
            if tags is not None and not isinstance(tags, list):
                raise RegistryError(f"the tag list of {self.ref.url} is not a list", fix="check the store URL")
            found += [t for t in tags or [] if isinstance(t, str)]
            m = _NEXT_LINK.search(link)
            url = urljoin(r.url, m.group(1)) if m else None
        raise RegistryError(f"{self.ref.url} has more than {max_pages * page} tags", why="listing stopped there",
                            fix="delete old tags")

    def blob(self, digest: str, size: int, *, what: str, mismatch: Callable[[str], Exception],
             progress: ProgressHandle | None = None, tries: int = 3) -> RangedStream:
        """The layer's bytes as a reader, hashed as they arrive and checked against the digest and size at the end
        (`mismatch(why)` when they differ); a dropped connection resumes with a Range request (store.ranged)."""
        window = Window(start=0, size=size, total=size, sha256=digest.removeprefix("sha256:"))

        def get(headers: dict[str, str]) -> requests.Response:
            return self.request("GET", self.url(f"blobs/{digest}"), what=what, ok=(200, 206), stream=True, follow=True,
                                headers=headers)

        retry = Retry(tries=tries, delay=self.delay, sleep=self.sleep, redact=self.redact,
                      note=lambda line: self.log.info(f"    oci: {line}"))
        return RangedStream(window, get, what=what, where=self.ref.url, mismatch=mismatch, retry=retry,
                            progress=progress)


class _Counting:
    """A file being uploaded, telling `progress` how many bytes were read."""

    def __init__(self, f: Stream, progress: Callable[[int], None] | None) -> None:
        self.f, self.progress, self.n = f, progress, 0

    def read(self, n: int = -1) -> bytes:
        chunk = self.f.read(max(n, CHUNK))  # http.client asks for 8 KiB; it sends whatever it is given
        self.n += len(chunk)
        if self.progress is not None and chunk:
            self.progress(self.n)
        return chunk

    def close(self) -> None:
        self.f.close()


def basic_header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
