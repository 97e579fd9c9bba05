"""One requests Session for the tool; sha256-verified downloads that never leave a partial file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import requests
import urllib3

from . import __version__
from .errors import StoreError, VerifyError
from .log import Log


class NetworkError(StoreError):
    pass


def session() -> requests.Session:
    s = requests.Session()
    s.headers["User-Agent"] = f"llamabundle/{__version__}"
    return s


def download(url: str, dest: Path, *, http: requests.Session, log: Log, sha256: str | None = None,
             connect_timeout: float = 10.0, read_timeout: float = 60.0, headers: dict[str, str] | None = None) -> str:
    """Download url to dest atomically; return its sha256. A mismatch with `sha256` deletes the file."""
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        with http.get(url, stream=True, timeout=(connect_timeout, read_timeout), headers=headers or {}) as r:
            if r.status_code != 200:
                raise NetworkError(f"GET {url} answered HTTP {r.status_code}", why=r.reason or "",
                                   fix="check the URL and your network; retry later")
            total = int(r.headers.get("Content-Length") or 0) or None
            done = 0
            with log.progress(f"download {dest.name}", total) as bar, open(part, "wb") as out:
                for chunk in r.raw.stream(1 << 20, decode_content=False):  # the bytes as served, never decoded
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    bar.update(done, total)
            if total is not None and done != total:
                raise NetworkError(f"GET {url} ended after {done} of {total} bytes", fix="retry")
    except (requests.RequestException, urllib3.exceptions.HTTPError) as e:
        part.unlink(missing_ok=True)
        raise NetworkError(f"cannot download {url}", why=_short(e), fix="check the network or use another source") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    got = digest.hexdigest()
    if sha256 is not None and got != sha256:
        part.unlink(missing_ok=True)
        raise VerifyError(f"sha256 mismatch for {url}", why=f"expected {sha256}, got {got}",
                          fix="the file is not the pinned one; check the recipe's sha256 or the mirror")
    os.replace(part, dest)
    return got


def _short(e: Exception) -> str:
    text = str(e)
    for marker in ("Failed to resolve", "Connection refused", "timed out", "Name or service not known"):
        if marker in text:
            return marker.lower()
    return text[:300]
