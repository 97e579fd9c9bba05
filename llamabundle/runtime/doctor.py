"""What was found and what to do about it: GPUs, driver, each installed bundle, the last probe, the reason.

Everything shown comes from the probe (whose nvidia-smi and driver-file readings are validated there) and from
the installed bundles' typed manifests; a driver floor that is not a driver version is shown as such, never
compared."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..gpus import PROC_VERSION, SMI_TIMEOUT, driver_older, is_driver_version
from ..reasons import Reason
from .install import Installed, list_installed
from .probe import ProbeResult, probe, read_cached
from .results import utc_timestamp


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    root: Path
    installed: tuple[Installed, ...]
    last_probe: ProbeResult | None  # the cached one from before this run
    result: ProbeResult  # probed now

    @property
    def advice(self) -> str:
        """One line: why, and what to do (e.g. 'driver 551.61 is older than 572.61 required by this bundle: update …')."""
        return self.result.sentence if self.result.reason is Reason.OK else f"{self.result.sentence}: {self.result.fix}"

    def to_json(self) -> dict[str, Any]:
        f = self.result.facts
        return {"schema": 1, "root": str(self.root), "gpus": f.get("gpus", []), "driver": f.get("driver"),
                "proc_driver": f.get("proc_driver"), "nvidia_smi": f.get("nvidia_smi"),
                "bundles": [{**i.to_json(), "driver_ok": self._driver_ok(i)} for i in self.installed],
                "last_probe": self.last_probe.to_json() if self.last_probe else None, "probe": self.result.to_json(),
                "advice": self.advice}

    def _driver_ok(self, inst: Installed) -> bool | None:
        """Whether the driver found meets the bundle's floor; None when either is unknown or not a version."""
        floor = inst.cuda_info.driver_floor if inst.cuda_info is not None else None
        driver = self.result.facts.get("driver")
        if not isinstance(floor, str) or not isinstance(driver, str) or not is_driver_version(floor) \
                or not is_driver_version(driver):
            return None
        return not driver_older(driver, floor)

    def rows(self) -> list[tuple[str, str]]:
        """(what, found) rows of the table doctor prints."""
        f = self.result.facts
        gpus = f.get("gpus") or []
        def mib(v: Any) -> str:
            return "?" if v is None else str(v)

        rows = [(f"GPU {n}", f"{g['name']}, {mib(g['memory_total_mib'])} MiB ({mib(g['memory_free_mib'])} MiB free)")
                for n, g in enumerate(gpus)] or [("GPU", f"none found ({f.get('nvidia_smi_error') or 'no NVIDIA driver'})")]
        driver = f.get("driver")
        rows.append(("driver", f"{driver or 'none'}" + (f" (kernel module {f['proc_driver']})" if f.get("proc_driver") else "")))
        for i in self.installed:
            ok = self._driver_ok(i)
            info, commit = i.cuda_info, i.manifest.llama_cpp.commit
            floor = info.driver_floor if info is not None else None
            note = "" if ok is None else " (driver ok)" if ok else f" (driver {driver} is too old)"
            if floor and not is_driver_version(floor):
                note = " (not a driver version: not compared)"
            cuda = (f"CUDA {info.toolkit or 'of an unrecorded version'}, "
                    + (f"driver floor {floor!s:.40}{note}, " if floor else "no driver floor recorded, ")) if info else ""
            rows.append((f"bundle {i.name}", f"key {i.key[:12]}, llama.cpp {str(commit)[:12] if commit else 'commit unrecorded'}, "
                         f"backends {'+'.join(i.backends) or '?'}, " + cuda
                         + f"installed {i.installed_at or 'at an unrecorded time'}"))
        if not self.installed:
            rows.append(("bundles", f"none installed in {self.root}"))
        last = self.last_probe
        rows.append(("last probe", "none" if last is None else
                     f"{last.backend} / {last.reason} at {utc_timestamp(last.probed_at)}"))
        rows += [("backend", self.result.backend.value), ("reason", self.result.reason.value),
                 ("why", self.result.sentence), ("what to do", self.result.fix)]
        return rows


def diagnose(*, root: Path, env: Mapping[str, str], cache_dir: Path | None, bundle: Path | None = None,
             nvidia_smi: str | None = None, proc_version: Path | None = PROC_VERSION,
             smi_timeout: float = SMI_TIMEOUT) -> Diagnosis:
    last = read_cached(cache_dir) if cache_dir is not None else None
    result = probe(root=root, env=env, cache_dir=cache_dir, bundle=bundle, nvidia_smi=nvidia_smi,
                   proc_version=proc_version, smi_timeout=smi_timeout)
    return Diagnosis(root=root, installed=tuple(list_installed(root)), last_probe=last, result=result)
