"""The consumer side (DESIGN §1, §5, §8): install a bundle on demand, probe which backend will run and why.

Reason codes are stable strings; their human sentences and fixes live in data/reasons.json."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Mapping
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

from .. import scratch
from ..data import load


class Backend(StrEnum):
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


@cache
def reasons() -> dict[str, Any]:
    table: dict[str, Any] = load("reasons.json")["reasons"]
    assert set(table) == {r.value for r in Reason}, f"reasons.json and Reason differ: {set(table) ^ {r.value for r in Reason}}"
    for name, info in table.items():
        assert info["backend"] in {b.value for b in Backend} and info["sentence"] and info["fix"], name
        assert (info["backend"] == "cuda") == (name == "ok") and (info["backend"] == "vulkan") == (name == "vulkan_ok"), name
    return table


class _Facts(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return "?"


def explain(reason: Reason, facts: Mapping[str, Any]) -> tuple[str, str]:
    """The reason's human sentence and what to do, filled in from the facts ('?' where one is unknown)."""
    info = reasons()[reason.value]
    values = _Facts({k: v for k, v in facts.items() if isinstance(v, (str, int, float))})
    return info["sentence"].format_map(values), info["fix"].format_map(values)


def backend_for(reason: Reason) -> Backend:
    return Backend(reasons()[reason.value]["backend"])


def utc_timestamp(epoch: float | None = None) -> str:
    """ISO 8601 UTC to the second, `YYYY-MM-DDTHH:MM:SSZ`: every timestamp of a JSON output or of a file an
    app reads (now, or the given Unix time)."""
    when = dt.datetime.now(dt.UTC) if epoch is None else dt.datetime.fromtimestamp(epoch, dt.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_utc_timestamp(value: str | float) -> int:
    """Unix seconds of a `utc_timestamp` string (a number, as older caches wrote, is taken as it is)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    when = dt.datetime.strptime(str(value), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    return int(when.timestamp())


def write_atomic(path: Path, text: str) -> None:
    """Replace path's content in one step: a reader (or a SIGKILL) sees the old file or the new one, never half.
    The temporary file `.<name>.<owner>.tmp` names its owner (scratch); a killed writer's is removed by the
    next write of that file."""
    scratch.sweep(path.parent, [f".{path.name}."])
    tmp = scratch.owned(path.parent, f".{path.name}.", ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
