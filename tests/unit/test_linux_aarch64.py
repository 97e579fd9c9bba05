"""The linux-aarch64 platform (platforms/linux_aarch64.py, data/linux_aarch64.json): its recipe rules, the key's
build host and glibc (pinned: computable anywhere; else read from the sysroot), the cross toolchain file, the
compilers under their versioned names, each CPU variant's -march tried on the real cross compilers, the static
check of the machine, and programs run under qemu-user."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from llamabundle import compilers, keys, platforms, proc
from llamabundle.build import BuildPlan, BuildTools, plan_build
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.errors import RecipeError, ToolchainError, VerifyError
from llamabundle.log import Log
from llamabundle.platforms import linux_aarch64
from llamabundle.platforms.linux_aarch64 import LINUX_AARCH64
from llamabundle.recipe import NO_HOST, Recipe
from tests import bundles as test_bundles

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "linux-aarch64-cpu.yaml"
SYSROOT = Path(linux_aarch64.knowledge()["cross"]["sysroot"])
HAS_CROSS = (SYSROOT / "lib" / "libc.so.6").is_file()


def recipe_text(**toolchain: str) -> str:
    tc = {"compiler": "clang", "version": "=19.1.7", **toolchain}
    return f"""
recipe: 1
name: t-arm
platform: linux-aarch64
llama_cpp:
  commit: 0c1e57098bba43ac29e6e3b677cdceebdd22334f
  sources: [{{github: ggml-org/llama.cpp}}]
backends: [cpu]
toolchain: {{{", ".join(f'{k}: "{v}"' for k, v in tc.items() if v)}}}
cmake: {{GGML_BACKEND_DL: "ON", GGML_CPU_ALL_VARIANTS: "ON", GGML_NATIVE: "OFF", GGML_OPENMP: "OFF"}}
targets: [llama-server]
"""


# ------------------------------------------------------------------------------------------- the recipe and the key


def test_the_shipped_recipe_has_a_key_computable_without_the_cross_toolchain(monkeypatch: pytest.MonkeyPatch) -> None:
    """It pins the compiler, the build host and the glibc: nothing of this machine is asked (no sysroot, no PATH)."""
    monkeypatch.setattr(linux_aarch64, "glibc_version", lambda libc: pytest.fail(f"read {libc}"))
    keyed = keys.resolve(keys.load(RECIPE), env={"PATH": "/nonexistent"})
    build = keyed.inputs["build"]
    assert (build["host"], build["glibc"]) == ("linux-x86_64", "2.36")
    assert keyed.inputs["platform"] == "linux-aarch64" and keyed.inputs["toolchain"] == {"compiler": "clang",
                                                                                         "version": "=19.1.7"}
    assert keyed.recipe.all_cpu_variants() == ("armv8.0_1", "armv8.2_1", "armv8.2_2", "armv8.2_3", "armv8.6_1",
                                               "armv8.6_2", "armv9.2_1", "armv9.2_2")


def test_where_it_is_built_and_the_glibc_make_different_keys() -> None:
    cross = keys.resolve(keys.parse(recipe_text(build_host="linux-x86_64", glibc="2.36")))
    native = keys.resolve(keys.parse(recipe_text(build_host="linux-aarch64", glibc="2.36")))
    newer = keys.resolve(keys.parse(recipe_text(build_host="linux-x86_64", glibc="2.39")))
    assert len({cross.key, native.key, newer.key}) == 3


def test_an_unpinned_glibc_is_read_from_the_sysroot_or_named_as_missing(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    libc = tmp_path / "libc.so.6"
    libc.write_bytes(b"\x7fELF...GNU C Library (Debian GLIBC 2.41-6) stable release version 2.41.\n...")
    monkeypatch.setattr(type(LINUX_AARCH64), "libc", lambda self, build_host: [libc])
    linux_aarch64.glibc_version.cache_clear()
    assert keys.resolve(keys.parse(recipe_text(build_host="linux-x86_64"))).inputs["build"]["glibc"] == "2.41"
    libc.unlink()
    linux_aarch64.glibc_version.cache_clear()
    with pytest.raises(ToolchainError) as e:
        keys.resolve(keys.parse(recipe_text(build_host="linux-x86_64")))
    assert "needs the glibc" in e.value.what and "toolchain: {glibc:" in e.value.fix
    linux_aarch64.glibc_version.cache_clear()


@pytest.mark.parametrize(("text", "path", "what"), [
    (recipe_text(version=""), "toolchain.version", "pins its compiler"),
    (recipe_text(compiler="mingw", version="=12.0.0"), "toolchain.compiler", "cannot target linux-aarch64"),
], ids=["unpinned", "mingw"])
def test_recipe_rules(text: str, path: str, what: str) -> None:
    with pytest.raises(RecipeError) as e:
        keys.parse(text, file="arm.yaml")
    assert path in e.value.what and what in e.value.what


def test_only_the_cpu_backend_is_built_for_arm_linux() -> None:
    r = dataclasses.replace(keys.load(RECIPE), backends=("cpu", "vulkan"))
    with pytest.raises(RecipeError) as e:
        LINUX_AARCH64.check_recipe(r)
    assert "backends[1]: the vulkan backend is not built for linux-aarch64" in e.value.what
    assert e.value.fix == "backends: [cpu, rpc]"


def test_build_host_and_glibc_belong_to_linux_aarch64_recipes_only() -> None:
    text = recipe_text(build_host="linux-x86_64").replace("platform: linux-aarch64", "platform: linux-x86_64")
    with pytest.raises(RecipeError) as e:
        keys.parse(text.replace("clang", "gcc").replace("=19.1.7", "=12.2.0"), file="x.yaml")
    assert "toolchain.build_host" in e.value.what and "only linux-aarch64" in e.value.fix


def test_an_arm64_machine_is_linux_aarch64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platforms._host, "system", lambda: "Linux")
    for machine in ("aarch64", "arm64"):
        monkeypatch.setattr(platforms._host, "machine", lambda m=machine: m)
        assert platforms.host_name() == "linux-aarch64"


# ------------------------------------------------------------------------------------------- the build


def _fake_compilers(bin_dir: Path, *names: str) -> str:
    bin_dir.mkdir(exist_ok=True)
    for n in names:
        (bin_dir / n).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / n).chmod(0o755)
    return str(bin_dir)


def test_compilers_are_taken_under_their_versioned_names_when_both_are_there(tmp_path: Path) -> None:
    both = _fake_compilers(tmp_path / "both", "clang-19", "clang++-19")
    half = _fake_compilers(tmp_path / "half", "clang-19")
    assert compilers.versioned(("clang", "clang++"), "=19.1.7", path=both) == ("clang-19", "clang++-19")
    assert compilers.versioned(("clang", "clang++"), "19", path=both) == ("clang-19", "clang++-19")
    assert compilers.versioned(("clang", "clang++"), "=19.1.7", path=half) == ("clang", "clang++")
    assert compilers.versioned(("clang", "clang++"), "[19,20)", path=both) == ("clang", "clang++")
    assert compilers.versioned(("clang", "clang++"), None, path=both) == ("clang", "clang++")


def _plan(r: Recipe, path: str) -> BuildPlan:
    """The plan as a build makes it: with the compilers the platform's setup picked on `path`."""
    picked = LINUX_AARCH64.programs(r, LINUX_AARCH64.build_host(r), path=path)
    return plan_build(r, NO_HOST, source_dir=Path("/s"), build_dir=Path("/b"), tools=BuildTools(cmake="cmake", ninja="ninja"),
                      compilers=picked)


def test_a_cross_plan_writes_the_toolchain_file_and_names_the_cross_compilers(tmp_path: Path) -> None:
    path = _fake_compilers(tmp_path / "bin", "clang-19", "clang++-19", "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++")
    r = keys.parse(recipe_text(build_host="linux-x86_64"))
    plan = _plan(r, path)
    assert "-DCMAKE_C_COMPILER=clang-19" in plan.configure and "-DCMAKE_CXX_COMPILER=clang++-19" in plan.configure
    assert f"-DCMAKE_TOOLCHAIN_FILE=/b/{linux_aarch64.TOOLCHAIN}" in plan.configure
    [(_, toolchain)] = [f for f in plan.files if f[0].endswith(linux_aarch64.TOOLCHAIN)]
    for line in ("set(CMAKE_SYSTEM_PROCESSOR aarch64)", "set(CMAKE_C_COMPILER_TARGET aarch64-linux-gnu)",
                 f"set(CMAKE_FIND_ROOT_PATH {SYSROOT})", "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)"):
        assert line in toolchain.splitlines()
    assert plan.backends == tuple(f"libggml-cpu-{v}.so" for v in r.all_cpu_variants())
    gcc = keys.parse(recipe_text(compiler="gcc", version="=12.2.0", build_host="linux-x86_64"))
    plan = _plan(gcc, path)
    assert "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++" in plan.configure  # no -12 names here: the plain ones
    [(_, toolchain)] = [f for f in plan.files if f[0].endswith(linux_aarch64.TOOLCHAIN)]
    assert "COMPILER_TARGET" not in toolchain  # gcc is the cross compiler itself
    native = keys.parse(recipe_text(build_host="linux-aarch64"))
    plan = _plan(native, path)
    assert "-DCMAKE_CXX_COMPILER=clang++-19" in plan.configure
    assert not [f for f in plan.files if f[0].endswith(linux_aarch64.TOOLCHAIN)]
    assert not any(a.startswith("-DCMAKE_TOOLCHAIN_FILE") for a in plan.configure)


def test_a_build_on_another_machine_than_the_recipe_names_is_refused() -> None:
    r = keys.parse(recipe_text(build_host="linux-aarch64", glibc="2.36"))
    with pytest.raises(ToolchainError) as e:
        LINUX_AARCH64.setup_toolchain(r, NO_HOST, env={"PATH": "/usr/bin:/bin"}, log=Log(quiet=True))
    assert "built on linux-aarch64 (toolchain.build_host)" in e.value.what and "a new key" in e.value.fix


@pytest.mark.skipif(not HAS_CROSS or shutil.which("aarch64-linux-gnu-gcc") is None,
                    reason="Debian's aarch64 cross gcc (g++-aarch64-linux-gnu; .ci/run installs it)")
def test_the_cross_gcc_12_is_refused_naming_the_first_variant_it_cannot_build() -> None:
    """Debian 12's aarch64 gcc 12 does not know armv9.2-a: the refusal names the variant, before any build."""
    version = compilers.detect_version("gcc", program="aarch64-linux-gnu-g++")
    assert version is not None
    r = keys.parse(recipe_text(compiler="gcc", version=f"={version}", build_host="linux-x86_64", glibc="2.36"))
    with pytest.raises(ToolchainError) as e:
        LINUX_AARCH64.setup_toolchain(r, NO_HOST, env={"PATH": "/usr/bin:/bin"}, log=Log(quiet=True))
    assert "cannot build the CPU variant armv9.2_1 (-march=armv9.2-a+dotprod+fp16+sve+i8mm+sme)" in e.value.what
    assert "armv9.2-a" in (e.value.why or "") and "exclude: [armv9.2_1]" in e.value.fix
    left_out = recipe_text(compiler="gcc", version=f"={version}", build_host="linux-x86_64", glibc="2.36").replace(
        "targets:", "cpu_variants: {exclude: [armv9.2_1, armv9.2_2]}\ntargets:")
    got = LINUX_AARCH64.setup_toolchain(keys.parse(left_out), NO_HOST, env={"PATH": "/usr/bin:/bin"}, log=Log(quiet=True))
    assert got.record == {"build_host": "linux-x86_64", "glibc": "2.36", "cross_target": "aarch64-linux-gnu"}


@pytest.mark.skipif(not HAS_CROSS or shutil.which("clang++-19") is None,
                    reason="Debian 12's clang-19 and the aarch64 sysroot (.ci/run installs them)")
def test_clang_19_builds_every_variant_and_the_glibc_pin_is_checked() -> None:
    r = keys.load(RECIPE)
    got = LINUX_AARCH64.setup_toolchain(r, NO_HOST, env={"PATH": "/usr/bin:/bin"}, log=Log(quiet=True))
    assert got.compiler == "19.1.7" and got.record["glibc"] == "2.36"
    other = keys.parse(recipe_text(build_host="linux-x86_64", glibc="2.39"))
    with pytest.raises(ToolchainError, match="would link against glibc 2.36, not the recipe's toolchain.glibc 2.39"):
        LINUX_AARCH64.setup_toolchain(other, NO_HOST, env={"PATH": "/usr/bin:/bin"}, log=Log(quiet=True))


# ------------------------------------------------------------------------------------------- checks and loading


def test_the_static_check_refuses_a_binary_for_another_machine(tmp_path: Path) -> None:
    root = tmp_path / "bundle"
    root.mkdir()
    shutil.copy(shutil.which("true") or "/bin/true", root / "llama-server")  # this machine's x86-64 ELF
    stage = tmp_path / "stage"
    shutil.copytree(root, stage)
    m = test_bundles.write_bundle(stage, {}, {"llama-server": "exe"},
                                  inputs=test_bundles.inputs_for("arm", platform="linux-aarch64"))
    manifest = manifest_mod.parse(m)
    with pytest.raises(VerifyError) as e:
        LINUX_AARCH64.check_static(root, manifest)
    assert e.value.what == "llama-server is built for EM_X86_64, not EM_AARCH64"


def test_the_load_check_says_why_it_is_skipped_without_qemu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linux_aarch64.shutil, "which", lambda name: None)
    loaded = LINUX_AARCH64.load_emulated(tmp_path, keep={})
    assert loaded.level == "skipped: qemu-aarch64 is not installed (apt-get install qemu-user)"


@pytest.mark.skipif(not HAS_CROSS or shutil.which("clang-19") is None or shutil.which("qemu-aarch64") is None,
                    reason="clang-19, the aarch64 sysroot and qemu-user (.ci/run installs them)")
def test_a_cross_built_program_runs_under_the_platforms_emulator(tmp_path: Path) -> None:
    """The emulator's argv runs a program linked against the sysroot's glibc, and the CPU model it is given is
    the one the program sees (its HWCAP: SVE on max, none on cortex-a53)."""
    src = tmp_path / "hw.c"
    src.write_text('#include <stdio.h>\n#include <sys/auxv.h>\nint main(void) {\n'
                   '  printf("sve=%d\\n", (getauxval(AT_HWCAP) & (1UL << 22)) != 0); return 0; }\n')
    exe = tmp_path / "hw"
    subprocess.run(["clang-19", "--target=aarch64-linux-gnu", "-O1", str(src), "-o", str(exe)], check=True)
    for cpu, sve in (("max", "1"), ("cortex-a53", "0")):
        runner, why = LINUX_AARCH64.emulator(cpu=cpu)
        assert runner is not None, why
        out = proc.capture([*runner, str(exe)], env={"PATH": "/usr/bin:/bin"}, timeout=60)
        assert (out.returncode, out.stdout.strip()) == (0, f"sve={sve}"), out.stderr


def test_a_build_verifies_at_the_load_level_where_this_machine_runs_the_bundle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under qemu on x86-64 (when qemu and the sysroot's libc are there), natively on arm64; a Windows bundle on
    Linux stays at static (Wine runs it only when asked)."""
    from llamabundle.pipeline import verify_level_for
    from llamabundle.verify import Level

    monkeypatch.setattr(platforms, "host_name", lambda: "linux-x86_64")
    monkeypatch.setattr(type(LINUX_AARCH64), "emulator", lambda self, cpu=None: (["qemu-aarch64"], ""))
    assert verify_level_for("linux-aarch64") is Level.LOAD
    assert verify_level_for("windows-x86_64") is Level.STATIC and verify_level_for("linux-x86_64") is Level.LOAD
    monkeypatch.setattr(type(LINUX_AARCH64), "emulator", lambda self, cpu=None: (None, "qemu-aarch64 is not installed"))
    assert verify_level_for("linux-aarch64") is Level.STATIC
    monkeypatch.setattr(platforms, "host_name", lambda: "linux-aarch64")
    assert verify_level_for("linux-aarch64") is Level.LOAD and verify_level_for("linux-x86_64") is Level.STATIC
