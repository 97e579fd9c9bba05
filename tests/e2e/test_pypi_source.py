"""The `pypi:` source with the real sdist (llama-cpp-python 0.3.36, 76 MB) served by a package index on
127.0.0.1, in a child Python whose PATH starts with this venv's PyPI cmake (the shim that broke pip's
isolated metadata build): the file is found through the simple API, downloaded by URL, sha256-checked
and proven against its vendored git index, and no process at all is started on the way (an audit
hook in the child records every one). An index serving other bytes under the pinned name is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llamabundle import keys
from tests.fakeindex import FakeIndex

from .conftest import RECIPE

CHILD = r"""
import json, sys, time
spawned = []
def hook(event, args):
    if event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "os.fork"):
        spawned.append([event, repr(args)[:300]])
from llamabundle.log import Log
from llamabundle.settings import Settings
from llamabundle.errors import LlamaBundleError
from llamabundle import keys
import os
recipe = keys.load(sys.argv[1])
settings = Settings.from_env(os.environ)
sys.addaudithook(hook)
t0 = time.monotonic()
try:
    from llamabundle.source import fetch_source
    tree = fetch_source(recipe, settings, Log())
    result = {"ok": True, "origin": tree.origin, "path": str(tree.path), "commit_time": tree.commit_time}
except LlamaBundleError as e:
    result = {"ok": False, "exit_code": e.exit_code, "what": e.what, "why": e.why}
result["seconds"] = time.monotonic() - t0
result["spawned"] = spawned
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def sdist(first_build: dict[str, Any], e2e_env: dict[str, str]) -> Path:
    """The real sdist, as the first build's pypi source left it in the download cache."""
    src = next(s for s in keys.load(RECIPE).llama_cpp.sources if getattr(s, "kind", "") == "pypi")
    files = list((Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]) / "downloads" / src.sha256).glob("*.tar.gz"))  # type: ignore[attr-defined]
    if not files:
        pytest.skip("the first build took its source from elsewhere (a git or github source): no sdist cached")
    return files[0]


def run_source(tmp: Path, index: FakeIndex, e2e_env: dict[str, str]) -> dict[str, Any]:
    venv_bin = Path(sys.executable).parent  # holds the PyPI cmake of '.[tools]'
    env = {**e2e_env, "LLAMABUNDLE_CACHE_DIR": str(tmp / "cache"), "LLAMABUNDLE_PIP_INDEX_URL": index.url,
           "LLAMABUNDLE_GITHUB_ARCHIVE_URL": "http://127.0.0.1:9",  # the github: source is unreachable, as here
           "PATH": f"{venv_bin}{os.pathsep}{e2e_env.get('PATH', '')}"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(RECIPE)], env=env, capture_output=True, text=True,
                         timeout=1200, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["stderr"] = out.stderr
    return result


def test_the_real_sdist_from_a_local_index_without_pip(sdist: Path, e2e_env: dict[str, str], tmp_path: Path) -> None:
    assert (Path(sys.executable).parent / "cmake").exists(), "the venv should hold the PyPI cmake"
    index = FakeIndex()
    try:
        index.add("llama-cpp-python", sdist.name, sdist)
        index.add("llama-cpp-python", "llama_cpp_python-0.3.35.tar.gz", b"another release")
        res = run_source(tmp_path, index, e2e_env)
    finally:
        index.close()
    assert res["ok"], res
    assert res["origin"] == "pypi:llama-cpp-python==0.3.36"
    assert res["spawned"] == []  # no pip, no cmake, no git: nothing was started
    assert index.requests == ["/simple/llama-cpp-python/", f"/files/llama-cpp-python/{sdist.name}"]
    assert "files match the git index of 0c1e57098bba" in res["stderr"]
    print(f"\nsource step from a loopback index: {res['seconds']:.1f} s (download, sha256, extract, proof)")


def test_a_local_index_serving_other_bytes_is_refused(sdist: Path, e2e_env: dict[str, str], tmp_path: Path) -> None:
    index = FakeIndex()
    try:
        index.add("llama-cpp-python", sdist.name, sdist)
        real = sdist.read_bytes()
        index.served[sdist.name] = real[:-16] + b"\0" * 16  # same name, same size, other bytes
        res = run_source(tmp_path, index, e2e_env)
    finally:
        index.close()
    assert not res["ok"] and res["exit_code"] == 5, res
    assert "sha256 mismatch" in res["why"] or "sha256 mismatch" in res["what"], res
    assert res["spawned"] == []
    cache = tmp_path / "cache"
    assert not (cache / "src").exists() or not any((cache / "src").iterdir())
    assert not list(cache.rglob("*.tar.gz*"))
