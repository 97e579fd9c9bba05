"""`llamabundle index`: a static site (for GitHub Pages) of every bundle a store holds. Planning is pure:
`rows_of` turns the store's entries (each checked as a lookup checks it, each backend giving its cells) into
rows, `site_json` and `render_html` into index.json and one self-contained index.html (inline CSS and
script, a Content-Security-Policy that allows nothing else, everything from a store HTML-escaped).
`write_site` writes both beside DIR and swaps them in with renames: a reader sees the previous index or the
new one; an existing DIR is replaced only when it is empty or a previous index. The schemas of index.json
and of `index --json` are generated here (`site_schema`, `report_schema`; a test checks the committed files)."""

from __future__ import annotations

import base64
import hashlib
import html
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from . import __version__, backends, scratch, untrusted
from .data import SCHEMA_DRAFT, schema_id
from .errors import DiskError, UsageError, disk_fix

if TYPE_CHECKING:
    from .log import Log
    from .store import Entry, Store

SITE = "llamabundle-index"  # index.json's "site": what marks a directory as a previous index
FILES = ("index.html", "index.json")
STAGE_PREFIX = ".index-"  # <parent>/.<DIR name>.index-<owner>: the new site being written
OLD_PREFIX = ".index-old-"  # <parent>/.<DIR name>.index-old-<owner>: the previous one, while it is swapped out
_LINK_SCHEMES = ("https", "http", "file")


@dataclass(frozen=True, kw_only=True)
class Row:
    """One bundle of the index: what index.json and each table row of index.html show."""

    name: str
    key: str
    platform: str
    backends: tuple[str, ...]
    toolkit: str | None
    sass: tuple[str, ...]
    ptx: tuple[str, ...]
    driver_floor: str | None
    glibc_floor: str | None
    commit: str
    version: str | None
    built_at: str | None
    zip_name: str
    zip_size: int
    zip_sha256: str
    url: str | None  # the download link (http(s) or file:), None when the store gives none that is one
    location: str  # where the store keeps the zip, as lookup says

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "platform": self.platform, "backends": list(self.backends),
                "toolkit": self.toolkit,
                "archs": {"sass": list(self.sass), "ptx": list(self.ptx)} if self.toolkit is not None else None,
                "driver_floor": self.driver_floor, "glibc_floor": self.glibc_floor, "commit": self.commit,
                "version": self.version, "built_at": self.built_at, "zip_name": self.zip_name,
                "zip_size": self.zip_size, "zip_sha256": self.zip_sha256, "url": self.url, "location": self.location}


@dataclass(frozen=True, kw_only=True)
class Site:
    store: str
    generated_at: str
    rows: tuple[Row, ...]


@dataclass(frozen=True, kw_only=True)
class IndexOutcome:
    site: Site
    out: Path
    replaced: bool  # a previous index (or an empty directory) was there and is gone now

    def to_json(self) -> dict[str, Any]:
        return {"store": self.site.store, "out": str(self.out), "files": [str(self.out / f) for f in FILES],
                "replaced": self.replaced, "generated_at": self.site.generated_at,
                "bundles": [r.to_json() for r in self.site.rows]}


# ------------------------------------------------------------------------------------ the plan (pure)


def download_url(location: str) -> str | None:
    """A link to the zip: an http(s) location as it is, a local path as a file: URL; anything else none."""
    scheme = urlsplit(location).scheme.lower()
    if scheme in _LINK_SCHEMES:
        return location
    if location.startswith("/") or (len(location) > 2 and location[1] == ":" and location[2] in "\\/"):
        return Path(location).as_uri()
    return None


def rows_of(entries: Iterable[Entry]) -> tuple[Row, ...]:
    """The rows, by platform, then name, the newest build of a name first (then by key: the same every run)."""
    rows = []
    for e in entries:
        m = e.manifest
        facts = next((f for b in backends.of(m.backends) if (f := b.index_facts(m)) is not None), None)
        rows.append(Row(name=m.name, key=e.key, platform=m.platform, backends=m.backends,
                        toolkit=facts.toolkit if facts else None, sass=facts.sass if facts else (),
                        ptx=facts.ptx if facts else (), driver_floor=facts.driver_floor if facts else None,
                        glibc_floor=m.glibc_floor, commit=m.llama_cpp.commit, version=m.llama_cpp.version,
                        built_at=m.built_at, zip_name=e.zip_name, zip_size=e.zip_size, zip_sha256=e.zip_sha256,
                        url=download_url(e.location), location=e.location))
    rows.sort(key=lambda r: r.key)
    rows.sort(key=lambda r: r.built_at or "", reverse=True)
    rows.sort(key=lambda r: (r.platform, r.name))
    return tuple(rows)


def site_json(site: Site) -> dict[str, Any]:
    """index.json: the site's data (schema: data/schemas/index-site.schema.json)."""
    return {"schema": 1, "site": SITE, "tool": f"llamabundle {__version__}", "store": site.store,
            "generated_at": site.generated_at, "bundles": [r.to_json() for r in site.rows]}


def human_size(n: int) -> str:
    """Bytes for people, in SI units: 999 B, 1.2 KB, 412.3 MB."""
    if n < 1000:
        return f"{n} B"
    size, unit = n / 1000, "KB"
    for bigger in ("MB", "GB", "TB"):
        if size < 1000:
            break
        size, unit = size / 1000, bigger
    return f"{size:.1f} {unit}"


def _e(text: object) -> str:
    """Text or an attribute value, HTML-escaped (quotes too)."""
    return html.escape(str(text), quote=True)


_CSS = """
:root { color-scheme: light dark; --bg: #fff; --fg: #1f2328; --muted: #59636e; --line: #d1d9e0; --head: #f6f8fa;
  --accent: #0969da; --chip: #ddf4ff; --chip-fg: #0a3069; --cuda: #dafbe1; --cuda-fg: #116329;
  --vk: #fbefff; --vk-fg: #6e40c9; --row: #f6f8fa; }
@media (prefers-color-scheme: dark) { :root { --bg: #0d1117; --fg: #e6edf3; --muted: #9198a1; --line: #3d444d;
  --head: #151b23; --accent: #4493f8; --chip: #0c2d6b; --chip-fg: #cae8ff; --cuda: #0f3d1f; --cuda-fg: #aff5b4;
  --vk: #3c1e70; --vk-fg: #e2c5ff; --row: #151b23; } }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
  font: 14px/1.5 -apple-system, BlinkMacSystemFont, "Segoe UI", "Noto Sans", Helvetica, Arial, sans-serif; }
header, main, footer { max-width: 1400px; margin: 0 auto; padding: 0 24px; }
header { padding-top: 24px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 28px 0 8px; }
h2 .count { color: var(--muted); font-weight: normal; font-size: 14px; }
.meta, footer { color: var(--muted); }
.meta { margin: 2px 0; }
.meta code { color: var(--fg); }
#filter { display: none; margin: 16px 0 0; padding: 6px 10px; width: 320px; max-width: 100%; font: inherit; color: var(--fg);
  background: var(--bg); border: 1px solid var(--line); border-radius: 6px; }
.js #filter { display: inline-block; }
.table-wrap { overflow-x: auto; border: 1px solid var(--line); border-radius: 6px; }
table { border-collapse: collapse; width: 100%; min-width: 1080px; table-layout: fixed; }
th, td { padding: 7px 10px; text-align: left; vertical-align: top; border-bottom: 1px solid var(--line);
  overflow-wrap: anywhere; }
th { white-space: nowrap; }
tbody tr:last-child td { border-bottom: 0; }
tbody tr:nth-child(even) { background: var(--row); }
th { background: var(--head); font-weight: 600; position: sticky; top: 0; }
th button { all: unset; cursor: pointer; }
th button::after { content: " \\2195"; color: var(--muted); font-size: 11px; opacity: 0.45; }
th button:hover::after { opacity: 1; }
th[aria-sort="ascending"] button::after { content: " \\2191"; color: var(--fg); opacity: 1; }
th[aria-sort="descending"] button::after { content: " \\2193"; color: var(--fg); opacity: 1; }
th.num button { float: right; }
.archs { font-size: 12px; }
.archs .muted { display: inline-block; min-width: 34px; }
td.num { text-align: right; }
code { font: 12px ui-monospace, SFMono-Regular, "SF Mono", Menlo, Consolas, monospace; }
.name { font-weight: 600; }
.chip { display: inline-block; padding: 0 7px; margin-right: 3px; border-radius: 10px; font-size: 12px;
  background: var(--chip); color: var(--chip-fg); }
.chip.cuda { background: var(--cuda); color: var(--cuda-fg); }
.chip.vulkan { background: var(--vk); color: var(--vk-fg); }
.muted { color: var(--muted); }
a { color: var(--accent); text-decoration: none; }
a:hover { text-decoration: underline; }
.empty { padding: 24px; border: 1px dashed var(--line); border-radius: 6px; color: var(--muted); }
footer { padding-top: 24px; padding-bottom: 24px; font-size: 12px; }
""".strip()

# Sorting by a column (click its header) and filtering (the text box): data-v on a cell is its sort value.
_SCRIPT = """
document.documentElement.classList.add("js");
function value(cell) { return cell.hasAttribute("data-v") ? cell.getAttribute("data-v") : cell.textContent; }
document.querySelectorAll("table.bundles").forEach(function (table) {
  table.querySelectorAll("th button").forEach(function (button, col) {
    button.addEventListener("click", function () {
      var th = button.parentNode, up = th.getAttribute("aria-sort") !== "ascending";
      table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", up ? "ascending" : "descending");
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      var num = th.classList.contains("num");
      rows.sort(function (a, b) {
        var x = value(a.cells[col]), y = value(b.cells[col]);
        var c = num ? Number(x) - Number(y) : x.localeCompare(y);
        return up ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
var filter = document.getElementById("filter");
if (filter) {
  filter.addEventListener("input", function () {
    var q = filter.value.toLowerCase();
    document.querySelectorAll("section.platform").forEach(function (section) {
      var shown = 0;
      section.querySelectorAll("tbody tr").forEach(function (r) {
        var hit = r.textContent.toLowerCase().indexOf(q) >= 0;
        r.hidden = !hit;
        if (hit) { shown += 1; }
      });
      section.hidden = shown === 0;
    });
  });
}
""".strip()

_COLUMNS: Sequence[tuple[str, str, int]] = (  # (header, class, width in % of the table: every table alike)
    ("Bundle", "", 18), ("Backends", "", 9), ("CUDA", "", 13), ("Needs", "", 10), ("llama.cpp", "", 8),
    ("Built", "", 9), ("Size", "num", 6), ("SHA-256", "", 9), ("Download", "", 18))


_CSS += "\n" + "\n".join(f"col.w{w} {{ width: {w}%; }}" for w in sorted({w for *_, w in _COLUMNS}))


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"


def _class(cls: str) -> str:
    return f' class="{cls}"' if cls else ""


def _cell(content: str, *, sort: object | None = None, cls: str = "", title: str | None = None) -> str:
    attrs = _class(cls) + (f' data-v="{_e(sort)}"' if sort is not None else "")
    attrs += f' title="{_e(title)}"' if title else ""
    return f"<td{attrs}>{content}</td>"


def _row_html(r: Row) -> str:
    dash = '<span class="muted">—</span>'
    backends = "".join(f'<span class="chip {_e(b) if b in ("cuda", "vulkan") else ""}">{_e(b)}</span>'
                       for b in r.backends) or dash
    cuda = dash
    if r.toolkit is not None:
        cuda = f'<div class="toolkit">{_e(r.toolkit)}</div>' + "".join(
            f'<div class="archs"><span class="muted">{kind}</span> <code>{_e(" ".join(archs))}</code></div>'
            for kind, archs in (("SASS", r.sass), ("PTX", r.ptx)) if archs)
    needs = [f"driver ≥ {r.driver_floor}"] if r.driver_floor else []  # the NVIDIA driver (the column's title)
    needs += [f"glibc ≥ {r.glibc_floor}"] if r.glibc_floor else []
    llama = f"<code>{_e(r.commit[:12])}</code>" + (f'<br><span class="muted">{_e(r.version)}</span>' if r.version else "")
    built = dash
    if r.built_at:
        day, _, time = r.built_at.partition("T")
        built = _e(day) + (f'<br><span class="muted">{_e(time.removesuffix("Z"))}{" UTC" if time.endswith("Z") else ""}'
                           "</span>" if time else "")
    link = (f'<a href="{_e(r.url)}">{_e(r.zip_name)}</a>' if r.url
            else f'<code title="{_e(r.location)}">{_e(r.zip_name)}</code>')
    cells = [
        _cell(f'<span class="name">{_e(r.name)}</span><br><code class="muted">{_e(r.key[:12])}</code>',
              sort=r.name, title=f"key {r.key}"),
        _cell(backends, sort=" ".join(r.backends)),
        _cell(cuda, sort=r.toolkit or ""),
        _cell("<br>".join(_e(x) for x in needs) if needs else dash, sort=" ".join(needs),
              title="the oldest NVIDIA driver and the glibc it needs" if needs else None),
        _cell(llama, sort=r.commit, title=f"commit {r.commit}"),
        _cell(built, sort=r.built_at or ""),
        _cell(_e(human_size(r.zip_size)), sort=r.zip_size, cls="num", title=f"{r.zip_size} bytes"),
        _cell(f"<code>{_e(r.zip_sha256[:12])}…</code>", sort=r.zip_sha256, title=f"sha256 {r.zip_sha256}"),
        _cell(link, cls="download"),
    ]
    return f'<tr data-key="{_e(r.key)}" data-platform="{_e(r.platform)}">' + "".join(cells) + "</tr>"


def render_html(site: Site) -> str:
    """index.html: one page, everything inline, grouped by platform, each table sortable by its columns."""
    platforms: dict[str, list[Row]] = {}
    for r in site.rows:
        platforms.setdefault(r.platform, []).append(r)
    cols = "<colgroup>" + "".join(f'<col class="w{width}">' for _, _, width in _COLUMNS) + "</colgroup>"
    head = "".join(f'<th scope="col"{_class(cls)}><button type="button">{_e(name)}</button></th>'
                   for name, cls, _ in _COLUMNS)
    sections = []
    for platform, rows in platforms.items():
        n = len(rows)
        sections.append(
            f'<section class="platform" id="{_e(platform)}" data-platform="{_e(platform)}">'
            f'<h2>{_e(platform)} <span class="count">{n} bundle{"" if n == 1 else "s"}</span></h2>'
            f'<div class="table-wrap"><table class="bundles">{cols}<thead><tr>{head}</tr></thead><tbody>'
            + "\n".join(_row_html(r) for r in rows) + "</tbody></table></div></section>")
    n = len(site.rows)
    body = ("\n".join(sections) if sections
            else f'<p class="empty">No bundles are published in <code>{_e(site.store)}</code> yet.</p>')
    csp = (f"default-src 'none'; style-src {_csp_hash(_CSS)}; script-src {_csp_hash(_SCRIPT)}; "
           "base-uri 'none'; form-action 'none'")
    tool = f"llamabundle {__version__}"
    stamp = site.generated_at.replace("T", " ").replace("Z", " UTC")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_e(csp)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="{_e(tool)}">
<title>llama.cpp bundles — {_e(site.store)}</title>
<style>{_CSS}</style>
</head>
<body>
<header>
<h1>llama.cpp bundles</h1>
<p class="meta">{n} bundle{"" if n == 1 else "s"} in <code>{_e(site.store)}</code> · generated {_e(stamp)}</p>
<p class="meta">Each zip is listed with its sha256: <code>llamabundle fetch</code> and <code>llamabundle install</code>
verify it, and every file in it, before use. The same data as JSON: <a href="index.json">index.json</a>.</p>
{'<input id="filter" type="search" placeholder="Filter bundles…" aria-label="Filter bundles">' if n else ""}
</header>
<main>
{body}
</main>
<footer>Generated by {_e(tool)} (<code>llamabundle index</code>).</footer>
<script>{_SCRIPT}</script>
</body>
</html>
"""


# ------------------------------------------------------------------------------------- writing


def _not_previous_index(d: Path) -> str | None:
    """Why the directory `d` is not a previous index (None: it is one). Its index.json is read within
    untrusted's limits: a file nested past them is not an index, never a crash."""
    try:
        data = untrusted.read(d / "index.json")
    except FileNotFoundError:
        return "it has no index.json written by llamabundle index"
    except OSError as e:
        return f"its index.json cannot be read: {e.strerror or e}"
    except untrusted.Untrusted as e:
        return f"its index.json is {e}"
    except ValueError:
        return "its index.json is not JSON"
    if not (isinstance(data, dict) and data.get("site") == SITE):
        return "its index.json was not written by llamabundle index"
    return None


def check_out_dir(out: Path) -> bool:
    """Whether `out` exists (and may be replaced): missing, an empty directory or a previous index are fine;
    anything else is a usage error that names what is there."""
    if not out.exists() and not out.is_symlink():
        return False
    if out.is_symlink() or not out.is_dir():
        raise UsageError(f"--out {out} is not a directory", why="the index is written as a directory "
                         "(index.html, index.json)", fix="pass a new directory, or a previous index's")
    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise DiskError(f"cannot read {out}", why=e.strerror or str(e), fix=disk_fix(e)) from None
    not_index = None if empty else _not_previous_index(out)
    if not_index is not None:
        raise UsageError(f"--out {out} is a directory that is not a previous index",
                         why=f"the index replaces its directory as a whole, and this one holds other files ({not_index})",
                         fix="pass a new or empty directory, or one that llamabundle index wrote")
    return True


def write_site(out: Path, site: Site) -> bool:
    """Write index.html and index.json into a new directory beside `out`, then put it in `out`'s place.
    Returns whether a previous `out` (an empty directory or a previous index) was replaced."""
    out = Path(os.path.abspath(out))
    parent = out.parent
    stage_prefix, old_prefix = f".{out.name}{STAGE_PREFIX}", f".{out.name}{OLD_PREFIX}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DiskError(f"cannot create {parent}", why=e.strerror or str(e), fix=disk_fix(e)) from None
    _recover(parent, old_prefix, out)
    scratch.sweep(parent, [stage_prefix, old_prefix])  # leftovers of killed runs (never a live one's)
    existed = check_out_dir(out)
    at = out
    try:
        stage = scratch.make_dir(parent, stage_prefix)
        try:
            # paths the C locale decoded with surrogate escapes (a store at /tmp/störe under LC_ALL=C) are
            # written back as their own bytes: UTF-8 whatever the locale
            for name, text in (("index.json", json.dumps(site_json(site), indent=2, sort_keys=True, ensure_ascii=False) + "\n"),
                               ("index.html", render_html(site))):
                at = stage / name
                with open(at, "x", encoding="utf-8", errors="surrogateescape", newline="\n") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
            at = out
            if existed:
                check_out_dir(out)  # still what it was: another process may have put something there
                old = scratch.owned(parent, old_prefix)
                os.replace(out, old)
                try:
                    os.replace(stage, out)
                except BaseException:
                    _put_back(old, out)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(stage, out)
        finally:
            shutil.rmtree(stage, ignore_errors=True)  # gone after the swap; what is left when it failed
    except OSError as e:
        raise DiskError(f"cannot write the index to {out}", why=f"{e.strerror or e} ({e.filename or at})",
                        fix=disk_fix(e)) from None
    return existed


def _put_back(old: Path, out: Path) -> None:
    """The swap failed halfway: the previous index goes back to its place."""
    try:
        os.replace(old, out)
    except OSError as e:
        raise DiskError(f"cannot put the previous index back in {out}", why=e.strerror or str(e),
                        fix=f"it is in {old}: rename it to {out.name}") from None


def _recover(parent: Path, old_prefix: str, out: Path) -> None:
    """A run killed between its two renames left no `out` and the previous index aside: put it back."""
    if os.path.lexists(out):
        return
    try:
        aside = [p for p in parent.iterdir() if p.name.startswith(old_prefix) and p.is_dir()
                 and not scratch.owner_alive(p.name[len(old_prefix):], mtime=p.stat().st_mtime)]
        if aside:
            os.replace(max(aside, key=lambda p: p.stat().st_mtime), out)
    except OSError:
        pass  # the sweep removes what is left; the new index is written anyway


def build_index(store: Store, out: Path, *, generated_at: str, log: Log | None = None) -> IndexOutcome:
    """List the store, then write the site to `out` (atomically); nothing is written when the listing fails."""
    check_out_dir(out)  # before the listing: a wrong --out fails fast
    root = getattr(store, "root", None)  # a local store's directory
    if isinstance(root, Path) and Path(os.path.abspath(out)) in (root, *root.parents):
        raise UsageError(f"--out {out} holds the store {root}", why="the index replaces its directory as a whole",
                         fix="write the index to a directory outside the store")
    if log is not None:
        log.info(f"listing the bundles in {store.url}")
    site = Site(store=store.url, generated_at=generated_at, rows=rows_of(store.list_entries()))
    if log is not None and not site.rows:
        log.warn(f"{store.url} holds no bundles: the index is empty")
    replaced = write_site(out, site)
    return IndexOutcome(site=site, out=Path(os.path.abspath(out)), replaced=replaced)


# ------------------------------------------------------------------------------------- schemas


def _row_schema() -> dict[str, Any]:
    def text(**more: Any) -> dict[str, Any]:
        return {"type": "string", **more}

    def maybe(**more: Any) -> dict[str, Any]:
        return {"type": ["string", "null"], **more}

    strings = {"type": "array", "items": {"type": "string"}}
    props = {
        "name": text(description="the bundle's name (bundle.json)"),
        "key": text(pattern="^[0-9a-f]{64}$", description="a cache key: the sha256 of the recipe's key inputs"),
        "platform": text(pattern="^[a-z0-9]+-[a-z0-9_]+$", description="e.g. linux-x86_64"),
        "backends": strings,
        "toolkit": maybe(description="the CUDA toolkit it was built with; null: no CUDA"),
        "archs": {"anyOf": [{"type": "object", "properties": {"sass": strings, "ptx": strings},
                             "required": ["ptx", "sass"], "additionalProperties": False}, {"type": "null"}],
                  "description": "the CUDA architectures built as SASS and as PTX; null: no CUDA"},
        "driver_floor": maybe(description="the oldest NVIDIA driver that runs it; null: no CUDA or not known"),
        "glibc_floor": maybe(description="Linux: the highest GLIBC_ symbol version it needs"),
        "commit": text(pattern="^[0-9a-f]{40}$", description="the llama.cpp commit"),
        "version": maybe(description="the llama.cpp build number (b….), when known"),
        "built_at": maybe(description="bundle.json's built_at, as it records it"),
        "zip_name": text(),
        "zip_size": {"type": "integer", "minimum": 0},
        "zip_sha256": text(pattern="^[0-9a-f]{64}$"),
        "url": maybe(description="the zip's download link (http(s) or file:)"),
        "location": text(description="where the store keeps the zip"),
    }
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def site_schema() -> dict[str, Any]:
    """The JSON schema of index.json (committed as data/schemas/index-site.schema.json)."""
    props: dict[str, Any] = {
        "schema": {"const": 1},
        "site": {"const": SITE, "description": "marks the directory as one that llamabundle index wrote"},
        "tool": {"type": "string"},
        "store": {"type": "string", "description": "the store's URL"},
        "generated_at": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$",
                         "description": "ISO 8601 UTC, to the second: YYYY-MM-DDTHH:MM:SSZ"},
        "bundles": {"type": "array", "items": {"$ref": "#/$defs/bundle"}},
    }
    return {"$schema": SCHEMA_DRAFT, "$id": schema_id("index-site"),
            "title": "llamabundle index: index.json of the static site",
            "type": "object", "properties": props, "required": sorted(props), "additionalProperties": False,
            "$defs": {"bundle": _row_schema()}}


def report_schema() -> dict[str, Any]:
    """The JSON schema of `llamabundle index --json` (committed as data/schemas/cli-index.schema.json)."""
    props: dict[str, Any] = {
        "schema": {"const": 1},
        "ok": {"const": True},
        "store": {"type": "string", "description": "the store's URL"},
        "out": {"type": "string", "description": "the site's directory"},
        "files": {"type": "array", "items": {"type": "string"}, "description": "the files written"},
        "replaced": {"type": "boolean", "description": "a previous index (or an empty directory) was replaced"},
        "generated_at": site_schema()["properties"]["generated_at"],
        "bundles": {"type": "array", "items": {"$ref": "#/$defs/bundle"}},
    }
    return {"$schema": SCHEMA_DRAFT, "$id": schema_id("cli-index"), "title": "llamabundle index --json",
            "type": "object", "properties": props, "required": sorted(props), "additionalProperties": False,
            "$defs": {"bundle": _row_schema()}}
