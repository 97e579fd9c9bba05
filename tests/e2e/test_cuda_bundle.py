"""The CUDA side of collect → bundle.json → verify, with real CUDA binaries and no GPU: the CPU build
of the e2e session plus a real `libggml-cuda.so` stand-in compiled by the PyPI toolkit's nvcc
(one kernel, PTX for sm_75 and SASS for sm_90, linked to cudart and cublas). Checks that the CUDA
runtime libraries and their license texts are bundled, libcuda never is, bundle.json records the
toolkit and the archs found in the binary, the arch check catches a mismatch, and the gpu level is
skipped (not passed) without a driver and fails with --require-gpu. The full CUDA build runs on
the GPU machine (bench/gpu/cuda_build.sh)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from llamabundle import bundle as bundle_mod
from llamabundle.backends import Prepared
from llamabundle.backends.cuda import CUDA
from llamabundle.backends.cuda.toolkit.pypi import install_from_pypi
from llamabundle.build import BuildTools, plan_build
from llamabundle.bundle.package import copy_licenses
from llamabundle.errors import VerifyError
from llamabundle.log import Log
from llamabundle.platforms import RuntimeSources
from llamabundle.platforms.linux import LINUX
from llamabundle.recipe import canonical_json, load_recipe
from llamabundle.settings import Settings
from llamabundle.verify import Level, verify_bundle
from tests.e2e.conftest import REPO, run_cli

CUDA_RECIPE = REPO / "recipes" / "linux-x86_64-cuda13.0.yaml"
KERNEL = r"""
#include <cublas_v2.h>
__global__ void scale(float *x, float a, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= a; }
extern "C" int stand_in(float *x, int n) {
    cublasHandle_t h; if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return -1;
    scale<<<(n + 255) / 256, 256>>>(x, 2.0f, n); cublasDestroy(h); return (int)cudaDeviceSynchronize();
}
"""


@pytest.fixture(scope="module")
def cuda_bundle(first_build: dict[str, Any], e2e_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    recipe = load_recipe(CUDA_RECIPE)
    settings = Settings.from_env(e2e_env)
    tk = install_from_pypi(version="13.0.2", platform="linux-x86_64", components=list(recipe.cuda.components),  # type: ignore[union-attr]
                           settings=settings, log=Log(quiet=True))
    work = tmp_path_factory.mktemp("cudabuild")
    cpu_bin = Path(first_build["result"]["bundled_libs"]["llama-server"]).parent
    shutil.copytree(cpu_bin, work / "bin", symlinks=True)
    (work / "k.cu").write_text(KERNEL)
    subprocess.run([tk.nvcc, "-shared", "-Xcompiler", "-fPIC", "-o", work / "bin" / "libggml-cuda.so", work / "k.cu",
                    "-gencode", "arch=compute_75,code=compute_75", "-gencode", "arch=compute_90,code=sm_90",
                    f"-L{tk.root / 'lib'}", "-lcublas", "-lcudart"], check=True, capture_output=True, timeout=600)
    plan = plan_build(recipe, source_dir=settings.cache_dir / "src" / recipe.llama_cpp.commit, build_dir=work,
                      tools=BuildTools(cmake="cmake", ninja="ninja"), toolkit_roots={"cuda": tk.root})
    stage = work / "stage"
    stage.mkdir()
    prepared = Prepared(root=tk.root, lib_dirs=tuple(tk.lib_dirs), toolchain={"nvcc": "13.0.88"})
    closure = LINUX.collect(plan, stage, log=Log(quiet=True),
                            sources=RuntimeSources(lib_dirs=prepared.lib_dirs, companions=CUDA.companions))
    roles = dict(closure.roles) | copy_licenses(plan.source_dir, stage) | CUDA.licenses(closure.bundled, prepared, stage)
    manifest = bundle_mod.write_manifest(stage, {
        "name": recipe.name, "key": recipe.key(), "inputs": recipe.key_inputs(), "platform": recipe.platform,
        "llama_cpp": {"commit": recipe.llama_cpp.commit}, "backends": sorted(recipe.backends),
        "cuda": CUDA.manifest_section(recipe, stage, platform=LINUX, prepared=prepared), "system_deps": closure.system_deps,
        "files": bundle_mod.file_entries(stage, roles)})
    zip_path = bundle_mod.pack(stage, work / "cuda.zip")
    return {"manifest": manifest.to_json(), "zip": zip_path, "stage": stage, "closure": closure, "roles": roles}


def test_cuda_runtime_libraries_and_licenses_are_bundled(cuda_bundle: dict[str, Any]) -> None:
    roles = cuda_bundle["roles"]
    for lib in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"):
        assert roles[lib] == "runtime"
    assert roles["libggml-cuda.so"] == "backend"
    assert roles["LICENSE-CUDA-cuda_cudart.txt"] == roles["LICENSE-CUDA-libcublas.txt"] == "license"
    assert not any(name.startswith(("libcuda.so", "libnvidia")) for name in roles)
    assert "libcuda.so.1" not in cuda_bundle["manifest"]["system_deps"]  # the stand-in uses the runtime API only


def test_bundle_json_records_toolkit_archs_and_driver_floor(cuda_bundle: dict[str, Any]) -> None:
    cuda = cuda_bundle["manifest"]["cuda"]
    assert cuda["toolkit"] == "13.0.2"
    assert cuda["archs"] == {"sass": ["90"], "ptx": ["75"]}
    assert cuda["driver_floor"] == "580.95.05"
    assert cuda["compression_mode"] == "size"


def test_verify_passes_archs_and_skips_gpu_without_a_driver(cuda_bundle: dict[str, Any], e2e_env: dict[str, str]) -> None:
    report = verify_bundle(cuda_bundle["zip"], level=Level.GPU, cache_dir=Settings.from_env(e2e_env).cache_dir)
    assert report.levels["archs"] == "passed (SASS 90; PTX 75)"
    assert report.levels["load"] == "passed"
    assert report.levels["gpu"] == "skipped: no NVIDIA driver on this machine"
    assert "CUDA" not in report.backends_loaded
    res = run_cli("verify", cuda_bundle["zip"], "--level", "gpu", "--require-gpu", env=e2e_env)
    assert res.returncode == 5 and "--require-gpu" in res.stderr


def test_verify_catches_archs_that_differ_from_the_recipe(cuda_bundle: dict[str, Any], tmp_path: Path) -> None:
    copy = tmp_path / "b"
    shutil.copytree(cuda_bundle["stage"], copy)
    manifest = json.loads((copy / "bundle.json").read_text())
    manifest["inputs"]["cuda"]["archs"] = ["75-virtual", "90-real", "120a-real"]
    manifest["key"] = hashlib.sha256(canonical_json(manifest["inputs"]).encode()).hexdigest()  # consistent again
    (copy / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(VerifyError) as e:
        verify_bundle(copy, level=Level.STATIC, cache_dir=tmp_path / "cache")
    assert "SASS ['90']" in e.value.what and "'120a'" in e.value.why
