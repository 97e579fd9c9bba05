"""A Python package index on 127.0.0.1 that speaks the simple repository API as PyPI does: PEP 691
JSON for clients that ask for it, PEP 503 HTML otherwise, file URLs on a second path like
files.pythonhosted.org, and `Range` requests. Records every path asked for."""

from __future__ import annotations

import hashlib
import html
import http.server
import json
import re
import threading
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class FakeIndex:
    def __init__(self, *, json_api: bool = True) -> None:
        self.projects: dict[str, dict[str, bytes | Path]] = {}  # normalised project -> filename -> bytes or a file
        self.listed_sha256: dict[str, str] = {}  # filename -> the sha256 the page claims (default: the real one)
        self.served: dict[str, bytes] = {}  # filename -> bytes served instead of the listed ones
        self.requests: list[str] = []
        self.json_api = json_api
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer.requests.append(self.path)
                m = re.fullmatch(r"/simple/([^/]+)/", self.path)
                if m:
                    return self._page(m.group(1))
                m = re.fullmatch(r"/files/([^/]+)/([^/]+)", self.path)
                if m:
                    return self._file(m.group(1), m.group(2))
                self.send_error(404)

            def _page(self, project: str) -> None:
                files = outer.projects.get(project)
                if files is None or project != _norm(project):
                    self.send_error(404)
                    return
                wants_json = outer.json_api and "application/vnd.pypi.simple.v1+json" in self.headers.get("Accept", "")
                entries = [(name, outer.listed_sha256.get(name) or hashlib.sha256(outer._bytes(project, name)).hexdigest(),
                            len(outer._bytes(project, name))) for name in sorted(files)]
                if wants_json:
                    doc = {"meta": {"api-version": "1.1"}, "name": project,
                           "files": [{"filename": n, "url": f"../../files/{project}/{n}", "hashes": {"sha256": h},
                                      "size": s} for n, h, s in entries]}
                    body, kind = json.dumps(doc).encode(), "application/vnd.pypi.simple.v1+json"
                else:
                    links = "".join(f'<a href="/files/{project}/{html.escape(n)}#sha256={h}">{html.escape(n)}</a><br/>\n'
                                    for n, h, _s in entries)
                    body, kind = f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode(), "text/html"
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _file(self, project: str, name: str) -> None:
                if name not in outer.projects.get(project, {}):
                    self.send_error(404)
                    return
                body = outer.served.get(name) or outer._bytes(project, name)
                start = 0
                rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
                if rng and int(rng.group(1)) < len(body):
                    start = int(rng.group(1))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()[:16]}"')
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                try:
                    view = memoryview(body)[start:]
                    for i in range(0, len(view), 1 << 20):
                        self.wfile.write(view[i:i + (1 << 20)])
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def _bytes(self, project: str, name: str) -> bytes:
        v = self.projects[project][name]
        if isinstance(v, Path):
            v = v.read_bytes()
            self.projects[project][name] = v
        return v

    def add(self, project: str, filename: str, content: bytes | Path) -> None:
        self.projects.setdefault(_norm(project), {})[filename] = content

    def file_requests(self) -> list[str]:
        return [p.rsplit("/", 1)[-1] for p in self.requests if p.startswith("/files/")]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
