"""A real Arm Linux bundle (issue 35): recipes/linux-aarch64-cpu.yaml cross-built here by `llamabundle build`
(Debian 12's clang 19 and aarch64 sysroot, RPC), its files all aarch64 ELF whose closure stays in the bundle and
the sysroot's glibc, `verify --level load` run under qemu-aarch64 (its RPC server too), and the CPU variant
dispatch: under QEMU CPU models of growing features the variant that loads is the expected one each time, and a
damaged variant fails the check.

The recipe is cut to the three CPU variants the QEMU models pick (KEEP) of its 8: each variant compiles ggml's CPU
backend again (about 17 files), and CI's two cores build this beside the shared build. clang 19 still compiles
every one of the 8 variants' -march (tests/unit/test_linux_aarch64.py), and the shipped recipe with all 8 was
built and run here under QEMU when issue 35 was done."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from llamabundle.deps import elf
from llamabundle.errors import VerifyError
from llamabundle.platforms import linux_aarch64
from llamabundle.platforms.linux_aarch64 import LINUX_AARCH64
from tests.e2e.conftest import REPO, build_recipe, cut_variants, run_cli, unzip

RECIPE = REPO / "recipes" / "linux-aarch64-cpu.yaml"
SYSROOT = Path(linux_aarch64.knowledge()["cross"]["sysroot"])
NEEDS = ("clang++-19", "aarch64-linux-gnu-gcc", "qemu-aarch64")
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(any(shutil.which(n) is None for n in NEEDS) or not SYSROOT.is_dir(),
                                 reason="clang-19, g++-aarch64-linux-gnu and qemu-user (.ci/run installs them)")]

# QEMU 7.2's CPU models (qemu-aarch64 -cpu help) -> the variant ggml's loader picks (the highest score: every
# feature a variant needs must be in the CPU's HWCAP). a64fx has SVE but not the dot product, so it is an
# Armv8.0 CPU to ggml; max has everything, SME included.
VARIANT_OF = {
    "cortex-a53": "armv8.0_1",  # Raspberry Pi 3: no dotprod
    "cortex-a72": "armv8.0_1",  # Raspberry Pi 4, Graviton 1
    "cortex-a76": "armv8.2_2",  # Raspberry Pi 5: dotprod, fp16
    "neoverse-n1": "armv8.2_2",  # Graviton 2, Ampere Altra
    "a64fx": "armv8.0_1",  # SVE without dotprod
    "max": "armv9.2_2",  # every feature QEMU has: SVE2, i8mm, SME
}
KEEP = tuple(sorted(set(VARIANT_OF.values())))  # armv8.0_1, armv8.2_2, armv9.2_2


@pytest.fixture(scope="module")
def arm_build(e2e_env: dict[str, str], store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    recipe = cut_variants(RECIPE, tmp_path_factory.mktemp("aarch64-recipe") / "linux-aarch64-cpu-e2e.yaml", keep=KEEP,
                          every=list(linux_aarch64.knowledge()["cpu_variants"]))
    return build_recipe(recipe, store=store, env=e2e_env, what="the aarch64 bundle")


@pytest.fixture(scope="module")
def unpacked_arm(arm_build: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return unzip(arm_build["location"], tmp_path_factory.mktemp("aarch64") / "bundle", executable=True)


def test_the_bundle_is_aarch64_with_its_variants_and_says_how_it_was_built(unpacked_arm: Path) -> None:
    manifest = json.loads((unpacked_arm / "bundle.json").read_text())
    assert manifest["platform"] == "linux-aarch64"
    assert manifest["inputs"]["build"]["host"] == "linux-x86_64" and manifest["inputs"]["build"]["glibc"] == "2.36"
    assert {k: manifest["toolchain"][k] for k in ("build_host", "cross_target", "glibc")} == {
        "build_host": "linux-x86_64", "cross_target": "aarch64-linux-gnu", "glibc": "2.36"}
    assert manifest["toolchain"]["compiler"] == "Clang 19.1.7"
    roles = {f["path"]: f["role"] for f in manifest["files"]}
    assert sorted(p for p, r in roles.items() if r == "backend") == [
        *(f"libggml-cpu-{v}.so" for v in KEEP), "libggml-rpc.so"]
    assert roles["ggml-rpc-server"] == "exe"
    binaries = [unpacked_arm / p for p in roles if elf.is_elf(unpacked_arm / p)]
    assert len(binaries) >= 14
    assert {elf.read_elf(b).machine for b in binaries} == {"EM_AARCH64"}
    assert {"libc.so.6", "libstdc++.so.6"} <= set(manifest["system_deps"])  # from the sysroot: never bundled
    floor = tuple(int(x) for x in manifest["glibc_floor"].split("."))
    assert floor <= (2, 36), "the binaries need no newer glibc than the sysroot's"
    print("files:", ", ".join(sorted(roles)))


def test_verify_load_runs_it_under_qemu_and_says_so(arm_build: dict[str, Any], e2e_env: dict[str, str]) -> None:
    res = run_cli("verify", arm_build["location"], "--level", "load", "--json", env=e2e_env, timeout=900)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["levels"]["load"] == f"passed (under qemu-aarch64 -cpu max -L {SYSROOT})"
    assert report["load_source"] == "llamabundle-probe"
    assert report["backends_loaded"]["CPU"].endswith(":libggml-cpu-armv9.2_2.so")  # <zip>:<member>
    assert report["modules"]["libggml-cpu-armv9.2_2.so"] == "loaded"
    # the bundle's aarch64 ggml-rpc-server under QEMU on loopback, serving the CPU to its aarch64 llama-server
    assert report["levels"]["rpc"].startswith("passed (ggml-rpc-server on 127.0.0.1:")
    assert "llama-server --rpc listed RPC0: 127.0.0.1:" in report["levels"]["rpc"]


def test_each_qemu_cpu_model_loads_its_expected_variant(unpacked_arm: Path) -> None:
    got = {}
    for cpu in VARIANT_OF:
        loaded = LINUX_AARCH64.load_emulated(unpacked_arm, keep={}, cpu=cpu)
        assert loaded.level.startswith(f"passed (under qemu-aarch64 -cpu {cpu} "), loaded.level
        got[cpu] = Path(loaded.backends["CPU"]).name.removeprefix("libggml-cpu-").removesuffix(".so")
    print("QEMU CPU model -> CPU variant loaded:", json.dumps(got))
    assert got == VARIANT_OF


def test_a_damaged_best_variant_fails_the_load_check(unpacked_arm: Path, tmp_path: Path) -> None:
    copy = tmp_path / "bundle"
    shutil.copytree(unpacked_arm, copy)
    best = copy / "libggml-cpu-armv9.2_2.so"
    best.write_bytes(b"\0" * 64 + best.read_bytes()[64:])  # its ELF header gone: the loader refuses it
    with pytest.raises(VerifyError) as e:
        LINUX_AARCH64.load_emulated(copy, keep={})
    assert e.value.what == "the CPU backend libggml-cpu-armv9.2_2.so of the bundle does not load"
