"""The same CUDA objects from two build trees as two machines would lay them out, with the real nvcc.

Both trees are configured by llamabundle's own plan (plan_build with the cache's fixed-length links, the nvcc
launcher and cicc's pin compiled before configuring, run_build), as `build` and `--check-reproducible`
configure theirs: the first from the cache's source into a short build directory with the session's PyPI
CUDA 13 toolkit; the second from a copy of the source at another path, into a build directory about twice as
deep, with the toolkit at a longer path (hard links) and the fixed links under another root, as another
cache directory would have them. Only one of ggml-cuda's objects is compiled in each: the flash-attention
tile instance dkq40, whose PTX (as dkq72's) followed the lengths of the real source path, working directory
and toolkit path before the pin answered nvcc's and cicc's realpath(), getcwd() and readlink() with the
fixed paths and gcc stopped resolving the toolkit's header paths (both objects took 270 s of CI's two cores). The recipe's archs: PTX for compute_75,
SASS for sm_90. The whole CUDA recipe built twice is on the GPU machine (bench/results/gpu-h200-cuda-repro/)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from llamabundle import keys, source
from llamabundle.backends.cuda.toolkit.layout import Toolkit
from llamabundle.build import FIXED_LENGTH, locate_tools, max_fixed_root, plan_build, remove_links, run_build
from llamabundle.log import Log
from llamabundle.recipe import NO_HOST
from llamabundle.settings import Settings
from tests.e2e.conftest import CUDA_RECIPE

OBJECTS = tuple(f"ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/template-instances/fattn-tile-instance-dkq{d}-dv{d}.cu.o"
                for d in (40,))


def _build(recipe_path: Path, src: Path, build: Path, fixed: Path, toolkit: Path, env: dict[str, str]) -> dict[str, str]:
    recipe = keys.load(recipe_path)
    tools = dataclasses.replace(locate_tools(path=env.get("PATH")), compiler_cache=None)  # compiled here, not taken from a cache
    plan = plan_build(recipe, NO_HOST, source_dir=src, build_dir=build, tools=tools, jobs=2,
                      toolkit_roots={"cuda": toolkit}, env={}, fixed_root=fixed)
    assert len(plan.links) == 3 and plan.commands  # source, build, toolkit: fixed-length links; the pin compiled first
    assert all(len(f) == FIXED_LENGTH for f, _ in plan.links)
    fixed_build = plan.links[1][0]
    plan = dataclasses.replace(plan, build=(tools.ninja, "-C", fixed_build, "-j2", *OBJECTS), programs=(), backends=())
    try:
        run_build(plan, log=Log(quiet=True), env=env, clean=True)
    finally:
        remove_links(plan.links)
    return {o: hashlib.sha256((build / o).read_bytes()).hexdigest() for o in OBJECTS}


def test_two_trees_at_paths_of_other_lengths_give_the_same_cuda_objects(toolkit: Toolkit, e2e_env: dict[str, str],
                                                                         tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (the host compiler and the pin's)")
    settings = Settings.from_env(e2e_env)
    recipe = keys.load(CUDA_RECIPE)
    tree = source.fetch_source(recipe, settings, Log(quiet=True))
    # The cache directories' fixed roots lie outside tmp_path: under pytest-xdist's deeper basetemp, a root under
    # it is too long to pad, and builds agree only with roots of one length (run_build warns of that).
    roots = Path(tempfile.mkdtemp(prefix="lb-fixed-"))
    fixed = roots / "fixed"
    other_fixed = roots / "another" / "cache" / "directory" / "fixed"
    assert len(str(other_fixed)) <= max_fixed_root(), f"{roots} (TMPDIR) is too long for this test"
    short_build = tmp_path / "b"
    deep = tmp_path / "elsewhere" / ("d" * 40) / "src"
    long_build = tmp_path / "elsewhere" / ("d" * 40) / ("b" * 40) / "build"
    shutil.copytree(tree.path, deep / "llama.cpp", symlinks=True)
    assert len(str(long_build)) - len(str(short_build)) > 80
    other_toolkit = tmp_path / "elsewhere" / "a-toolkit-at-another-path" / "cuda-13"
    if len(str(other_toolkit)) == len(str(toolkit.root)):
        other_toolkit = other_toolkit.with_name("cuda-13.0")
    try:
        shutil.copytree(toolkit.root, other_toolkit, symlinks=True, copy_function=os.link)
    except OSError:  # another file system
        shutil.rmtree(other_toolkit, ignore_errors=True)
        shutil.copytree(toolkit.root, other_toolkit, symlinks=True)
    assert len(str(other_toolkit)) != len(str(toolkit.root))
    try:
        first = _build(CUDA_RECIPE, tree.path, short_build, fixed, toolkit.root, e2e_env)
        second = _build(CUDA_RECIPE, deep / "llama.cpp", long_build, other_fixed, other_toolkit, e2e_env)
        assert first == second
        assert not any(fixed.iterdir()) and not any(other_fixed.iterdir())  # the links of both trees are gone
    finally:
        shutil.rmtree(roots, ignore_errors=True)
