"""`llamabundle-probe --drivers` (data/programs/llamabundle-probe.cpp) for real: the program compiled by g++ against
the ggml of the e2e session's CPU build tree (the shared build's cached tree, found by the CPU recipe's key, its
headers in the llama.cpp source it was configured from; its libraries copied beside the program as in a bundle),
which is seconds where a bundle build would be minutes, then run with the driver libraries it asks for:

- the fake NVIDIA driver of tests/data/fakecuda (gcc compiles it into a libcuda.so.1 on LD_LIBRARY_PATH): its two
  devices with their compute capabilities, bus ids and memory; its cuInit failing; an older one without
  cuDeviceGetAttribute; one that lists 1000 devices and writes on stdout; a file that is no library at all;
- no libcuda.so.1: not opened, with the loader's own message;
- lavapipe (mesa-vulkan-drivers) as the Vulkan driver: one device, of type cpu; no Vulkan driver at all.

Every answer is validated against the schema llamabundle ships and read by runtime/drivers.query, as the
installer reads it (a clean environment, a process group of its own). Skipped where g++ or gcc is missing, or
the shared build left no tree with ggml's libraries (it is waited for: the `first_build` fixture)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llamabundle.runtime import drivers
from llamabundle.runtime.drivers import CudaDevice

from .conftest import REPO
from .probeprogram import run_probe

FAKECUDA = REPO / "tests" / "data" / "fakecuda" / "libcuda.c"
PROGRAM = REPO / "llamabundle" / "data" / "programs" / "llamabundle-probe.cpp"
LAVAPIPE = Path("/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
GXX, GCC = shutil.which("g++"), shutil.which("gcc")
H200 = {"index": 0, "name": "NVIDIA Fake H200", "compute_capability": "9.0", "device_id": "0000:00:06.0",
        "memory_total": 143771 << 20}
A100 = {"index": 1, "name": "NVIDIA Fake A100", "compute_capability": "8.0", "device_id": "0001:c1:00.0",
        "memory_total": 80 << 30}
NOT_FOUND = "libcuda.so.1: cannot open shared object file: No such file or directory"

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="builds and runs a Linux program"),
              pytest.mark.skipif(GXX is None or GCC is None, reason="needs g++ and gcc (Debian: apt-get install g++)")]


def _system_libcuda() -> bool:
    """Whether this machine has an NVIDIA driver of its own (the answers without the fake then differ)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def ggml_tree(cache: Path, key: str) -> tuple[Path, Path] | None:
    """The newest build tree of the recipe `key` in the llamabundle cache that has ggml's libraries, and the
    ggml/include of the source it was configured from (CMakeCache.txt's CMAKE_HOME_DIRECTORY); None without."""
    trees = sorted((t for t in (cache / "build").glob(f"{key[:16]}-*")
                    if (t / "bin" / "libggml.so").exists() and (t / "bin" / "libggml-base.so").exists()
                    and (t / "CMakeCache.txt").is_file()), key=lambda t: t.stat().st_mtime_ns)
    for tree in reversed(trees):
        home = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.+)$", (tree / "CMakeCache.txt").read_text(), re.M)
        include = Path(home.group(1).strip()) / "ggml" / "include" if home else None
        if include is not None and (include / "ggml-backend.h").is_file():
            return tree, include
    return None


@pytest.fixture(scope="module")
def probe(e2e_env: dict[str, str], recipe_key: str, first_build: dict[str, Any],
          tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llamabundle-probe compiled from this checkout's source, beside copies of the cached tree's libggml and
    libggml-base (RUNPATH $ORIGIN, as in a bundle): the cached tree (the session's shared build, waited for) is
    only read."""
    found = ggml_tree(Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]), recipe_key)
    if found is None:
        pytest.skip(f"no build tree of recipes/linux-x86_64-cpu.yaml (key {recipe_key[:16]}) with ggml's libraries in "
                    f"{e2e_env['LLAMABUNDLE_CACHE_DIR']}/build: run the e2e pipeline once (tests/e2e/test_pipeline.py)")
    tree, include = found
    bundle = tmp_path_factory.mktemp("drivers") / "bundle"
    bundle.mkdir()
    for lib in [*(tree / "bin").glob("libggml.so*"), *(tree / "bin").glob("libggml-base.so*")]:
        shutil.copyfile(lib, bundle / lib.name)  # the links' targets, as files: what `bundle` collects
    assert GXX is not None
    exe = bundle / "llamabundle-probe"
    res = subprocess.run([GXX, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{include}", str(PROGRAM),
                          f"-L{bundle}", "-lggml", "-lggml-base", "-ldl", "-Wl,-rpath,$ORIGIN", "-o", str(exe)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return exe


def fake_cuda(where: Path, *defines: str) -> Path:
    """tests/data/fakecuda/libcuda.c compiled into where/libcuda.so.1; `where` returned (for LD_LIBRARY_PATH)."""
    where.mkdir(parents=True, exist_ok=True)
    assert GCC is not None
    subprocess.run([GCC, "-Wall", "-Wextra", "-Werror", *defines, "-shared", "-fPIC", "-o", str(where / "libcuda.so.1"),
                    str(FAKECUDA)], check=True, timeout=120)
    return where


def run_drivers(probe: Path, **env: str) -> dict[str, Any]:
    """`probe --drivers` in an environment of `env` alone (and PATH): its answer, valid against the schema."""
    got = run_probe([str(probe), "--drivers"], env={"PATH": "/usr/bin:/bin", **env}, cwd=probe.parent, timeout=120)
    assert (got["schema"], got["program"], got["mode"]) == (1, "llamabundle-probe", "drivers")
    return got


def test_the_fake_nvidia_driver_lists_its_two_devices(probe: Path, tmp_path: Path) -> None:
    fake = fake_cuda(tmp_path / "fakecuda")
    cuda = run_drivers(probe, LD_LIBRARY_PATH=str(fake))["drivers"]["cuda"]
    assert cuda == {"library": "libcuda.so.1", "opened": True, "error": None, "path": str(fake / "libcuda.so.1"),
                    "missing": [], "init": 0, "init_error": None, "driver_version": 12080, "cuda_version": "12.8",
                    "device_count": 2, "devices": [H200, A100], "problems": []}

    got = drivers.query(probe, env={"LD_LIBRARY_PATH": str(fake)})  # as the installer asks
    assert got.cuda_driver_version == "12.8" and got.cuda_not_opened is None and "cuda" in got.gpu_backends
    assert got.cuda_devices == (CudaDevice(index=0, name="NVIDIA Fake H200", compute_capability="9.0",
                                           bus_id="0000:00:06.0", memory_total=150754820096),
                                CudaDevice(index=1, name="NVIDIA Fake A100", compute_capability="8.0",
                                           bus_id="0001:c1:00.0", memory_total=85899345920))


def test_a_failing_cuinit_is_reported_with_its_name_and_no_device(probe: Path, tmp_path: Path) -> None:
    fake = fake_cuda(tmp_path / "fakecuda")
    cuda = run_drivers(probe, LD_LIBRARY_PATH=str(fake), FAKECUDA_INIT_ERROR="100")["drivers"]["cuda"]
    assert (cuda["opened"], cuda["init"], cuda["init_error"]) == (True, 100, "CUDA_ERROR_NO_DEVICE")
    assert (cuda["device_count"], cuda["devices"], cuda["problems"]) == (None, [], [])
    assert cuda["driver_version"] == 12080  # asked without cuInit, as the driver allows
    got = drivers.query(probe, env={"LD_LIBRARY_PATH": str(fake), "FAKECUDA_INIT_ERROR": "100"})
    assert got.cuda_devices == () and "cuda" not in got.gpu_backends
    assert got.why_not("cuda") == "cuInit returned 100 (CUDA_ERROR_NO_DEVICE)"


@pytest.mark.skipif(_system_libcuda(), reason="this machine has an NVIDIA driver of its own (libcuda.so.1 opens)")
def test_without_libcuda_the_loaders_message_says_why(probe: Path) -> None:
    cuda = run_drivers(probe)["drivers"]["cuda"]
    assert (cuda["opened"], cuda["error"], cuda["path"]) == (False, NOT_FOUND, None)
    assert (cuda["init"], cuda["driver_version"], cuda["devices"], cuda["missing"]) == (None, None, [], [])
    got = drivers.query(probe, env={})
    assert got.cuda_not_opened == NOT_FOUND and got.why_not("cuda") == f"libcuda.so.1 did not open: {NOT_FOUND}"


def test_a_libcuda_that_is_no_library_or_lacks_the_driver_api_is_named_not_called(probe: Path, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "libcuda.so.1").write_bytes(b"\x7fELF not really\n")
    cuda = run_drivers(probe, LD_LIBRARY_PATH=str(garbage))["drivers"]["cuda"]
    assert cuda["opened"] is False and cuda["error"].startswith(f"{garbage / 'libcuda.so.1'}: ")

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "empty.c").write_text("int not_cuda(void) { return 0; }\n")
    assert GCC is not None
    subprocess.run([GCC, "-shared", "-fPIC", "-o", str(empty / "libcuda.so.1"), str(empty / "empty.c")], check=True)
    cuda = run_drivers(probe, LD_LIBRARY_PATH=str(empty))["drivers"]["cuda"]
    assert cuda["opened"] is True and cuda["missing"] == [
        "cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetName", "cuDeviceGetAttribute",
        "cuDeviceTotalMem_v2"]
    assert (cuda["init"], cuda["driver_version"], cuda["devices"]) == (None, None, [])


def test_an_older_driver_without_attributes_gives_what_it_has(probe: Path, tmp_path: Path) -> None:
    """No cuDeviceGetAttribute, no cuGetErrorName, only the 32-bit cuDeviceTotalMem of CUDA 3.1."""
    fake = fake_cuda(tmp_path / "old", "-DFAKECUDA_OLD")
    cuda = run_drivers(probe, LD_LIBRARY_PATH=str(fake))["drivers"]["cuda"]
    assert cuda["missing"] == ["cuDeviceGetAttribute"] and cuda["init"] == 0
    assert cuda["devices"] == [{**H200, "compute_capability": None, "device_id": None, "memory_total": 0xFFFFFFFF},
                               {**A100, "compute_capability": None, "device_id": None, "memory_total": 0xFFFFFFFF}]
    failed = run_drivers(probe, LD_LIBRARY_PATH=str(fake), FAKECUDA_INIT_ERROR="100")["drivers"]["cuda"]
    assert (failed["init"], failed["init_error"]) == (100, None)  # no cuGetErrorName to name it


def test_a_hostile_driver_is_bounded_escaped_and_kept_off_stdout(probe: Path, tmp_path: Path) -> None:
    """1000 devices (64 listed, the count said), a name of quotes, control characters and bytes that are not
    UTF-8, and text on stdout from cuInit: the answer is still one valid JSON object."""
    fake = fake_cuda(tmp_path / "fakecuda")
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(fake), "FAKECUDA_DEVICES": "1000",
           "FAKECUDA_STDOUT": "{\"not\": \"the answer\"}", "FAKECUDA_NAME0": os.fsdecode(b'Fake "q"\n\xff\xc3 G\x01')}
    res = subprocess.run([str(probe), "--drivers"], env=env, capture_output=True, timeout=120)
    assert res.returncode == 0 and b'{"not": "the answer"}' in res.stderr and b"the answer" not in res.stdout
    got = drivers.parse(res.stdout)
    assert len(got.cuda_devices) == 64 and got.cuda_devices[-1].index == 63
    assert got.cuda.problems == ("cuDeviceGetCount said 1000 devices: the first 64 are listed",)
    assert got.cuda_devices[0].name == 'Fake "q"\n\ufffd\ufffd G\x01'
    assert got.cuda_devices[1].bus_id == "0001:c1:00.0" and got.cuda_devices[63].bus_id == "0001:ff:00.0"


@pytest.mark.skipif(not LAVAPIPE.is_file() or not any(Path(d, "libvulkan.so.1").exists()
                                                       for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu")),
                    reason="needs libvulkan1 and mesa-vulkan-drivers (apt-get install libvulkan1 mesa-vulkan-drivers)")
def test_lavapipe_is_one_vulkan_device_of_type_cpu(probe: Path, tmp_path: Path) -> None:
    vulkan = run_drivers(probe, VK_DRIVER_FILES=str(LAVAPIPE), VK_ICD_FILENAMES=str(LAVAPIPE))["drivers"]["vulkan"]
    assert (vulkan["opened"], vulkan["error"], vulkan["missing"], vulkan["problems"]) == (True, None, [], [])
    assert vulkan["path"] is not None and Path(vulkan["path"]).name.startswith("libvulkan.so.1")
    assert (vulkan["create_instance"], vulkan["device_count"]) == (0, 1)
    (device,) = vulkan["devices"]
    assert device["index"] == 0 and device["type"] == "cpu" and device["name"].startswith("llvmpipe (LLVM ")
    assert re.fullmatch(r"1\.[0-9]+\.[0-9]+", device["api_version"]) and device["vendor_id"] == 0x10005  # Mesa
    print(f"\nlavapipe as --drivers sees it: {device}")

    got = drivers.query(probe, env={"VK_DRIVER_FILES": str(LAVAPIPE), "VK_ICD_FILENAMES": str(LAVAPIPE)})
    assert [(d.type, d.gpu) for d in got.vulkan_devices] == [("cpu", False)] and "vulkan" not in got.gpu_backends
    assert got.why_not("vulkan") == f"the Vulkan loader lists only CPU implementations: {device['name']}"

    none = tmp_path / "no-such-icd.json"  # a loader without any driver: vkCreateInstance has nothing to create
    vulkan = run_drivers(probe, VK_DRIVER_FILES=str(none), VK_ICD_FILENAMES=str(none))["drivers"]["vulkan"]
    assert (vulkan["opened"], vulkan["create_instance"], vulkan["device_count"], vulkan["devices"]) == (True, -9, None, [])


def test_drivers_takes_neither_dir_nor_rpc_and_the_default_answer_is_unchanged(probe: Path) -> None:
    for argv in (["--drivers", "--dir", "."], ["--dir", ".", "--drivers"],
                 ["--drivers", "--rpc", "127.0.0.1:50052"], ["--rpc", "127.0.0.1:50052", "--drivers"]):
        res = subprocess.run([str(probe), *argv], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr == ("llamabundle-probe: --drivers goes with neither --dir nor --rpc "
                              "(usage: llamabundle-probe [--dir DIR] [--rpc HOST:PORT[,...]] | --drivers)\n")
    helped = subprocess.run([str(probe), "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--drivers: the GPU drivers of this machine" in helped.stdout
    got = run_probe([str(probe)], env={"PATH": "/usr/bin:/bin"}, cwd=probe.parent)  # beside ggml, no backend module
    assert "mode" not in got and got["dir"] == str(probe.parent) and got["modules"] == [] and got["devices"] == []
