"""A Python package index on 127.0.0.1 that speaks the simple repository API as PyPI does: PEP 691
JSON for clients that ask for it, PEP 503 HTML otherwise, file URLs on a second path like
files.pythonhosted.org, and `Range` requests, on a tests/loopback.py server. Records every path asked for."""

from __future__ import annotations

import hashlib
import html
import json
import re
from pathlib import Path

from tests.loopback import Loopback, Reply, Request, error


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class FakeIndex:
    def __init__(self, *, json_api: bool = True) -> None:
        self.projects: dict[str, dict[str, bytes | Path]] = {}  # normalised project -> filename -> bytes or a file
        self.listed_sha256: dict[str, str] = {}  # filename -> the sha256 the page claims (default: the real one)
        self.served: dict[str, bytes] = {}  # filename -> bytes served instead of the listed ones
        self.json_api = json_api
        self.server = Loopback(self._answer).start()
        self.url = f"{self.server.url}/simple"

    @property
    def requests(self) -> list[str]:
        """Every path asked for, in order."""
        return self.server.paths()

    def _answer(self, req: Request) -> Reply:
        m = re.fullmatch(r"/simple/([^/]+)/", req.path)
        if m:
            return self._page(req, m.group(1))
        m = re.fullmatch(r"/files/([^/]+)/([^/]+)", req.path)
        if m:
            return self._file(req, m.group(1), m.group(2))
        return error(404)

    def _page(self, req: Request, project: str) -> Reply:
        files = self.projects.get(project)
        if files is None or project != _norm(project):
            return error(404)
        wants_json = self.json_api and "application/vnd.pypi.simple.v1+json" in req.headers.get("accept", "")
        entries = [(name, self.listed_sha256.get(name) or hashlib.sha256(self._bytes(project, name)).hexdigest(),
                    len(self._bytes(project, name))) for name in sorted(files)]
        if wants_json:
            doc = {"meta": {"api-version": "1.1"}, "name": project,
                   "files": [{"filename": n, "url": f"../../files/{project}/{n}", "hashes": {"sha256": h},
                              "size": s} for n, h, s in entries]}
            body, kind = json.dumps(doc).encode(), "application/vnd.pypi.simple.v1+json"
        else:
            links = "".join(f'<a href="/files/{project}/{html.escape(n)}#sha256={h}">{html.escape(n)}</a><br/>\n'
                            for n, h, _s in entries)
            body, kind = f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode(), "text/html"
        return Reply(200, {"Content-Type": kind}, body)

    def _file(self, req: Request, project: str, name: str) -> Reply:
        if name not in self.projects.get(project, {}):
            return error(404)
        body = self.served.get(name) or self._bytes(project, name)
        start, status, headers = 0, 200, {}
        rng = re.fullmatch(r"bytes=(\d+)-", req.headers.get("range", ""))
        if rng and int(rng.group(1)) < len(body):  # no If-Range, no 416: past the end is the whole file
            start, status = int(rng.group(1)), 206
            headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        headers |= {"Accept-Ranges": "bytes", "ETag": f'"{hashlib.sha256(body).hexdigest()[:16]}"'}
        return Reply(status, headers, body[start:], chunk=1 << 20)

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
        self.server.close()
