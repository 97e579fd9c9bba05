"""What probe asks of a GPU backend, and what it shows it: the bundle, the machine's GPU scan, and the bundle's
own `llama-server --verbose --list-devices` (run once, on demand). A backend answers with a verdict (a reason
code and its facts) and, when it did not come up, its own diagnosis of why."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bundle.manifest import Manifest
from ..errors import VerifyError
from ..gpus import SMI_TIMEOUT, GpuScan
from ..platforms.load import Loaded
from ..reasons import Reason, Verdict

ListDevices = Callable[[], "Loaded | VerifyError"]
_MEMORY_SUFFIX = re.compile(r"\s*\([^()]*MiB[^()]*\)\s*$")  # a --list-devices line's "(143155 MiB, 142629 MiB free)"


def device_name(description: str) -> str:
    """`NVIDIA H200` of a --list-devices line's description `NVIDIA H200 (143155 MiB, 142629 MiB free)`."""
    return _MEMORY_SUFFIX.sub("", description).strip()


@dataclass(frozen=True, kw_only=True)
class Sight:
    """One probe's view of a bundle on this machine."""
    root: Path  # the bundle directory
    manifest: Manifest
    scan: GpuScan  # nvidia-smi's GPUs and the driver
    facts: dict[str, Any]  # probe's facts so far; a verdict adds what it compared (the driver floor)
    list_devices: ListDevices  # verify's run of the bundle's llama-server --list-devices, once
    env: Mapping[str, str]  # the environment nvidia-smi runs in
    smi_timeout: float = SMI_TIMEOUT
    lib_dirs: tuple[Path, ...] | None = None  # this machine's library directories (None: ldconfig's, then the usual)


def device_of(sight: Sight, loader_name: str, *, failed: Reason, not_loaded: Verdict,
              no_device: Verdict) -> Verdict | str:
    """The first device line of the backend `loader_name` (CUDA, Vulkan) in the bundle's --list-devices, or the
    verdict of why there is none: `failed` when the bundle did not start (with verify's words), `not_loaded`,
    `no_device`."""
    loaded = sight.list_devices()
    if isinstance(loaded, VerifyError):
        return failed, {"detail": loaded.what + (f" ({loaded.why})" if loaded.why else ""), "output": loaded.details}
    if loaded.level.startswith("skipped"):
        return failed, {"detail": loaded.level.removeprefix("skipped: ")}
    if loader_name not in loaded.backends:
        return not_loaded
    dev = next((d for d in loaded.devices if d.startswith(loader_name)), None)
    return dev if dev is not None else no_device
