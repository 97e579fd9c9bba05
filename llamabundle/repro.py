"""The reproducibility check (`build --check-reproducible`): build again from a copy of the source at another
path, in a new build directory, package it, and compare the two zips byte for byte. When they differ, the
second zip is kept beside the first (`<name>.second.zip`) for a closer look."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import cache, scratch
from .build import plan_build, remove_links, run_build
from .bundle import diff_zips
from .digest import sha256_file
from .errors import VerifyError
from .log import Log
from .package import Made, package
from .platforms.base import HostToolchain


def rebuild_elsewhere(made: Made, zip_a: Path, *, toolchain: HostToolchain, jobs: int | None, cache_dir: Path,
                      build_timeout: float, log: Log,
                      env: Mapping[str, str]) -> dict[str, Any]:
    """Raises VerifyError naming each differing file and its first differing byte unless both zips are equal."""
    work = scratch.make_dir(cache.tmp_dir(cache_dir), cache.REPRO_PREFIX)
    try:
        with log.step("second build elsewhere (reproducibility check)"):
            src_b = work / "elsewhere" / "src" / "llama.cpp"
            shutil.copytree(made.src.path, src_b, symlinks=True)
            plan_b = plan_build(made.recipe, made.keyed.host, source_dir=src_b, build_dir=work / "b" / "build",
                                tools=replace(made.tools, compiler_cache=None),  # compiled again, not taken from a cache
                                jobs=jobs, toolkit_roots=made.toolkit_roots, env=toolchain.env,
                                fixed_root=cache.fixed_dir(cache_dir), compilers=toolchain.compilers)
            try:
                result_b = run_build(plan_b, log=log, env=env, clean=True, timeout=build_timeout,
                                     lay=lambda d: made.lay(d, log))
            finally:  # those into the scratch tree, removed below (a toolkit's link may serve another build)
                remove_links([(fixed, real) for fixed, real in plan_b.links if Path(real).is_relative_to(work)])
        zip_b = work / zip_a.name
        package(replace(made, src=replace(made.src, path=src_b)), plan_b, result_b, zip_b, toolchain=toolchain,
                cache_dir=cache_dir, log=log)
        diffs = diff_zips(zip_a, zip_b)
        sha_a, sha_b = sha256_file(zip_a), sha256_file(zip_b)
        kept = cache.sibling(zip_a, cache.SECOND_ZIP_SUFFIX)
        if diffs or sha_a != sha_b:
            shutil.move(zip_b, kept)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if diffs or sha_a != sha_b:
        lines = "\n".join(f"    {d}" for d in diffs) or "    (same members; the zip containers differ)"
        raise VerifyError("the bundle is not reproducible: a second build elsewhere gave other bytes",
                          why=f"zip sha256 {sha_a} ({zip_a}) vs {sha_b} (the second build, kept as {kept})",
                          details=lines, fix="compare the files listed in the two zips: look for paths, dates or "
                                             "build-order effects")
    log.info(f"    reproducible: both builds give zip sha256 {sha_a}")
    return {"sha256": sha_a, "second_build": "other source path and build directory"}
