"""Files of a Python package index, by URL: the simple repository API (PEP 691 JSON, else PEP 503
HTML) of `LLAMABUNDLE_PIP_INDEX_URL` or PyPI, read once per project, and nothing else.

pip is never asked: `pip download` of an sdist prepares its metadata in an isolated build
environment (which can mean compiling CMake from source), and pip's own progress and retries are not
ours. The sdist of the `pypi:` source and the CUDA wheels of the PyPI toolkit are looked up here and
then fetched with `net.download` against their pinned sha256.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urljoin

import requests

from . import net, untrusted
from .errors import LlamaBundleError, VerifyError
from .log import Log

DEFAULT_INDEX = "https://pypi.org/simple"
ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
MAX_PAGE = 64 << 20  # a project page lists files; refuse anything absurd


class IndexUnavailable(net.NetworkError):
    """The index could not be read, or does not list the file asked for (exit 6)."""


@dataclass(frozen=True, kw_only=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    size: int | None


def normalize(project: str) -> str:
    """PEP 503 name normalisation: `llama_cpp.Python` → `llama-cpp-python`."""
    return re.sub(r"[-_.]+", "-", project).lower()


def sdist_filename(project: str, version: str) -> str:
    """The sdist's file name as PEP 625 spells it (`llama_cpp_python-0.3.36.tar.gz`)."""
    return f"{re.sub(r'[-_.]+', '_', project).lower()}-{version}.tar.gz"


def project_files(project: str, *, index_url: str | None, http: requests.Session,
                  connect_timeout: float = 10.0) -> list[IndexFile]:
    """Every file the index lists for `project` (its simple page)."""
    base = (index_url or DEFAULT_INDEX).rstrip("/")
    url = f"{base}/{normalize(project)}/"
    r = net.get_page(url, http=http, headers={"Accept": ACCEPT}, connect_timeout=connect_timeout, max_bytes=MAX_PAGE)
    if r.status_code == 404:
        raise IndexUnavailable(f"{project} is not on the package index {base}", why=f"GET {url} answered HTTP 404",
                               fix="check the recipe's package name and LLAMABUNDLE_PIP_INDEX_URL")
    if r.status_code != 200:
        raise IndexUnavailable(f"cannot read the package index page {url}", why=f"HTTP {r.status_code}",
                               fix="check LLAMABUNDLE_PIP_INDEX_URL (a simple index, like https://pypi.org/simple)")
    kind = r.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if _is_json(kind):  # an answer that is not JSON says what came back (status, content type, first bytes)
        doc = net.answer_json(r, what=f"the package index page {url}", error=IndexUnavailable, max_bytes=MAX_PAGE,
                              fix="check LLAMABUNDLE_PIP_INDEX_URL (a simple index, like https://pypi.org/simple)")
        return json_files(doc, page_url=r.url or url)
    return parse_page(r.content, kind=kind, page_url=r.url or url)


def _is_json(kind: str) -> bool:
    return kind.endswith("+json") or kind == "application/json"


def parse_page(body: bytes, *, kind: str, page_url: str) -> list[IndexFile]:
    """A project page in either form; file URLs made absolute against the page's URL."""
    if _is_json(kind):
        try:
            doc = untrusted.loads(body, max_bytes=MAX_PAGE)
        except ValueError as e:
            raise IndexUnavailable(f"the package index page {page_url} is not valid PEP 691 JSON",
                                   why=f"{str(e)[:200]}: {untrusted.preview(body)}",
                                   fix="check LLAMABUNDLE_PIP_INDEX_URL") from None
        return json_files(doc, page_url=page_url)
    parser = _Anchors()
    parser.feed(body.decode("utf-8", errors="replace"))
    out = []
    for href, text in parser.anchors:
        url, frag = urldefrag(urljoin(page_url, href))
        m = re.fullmatch(r"sha256=([0-9a-fA-F]{64})", frag)
        name = text.strip() or url.rsplit("/", 1)[-1]
        out.append(IndexFile(filename=name, url=url, sha256=m.group(1).lower() if m else None, size=None))
    return out


def json_files(doc: Any, *, page_url: str) -> list[IndexFile]:
    """The files a PEP 691 project page's JSON value lists; file URLs made absolute against the page's URL."""
    try:
        out = []
        for f in doc["files"]:
            sha = f.get("hashes", {}).get("sha256")
            size = f.get("size")
            out.append(IndexFile(filename=str(f["filename"]), url=urljoin(page_url, str(f["url"])),
                                 sha256=sha.lower() if isinstance(sha, str) else None,
                                 size=size if isinstance(size, int) and not isinstance(size, bool) else None))
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise IndexUnavailable(f"the package index page {page_url} is not valid PEP 691 JSON", why=str(e)[:200],
                               fix="check LLAMABUNDLE_PIP_INDEX_URL") from None


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.anchors: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or None
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.anchors.append((self._href, "".join(self._text)))
            self._href = None


def find_file(files: list[IndexFile], filename: str, *, project: str, sha256: str, index: str) -> IndexFile:
    """The listed file of that name; refused (exit 5) when the index says its sha256 is another one."""
    for f in files:
        if f.filename == filename:
            if f.sha256 is not None and f.sha256 != sha256.lower():
                raise VerifyError(f"the package index lists {filename} with sha256 {f.sha256}",
                                  why=f"the pinned sha256 is {sha256}",
                                  fix="the index serves another file under that name; use the official index or "
                                      "check the pin")
            return f
    raise IndexUnavailable(f"{filename} is not on the package index {index}",
                      why=f"{project}'s page lists {len(files)} files, none of that name",
                      fix="check the pinned version and LLAMABUNDLE_PIP_INDEX_URL")


def download_pinned(project: str, filename: str, *, sha256: str, size: int | None, dest_dir: Path,
                    index_url: str | None, http: requests.Session, log: Log, connect_timeout: float = 10.0,
                    files: list[IndexFile] | None = None,
                    mismatch_error: type[LlamaBundleError] = VerifyError) -> Path:
    """Look `filename` up on the index and download it into `dest_dir/filename`, checked against
    `sha256` (and `size`) while it streams; resumable, retried, with progress (net.download)."""
    listed = files if files is not None else project_files(project, index_url=index_url, http=http,
                                                           connect_timeout=connect_timeout)
    f = find_file(listed, filename, project=project, sha256=sha256, index=(index_url or DEFAULT_INDEX))
    if size is not None and f.size is not None and f.size != size:
        raise VerifyError(f"the package index lists {filename} with {f.size} bytes, not the pinned {size}",
                          fix="the index serves another file under that name")
    dest = dest_dir / filename
    net.download(f.url, dest, http=http, log=log, sha256=sha256, size=size if size is not None else f.size,
                 connect_timeout=connect_timeout, mismatch_error=mismatch_error)
    return dest
