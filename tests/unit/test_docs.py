"""The contract in docs/ stays true of the code: every reason code of data/reasons.json has its section in
docs/probe.md with its backend, sentence and fix (and no section names a code that is gone); every top-level
property of bundle.json's schema is described in docs/bundle-format.md; every schema a page links exists,
ships in the wheel (package data) and every page links one; every relative link resolves."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import Path

import pytest

from llamabundle import backends

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = ["bundle-format.md", "store-layout.md", "install-rules.md", "probe.md", "consumer-walkthrough.md",
         "python-api.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def text(page: str) -> str:
    return (DOCS / page).read_text(encoding="utf-8")


def links(page: str) -> list[str]:
    return [m.group(1) for m in LINK.finditer(text(page)) if "://" not in m.group(1)]


def reason_sections() -> dict[str, str]:
    """docs/probe.md's `### `code`` sections: code -> the section's text."""
    body = text("probe.md").split("\n## The reason codes", 1)[1]
    parts = re.split(r"^### `([a-z0-9_]+)`\s*$", body, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_page_exists() -> None:
    assert set(PAGES) <= {p.name for p in DOCS.glob("*.md")}


def test_every_reason_code_has_its_section_in_probe_md() -> None:
    reasons = json.loads((ROOT / "llamabundle" / "data" / "reasons.json").read_text(encoding="utf-8"))["reasons"]
    sections = reason_sections()
    missing = sorted(set(reasons) - set(sections))
    assert not missing, f"docs/probe.md has no '### `code`' section for {missing}: add one per code (see its end)"
    assert not sorted(set(sections) - set(reasons)), "docs/probe.md describes codes reasons.json no longer has"
    for code, info in reasons.items():
        section = sections[code]
        assert f"- backend: `{info['backend']}`" in section, code
        assert f"- sentence: `{info['sentence']}`" in section, f"{code}: the sentence differs from reasons.json"
        assert f"- fix: `{info['fix']}`" in section, f"{code}: the fix differs from reasons.json"
        assert "- when: " in section, f"{code}: say when probe gives it"


def test_every_top_level_bundle_json_property_is_in_bundle_format_md() -> None:
    committed = json.loads((ROOT / "llamabundle" / "data" / "schemas" / "bundle.schema.json").read_text(encoding="utf-8"))
    assert committed == backends.bundle_schema()  # (test_manifest checks the committed bytes)
    page = text("bundle-format.md")
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \|", page, flags=re.M))
    missing = sorted(set(committed["properties"]) - rows)
    assert not missing, f"docs/bundle-format.md has no table row for bundle.json's {missing}"
    entry = committed["properties"]["files"]["items"]["properties"]
    assert not sorted(set(entry) - rows), "docs/bundle-format.md describes every file entry field"
    for field in committed["required"]:
        assert re.search(rf"^\| `{field}` \|[^\n]*\| yes \|", page, flags=re.M), f"{field} is required"


@pytest.mark.parametrize("page", PAGES)
def test_every_page_links_a_schema_and_its_relative_links_resolve(page: str) -> None:
    found = links(page)
    assert any(link.endswith(".schema.json") for link in found), f"docs/{page} links no JSON schema"
    for link in found:
        target, _, anchor = link.partition("#")
        path = (DOCS / target).resolve() if target else DOCS / page
        assert path.exists(), f"docs/{page} links {link}, which does not exist"
        if anchor and path.suffix == ".md":
            heads = [_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)]
            assert anchor in heads, f"docs/{page} links {link}: no such heading in {path.name}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_linked_schemas_ship_in_the_wheel() -> None:
    """Every schema the docs link lies in the package and matches its package data (pyproject.toml)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    globs = data["tool"]["setuptools"]["package-data"]["llamabundle"]
    package = ROOT / "llamabundle"
    linked = {(DOCS / link.partition("#")[0]).resolve() for page in PAGES for link in links(page)
              if link.partition("#")[0].endswith(".json")}
    assert linked
    for path in sorted(linked):
        assert path.is_relative_to(package), f"{path} is linked from docs/ but is not in the package"
        rel = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), \
            f"{rel} is not package data: add its directory to [tool.setuptools.package-data]"
    every = {p.relative_to(package).as_posix() for p in package.joinpath("data").rglob("*.schema.json")}
    assert all(any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs) for rel in every)


def test_readme_links_the_docs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in PAGES:
        assert f"(docs/{page})" in readme, f"README.md does not link docs/{page}"
    assert "llamabundle.api" in readme
