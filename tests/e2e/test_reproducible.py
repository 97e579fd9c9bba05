"""Byte-reproducible bundles (issue 7): `build --check-reproducible` on the shipped CPU recipe builds it in the
cached build tree, then again from a copy of the source at another path in a new build directory, and both
zips have the same sha256. The first build is the one test_pipeline.py made (nothing recompiles there)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from .conftest import BUILD_TIMEOUT, RECIPE, run_cli


def test_two_builds_in_different_places_give_the_same_zip(first_build: dict[str, Any], e2e_env: dict[str, str],
                                                          store: Path, recipe_key: str, tmp_path: Path) -> None:
    res = run_cli("build", RECIPE, "--store", tmp_path / "store", "--check-reproducible", "--json", env=e2e_env,
                  timeout=2 * BUILD_TIMEOUT)
    assert res.returncode == 0, res.stderr[-6000:]
    out = json.loads(res.stdout)
    zip_path = Path(out["zip"])
    from llamabundle.digest import sha256_file

    assert out["reproducible"]["sha256"] == sha256_file(zip_path)
    assert "second build elsewhere" in res.stderr
    # the first build of this session (kept in its own store) gave the same bytes too
    (first_zip,) = (store / recipe_key).glob("*.zip")
    assert sha256_file(first_zip) == out["reproducible"]["sha256"]
    manifest = json.loads(zipfile.ZipFile(zip_path).read("bundle.json"))
    assert manifest["built_at"] == "2026-10-01T02:11:48Z"  # the pinned commit's committer date, not the clock


def test_llama_server_version_names_the_pinned_commit_and_build(unpacked: Path) -> None:
    import subprocess

    res = subprocess.run([str(unpacked / "llama-server"), "--version"], capture_output=True, text=True, timeout=60)
    text = res.stdout + res.stderr
    assert "(build 11312, commit 0c1e5709)" in text, text  # not "build 0, commit unknown"
