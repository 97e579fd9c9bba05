"""`llamabundle index` rendered by a real browser: headless Chromium loads the generated index.html from disk
(file:, no network), and the DOM it builds is checked: one row per bundle, grouped by platform, the page's
own script ran under its Content-Security-Policy, sorting by a column works, and markup from a hostile
bundle.json stays text. A screenshot of the page is taken (and copied to $LLAMABUNDLE_INDEX_SCREENSHOT when
set: that is how bench/results/index-site/screenshot.png is made).

Needs Chromium (Debian package `chromium`); skips with a reason without it."""

from __future__ import annotations

import base64
import hashlib
import html.parser
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from llamabundle.bundle import manifest as manifest_mod
from llamabundle.store.local import LocalStore
from tests import bundles

from .conftest import run_cli

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium)")

FILES = {"llama-server": b"\x7fELF not really\n" * 4096, "LICENSE": b"MIT License\n"}
ROLES = {"llama-server": "exe", "LICENSE": "license"}
CUDA = {"toolkit": "12.8.1", "archs": {"sass": ["86", "89", "120a"], "ptx": ["50", "61", "70", "75", "80"]},
        "driver_floor": "572.61"}
PWN = ('<script>document.title = "pwned"</script>'
       '<img src=x onerror="document.body.setAttribute(\'data-pwned\', \'1\')">')
WIDTH, HEIGHT = 1440, 640


def make(tmp: Path, tag: str, *, platform: str = "linux-x86_64", backends: tuple[str, ...] = ("cpu",),
         cuda: dict[str, Any] | None = None, size: int = 1, **fields: Any) -> tuple[Path, manifest_mod.Manifest]:
    inputs = bundles.inputs_for(tag, platform=platform, cuda={"toolkit": cuda["toolkit"]} if cuda else None)
    files = {**FILES, "llama-server": FILES["llama-server"] * size}
    zip_path, m = bundles.make_zip(tmp, files, ROLES, zip_name=f"{tag}.zip", name=tag, inputs=inputs,
                                   backends=list(backends), **({"cuda": cuda} if cuda else {}), **fields)
    return zip_path, manifest_mod.parse(m)


def publish_three(tmp: Path, store_root: Path) -> list[manifest_mod.Manifest]:
    """Three bundles of different platforms and backends, published to a local store."""
    tmp.mkdir(parents=True, exist_ok=True)
    made = [make(tmp, "linux-x86_64-cpu", built_at="2025-05-01T09:12:44Z", glibc_floor="2.35",
                 llama_cpp={"commit": bundles.COMMIT, "version": "b6502"}),
            make(tmp, "linux-x86_64-vulkan", backends=("cpu", "vulkan"), size=3, built_at="2025-05-01T09:40:02Z",
                 glibc_floor="2.35", llama_cpp={"commit": bundles.COMMIT, "version": "b6502"}),
            make(tmp, "windows-x86_64-cuda12.8", platform="windows-x86_64", backends=("cpu", "cuda"), cuda=CUDA,
                 size=9, built_at="2025-05-02T14:03:19Z", llama_cpp={"commit": bundles.COMMIT, "version": "b6502"})]
    store = LocalStore(store_root)
    for zip_path, m in made:
        store.publish(zip_path, m)
    return [m for _, m in made]


def env_for(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["LLAMABUNDLE_CACHE_DIR"] = str(tmp / "cache")
    env.pop("LLAMABUNDLE_STORE", None)
    env.pop("GITHUB_ACTIONS", None)
    env["SOURCE_DATE_EPOCH"] = "1746200000"  # the page's "generated" stamp: the same every run
    return env


def index(tmp: Path, store_root: Path, out: Path) -> dict[str, Any]:
    r = run_cli("index", "--store", store_root, "--out", out, "--json", env=env_for(tmp), timeout=120)
    assert r.returncode == 0, r.stderr
    report: dict[str, Any] = json.loads(r.stdout)
    return report


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium with a profile of its own (root: no sandbox), nothing from the network."""
    assert CHROMIUM is not None
    argv = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--hide-scrollbars",
            "--disable-extensions", "--disable-background-networking", "--disable-component-update",
            f"--user-data-dir={tmp / 'profile'}", *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                       env={**os.environ, "HOME": str(tmp)})
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def dom(tmp: Path, page: Path) -> str:
    return chromium(tmp, "--virtual-time-budget=2000", "--dump-dom", page.as_uri()).stdout


class Dom(html.parser.HTMLParser):
    """The serialized DOM: each element's tag and attributes, and the text of each table row by data-key."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.rows: dict[str, list[str]] = {}
        self.order: list[str] = []
        self._row: str | None = None
        self.title = ""
        self._in_title = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.elements.append((tag, a))
        if tag == "tr" and a.get("data-key"):
            self._row = a["data-key"]
            self.rows[self._row] = []
            self.order.append(self._row)
        self._in_title = tag == "title"

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = None
        self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._row is not None:
            self.rows[self._row].append(data)
        if self._in_title:
            self.title += data

    def tags(self, name: str) -> list[dict[str, str | None]]:
        return [a for t, a in self.elements if t == name]


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    w, h = struct.unpack(">II", head[16:24])
    return int(w), int(h)


def test_the_index_renders_one_row_per_bundle_grouped_by_platform(tmp_path: Path) -> None:
    made = publish_three(tmp_path / "b", tmp_path / "store")
    out = tmp_path / "site"
    report = index(tmp_path, tmp_path / "store", out)
    assert len(report["bundles"]) == 3

    d = Dom(dom(tmp_path, out / "index.html"))
    html_el = next(a for t, a in d.elements if t == "html")
    assert "js" in (html_el.get("class") or "").split(), "the page's own script did not run (CSP hash?)"
    assert sorted(d.rows) == sorted(m.key for m in made)  # one row per bundle, in the DOM the browser built
    assert [a["data-platform"] for a in d.tags("section")] == ["linux-x86_64", "windows-x86_64"]
    cuda = next(m for m in made if "cuda" in m.sections)
    text = " ".join(d.rows[cuda.key])
    assert "12.8.1" in text and "86 89 120a" in text and "50 61 70 75 80" in text and "572.61" in text
    assert "windows-x86_64-cuda12.8.zip" in text and "2025-05-02" in text and "14:03:19 UTC" in text
    links = {a.get("href") for a in d.tags("a")}
    assert {b["url"] for b in report["bundles"]} <= links

    shot = tmp_path / "screenshot.png"
    chromium(tmp_path, f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=2000",
             (out / "index.html").as_uri())
    assert png_size(shot) == (WIDTH, HEIGHT) and shot.stat().st_size > 20_000  # a page, not a blank one
    keep = os.environ.get("LLAMABUNDLE_INDEX_SCREENSHOT")
    if keep:
        Path(keep).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, keep)


def test_sorting_by_a_column_in_the_browser(tmp_path: Path) -> None:
    """The page's sort script, clicked by a test script added to a copy of the page (its hash added to the
    copy's Content-Security-Policy): the Size header sorts ascending, then descending."""
    made = publish_three(tmp_path / "b", tmp_path / "store")
    out = tmp_path / "site"
    index(tmp_path, tmp_path / "store", out)
    page = (out / "index.html").read_text(encoding="utf-8")
    probe = ('var t = document.querySelector("section[data-platform=linux-x86_64] table"), '
             'b = Array.prototype.find.call(t.querySelectorAll("th button"), function (x) { '
             'return x.textContent === "Size"; }); b.click(); '
             'var up = Array.prototype.map.call(t.tBodies[0].rows, function (r) { return r.dataset.key; }); '
             'b.click(); '
             'var down = Array.prototype.map.call(t.tBodies[0].rows, function (r) { return r.dataset.key; }); '
             'document.body.setAttribute("data-up", up.join(",")); '
             'document.body.setAttribute("data-down", down.join(","));')
    digest = base64.b64encode(hashlib.sha256(probe.encode()).digest()).decode()
    q = "&#x27;"  # the policy is an attribute value: its quotes are escaped
    assert page.count(f"script-src {q}sha256-") == 1
    page = page.replace(f"script-src {q}sha256-", f"script-src {q}sha256-{digest}{q} {q}sha256-", 1)
    page = page.replace("</body>", f"<script>{probe}</script>\n</body>", 1)
    (out / "probe.html").write_text(page, encoding="utf-8")
    d = Dom(dom(tmp_path, out / "probe.html"))
    body = d.tags("body")[0]
    linux = sorted((m for m in made if m.platform == "linux-x86_64"), key=lambda m: m.name)
    small, big = linux[0].key, linux[1].key  # the cpu bundle is the smaller one
    assert body.get("data-up") == f"{small},{big}" and body.get("data-down") == f"{big},{small}"


def test_markup_from_a_hostile_bundle_json_stays_text_in_the_browser(tmp_path: Path) -> None:
    zip_path, m = make(tmp_path / "b", "evil", backends=("cpu", PWN), built_at=PWN, glibc_floor=PWN,
                       llama_cpp={"commit": bundles.COMMIT, "version": PWN})
    LocalStore(tmp_path / "store").publish(zip_path, m)
    out = tmp_path / "site"
    index(tmp_path, tmp_path / "store", out)
    d = Dom(dom(tmp_path, out / "index.html"))
    assert d.title.startswith("llama.cpp bundles") and "pwned" not in d.title
    assert d.tags("body")[0].get("data-pwned") is None and not d.tags("img")
    assert len(d.tags("script")) == 1 and list(d.rows) == [m.key]
    assert PWN in " ".join(d.rows[m.key])  # shown as text
