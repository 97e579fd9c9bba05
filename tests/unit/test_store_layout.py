"""The layout of llamabundle.store: the protocol (store.base) imports no concrete store, the concrete stores
import only the protocol from the package, and the factory (llamabundle.store.open_store) is the one place that
reads the settings, handing each store explicit values."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamabundle.log import Log
from llamabundle.settings import Settings
from llamabundle.store import open_store
from llamabundle.store.github import DEFAULT_API_URL, GitHubStore
from llamabundle.store.local import LocalStore

REPO = Path(__file__).resolve().parents[2]
STORE = REPO / "llamabundle" / "store"
CONCRETE = ("llamabundle.store.local", "llamabundle.store.github", "llamabundle.store.oci")


def _loaded_after(statement: str) -> list[str]:
    """The llamabundle modules a fresh interpreter has loaded after running `statement`."""
    script = (f"{statement}\nimport json, sys\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.startswith('llamabundle'))))")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    loaded: list[str] = json.loads(out.stdout)
    return loaded


@pytest.mark.parametrize("statement", ["import llamabundle.store.base", "import llamabundle.store",
                                       "from llamabundle.store import Entry, Published, Store, open_store"])
def test_importing_the_protocol_imports_no_concrete_store(statement: str) -> None:
    loaded = _loaded_after(statement)
    assert "llamabundle.store.base" in loaded
    assert not [m for m in CONCRETE if m in loaded], loaded


def _relative_imports(path: Path) -> list[str]:
    """`from .X import …` and `from . import …` of a module (as ".X" and "."), and its absolute llamabundle.store imports."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                found.append("." + (node.module or ""))
            elif node.level == 0 and (node.module or "").startswith("llamabundle.store"):
                found.append(node.module or "")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("llamabundle.store")]
    return found


def _store_imports(path: Path) -> set[str]:
    """What a module of the github package takes from llamabundle.store outside the package (`from ..X import`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 2:
            found |= {node.module} if node.module else {a.name for a in node.names}
    return found


def test_base_imports_no_store_and_the_stores_import_only_base() -> None:
    """A store takes from the package only the protocol, the SHA256SUMS grammar, the blob codec (which takes
    only the protocol) and the ranged blob reader (which takes nothing of it); the GitHub and OCI stores' own
    modules take those and each other."""
    assert _relative_imports(STORE / "base.py") == _relative_imports(STORE / "sums.py") == []
    assert _relative_imports(STORE / "ranged.py") == []
    assert _relative_imports(STORE / "codec.py") == [".base"]
    assert set(_relative_imports(STORE / "local.py")) <= {".", ".base"}
    for path in sorted((STORE / "github").glob("*.py")):
        assert set(_relative_imports(path)) <= {".", ".blobs", ".client", ".releases", ".publish", ".store"}, path.name
        assert _store_imports(path) <= {"base", "sums", "codec", "ranged"}, path.name
    for path in sorted((STORE / "oci").glob("*.py")):
        assert set(_relative_imports(path)) <= {".", ".client", ".image", ".store"}, path.name
        assert _store_imports(path) <= {"base", "codec", "ranged"}, path.name


def test_every_store_module_says_what_it_is_for() -> None:
    for path in sorted(STORE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert doc and len(doc) > 40, path.name


# ---------------------------------------------------------------------------------- the factory


def test_a_path_and_a_file_url_are_local_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_path = open_store(str(tmp_path / "a"), settings=Settings(cache_dir=tmp_path / "cache"))
    assert type(by_path) is LocalStore
    assert (by_path.root, by_path.url) == ((tmp_path / "a").resolve(), str((tmp_path / "a").resolve()))

    by_url = open_store(f"file://{tmp_path}/b")
    assert type(by_url) is LocalStore and by_url.root == (tmp_path / "b").resolve()
    assert by_url.lookup("0" * 64) is None  # a real store on the directory (created on the first publish)

    monkeypatch.setenv("HOME", str(tmp_path))
    home = open_store("~/c")
    assert type(home) is LocalStore and home.root == (tmp_path / "c").resolve()


def test_github_gets_the_settings_fields_it_uses() -> None:
    settings = Settings(cache_dir=Path("/nonexistent"), github_api_url="http://127.0.0.1:9/api/",
                        github_token="t0ken", connect_timeout=3.5)
    log = Log(quiet=True)
    tags = {"ab" * 32: "bundle-abababababab"}
    store = open_store("github:owner/repo", settings=settings, log=log, tags=tags)
    assert type(store) is GitHubStore  # constructing it touches no network
    assert (store.url, store.repo, store.api_url, store.token) == ("github:owner/repo", "owner/repo",
                                                                   "http://127.0.0.1:9/api", "t0ken")
    assert store.client.timeout[0] == store.client.upload_timeout[0] == 3.5
    assert store.log is log and store.tags == tags


def test_github_without_settings_has_the_stores_defaults() -> None:
    store = open_store("github:owner/repo")
    assert type(store) is GitHubStore
    default = GitHubStore("owner/repo")
    assert (store.api_url, store.token, store.client.timeout, store.tags) == (DEFAULT_API_URL, None,
                                                                              default.client.timeout, {})
