"""verify's gpu level on a listed CUDA device that no kernel of the bundle runs on.

On the H200 a bundle of sm_80 SASS only listed `CUDA0: NVIDIA H200` and `verify --level gpu` would have passed,
while llama-bench aborted at its first kernel (bench/results/gpu-h200-multi-backend/). The compute capability
ggml-cuda reports while it loads (`Device 0: NVIDIA H200, compute capability 9.0`) is read from the same
--list-devices run and checked against bundle.json's SASS and PTX. The output here is the H200's own."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from llamabundle import verify
from llamabundle.backends import cuda, vulkan
from llamabundle.bundle.manifest import Manifest
from llamabundle.errors import VerifyError
from llamabundle.platforms.load import Loaded, read_list_devices

H200_OUTPUT = Path(__file__).parents[1] / "data" / "h200" / "list-devices-cuda-vulkan.txt"


def loaded_from_h200(root: Path) -> Loaded:
    lines = H200_OUTPUT.read_text().replace("BUNDLE", str(root)).splitlines()
    loaded = Loaded(level="passed")
    read_list_devices(lines, root=root, loaded=loaded, exe="llama-server")
    return loaded


def report_of(loaded: Loaded) -> verify.VerifyReport:
    r = verify.VerifyReport(path="b.zip", key="k", platform="linux-x86_64", files=1, bytes=1)
    r.levels["load"] = loaded.level
    r.backends_loaded, r.devices, r.compute_caps = dict(loaded.backends), list(loaded.devices), dict(loaded.compute_caps)
    return r


def manifest(sass: tuple[str, ...], ptx: tuple[str, ...], *backends: str) -> Manifest:
    cuda = {"toolkit": "13.0.2", "archs": {"sass": list(sass), "ptx": list(ptx)}}
    return SimpleNamespace(backends=backends, sections={"cuda": cuda}, inputs={}, key="k" * 12)  # type: ignore[return-value]


@pytest.fixture(autouse=True)
def _no_drivers_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda.Cuda, "device_present", lambda self: True)
    monkeypatch.setattr(vulkan.Vulkan, "device_present", lambda self: True)


def test_the_compute_capability_is_read_from_the_list_devices_output(tmp_path: Path) -> None:
    loaded = loaded_from_h200(tmp_path)
    assert loaded.compute_caps == {"CUDA0": "9.0"}
    assert loaded.devices == ["CUDA0: NVIDIA H200 (143155 MiB, 142612 MiB free)",
                              "Vulkan0: NVIDIA H200 (143771 MiB, 142612 MiB free)"]
    assert verify.VerifyReport(path="p", key="k", platform="x", files=0, bytes=0).to_json()["compute_caps"] == {}


def test_a_bundle_for_other_gpus_is_not_a_passed_gpu_level(tmp_path: Path) -> None:
    r = report_of(loaded_from_h200(tmp_path))
    verify.check_gpu(manifest(("80",), (), "cpu", "cuda"), r, require_gpu=False)
    assert r.levels["gpu"] == ("skipped: CUDA0 (compute capability 9.0) is listed, but no kernel of the bundle runs "
                               "on it (SASS: 80; PTX: none): the bundle is for other GPUs")
    with pytest.raises(VerifyError) as e:
        verify.check_gpu(manifest(("80",), (), "cpu", "cuda"), report_of(loaded_from_h200(tmp_path)), require_gpu=True)
    assert e.value.what.startswith("GPU check skipped: CUDA0 (compute capability 9.0) is listed")
    # sm_86 SASS does not run on 9.0 either; compute_80 PTX does (the driver's JIT), as does sm_90 SASS
    for sass, ptx, runs in ((("86",), (), False), ((), ("80",), True), (("90",), ("75",), True)):
        r = report_of(loaded_from_h200(tmp_path))
        verify.check_gpu(manifest(sass, ptx, "cpu", "cuda"), r, require_gpu=False)
        if runs:
            assert r.levels["gpu"] == "passed", (sass, ptx)
        else:
            assert r.levels["gpu"].startswith("skipped: CUDA0 (compute capability 9.0) is listed"), (sass, ptx)


def test_in_a_multi_backend_bundle_vulkan_still_passes(tmp_path: Path) -> None:
    r = report_of(loaded_from_h200(tmp_path))
    verify.check_gpu(manifest(("80",), (), "cpu", "cuda", "vulkan"), r, require_gpu=True)
    assert r.levels["gpu"] == "passed (Vulkan)"
    assert r.levels["gpu CUDA"].startswith("skipped: CUDA0 (compute capability 9.0) is listed, but no kernel")


def test_unknown_capabilities_or_archs_leave_the_listed_device_passed(tmp_path: Path) -> None:
    loaded = loaded_from_h200(tmp_path)
    loaded.compute_caps.clear()  # the log line was lost (llama.cpp's log thread), or an older ggml said nothing
    r = report_of(loaded)
    verify.check_gpu(manifest(("80",), (), "cpu", "cuda"), r, require_gpu=True)
    assert r.levels["gpu"] == "passed"
    r = report_of(loaded_from_h200(tmp_path))
    verify.check_gpu(manifest((), (), "cpu", "cuda"), r, require_gpu=True)  # bundle.json records no archs
    assert r.levels["gpu"] == "passed"
