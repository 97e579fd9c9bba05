"""End-to-end: CUDA 13.0.2 from NVIDIA's PyPI wheels (by URL from the real PyPI) into the persistent e2e
cache, then the toolkit's own nvcc compiles and links a kernel with the system gcc, and CMake
configures llama.cpp's CUDA backend against it. No GPU is needed: nothing here runs a kernel."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from llamabundle import keys
from llamabundle.backends.cuda.toolkit import layout, pypi
from llamabundle.log import Log
from llamabundle.settings import Settings

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")),
                                reason="the PyPI toolkit e2e test runs on Linux x86_64")

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "linux-x86_64-cpu.yaml"
VERSION = "13.0.2"
COMPONENTS = ["cuda_nvcc", "cuda_cudart", "cuda_cccl", "libcublas"]
INSTALL_TIMEOUT = 60 * 60

KERNEL = r"""
#include <cstdio>
#include <cuda_runtime.h>

__global__ void add_one(int *a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] += 1;
}

int main() {
    int *d = nullptr;
    cudaError_t err = cudaMalloc(&d, 32 * sizeof(int));
    if (err == cudaSuccess) {
        add_one<<<1, 32>>>(d, 32);
        err = cudaDeviceSynchronize();
        cudaFree(d);
    }
    std::printf("cuda: %s\n", cudaGetErrorString(err));
    return 0;
}
"""


@pytest.fixture(scope="session")
def settings(e2e_env: dict[str, str]) -> Settings:
    return Settings.from_env(e2e_env)


@pytest.fixture(scope="session")
def installed(settings: Settings) -> dict[str, Any]:
    start = time.monotonic()
    tk = pypi.install_from_pypi(version=VERSION, platform="linux-x86_64", components=COMPONENTS,
                                settings=settings, log=Log())
    return {"toolkit": tk, "seconds": time.monotonic() - start}


@pytest.fixture(scope="session")
def toolkit(installed: dict[str, Any]) -> layout.Toolkit:
    return installed["toolkit"]


def clean_env(e2e_env: dict[str, str]) -> dict[str, str]:
    """The e2e environment without any other CUDA: no CUDA_PATH/CUDA_HOME, no CUDA dirs on PATH or
    LD_LIBRARY_PATH, so whatever is found comes from the toolkit under test."""
    env = {k: v for k, v in e2e_env.items()
           if k not in ("CUDA_PATH", "CUDA_HOME", "CUDA_ROOT", "CUDAToolkit_ROOT", "CUDACXX", "LD_LIBRARY_PATH", "NVCC_PREPEND_FLAGS",
                        "NVCC_APPEND_FLAGS", "CMAKE_PREFIX_PATH")}
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "/usr/bin:/bin").split(os.pathsep) if "cuda" not in d.lower())
    return env


def test_install_layout(toolkit: layout.Toolkit, settings: Settings) -> None:
    records = pypi.plan_pypi(VERSION, "linux-x86_64", COMPONENTS)
    assert {r.component for r in records} == {*COMPONENTS, "cuda_crt", "libnvvm"}
    assert toolkit.root == pypi.default_root(settings, version=VERSION, platform="linux-x86_64", records=records)
    assert layout.read_installed(toolkit.root) == toolkit
    root = toolkit.root
    for rel in ("bin/nvcc", "bin/ptxas", "bin/cudafe++", "bin/fatbinary", "bin/nvlink", "nvvm/bin/cicc",
                "include/cuda_runtime.h", "include/crt/host_config.h", "include/cublas_v2.h", "include/cccl/cub/cub.cuh",
                "lib/libcudart.so.13", "lib/libcublas.so.13", "lib/libcublasLt.so.13", "lib/libnvvm.so.4",
                "nvvm/libdevice/libdevice.10.bc", "lib/stubs/libcuda.so", "version.json"):
        assert (root / rel).is_file(), rel
    for rel in ("bin/nvcc", "bin/ptxas", "nvvm/bin/cicc"):
        assert os.access(root / rel, os.X_OK), rel
    for dev in ("libcudart.so", "libcublas.so", "libcublasLt.so", "libnvvm.so"):
        assert (root / "lib" / dev).is_symlink() and (root / "lib" / dev).resolve().is_file(), dev
    for comp in (*COMPONENTS, "cuda_crt", "libnvvm"):
        assert "NVIDIA" in (root / f"LICENSE.{comp}").read_text(errors="replace"), comp
    sizes = {r.filename: (pypi.download_dir(settings, r) / r.filename).stat().st_size for r in records}
    assert sizes == {r.filename: r.size for r in records}
    print(f"\nwheels: {sizes}\ntotal {sum(sizes.values())} bytes")


def test_second_install_downloads_nothing(toolkit: layout.Toolkit, settings: Settings,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def no(*a: Any, **kw: Any) -> None:
        raise AssertionError("a second install may not download or extract")

    monkeypatch.setattr(pypi, "_download_wheels", no)
    monkeypatch.setattr(pypi, "extract_zip", no)
    start = time.monotonic()
    again = pypi.install_from_pypi(version=VERSION, platform="linux-x86_64", components=list(reversed(COMPONENTS)),
                                   settings=settings, log=Log())
    assert again == toolkit
    assert time.monotonic() - start < 60


def test_nvcc_version(toolkit: layout.Toolkit, e2e_env: dict[str, str]) -> None:
    out = subprocess.run([str(toolkit.nvcc), "--version"], env=clean_env(e2e_env), capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert "Cuda compilation tools, release 13.0, V13.0.88" in out.stdout, out.stdout


def test_nvcc_compiles_and_links_a_kernel(toolkit: layout.Toolkit, e2e_env: dict[str, str], tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no system gcc")
    src = tmp_path / "add_one.cu"
    src.write_text(KERNEL)
    exe = tmp_path / "add_one"
    env = clean_env(e2e_env)
    argv = [str(toolkit.nvcc), "-ccbin", gcc, "-gencode", "arch=compute_75,code=compute_75",
            "-gencode", "arch=compute_90,code=sm_90", "-o", str(exe), str(src)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    from elftools.elf.elffile import ELFFile

    with open(exe, "rb") as fh:
        elf = ELFFile(fh)
        assert elf.header["e_machine"] == "EM_X86_64"
        assert any(seg["p_type"] == "PT_INTERP" for seg in elf.iter_segments())  # a program, not an object
        assert elf.get_section_by_name(".nv_fatbin") is not None  # device code is embedded
    # the kernel's host side runs: without a GPU/driver the runtime reports it and the program still exits 0
    ran = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert ran.returncode == 0 and ran.stdout.startswith("cuda: "), ran.stdout + ran.stderr
    # what went into it (the fat binary is compressed, so ask nvcc): PTX for 75, SASS for 90, this toolkit's headers
    dry = subprocess.run([*argv, "--dryrun"], env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    plan = dry.stdout + dry.stderr
    assert "--image3=kind=ptx,sm=75," in plan and "--image3=kind=elf,sm=90," in plan, plan[-3000:]
    assert "ptxas -arch=sm_90" in plan
    assert f'"-I{toolkit.root}/bin/..//include"' in plan, plan[-3000:]
    assert f"{toolkit.root}/bin/..//include/cccl" in plan


def _llama_source(e2e_env: dict[str, str]) -> Path:
    recipe = keys.load(RECIPE)
    settings = Settings.from_env(e2e_env)
    src = settings.cache_dir / "src" / recipe.llama_cpp.commit
    if not (src / "CMakeLists.txt").is_file():
        from llamabundle.source import fetch_source

        fetch_source(recipe, settings, Log())
    assert (src / "ggml" / "src" / "ggml-cuda" / "CMakeLists.txt").is_file(), src
    return src


def test_cmake_configures_llama_cpp_cuda(toolkit: layout.Toolkit, e2e_env: dict[str, str], tmp_path: Path) -> None:
    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if cmake is None or ninja is None:
        pytest.skip("cmake and ninja are needed")
    src = _llama_source(e2e_env)
    build = tmp_path / "build"
    root = toolkit.root
    argv = [cmake, "-S", str(src), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
            "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90-real", f"-DCUDAToolkit_ROOT={root}",
            f"-DCMAKE_CUDA_COMPILER={root}/bin/nvcc", "-DGGML_BACKEND_DL=ON", "-DGGML_NATIVE=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    out = subprocess.run(argv, env=clean_env(e2e_env), capture_output=True, text=True, timeout=1200,
                         stdin=subprocess.DEVNULL)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    found = re.search(r'^-- Found CUDAToolkit: (.*) \(found version "([0-9.]+)"\)', text, re.M)
    assert found, text[-6000:]
    print(f"\n{found.group(0)}")
    assert found.group(2) == "13.0.88" and found.group(1).startswith(str(root)), found.group(0)
    assert "-- The CUDA compiler identification is NVIDIA 13.0.88" in text
    assert "-- Including CUDA backend" in text
    cache = (build / "CMakeCache.txt").read_text()
    entries = dict(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*):[A-Z]+=(.*)$", cache, re.M))
    assert entries["CMAKE_CUDA_COMPILER"] == f"{root}/bin/nvcc"
    for key in ("CUDA_CUDART", "CUDA_cublas_LIBRARY", "CUDA_cudart_LIBRARY", "CUDA_cuda_driver_LIBRARY"):
        assert entries.get(key, "").startswith(str(root) + "/"), (key, entries.get(key))
    assert Path(entries["CUDA_cuda_driver_LIBRARY"]).resolve() == (root / "lib" / "stubs" / "libcuda.so").resolve()
    assert (build / "build.ninja").is_file()
