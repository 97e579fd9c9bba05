"""The shipped CPU recipe through a compiler cache (issue 34, Deliver 2): byte for byte the same bundle with and
without one, on a miss and on a hit. The session's shared build (conftest.first_build) compiles through ccache when
it is installed (`auto`; .ci/run installs it) with its cache empty in CI: a miss. test_reproducible.py's second build
compiles without a cache (repro.py) and gives the same files. Here a new build directory of the same key compiles
everything from the warm cache (no preprocessor, ccache's depend mode; the paths under the llamabundle cache hashed
relative to it) and gives the same zip again."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from llamabundle import compiler_cache
from llamabundle.digest import sha256_file

from .conftest import BUILD_TIMEOUT, RECIPE, run_cli

CCACHE = compiler_cache.find("ccache", path=os.environ.get("PATH"))


@pytest.mark.skipif(CCACHE is None, reason="ccache is not installed (apt-get install ccache; .ci/run does)")
def test_a_new_build_directory_compiles_from_the_warm_cache_and_gives_the_same_zip(
        first_build: dict[str, Any], e2e_env: dict[str, str], store: Path, recipe_key: str, tmp_path: Path) -> None:
    assert CCACHE is not None
    shared = first_build["result"]["compiler_cache"]
    assert shared is not None and shared["tool"] == "ccache" and shared["mode"] == "depend", shared
    # A build tree is named by the build's tools: ccache through another path gives this key a new, empty one
    # (what a clean build directory or a new runner has), beside the shared tree, which other tests read.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ccache").symlink_to(CCACHE)
    env = {**e2e_env, "PATH": f"{bin_dir}{os.pathsep}{e2e_env.get('PATH', '')}"}
    res = run_cli("build", RECIPE, "--store", tmp_path / "store", "--compiler-cache", "ccache", "--json", env=env,
                  timeout=BUILD_TIMEOUT)
    assert res.returncode == 0, res.stderr[-6000:]
    out = json.loads(res.stdout)
    stats = out["compiler_cache"]
    assert stats["tool"] == "ccache" and stats["misses"] == 0, stats
    # every compile, from the cache (231 with the shared build's 3 CPU variants)
    assert stats["hits"] == stats["hits_without_preprocessor"] >= 200, stats
    assert set(stats["by_language"]) >= {"C", "C++"}
    assert f"compiler cache: ccache {stats['version']}: {stats['hits']} hits, 0 misses" in res.stderr
    (first_zip,) = (store / recipe_key).glob("*.zip")
    assert sha256_file(Path(out["zip"])) == sha256_file(first_zip)
