"""The runtime reason codes (DESIGN §8): why a backend runs or does not, as stable strings an app matches on,
each with a human sentence and a fix kept as data (data/reasons.json, templates over probe's facts). A GPU
backend names the codes it can give (Backend.reasons); probe gives the rest."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from functools import cache
from typing import Any

from .data import load


class Chosen(StrEnum):
    """The backend a result runs on (probe's `backend`)."""
    CUDA = "cuda"
    VULKAN = "vulkan"
    CPU = "cpu"


class Reason(StrEnum):
    OK = "ok"
    BINARY_MISSING_NVIDIA_DETECTED = "binary_missing_nvidia_detected"  # the only one that triggers an install
    GPU_MISSING = "gpu_missing"
    DRIVER_TOO_OLD = "driver_too_old"
    CUDA_UNAVAILABLE = "cuda_unavailable"
    # what probe found to be why the CUDA backend did not load or listed no device (instead of cuda_unavailable)
    CUDA_LIBRARY_MISSING = "cuda_library_missing"
    CUDA_DRIVER_LIBRARY_MISSING = "cuda_driver_library_missing"
    CUDA_DRIVER_TOO_OLD_FOR_TOOLKIT = "cuda_driver_too_old_for_toolkit"
    CUDA_ARCH_UNSUPPORTED = "cuda_arch_unsupported"
    CUDA_PTX_TOO_NEW = "cuda_ptx_too_new"
    CUDA_STARTUP_FAILED = "cuda_startup_failed"
    CUDA_GPU_LAYERS_ZERO = "cuda_gpu_layers_zero"
    CUDA_BUNDLE_INSTALL_FAILED = "cuda_bundle_install_failed"
    BUNDLE_INVALID = "bundle_invalid"
    VULKAN_OK = "vulkan_ok"
    VULKAN_LOADER_MISSING = "vulkan_loader_missing"
    VULKAN_UNAVAILABLE = "vulkan_unavailable"
    VULKAN_NO_GPU = "vulkan_no_gpu"
    CPU_PREFERRED = "cpu_preferred"


Verdict = tuple[Reason, dict[str, Any]]  # a backend's answer to probe: the reason, and the facts behind it


@cache
def reasons() -> dict[str, Any]:
    table: dict[str, Any] = load("reasons.json")["reasons"]
    assert set(table) == {r.value for r in Reason}, f"reasons.json and Reason differ: {set(table) ^ {r.value for r in Reason}}"
    for name, info in table.items():
        assert info["backend"] in {b.value for b in Chosen} and info["sentence"] and info["fix"], name
        assert (info["backend"] == "cuda") == (name == "ok") and (info["backend"] == "vulkan") == (name == "vulkan_ok"), name
    return table


class _Facts(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return "?"


def fill(info: Mapping[str, str], facts: Mapping[str, Any]) -> tuple[str, str]:
    """A code's sentence and fix (reasons.json) filled in from the facts ('?' where one is unknown)."""
    values = _Facts({k: v for k, v in facts.items() if isinstance(v, (str, int, float))})
    return info["sentence"].format_map(values), info["fix"].format_map(values)


def explain(reason: Reason, facts: Mapping[str, Any]) -> tuple[str, str]:
    """The reason's human sentence and what to do, filled in from the facts ('?' where one is unknown)."""
    return fill(reasons()[reason.value], facts)


def backend_for(reason: Reason) -> Chosen:
    return Chosen(reasons()[reason.value]["backend"])
