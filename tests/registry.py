"""A real OCI registry for the tests: Debian's `docker-registry` (the CNCF distribution registry 2.8) started on
127.0.0.1 on a free port, its storage under the test's tmp_path, no auth (`Registry`; `serve` runs one and
skips with a reason where /usr/bin/docker-registry is missing). `Proxy` is a loopback HTTP proxy in front of it
that counts the bytes of blob GET answers and blob PUT bodies per digest, can stall a PUT part-way (for kills),
and with `auth=(user, password)` demands `Authorization: Bearer <token>`, answering 401 with a Bearer challenge
naming its own token realm, which issues tokens only for the right Basic credentials."""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import json
import re
import secrets
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import requests

DOCKER_REGISTRY = Path("/usr/bin/docker-registry")
SERVICE = "llamabundle-test-registry"
_BLOB_PATH = re.compile(r"^/v2/(?P<repo>.+)/blobs/(?P<digest>sha256:[0-9a-f]{64})$")
_REPO_PATH = re.compile(r"^/v2/(?P<repo>.+?)/(?:blobs|manifests|tags)/")

CONFIG = """\
version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {root}
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    """docker-registry serving `root` (its filesystem storage) on 127.0.0.1:`port`."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.root = where / "storage"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def netloc(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Registry:
        self.where.mkdir(parents=True, exist_ok=True)
        for _attempt in range(5):  # a free port can be taken between looking and binding: try another
            self.port = free_port()
            config = self.where / "config.yml"
            config.write_text(CONFIG.format(root=self.root, port=self.port), encoding="utf-8")
            log = open(self.where / "registry.log", "ab")  # noqa: SIM115 - the child holds it
            self.proc = subprocess.Popen([str(DOCKER_REGISTRY), "serve", str(config)], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if requests.get(f"http://{self.netloc}/v2/", timeout=2).status_code == 200:
                        return self
                except requests.RequestException:
                    pass
                time.sleep(0.05)
            self.stop()
        raise RuntimeError(f"docker-registry did not start: {(self.where / 'registry.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def blob_files(self) -> dict[str, Path]:
        """Every blob the registry stores (layers, configs and manifests alike): digest -> its data file."""
        base = self.root / "docker" / "registry" / "v2" / "blobs" / "sha256"
        return {f"sha256:{p.parent.name}": p for p in sorted(base.glob("*/*/data"))} if base.is_dir() else {}

    def blobs(self) -> dict[str, int]:
        """digest -> size of every blob stored."""
        return {d: p.stat().st_size for d, p in self.blob_files().items()}

    def tags(self, repo: str) -> list[str]:
        d = self.root / "docker" / "registry" / "v2" / "repositories" / repo / "_manifests" / "tags"
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


@contextlib.contextmanager
def serve(where: Path) -> Iterator[Registry]:
    """A running registry with its storage under `where`, stopped on leaving; the test is skipped, with the
    reason, where /usr/bin/docker-registry is missing. A test module's fixture: `with serve(tmp_path) as r: yield r`."""
    if not DOCKER_REGISTRY.is_file():
        pytest.skip(f"{DOCKER_REGISTRY} is missing: install Debian's docker-registry (the CNCF distribution registry 2.8)")
    reg = Registry(where).start()
    try:
        yield reg
    finally:
        reg.stop()


class Proxy:
    """A loopback proxy in front of `upstream` (HOST:PORT). `got[digest]`: bytes of blob GET answers sent to
    clients; `put[digest]`: bytes of blob PUT bodies received; `seen`: (method, path, status, Authorization
    header) of every request. With `auth`, every request but the token realm's needs a token it issued."""

    def __init__(self, upstream: str, *, auth: tuple[str, str] | None = None) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.auth = auth
        self.tokens: set[str] = set()
        self.got: Counter[str] = Counter()
        self.put: Counter[str] = Counter()
        self.seen: list[tuple[str, str, int, str]] = []
        self.token_requests: list[str] = []  # the Authorization header of each token request ("" without)
        self.stall_put_after: int | None = None  # a blob PUT stops forwarding after this many body bytes
        self.stalled = threading.Event()  # set when a PUT stalls
        self.release = threading.Event()  # set to let a stalled PUT go on (or end)
        self.lock = threading.Lock()
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.proxy = self
        self.port = int(self.httpd.server_address[1])
        self.netloc = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> Proxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def reset(self) -> None:
        with self.lock:
            self.got.clear()
            self.put.clear()
            self.seen.clear()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    proxy: Proxy

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hangs up (a killed publisher) is no error of the proxy


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def _exchange(self) -> None:
        p = self.server.proxy
        path = urlsplit(self.path).path
        if path == "/token":
            self._token()
            return
        auth = self.headers.get("Authorization", "")
        if p.auth is not None and not (auth.startswith("Bearer ") and auth[7:] in p.tokens):
            self._challenge(path)
            return
        status = self._forward(path)
        with p.lock:
            p.seen.append((self.command, self.path, status, auth))

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _exchange

    def _json(self, status: int, body: dict[str, object], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _challenge(self, path: str) -> None:
        p = self.server.proxy
        m = _REPO_PATH.match(path)
        scope = ""
        if m:
            scope = f',scope="repository:{m.group("repo")}:pull{"" if self.command in ("GET", "HEAD") else ",push"}"'
        self._read_body()  # a client sending a body gets its answer after it was read
        with p.lock:
            p.seen.append((self.command, self.path, 401, self.headers.get("Authorization", "")))
        self._json(401, {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]},
                   {"WWW-Authenticate": f'Bearer realm="http://{p.netloc}/token",service="{SERVICE}"{scope}'})

    def _token(self) -> None:
        p = self.server.proxy
        auth = self.headers.get("Authorization", "")
        with p.lock:
            p.token_requests.append(auth)
        query = parse_qs(urlsplit(self.path).query)
        right = p.auth is not None and auth == "Basic " + base64.b64encode(f"{p.auth[0]}:{p.auth[1]}".encode()).decode()
        if not right or query.get("service") != [SERVICE]:
            self._json(401, {"errors": [{"code": "UNAUTHORIZED", "message": "incorrect username or password"}]})
            return
        token = secrets.token_hex(16)
        with p.lock:
            p.tokens.add(token)
        self._json(200, {"token": token, "access_token": token, "expires_in": 300})

    def _read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _forward(self, path: str) -> int:
        p = self.server.proxy
        conn = http.client.HTTPConnection(*p.upstream, timeout=120)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() not in ("authorization", "connection", "keep-alive", "proxy-connection"):
                    conn.putheader(k, v)  # Host as the client sent it: the registry's Locations point here
            conn.endheaders()
            left = int(self.headers.get("Content-Length") or 0)
            digest = (parse_qs(urlsplit(self.path).query).get("digest") or [""])[0] if self.command == "PUT" else ""
            sent = 0
            while left > 0:
                if digest and p.stall_put_after is not None and sent >= p.stall_put_after:
                    p.stalled.set()
                    p.release.wait(120)
                    return 0  # the body is never finished: the upstream upload stays incomplete
                want = min(1 << 16, left)
                if digest and p.stall_put_after is not None:
                    want = min(want, max(1, p.stall_put_after - sent))
                chunk = self.rfile.read(want)
                if not chunk:
                    return 0
                conn.send(chunk)
                left -= len(chunk)
                sent += len(chunk)
                if digest:
                    with p.lock:
                        p.put[digest] += len(chunk)
            resp = conn.getresponse()
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in ("connection", "keep-alive", "transfer-encoding"):
                    self.send_header(k, v)
            self.send_header("Connection", "close")
            self.end_headers()
            blob = _BLOB_PATH.match(path) if self.command == "GET" else None
            if self.command != "HEAD":
                while chunk := resp.read(1 << 16):
                    self.wfile.write(chunk)
                    if blob:
                        with p.lock:
                            p.got[blob.group("digest")] += len(chunk)
            return resp.status
        finally:
            conn.close()
