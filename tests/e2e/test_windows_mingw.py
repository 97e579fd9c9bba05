"""A real Windows bundle, cross-built on Linux with mingw-w64 (issue 5): `llamabundle build` of
recipes/windows-x86_64-cpu-mingw.yaml (sources from the shared cache, like test_pipeline.py) with its CPU variants
cut to two (x64 and haswell: AVX2, the best one any CPU with AVX2 picks of them; all 13 were one of CI's longest
builds on two cores, and three still 43 % of this build's compile time), then static verification, llama-server.exe
run under Wine, and a bundle missing a runtime DLL refused with exit 5."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from llamabundle import cache
from tests.e2e.conftest import REPO, build_recipe, cut_variants, run_cli, unzip
from tests.e2e.probeprogram import ABSENT, add_unloadable_module, module, run_probe

RECIPE = REPO / "recipes" / "windows-x86_64-cpu-mingw.yaml"
CXX = "x86_64-w64-mingw32-g++-posix"
RUNTIME = {"libgomp-1.dll", "libstdc++-6.dll", "libgcc_s_seh-1.dll", "libwinpthread-1.dll"}
KEEP = ("x64", "haswell")
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which(CXX) is None, reason=f"{CXX} (mingw-w64, posix threads) is not installed")]


@pytest.fixture(scope="module")
def mingw_build(e2e_env: dict[str, str], store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    recipe = cut_variants(RECIPE, tmp_path_factory.mktemp("mingw-recipe") / "windows-x86_64-cpu-mingw-e2e.yaml", keep=KEEP)
    return build_recipe(recipe, store=store, env=e2e_env, what="the mingw bundle")


@pytest.fixture(scope="module")
def unpacked_mingw(mingw_build: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return unzip(mingw_build["location"], tmp_path_factory.mktemp("mingw") / "bundle")


def test_the_bundle_holds_the_programs_its_variants_and_the_mingw_runtime(unpacked_mingw: Path, e2e_env: dict[str, str]) -> None:
    manifest = json.loads((unpacked_mingw / "bundle.json").read_text())
    assert manifest["platform"] == "windows-x86_64" and "sapphirerapids" in manifest["inputs"]["cpu_variants"]["exclude"]
    assert manifest["toolchain"]["compiler"].startswith("GNU ")
    roles = {f["path"]: f["role"] for f in manifest["files"]}
    assert {p for p, r in roles.items() if r == "exe"} == {"llama-server.exe", "llama-cli.exe", "llama-bench.exe",
                                                            "ggml-rpc-server.exe", "llamabundle-memory.exe",
                                                            "llamabundle-probe.exe"}
    backends = sorted(p for p, r in roles.items() if r == "backend")
    assert backends.pop(backends.index("ggml-rpc.dll")) and manifest["backends"] == ["cpu", "rpc"]
    assert backends == [f"ggml-cpu-{v}.dll" for v in sorted(KEEP)]
    assert "ggml-cpu-sapphirerapids.dll" not in roles
    assert RUNTIME <= {p for p, r in roles.items() if r == "runtime"}
    assert "KERNEL32.dll" in manifest["system_deps"] and not RUNTIME & set(manifest["system_deps"])
    res = run_cli("deps", "--json", *(unpacked_mingw / n for n in ("llama-server.exe", *backends)), env=e2e_env)
    assert res.returncode == 0, res.stderr
    classes = {d["name"].lower(): d["class"] for d in json.loads(res.stdout)["deps"]}
    assert {n: classes[n] for n in RUNTIME} == {n: "bundled" for n in RUNTIME}  # found inside the bundle
    print("DLL classes:", json.dumps({d["name"]: d["kind"] or d["class"] for d in json.loads(res.stdout)["deps"]}))


def test_static_verification_passes(mingw_build: dict[str, Any], e2e_env: dict[str, str]) -> None:
    res = run_cli("verify", mingw_build["location"], "--level", "static", "--json", env=e2e_env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["levels"] == {"manifest": "passed", "static": "passed"}


def test_llama_server_exe_loads_its_backend_from_the_bundle_under_wine(mingw_build: dict[str, Any],
                                                                         e2e_env: dict[str, str]) -> None:
    if shutil.which("wine") is None:
        pytest.skip("wine is not installed")
    res = run_cli("verify", mingw_build["location"], "--level", "load", "--json", env=e2e_env, timeout=900)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["levels"]["load"].startswith("passed (under Wine; llamabundle-probe.exe, then llama-server.exe")
    assert report["load_source"] == "llamabundle-probe" and sorted(report["modules"].values()).count("loaded") == 2
    assert report["backends_loaded"]["RPC"] == f"{mingw_build['location']}:ggml-rpc.dll"
    assert report["levels"]["rpc"].startswith("skipped: "), "under Wine a program runs through a launcher"
    cpu = report["backends_loaded"]["CPU"]
    # it ran from a temporary copy; the report names the member of the user's zip
    assert cpu.startswith(f"{mingw_build['location']}:ggml-cpu-") and "llamabundle-verify-" not in cpu
    assert report["devices"] == []  # a CPU-only build lists "  (none)", as on Linux


def test_a_bundle_without_libgomp_fails_static_verification(unpacked_mingw: Path, e2e_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    copy = tmp_path / "bundle"
    shutil.copytree(unpacked_mingw, copy)
    (copy / "libgomp-1.dll").unlink()
    res = run_cli("verify", copy, "--level", "static", env=e2e_env)  # bundle.json still lists it
    assert res.returncode == 5 and "libgomp-1.dll" in res.stderr and "Traceback" not in res.stderr
    manifest = json.loads((copy / "bundle.json").read_text())  # drop its entry too: the import check finds it
    manifest["files"] = [f for f in manifest["files"] if f["path"] != "libgomp-1.dll"]
    (copy / "bundle.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    res = run_cli("verify", copy, "--level", "static", env=e2e_env)
    assert res.returncode == 5, res.stderr
    assert "libgomp-1.dll (imported by " in res.stderr and "is not in the bundle" in res.stderr
    assert "ggml-cpu-haswell.dll" in res.stderr  # one of the binaries that import it (OpenMP)
    assert "Traceback" not in res.stderr


def test_the_bundles_probe_exe_lists_the_cpu_backend_under_wine_and_names_a_missing_dll(
        unpacked_mingw: Path, e2e_env: dict[str, str], tmp_path: Path) -> None:
    """llamabundle-probe.exe (the same program, cross-built) under Wine: one CPU variant loaded, the CPU device; a
    module importing a DLL that is nowhere gets LoadLibraryW's error 126 with that DLL's name, found from its imports."""
    if shutil.which("wine") is None:
        pytest.skip("wine is not installed")
    copy = tmp_path / "bundle"
    shutil.copytree(unpacked_mingw, copy)
    add_unloadable_module(copy, cc=CXX.replace("g++", "gcc"), name="ggml-rpc.dll", dep=f"{ABSENT}.dll")
    prefix = cache.wine_prefix(Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]))
    prefix.mkdir(parents=True, exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(prefix), "WINEPREFIX": str(prefix), "WINEDEBUG": "-all",
           "WINEDLLOVERRIDES": "mscoree,mshtml="}
    got = run_probe(["wine", str(copy / "llamabundle-probe.exe")], env=env, cwd=copy, timeout=600)
    cpu = [m for m in got["modules"] if m["backend"] == "cpu"]
    assert len(cpu) == len(KEEP) and all(m["opened"] for m in cpu)
    (loaded,) = [m for m in cpu if m["loaded"]]
    assert loaded["registered"] == "CPU" and loaded["score"] == max(m["score"] for m in cpu)
    assert [d["name"] for d in got["devices"]] == ["CPU"]
    rpc = module(got, "ggml-rpc.dll")
    assert (rpc["opened"], rpc["outcome"]) == (False, "not_opened")
    assert rpc["error"].startswith("error 126: ") and rpc["error"].endswith(f"(missing: {ABSENT}.dll)"), rpc["error"]
    print(f"\nprobe under Wine: {loaded['file']} loaded; ggml-rpc.dll: {rpc['error']}")
