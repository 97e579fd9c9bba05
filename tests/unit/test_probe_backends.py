"""probe with several GPU backends in one bundle (CPU + CUDA + Vulkan): which one the app should use on this
machine and why (CUDA on NVIDIA when its checks pass, else Vulkan, else CPU; an explicit preference
honoured), one physical GPU counted once, and the llama-server flags that select the chosen backend.
The bundles are real unpacked bundles whose llama-server is a shell program answering --list-devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamabundle.backends import vulkan
from llamabundle.reasons import Chosen, Reason
from llamabundle.runtime.probe import pair_devices
from tests.probing import H200, OLD, fake_smi, make_stage, run_probe

ALL = ("cpu", "cuda", "vulkan")


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": str(tmp_path / "emptybin"), "HOME": str(tmp_path)}


@pytest.fixture(autouse=True)
def loader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vulkan, "loader_path", lambda: "/usr/lib/x86_64-linux-gnu/libvulkan.so.1")


def probe_stage(tmp: Path, env: dict[str, str], server: str, smi: Path | None, **kw: object):  # type: ignore[no-untyped-def]
    stage, _ = make_stage(tmp, server=server, backends=kw.pop("backends", ALL))  # type: ignore[arg-type]
    return run_probe(tmp, env, smi, bundle=stage, max_age=0, **kw)


def test_cuda_wins_on_nvidia_and_the_gpu_is_one_device(tmp_path: Path, env: dict[str, str]) -> None:
    r = probe_stage(tmp_path, env, "both", fake_smi(tmp_path / "smi", H200))
    assert (r.backend, r.reason) == (Chosen.CUDA, Reason.OK)
    assert r.facts["gpu_devices"] == [{"name": "NVIDIA H200", "devices": ["CUDA0", "Vulkan0"]}]
    assert r.facts["server_args"] == ["--device", "CUDA0"]
    assert r.facts["server_env"] == {"GGML_VK_VISIBLE_DEVICES": ""}, "Vulkan is hidden from a CUDA run"


def test_vulkan_is_used_when_asked_and_says_so(tmp_path: Path, env: dict[str, str]) -> None:
    r = probe_stage(tmp_path, env, "both", fake_smi(tmp_path / "smi", H200), prefer="vulkan")
    assert (r.backend, r.reason) == (Chosen.VULKAN, Reason.VULKAN_OK)
    assert "Vulkan was asked for" in r.sentence and "NVIDIA H200" in r.facts["device_name"]
    assert r.facts["server_args"] == ["--device", "Vulkan0"] and r.facts["server_env"] == {"CUDA_VISIBLE_DEVICES": ""}


def test_a_driver_below_the_floor_falls_back_to_vulkan_naming_the_cause(tmp_path: Path, env: dict[str, str]) -> None:
    old = OLD.replace("NVIDIA GeForce RTX 3060", "NVIDIA H200")
    r = probe_stage(tmp_path, env, "both", fake_smi(tmp_path / "smi", old))
    assert (r.backend, r.reason) == (Chosen.VULKAN, Reason.VULKAN_OK)
    assert r.facts["cuda_reason"] == "driver_too_old"
    assert "CUDA is not used: driver 551.61 is older than 572.61" in r.sentence


def test_an_amd_gpu_runs_vulkan_and_needs_no_nvidia(tmp_path: Path, env: dict[str, str]) -> None:
    r = probe_stage(tmp_path, env, "vulkan_amd", None)
    assert (r.backend, r.reason) == (Chosen.VULKAN, Reason.VULKAN_OK)
    assert r.facts["cuda_reason"] == "gpu_missing" and "AMD Radeon RX 7900 XTX" in r.sentence
    assert r.facts["gpu_devices"] == [{"name": "AMD Radeon RX 7900 XTX (RADV NAVI31)", "devices": ["Vulkan0"]}]
    vk_only = probe_stage(tmp_path, env, "vulkan_amd", None, backends=("cpu", "vulkan"))
    assert vk_only.reason is Reason.VULKAN_OK and "the bundle has no CUDA backend" in vk_only.sentence
    assert vk_only.facts["server_env"] == {}


@pytest.mark.parametrize("server, reason, words", [
    ("vulkan_lavapipe", Reason.VULKAN_NO_GPU, "found no Vulkan GPU"),
    ("vulkan_silent", Reason.VULKAN_UNAVAILABLE, "no Vulkan driver (ICD) could be loaded"),
])
def test_without_a_vulkan_gpu_the_cpu_runs_with_the_vulkan_cause(tmp_path: Path, env: dict[str, str], server: str,
                                                                 reason: Reason, words: str) -> None:
    r = probe_stage(tmp_path, env, server, None, backends=("cpu", "vulkan"))
    assert (r.backend, r.reason) == (Chosen.CPU, reason)
    assert words in r.sentence and r.facts["server_args"] == ["--device", "none"]


def test_no_loader_is_its_own_reason(tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vulkan, "loader_path", lambda: None)
    r = probe_stage(tmp_path, env, "vulkan_amd", None, backends=("cpu", "vulkan"))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.VULKAN_LOADER_MISSING)
    assert "apt-get install libvulkan1" in r.fix


def test_on_nvidia_a_cuda_failure_is_the_reason_when_vulkan_has_no_gpu_either(tmp_path: Path, env: dict[str, str]) -> None:
    old = OLD.replace("NVIDIA GeForce RTX 3060", "NVIDIA H200")
    r = probe_stage(tmp_path, env, "vulkan_lavapipe", fake_smi(tmp_path / "smi", old))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.DRIVER_TOO_OLD)
    assert r.facts["vulkan_reason"] == "vulkan_no_gpu"


def test_cpu_preference_is_honoured_and_names_what_would_run(tmp_path: Path, env: dict[str, str]) -> None:
    r = probe_stage(tmp_path, env, "both", fake_smi(tmp_path / "smi", H200), prefer="cpu")
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.CPU_PREFERRED)
    assert "CUDA0" in r.sentence and r.facts["server_args"] == ["--device", "none"]


def test_pairing_counts_one_gpu_once_but_two_alike_twice() -> None:
    two = ["CUDA0: NVIDIA H200 (1 MiB, 1 MiB free)", "CUDA1: NVIDIA H200 (1 MiB, 1 MiB free)",
           "Vulkan0: NVIDIA H200 (1 MiB, 1 MiB free)", "Vulkan1: NVIDIA H200 (1 MiB, 1 MiB free)"]
    assert pair_devices(two) == [{"name": "NVIDIA H200", "devices": ["CUDA0", "Vulkan0"]},
                                 {"name": "NVIDIA H200", "devices": ["CUDA1", "Vulkan1"]}]
