"""Byte-reproducible bundles (issue 7): `build --check-reproducible` builds a recipe in the cached build tree, then
again from a copy of the source at another path in a new build directory without the compiler cache, and both zips
have the same sha256. The recipe is the shipped CPU recipe with its CPU variants cut to the baseline one (x64): its
first build compiles from the warm cache the session's shared build filled (test_pipeline.py), the second compiles
for real, without the shared build's other variants (all 14 a second time were one of CI's longest builds). What it shares with
the shared build's zip is byte for byte the same."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from llamabundle.digest import sha256_file

from .conftest import BUILD_TIMEOUT, SHIPPED, cut_variants, run_cli

KEEP = ("x64",)


def test_two_builds_in_different_places_give_the_same_zip(first_build: dict[str, Any], e2e_env: dict[str, str],
                                                          store: Path, recipe_key: str, tmp_path: Path) -> None:
    recipe = cut_variants(SHIPPED, tmp_path / "cpu-baseline-variant.yaml", keep=KEEP)
    res = run_cli("build", recipe, "--store", tmp_path / "store", "--check-reproducible", "--json", env=e2e_env,
                  timeout=2 * BUILD_TIMEOUT)
    assert res.returncode == 0, res.stderr[-6000:]
    out = json.loads(res.stdout)
    zip_path = Path(out["zip"])
    assert out["reproducible"]["sha256"] == sha256_file(zip_path)
    assert "second build elsewhere" in res.stderr
    with zipfile.ZipFile(zip_path) as zf:
        manifest = json.loads(zf.read("bundle.json"))
        mine = {i.filename: zf.read(i) for i in zf.infolist() if i.filename != "bundle.json"}
    assert manifest["built_at"] == "2026-10-01T02:11:48Z"  # the pinned commit's committer date, not the clock
    assert sorted(n for n in mine if n.startswith("libggml-cpu-")) == [f"libggml-cpu-{v}.so" for v in sorted(KEEP)]
    # the shared build of its variants (through the compiler cache, in its own tree) made the same files
    (first_zip,) = (store / recipe_key).glob("*.zip")
    with zipfile.ZipFile(first_zip) as zf:
        differ = [n for n in mine if zf.read(n) != mine[n]]
    assert differ == [], f"not the shared build's bytes: {differ}"


def test_llama_server_version_names_the_pinned_commit_and_build(unpacked: Path) -> None:
    import subprocess

    res = subprocess.run([str(unpacked / "llama-server"), "--version"], capture_output=True, text=True, timeout=60)
    text = res.stdout + res.stderr
    assert "(build 11312, commit 0c1e5709)" in text, text  # not "build 0, commit unknown"
