"""What makes a Linux CUDA build give the same bytes twice (backends/cuda/nvcc_launch.py, determinism.py,
build.fixed_path): the compiles run through source and build paths of one fixed length, nvcc through the
launcher (a per-file -frandom-seed, no address randomisation, PWD the fixed build path, cicc's seed and
clocks pinned, nvcc's and cicc's getcwd() and realpath() answering the fixed paths, by a preloaded library
compiled before configuring). The launcher and the pin run for real
here, with gcc and small programs in nvcc's and cicc's places; the real nvcc is in
tests/e2e/test_cuda_reproducible.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llamabundle import keys
from llamabundle.backends.base import Launcher
from llamabundle.backends.cuda import determinism, nvcc_launch
from llamabundle.build import (
    FIXED_LENGTH,
    BuildPlan,
    BuildTools,
    fixed_path,
    make_links,
    max_fixed_root,
    plan_build,
    unpadded,
)
from llamabundle.errors import BuildError
from llamabundle.recipe import NO_HOST

ROOT = Path(__file__).resolve().parents[2]
CUDA = ROOT / "recipes" / "linux-x86_64-cuda13.0.yaml"
WINDOWS_CUDA = ROOT / "recipes" / "windows-x86_64-cuda12.8.yaml"
CPU = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
TOOLS = BuildTools(cmake="cmake", ninja="ninja", compiler_cache="/usr/bin/ccache")
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc compiles the pin")


def test_the_seed_is_the_source_path_in_the_tree() -> None:
    root = "/f/s____0123"
    assert nvcc_launch.seed_of(["nvcc", "-x", "cu", "-c", f"{root}/ggml/src/a.cu", "-o", "a.o"], root) == "ggml/src/a.cu"
    assert nvcc_launch.seed_of(["nvcc", "-c", "/elsewhere/b.cu", "-o", "b.o"], root) == "b.cu"
    assert nvcc_launch.seed_of(["nvcc", "--version"], root) is None
    assert nvcc_launch.seed_of(["nvcc", "-c"], root) is None


def test_fixed_paths_have_one_length_wherever_the_trees_lie(tmp_path: Path) -> None:
    root = tmp_path / "cache" / "fixed"
    a = fixed_path(Path("/home/u/.cache/llamabundle/src/0c1e5709"), root, "s")
    b = fixed_path(tmp_path / "cache" / "tmp" / "repro-x" / "elsewhere" / "src" / "llama.cpp", root, "s")
    assert len(str(a)) == len(str(b)) == FIXED_LENGTH and a != b and a.parent == b.parent == root
    assert fixed_path(Path("/x"), root, "s") == fixed_path(Path("/x"), root, "s") != fixed_path(Path("/x"), root, "b")


def test_a_cache_directory_too_long_to_pad_is_named_with_the_length_that_fits() -> None:
    fits = Path("/c" + "x" * (max_fixed_root() - 2 - len("/fixed"))) / "fixed"
    too_long = Path(str(fits.parent) + "x") / "fixed"
    assert len(str(fits)) == max_fixed_root() == len(str(too_long)) - 1
    assert unpadded(_plan(CUDA, Path("/s"), Path("/b"), fits).links) is None
    links = _plan(CUDA, Path("/s"), Path("/b"), too_long).links
    assert [len(f) for f, _ in links] == [FIXED_LENGTH + 1] * 3
    warning = unpadded(links)
    assert warning is not None and f"under {too_long}, {max_fixed_root() + 1} characters" in warning
    assert f"at most {len(str(fits.parent))} characters (LLAMABUNDLE_CACHE_DIR)" in warning


def _plan(recipe: Path, src: Path, build: Path, fixed: Path | None) -> BuildPlan:
    return plan_build(keys.load(recipe), NO_HOST, source_dir=src, build_dir=build, tools=TOOLS,
                      toolkit_roots={"cuda": Path("/C")}, fixed_root=fixed)


def test_a_linux_cuda_build_is_configured_at_fixed_paths_with_the_launcher_before_ccache(tmp_path: Path) -> None:
    fixed = tmp_path / "fixed"
    one = _plan(CUDA, Path("/cache/src/c"), Path("/cache/build/k-1"), fixed)
    two = _plan(CUDA, Path("/cache/tmp/repro-abc/elsewhere/src/llama.cpp"), Path("/cache/tmp/repro-abc/b/build"), fixed)
    for plan in (one, two):
        (src, real_src), (build, real_build), (toolkit, real_toolkit) = plan.links
        assert real_toolkit == "/C" and len(toolkit) == FIXED_LENGTH and Path(toolkit).name.startswith("t_")
        assert plan.configure[1:5] == ("-S", src, "-B", build) and plan.build[2] == build
        assert (plan.source_dir, plan.build_dir, plan.output_dir) == (Path(real_src), Path(real_build), Path(real_build) / "bin")
        defs = dict(a[2:].split("=", 1) for a in plan.configure if a.startswith("-D"))
        launcher = defs["CMAKE_CUDA_COMPILER_LAUNCHER"].split(";")
        assert launcher[:3] == [sys.executable, "-I", f"{build}/{determinism.DIR}/nvcc_launch.py"]
        assert launcher[3:] == [src, build, f"{build}/{determinism.DIR}/cicc_pin.so", "/usr/bin/ccache"]
        assert defs["CMAKE_C_COMPILER_LAUNCHER"] == defs["CMAKE_CXX_COMPILER_LAUNCHER"] == "/usr/bin/ccache"
        assert f"-ffile-prefix-map={src}=/llama.cpp" in defs["CMAKE_CUDA_FLAGS"] and real_src not in defs["CMAKE_CUDA_FLAGS"]
        # the toolkit through its link too: nvcc, its headers and the prefix map of them (nvcc's toolkit is
        # the launcher's third fixed path)
        assert defs["CMAKE_CUDA_COMPILER"] == f"{toolkit}/bin/nvcc" and defs["CUDAToolkit_ROOT"] == toolkit
        assert f"-ffile-prefix-map={toolkit}=/cuda" in defs["CMAKE_CUDA_FLAGS"]
        assert plan.commands == (("gcc", "-shared", "-fPIC", "-O2", "-o", f"{build}/{determinism.DIR}/cicc_pin.so",
                                  f"{build}/{determinism.DIR}/cicc_pin.c", "-ldl"),)
        assert dict(plan.files)[f"{build}/{determinism.DIR}/nvcc_launch.py"] == Path(nvcc_launch.__file__).read_text()
        assert plan.to_json()["links"] == {src: real_src, build: real_build, toolkit: real_toolkit}
    # the two builds' commands differ only in the fixed paths' digests, never in a length
    assert [len(a) for a in one.configure] == [len(a) for a in two.configure]


def test_builds_without_a_launcher_keep_their_real_paths(tmp_path: Path) -> None:
    for recipe in (CPU, WINDOWS_CUDA):  # no CUDA; MSVC's CUDA (not claimed reproducible)
        plan = _plan(recipe, tmp_path / "s", tmp_path / "b", tmp_path / "fixed")
        assert plan.links == () and plan.commands == () and plan.configure[1:5] == ("-S", str(tmp_path / "s"), "-B", str(tmp_path / "b"))
    plan = _plan(CUDA, tmp_path / "s", tmp_path / "b", None)  # `bundle` (no build) and callers without a cache
    assert plan.links == () and "-DCMAKE_CUDA_COMPILER_LAUNCHER=/usr/bin/ccache" in plan.configure


def test_links_are_made_replaced_when_stale_and_never_over_a_directory(tmp_path: Path) -> None:
    real, other = tmp_path / "real", tmp_path / "other"
    real.mkdir()
    other.mkdir()
    link = tmp_path / "fixed" / "s___1"
    make_links([(str(link), str(other))])
    make_links([(str(link), str(real))])  # a link left pointing elsewhere is replaced
    assert os.readlink(link) == str(real)
    make_links([(str(link), str(real))])  # and kept when right
    assert os.readlink(link) == str(real) and sorted(p.name for p in link.parent.iterdir()) == ["s___1"]
    blocked = tmp_path / "fixed" / "b___2"
    blocked.mkdir()
    with pytest.raises(BuildError, match="cannot make"):
        make_links([(str(blocked), str(real))])
    assert blocked.is_dir() and not blocked.is_symlink()


def _launcher_tree(tmp_path: Path) -> tuple[Launcher, Path, Path]:
    src, build = tmp_path / "fixed" / "s", tmp_path / "fixed" / "b"
    (src / "ggml").mkdir(parents=True)
    build.mkdir(parents=True)
    launcher = determinism.launcher(c_compiler="gcc", source_dir=src, build_dir=build)
    for name, text in launcher.files:
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_text(text)
    for command in launcher.commands:
        subprocess.run(command, check=True, capture_output=True)
    return launcher, src, build


@needs_gcc
def test_the_launcher_runs_the_compiler_with_the_seed_the_pin_no_randomisation_and_a_fixed_pwd(tmp_path: Path) -> None:
    launcher, src, build = _launcher_tree(tmp_path)
    fake_nvcc = tmp_path / "nvcc"
    fake_nvcc.write_text("#!/bin/sh\necho \"ARGS $*\"\necho \"PERS $(cat /proc/self/personality)\"\n"
                         "echo \"PRELOAD $LD_PRELOAD\"\necho \"PWD $PWD\"\necho \"FIXED $LLAMABUNDLE_FIXED_PATHS\"\n")
    fake_nvcc.chmod(0o755)
    env = {**os.environ, "LD_PRELOAD": "", "PWD": "/somewhere/else"}
    done = subprocess.run([*launcher.argv, str(fake_nvcc), "-x", "cu", "-c", f"{src}/ggml/f.cu", "-o", "f.o"],
                          cwd=build.resolve(), env=env, capture_output=True, text=True, check=True)
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert out["ARGS"] == f"-x cu -c {src}/ggml/f.cu -o f.o -frandom-seed=ggml/f.cu"
    assert out["PRELOAD"] == launcher.argv[-1] and out["PWD"] == str(build)
    assert out["FIXED"] == f"{src}:{build}:{tmp_path.parent}"  # the pin's fixed paths: source, build, nvcc's toolkit
    if determinism.randomisation_refused() is None:
        assert int(out["PERS"], 16) & nvcc_launch.ADDR_NO_RANDOMIZE
    # A compiler cache after the launcher (ccache nvcc …): the toolkit is still nvcc's, not the cache's
    fake_cache = tmp_path / "cachebin" / "bin" / "ccache"
    fake_cache.parent.mkdir(parents=True)
    fake_cache.write_text('#!/bin/sh\nexec "$@"\n')
    fake_cache.chmod(0o755)
    done = subprocess.run([*launcher.argv, str(fake_cache), str(fake_nvcc), "-c", f"{src}/ggml/f.cu"],
                          cwd=build.resolve(), env=env, capture_output=True, text=True, check=True)
    assert dict(line.split(" ", 1) for line in done.stdout.splitlines())["FIXED"] == f"{src}:{build}:{tmp_path.parent}"
    missing = subprocess.run([*launcher.argv[:-1], str(tmp_path / "gone.so"), str(fake_nvcc)], capture_output=True, text=True)
    assert missing.returncode == 2 and "gone.so is missing" in missing.stderr and "run the llamabundle build again" in missing.stderr


@needs_gcc
def test_the_pin_fixes_the_seed_and_the_clocks_of_cicc_only(tmp_path: Path) -> None:
    launcher, _, build = _launcher_tree(tmp_path)
    probe = tmp_path / "probe.c"
    probe.write_text(textwrap.dedent("""\
        #include <stdio.h>
        #include <stdlib.h>
        #include <time.h>
        #include <unistd.h>
        int main(void) {
            struct timespec a, b;
            srand((unsigned)time(NULL) ^ (unsigned)getpid());
            clock_gettime(CLOCK_MONOTONIC, &a);
            clock_gettime(CLOCK_MONOTONIC, &b);
            printf("%d %ld %lld\\n", rand(), (long)time(NULL), (long long)(b.tv_nsec - a.tv_nsec));
            return 0;
        }
        """))
    for name in ("cicc", "other"):
        subprocess.run(["gcc", "-O1", "-o", str(tmp_path / name), str(probe)], check=True)
    pin = launcher.argv[-1]

    def run(name: str) -> list[int]:
        out = subprocess.run([str(tmp_path / name)], env={**os.environ, "LD_PRELOAD": pin}, capture_output=True,
                             text=True, check=True, cwd=build).stdout.split()
        return [int(x) for x in out]

    first, second = run("cicc"), run("cicc")
    assert first == second  # the same rand(), the same instant, one tick between two clock reads
    assert first[1] == 1_700_000_000 and first[2] == 1000
    other = run("other")
    assert abs(other[1] - time.time()) < 600  # the real clock


@needs_gcc
def test_the_pin_answers_getcwd_realpath_and_readlink_of_nvcc_and_cicc_with_the_fixed_paths(tmp_path: Path) -> None:
    """cicc's PTX followed the lengths of the real working directory (it keeps it on its heap), of the real
    source path (nvcc resolves it and passes it on) and of the toolkit (where they run from): through the pin,
    in nvcc and cicc only, getcwd, realpath and readlink("/proc/self/exe") answer with the fixed-length links
    (LLAMABUNDLE_FIXED_PATHS) wherever the real answer lies under what one links to."""
    launcher, _, _ = _launcher_tree(tmp_path)
    real_build = tmp_path / ("a-much-longer-real-build-directory-" + "x" * 40)
    real_src = tmp_path / "src-elsewhere"
    (real_build / "sub").mkdir(parents=True)
    (real_src / "ggml").mkdir(parents=True)
    (real_src / "ggml" / "f.cu").write_text("")
    links = tmp_path / "fixed"
    (links / "b-link").symlink_to(real_build)
    (links / "s-link").symlink_to(real_src)
    real_toolkit = tmp_path / "toolkit-at-its-real-path"
    (real_toolkit / "bin").mkdir(parents=True)
    (links / "t-link").symlink_to(real_toolkit)
    probe = tmp_path / "probe.c"
    probe.write_text(textwrap.dedent("""\
        #include <limits.h>
        #include <stdio.h>
        #include <stdlib.h>
        #include <unistd.h>
        int main(int argc, char **argv) {
            char small[8], buf[4096], resolved[PATH_MAX], exe[PATH_MAX] = {0}, tiny[4] = {0};
            char *dyn = getcwd(NULL, 0), *rp = realpath(argv[1], NULL);
            printf("%s\\n%s\\n%d\\n%s\\n%s\\n", getcwd(buf, sizeof buf), dyn, getcwd(small, sizeof small) == NULL,
                   rp, realpath(argv[2], resolved));
            ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
            printf("%.*s %zd %zd\\n", (int)n, exe, n, readlink("/proc/self/exe", tiny, sizeof tiny));
            free(dyn);
            free(rp);
            return 0;
        }
        """))
    for name in ("cicc", "nvcc", "other"):
        subprocess.run(["gcc", "-O1", "-o", str(real_toolkit / "bin" / name), str(probe)], check=True)
    fixed = f"{links / 's-link'}:{links / 'b-link'}:{links / 't-link'}"

    def run(name: str, cwd: Path, fixed_paths: str = fixed) -> list[str]:
        env = {**os.environ, "LD_PRELOAD": launcher.argv[-1], "LLAMABUNDLE_FIXED_PATHS": fixed_paths}
        # through env: the unit tests' guard refuses to start a program named nvcc (this one is a stand-in)
        return subprocess.run(["env", str(real_toolkit / "bin" / name), str(real_src / "ggml" / ".." / "ggml" / "f.cu"), str(tmp_path)],
                              env=env, cwd=cwd, capture_output=True, text=True, check=True).stdout.splitlines()

    def exe(name: str, root: Path) -> str:  # readlink's answer and its length; into 4 bytes it is cut, as readlink does
        return f"{root / 'bin' / name} {len(str(root / 'bin' / name))} 4"

    mapped = [str(links / "b-link" / "sub")] * 2 + ["1", str(links / "s-link" / "ggml" / "f.cu"), str(tmp_path)]
    for name in ("cicc", "nvcc"):  # getcwd(NULL, 0) too; ERANGE when too small; paths outside untouched
        assert run(name, real_build / "sub") == [*mapped, exe(name, links / "t-link")]
    as_is = [str(real_build / "sub")] * 2 + ["1", str(real_src / "ggml" / "f.cu"), str(tmp_path)]
    assert run("other", real_build / "sub") == [*as_is, exe("other", real_toolkit)]  # nothing else nvcc starts
    assert run("cicc", real_build / "sub", fixed_paths="") == [*as_is, exe("cicc", real_toolkit)]
    assert run("cicc", tmp_path)[:4] == [str(tmp_path)] * 2 + ["1", str(links / "s-link" / "ggml" / "f.cu")]
