"""The CUDA side of `llamabundle bundle` → bundle.json → verify, with real CUDA binaries and no GPU: the
CMake build directory of the e2e session's CPU build (its cache, compiler record, build-info and bin/),
copied, plus a real `libggml-cuda.so` stand-in compiled by the PyPI toolkit's nvcc (one kernel, PTX for
sm_75 and SASS for sm_90, linked to cudart and cublas), bundled through the CLI as a user would with
`--toolkit-root`. Checks that the CUDA runtime libraries, NVRTC (a run-time companion of cuBLASLt, which
no DT_NEEDED names) and their licence texts are bundled with their origin and reason, libcuda never is,
bundle.json records the toolkit and the archs found in the binary, verify checks the archs and the
companions, the gpu level is skipped (not passed) without a driver and fails with --require-gpu, and a
recipe that omits latent companions bundles no NVRTC. The full CUDA build runs on the GPU machine
(bench/gpu/cuda_build.sh)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from llamabundle import keys
from llamabundle.backends.cuda.toolkit.layout import Toolkit
from llamabundle.digest import canonical_json
from llamabundle.errors import VerifyError
from llamabundle.verify import Level, verify_bundle
from tests.clicontract import valid
from tests.e2e.conftest import CUDA_RECIPE, SHARED_KEEP, cut_variants, run_cli

BUNDLE_TIMEOUT = 30 * 60
KERNEL = r"""
#include <cublas_v2.h>
__global__ void scale(float *x, float a, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= a; }
extern "C" int stand_in(float *x, int n) {
    cublasHandle_t h; if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return -1;
    scale<<<(n + 255) / 256, 256>>>(x, 2.0f, n); cublasDestroy(h); return (int)cudaDeviceSynchronize();
}
"""
LATENT_NVRTC = "loaded by libcublasLt.so.13 at run time (latent companion)"
REQUIRED_BUILTINS = "loaded by libnvrtc.so.13 at run time (required companion)"


def _without_rpc(work: Path) -> Path:
    """The CUDA recipe without its rpc backend and with the shared CPU build's variants (SHARED_KEEP): `bundle` reads
    that build's tree, which has no ggml-rpc (tests/e2e/test_rpc_bundle.py builds RPC for real) and 3 of the 14 CPU
    variants."""
    text = CUDA_RECIPE.read_text()
    changed, n = re.subn(r"^backends: \[cpu, cuda, rpc\]", "backends: [cpu, cuda]", text, count=1, flags=re.M)
    assert n == 1, "the CUDA recipe carries rpc"
    recipe = work / CUDA_RECIPE.name
    recipe.write_text(changed)
    return cut_variants(recipe, recipe, keep=SHARED_KEEP)


def _files(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["path"]: f for f in manifest["files"]}


def _linked_copy(src: Path, dst: Path) -> Path:
    """An unpacked bundle's copy whose files are hard links (a test replaces a file, never writes into one)."""
    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:  # another file system
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    return dst


def _rewrite_manifest(root: Path, manifest: dict[str, Any]) -> None:
    (root / "bundle.json").unlink()  # a hard link to the original: a new file, not new bytes in the old one
    (root / "bundle.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def build_dir(first_build: dict[str, Any], toolkit: Toolkit, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CMake build directory as `bundle` reads it: the CPU build's CMakeCache.txt, CMake's compiler records,
    llama.cpp's build-info and bin/, with the stand-in libggml-cuda.so built into bin/."""
    cpu_build = Path(first_build["result"]["bundled_libs"]["llama-server"]).parent.parent
    assert (cpu_build / "CMakeCache.txt").is_file(), cpu_build
    work = tmp_path_factory.mktemp("cudabuild")
    build = work / "build"
    build.mkdir()
    shutil.copyfile(cpu_build / "CMakeCache.txt", build / "CMakeCache.txt")
    records = sorted(cpu_build.glob("CMakeFiles/*/CMakeCXXCompiler.cmake"))
    assert records, f"no CMakeCXXCompiler.cmake in {cpu_build}/CMakeFiles"
    for rec in records:
        for name in ("CMakeCXXCompiler.cmake", "CMakeCCompiler.cmake"):
            if (rec.parent / name).is_file():
                (build / rec.parent.relative_to(cpu_build)).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(rec.parent / name, build / rec.parent.relative_to(cpu_build) / name)
    # what CMake records of nvcc when it compiles CUDA (the stand-in below is compiled by that nvcc)
    (build / records[-1].parent.relative_to(cpu_build) / "CMakeCUDACompiler.cmake").write_text(
        'set(CMAKE_CUDA_COMPILER_VERSION "13.0.88")\n')
    (build / "common").mkdir()
    shutil.copyfile(cpu_build / "common" / "build-info.cpp", build / "common" / "build-info.cpp")
    (build / "tools" / "ui").mkdir(parents=True)  # what llama.cpp's ui-assets.cmake wrote: it embedded the web UI
    shutil.copyfile(cpu_build / "tools" / "ui" / "ui.h", build / "tools" / "ui" / "ui.h")
    shutil.copytree(cpu_build / "bin", build / "bin", symlinks=True)
    (work / "k.cu").write_text(KERNEL)
    subprocess.run([toolkit.nvcc, "-shared", "-Xcompiler", "-fPIC", "-o", build / "bin" / "libggml-cuda.so", work / "k.cu",
                    "-gencode", "arch=compute_75,code=compute_75", "-gencode", "arch=compute_90,code=sm_90",
                    f"-L{toolkit.root / 'lib'}", "-lcublas", "-lcudart"], check=True, capture_output=True, timeout=600)
    return build


@pytest.fixture(scope="module")
def cuda_bundle(build_dir: Path, toolkit: Toolkit, e2e_env: dict[str, str],
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`llamabundle bundle RECIPE BUILD_DIR --out DIR --toolkit-root ROOT --json`, as a user runs it."""
    out = tmp_path_factory.mktemp("cudabundle") / "bundle"
    recipe = _without_rpc(out.parent)
    res = run_cli("bundle", recipe, build_dir, "--out", out, "--toolkit-root", toolkit.root, "--json",
                  env=e2e_env, timeout=BUNDLE_TIMEOUT)
    assert res.returncode == 0, f"bundle exited {res.returncode}:\n{res.stderr[-6000:]}"
    result = json.loads(res.stdout)
    valid("bundle", result)  # its own schema (ops_tool at the top, verify's compute_caps, load_source: issue 32)
    assert result["out"] == str(out)
    zip_path = out.parent / "bundle.zip"  # the zip the command left in the cache, kept apart from other runs
    shutil.copyfile(result["zip"], zip_path)
    manifest = json.loads((out / "bundle.json").read_text())
    return {"result": result, "manifest": manifest, "files": _files(manifest), "out": out, "zip": zip_path,
            "stderr": res.stderr}


@pytest.fixture(scope="module")
def omitted(build_dir: Path, toolkit: Toolkit, e2e_env: dict[str, str],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same build bundled (into a zip) with a copy of the recipe that sets cuda.latent_companions: omit."""
    work = tmp_path_factory.mktemp("omit")
    text = _without_rpc(work).read_text()
    assert "latent_companions" not in text
    changed, n = re.subn(r"^cuda:\n", "cuda:\n  latent_companions: omit\n", text, count=1, flags=re.M)
    assert n == 1
    recipe = work / CUDA_RECIPE.name
    recipe.write_text(changed)
    assert keys.load(recipe).cuda.latent_companions == "omit"  # type: ignore[union-attr]
    zip_path = work / "omit.zip"
    res = run_cli("bundle", recipe, build_dir, "--out", zip_path, "--toolkit-root", toolkit.root, "--json",
                  env=e2e_env, timeout=BUNDLE_TIMEOUT)
    assert res.returncode == 0, f"bundle exited {res.returncode}:\n{res.stderr[-6000:]}"
    result = json.loads(res.stdout)
    assert result["zip"] == str(zip_path) and zip_path.is_file() and result["out"] is None
    with zipfile.ZipFile(zip_path) as z:
        names = z.namelist()
        manifest = json.loads(z.read("bundle.json"))
    return {"result": result, "manifest": manifest, "names": names}


def test_cuda_runtime_libraries_come_from_the_toolkit(cuda_bundle: dict[str, Any], toolkit: Toolkit) -> None:
    files = cuda_bundle["files"]
    for lib in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"):
        assert files[lib]["role"] == "runtime", files[lib]
        assert files[lib]["origin"] == "toolkit", files[lib]
        assert files[lib]["why"].startswith("imported by "), files[lib]
        assert Path(cuda_bundle["result"]["bundled_libs"][lib]).is_relative_to(toolkit.root)
    assert "libggml-cuda.so" in files["libcudart.so.13"]["why"]
    assert "libcublas.so.13" in files["libcublasLt.so.13"]["why"]
    assert files["libggml-cuda.so"]["role"] == "backend" and files["libggml-cuda.so"]["origin"] == "build"
    assert files["libggml-cuda.so"]["why"] == "backend module: loaded by ggml at run time"
    assert (cuda_bundle["out"] / "libcublasLt.so.13").is_file()


def test_nvrtc_is_bundled_as_a_run_time_companion(cuda_bundle: dict[str, Any]) -> None:
    files = cuda_bundle["files"]
    nvrtc, builtins = files["libnvrtc.so.13"], files["libnvrtc-builtins.so.13.0"]
    assert (nvrtc["role"], nvrtc["origin"], nvrtc["why"]) == ("runtime", "toolkit", LATENT_NVRTC)
    assert (builtins["role"], builtins["origin"], builtins["why"]) == ("runtime", "toolkit", REQUIRED_BUILTINS)
    for name in ("libnvrtc.so.13", "libnvrtc-builtins.so.13.0"):
        assert (cuda_bundle["out"] / name).is_file()
    levels = cuda_bundle["result"]["verify"]["levels"]  # the verify `bundle` ran before writing anything
    assert "libcublasLt.so.13 -> libnvrtc.so.13" in levels["companions"]
    assert levels["companions"].startswith("passed")


def test_programs_and_build_products_come_from_the_build(cuda_bundle: dict[str, Any]) -> None:
    files = cuda_bundle["files"]
    server = files["llama-server"]
    assert (server["role"], server["origin"]) == ("exe", "build")
    assert server["why"].startswith("program")
    for lib in ("libllama.so.0", "libggml.so.0", "libggml-base.so.0"):
        assert (files[lib]["role"], files[lib]["origin"]) == ("runtime", "build"), files[lib]
    cpu = [p for p, f in files.items() if f["role"] == "backend" and p.startswith("libggml-cpu-")]
    assert cpu and all(files[p]["origin"] == "build" for p in cpu)
    assert files["LICENSE"]["origin"] == "source"
    manifest = cuda_bundle["manifest"]
    assert manifest["toolchain"]["compiler"].startswith("GNU ")
    assert manifest["llama_cpp"]["commit"] == keys.load(CUDA_RECIPE).llama_cpp.commit


def test_cuda_licences_are_bundled_and_the_driver_never_is(cuda_bundle: dict[str, Any]) -> None:
    files = cuda_bundle["files"]
    for comp in ("cuda_cudart", "libcublas", "cuda_nvrtc"):
        lic = files[f"LICENSE-CUDA-{comp}.txt"]
        assert (lic["role"], lic["origin"]) == ("license", "toolkit"), lic
        assert comp in lic["why"]
        assert (cuda_bundle["out"] / f"LICENSE-CUDA-{comp}.txt").stat().st_size > 0
    assert not any(name.startswith(("libcuda.so", "libnvidia")) for name in files)
    assert "libcuda.so.1" not in cuda_bundle["manifest"]["system_deps"]  # the stand-in uses the runtime API only


def test_bundle_json_records_toolkit_archs_and_driver_floor(cuda_bundle: dict[str, Any]) -> None:
    cuda = cuda_bundle["manifest"]["cuda"]
    assert cuda["toolkit"] == "13.0.2"
    assert cuda["archs"] == {"sass": ["90"], "ptx": ["75"]}
    assert cuda["driver_floor"] == "580.95.05"
    assert cuda["compression_mode"] == "size"
    assert cuda_bundle["manifest"]["inputs"]["cuda"]["components"] == sorted(keys.load(CUDA_RECIPE).cuda.components)  # type: ignore[union-attr]
    assert "latent_companions" not in cuda_bundle["manifest"]["inputs"]["cuda"]  # ship: the default, not in the key


def test_verify_passes_archs_and_companions_and_skips_gpu_without_a_driver(cuda_bundle: dict[str, Any],
                                                                          e2e_env: dict[str, str]) -> None:
    res = run_cli("verify", cuda_bundle["zip"], "--level", "gpu", "--json", env=e2e_env)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    levels = report["levels"]
    assert levels["archs"] == "passed (SASS 90; PTX 75)"
    assert levels["companions"].startswith("passed (")
    assert "libcublasLt.so.13 -> libnvrtc.so.13" in levels["companions"]
    assert "libnvrtc.so.13 -> libnvrtc-builtins.so.13.0" in levels["companions"]
    assert levels["load"] == "passed"
    assert levels["gpu"] == "skipped: no NVIDIA driver on this machine"
    assert "CUDA" not in report["backends_loaded"]
    res = run_cli("verify", cuda_bundle["zip"], "--level", "gpu", "--require-gpu", env=e2e_env)
    assert res.returncode == 5 and "--require-gpu" in res.stderr


def test_verify_catches_archs_that_differ_from_the_recipe(cuda_bundle: dict[str, Any], tmp_path: Path) -> None:
    copy = _linked_copy(cuda_bundle["out"], tmp_path / "b")
    manifest = json.loads((copy / "bundle.json").read_text())
    manifest["inputs"]["cuda"]["archs"] = ["75-virtual", "90-real", "120a-real"]
    manifest["key"] = hashlib.sha256(canonical_json(manifest["inputs"]).encode()).hexdigest()  # consistent again
    _rewrite_manifest(copy, manifest)
    with pytest.raises(VerifyError) as e:  # the section's claim no longer matches the archs its key names
        verify_bundle(copy, level=Level.STATIC, cache_dir=tmp_path / "cache")
    assert "it says SASS ['90'] and PTX ['75'], its inputs ask for SASS ['90', '120a']" in e.value.what
    manifest["cuda"]["archs"]["sass"] = ["90", "120a"]  # the claim edited to match: ggml-cuda itself proves it wrong
    _rewrite_manifest(copy, manifest)
    with pytest.raises(VerifyError) as e:
        verify_bundle(copy, level=Level.STATIC, cache_dir=tmp_path / "cache")
    assert "SASS ['90']" in e.value.what and "'120a'" in e.value.why


def test_verify_catches_a_missing_companion(cuda_bundle: dict[str, Any], tmp_path: Path) -> None:
    copy = _linked_copy(cuda_bundle["out"], tmp_path / "b")
    (copy / "libnvrtc.so.13").unlink()
    manifest = json.loads((copy / "bundle.json").read_text())
    before = len(manifest["files"])
    manifest["files"] = [f for f in manifest["files"] if f["path"] != "libnvrtc.so.13"]
    assert len(manifest["files"]) == before - 1
    assert "libnvrtc.so.13" in manifest["parts"]["cuda"]  # a companion is its backend's: out of the part list too
    manifest["parts"]["cuda"].remove("libnvrtc.so.13")
    _rewrite_manifest(copy, manifest)  # the key is left as it is: the inputs did not change
    verify_bundle(cuda_bundle["out"], level=Level.STATIC, cache_dir=tmp_path / "cache")  # the original still passes
    with pytest.raises(VerifyError) as e:
        verify_bundle(copy, level=Level.STATIC, cache_dir=tmp_path / "cache")
    assert "libnvrtc.so.13" in e.value.what
    assert LATENT_NVRTC in e.value.why


def test_a_recipe_that_omits_latent_companions_bundles_no_nvrtc(omitted: dict[str, Any], cuda_bundle: dict[str, Any]) -> None:
    manifest = omitted["manifest"]
    assert manifest["inputs"]["cuda"]["latent_companions"] == "omit"
    assert manifest["key"] != cuda_bundle["manifest"]["key"]
    assert not any(n.startswith("libnvrtc") for n in omitted["names"])
    files = _files(manifest)
    assert not any(p.startswith("libnvrtc") for p in files)
    assert "LICENSE-CUDA-cuda_nvrtc.txt" not in files
    for lib in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"):
        assert files[lib]["origin"] == "toolkit"
    levels = omitted["result"]["verify"]["levels"]
    assert levels["archs"] == "passed (SASS 90; PTX 75)"
    assert "companions" not in levels  # nothing named: cuBLASLt's NVRTC is latent and omitted
