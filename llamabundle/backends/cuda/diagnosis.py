"""Probe's view of the CUDA backend: its verdict (an NVIDIA GPU, the driver against the bundle's floor, the
backend loading from the bundle and listing its device, a kernel of the bundle that runs on that GPU), and,
when the backend did not load or listed no device, the diagnosis of why: a library of ggml-cuda's import
closure this machine lacks (the bundle's own, or the driver's libcuda.so.1), GPUs neither the SASS nor the
PTX serves, PTX the driver is too old to JIT, a driver too old for the toolkit. Nothing here raises to probe:
a check that cannot be made says why, and the reason stays cuda_unavailable."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ... import data, gpus, platforms
from ...deps.elf import ElfInfo, is_elf, ldconfig_cache, read_elf, resolve_closure, system_library_dirs
from ...deps.policy import linux_policy
from ...errors import VerifyError
from ...gpus import driver_older, is_driver_version
from ...reasons import Reason, Verdict
from ..probing import Sight, device_of
from . import section
from .report import Status, arch_fix, serving


def verdict(sight: Sight, *, loader_name: str) -> Verdict:
    """CUDA's checks, in order: an NVIDIA GPU, the driver against the bundle's floor, the backend loading
    from the bundle and listing its device; when it did not load or listed none, why (`diagnose`). A listed
    device is not yet a working one: ggml-cuda lists a GPU that none of its kernels can run on (seen on the
    H200: a bundle of sm_80 SASS listed `CUDA0: NVIDIA H200`, and llama-bench aborted at its first kernel), so
    the GPUs' compute capabilities are checked against the bundle's SASS and PTX too (`kernels`)."""
    manifest, scan, facts = sight.manifest, sight.scan, sight.facts
    if not scan.present:
        return Reason.GPU_MISSING, {"detail": scan.error or "no NVIDIA driver found"}
    info = section.read(manifest)
    floor = info.driver_floor if info is not None else None
    facts.update(floor=floor)
    if floor and not is_driver_version(floor):
        return Reason.BUNDLE_INVALID, {"detail": f"its bundle.json records the driver floor {floor[:40]!r}, "
                                                 "which is not a driver version"}
    if floor and scan.driver and driver_older(scan.driver, floor):
        return Reason.DRIVER_TOO_OLD, {}
    dev = device_of(sight, loader_name, failed=Reason.CUDA_STARTUP_FAILED,
                    not_loaded=(Reason.CUDA_UNAVAILABLE, {"detail": "the CUDA backend did not load"}),
                    no_device=(Reason.CUDA_UNAVAILABLE, {"detail": "the CUDA backend loaded but listed no device"}))
    if isinstance(dev, str):
        device = dev.split(":", 1)[0]
        try:
            found = diagnose(sight, checks=KERNEL_CHECKS)
        except Exception as e:  # the check never takes the probe down: the device is listed
            return Reason.OK, {"cuda_device": device, "kernels": {"errors": [f"{type(e).__name__}: {e}"[:300]]}}
        evidence = {**found.evidence, "errors": list(found.errors)}
        if found.cause is None:
            return Reason.OK, {"cuda_device": device, "kernels": evidence}
        return found.cause[0], {"detail": f"the CUDA backend loaded and listed {device}, but no kernel in the bundle "
                                          "runs on it", "kernels": evidence, **found.cause[1]}
    if dev[0] is not Reason.CUDA_UNAVAILABLE:
        return dev
    try:
        found = diagnose(sight)
    except Exception as e:  # a diagnosis never takes the probe down: the old reason, with what went wrong
        return dev[0], {**dev[1], "cause": None, "diagnosis_error": f"{type(e).__name__}: {e}"[:500]}
    if found.cause is None:
        return dev[0], {**dev[1], **found.to_facts()}
    return found.cause[0], {**dev[1], **found.to_facts(), **found.cause[1]}



@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """What diagnose_cuda found: the cause's verdict (None: none found), what each check saw, what it could not."""

    cause: Verdict | None
    evidence: dict[str, Any]
    errors: tuple[str, ...]

    def to_facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"cause": None, "diagnosis": {**self.evidence, "errors": list(self.errors)}}
        if self.cause is None and self.errors:
            facts["diagnosis_error"] = "; ".join(self.errors)[:500]
        return facts


class Look:
    """One diagnosis's view of the bundle and the machine; nvidia-smi is asked each question once, when needed."""

    def __init__(self, sight: Sight) -> None:
        self.sight, self.root, self.manifest, self.scan = sight, sight.root, sight.manifest, sight.scan
        self.evidence: dict[str, Any] = {}
        self.errors: list[str] = []
        self._asked: dict[tuple[str, ...], str | None] = {}

    @property
    def toolkit(self) -> str | None:
        info = section.read(self.manifest)
        return info.toolkit if info is not None and info.toolkit else None

    def smi(self, args: tuple[str, ...], what: str) -> str | None:
        """nvidia-smi's stdout for `args` (its timeout, its own process group), or None with the reason in errors."""
        if args not in self._asked:
            out: str | None = None
            if self.scan.nvidia_smi is None:
                self.errors.append(f"{what}: nvidia-smi is not on PATH")
            else:
                answer = gpus.run(self.scan.nvidia_smi, args, env=self.sight.env, timeout=self.sight.smi_timeout,
                                  show_args=True)
                out = answer.stdout
                if answer.failure is not None:
                    self.errors.append(f"{what}: {answer.failure}")
            self._asked[args] = out
        return self._asked[args]

    def compute_caps(self) -> list[tuple[int, int]] | None:
        """Each listed GPU's compute capability (nvidia-smi --query-gpu=compute_cap), or None when not known."""
        if "compute_caps" not in self.evidence:
            text = self.smi(gpus.COMPUTE_CAP_ARGS, "compute capability")
            ccs: list[tuple[int, int]] | None = None
            if text is not None:
                ccs, wrong = gpus.read_compute_caps(text)
                if wrong is not None:
                    self.errors.append(f"compute capability: {wrong}")
            self.evidence["compute_caps"] = [f"{a}.{b}" for a, b in ccs] if ccs is not None else None
        caps = self.evidence["compute_caps"]
        return [(int(c.split(".")[0]), int(c.split(".")[1])) for c in caps] if caps is not None else None

    def driver_cuda(self) -> tuple[int, int] | None:
        """The newest CUDA the driver runs, from nvidia-smi's header (`CUDA Version: 12.8`), or None."""
        if "driver_cuda" not in self.evidence:
            text = self.smi(gpus.HEADER_ARGS, "the driver's CUDA version")
            found = gpus.read_driver_cuda(text) if text is not None else None
            if text is not None and found is None:
                self.errors.append("the driver's CUDA version: nvidia-smi's header names no 'CUDA Version'")
            self.evidence["driver_cuda"] = f"{found[0]}.{found[1]}" if found else None
        got = self.evidence["driver_cuda"]
        return (int(got.split(".")[0]), int(got.split(".")[1])) if got else None

    def toolkit_floors(self) -> tuple[str | None, str | None]:
        """(the driver floor data/cuda.json gives the bundle's toolkit on its OS, the lowest floor of a release with
        the same major.minor, whose PTX ISA is the same) — None where the toolkit is not in the data."""
        toolkit = self.toolkit
        if toolkit is None:
            return None, None
        os_name = platforms.get(self.manifest.platform).system
        toolkits = data.cuda_toolkits()
        exact = toolkits.get(toolkit, {}).get("driver_floor", {}).get(os_name)
        same = [info["driver_floor"][os_name] for v, info in toolkits.items()
                if _major_minor(v) == _major_minor(toolkit) and os_name in info.get("driver_floor", {})]
        lowest = min(same, key=lambda f: tuple(int(x) for x in re.findall(r"[0-9]+", f)), default=None)
        return exact, lowest


def _major_minor(version: str) -> tuple[int, int] | None:
    nums = re.findall(r"[0-9]+", version)
    return (int(nums[0]), int(nums[1])) if len(nums) >= 2 else None


ALL_CHECKS = ("libraries", "archs", "ptx", "driver")
KERNEL_CHECKS = ("archs", "ptx")  # a GPU that no SASS or PTX serves, PTX the driver cannot JIT: listed, yet no kernel runs


def diagnose(sight: Sight, *, checks: Sequence[str] = ALL_CHECKS) -> Diagnosis:
    """Why the bundle's CUDA backend did not load or listed no device, in order: a library of ggml-cuda's static
    import closure that neither the bundle nor this machine has (the bundle's own, then the driver's), the GPUs'
    compute capability served by neither SASS nor PTX, PTX as their only code with a driver too old to JIT it,
    the driver too old for the bundle's toolkit. A check that cannot be made says why; none raises. `checks`
    names the ones to make (KERNEL_CHECKS: those that still apply when the device was listed)."""
    look = Look(sight)
    table = {"libraries": _library_cause, "archs": _arch_cause, "ptx": _ptx_cause, "driver": _driver_cause}
    for name, check in ((n, table[n]) for n in checks):
        try:
            cause = check(look)
        except Exception as e:  # one check that fails leaves the others to run
            look.errors.append(f"{name}: {type(e).__name__}: {e}"[:300])
            continue
        if cause is not None:
            return Diagnosis(cause=cause, evidence=look.evidence, errors=tuple(look.errors))
    return Diagnosis(cause=None, evidence=look.evidence, errors=tuple(look.errors))


# The loader's words for a library it did not find, as the bundle's llamabundle-probe quotes them: dlerror's
# "libcudart.so.13: cannot open shared object file: …", Windows' "error 126: … (missing: cudart64_12.dll)"
_NOT_FOUND = (re.compile(r"^([^:\s]+): cannot open shared object file"), re.compile(r"\(missing: ([^,)]+)"))


def _loader_says(look: Look, lib_name: str) -> tuple[str, str] | None:
    """(the library the loader did not find, its message) where the bundle's probe opened ggml-cuda and the
    loader refused it for a missing library; None for a bundle without the probe or another failure."""
    loaded = look.sight.list_devices()
    said = loaded.modules.get(lib_name) if not isinstance(loaded, VerifyError) else None
    for pattern in _NOT_FOUND:
        if said and (m := pattern.search(said)):
            return m.group(1), said
    return None


def _library_cause(look: Look) -> Verdict | None:
    """Where the bundle's probe quotes the loader refusing ggml-cuda for a library it did not find, that library
    (the loader's message in the cause). Else ggml-cuda's DT_NEEDED closure against the bundle directory and this
    machine's library directories (the loader's view with the clean environment verify runs llama-server in): a
    library found nowhere, or a driver library (libcuda.so.1, never bundled) this machine lacks."""
    lib_name = platforms.get(look.manifest.platform).library_file("ggml-cuda")
    if (says := _loader_says(look, lib_name)) is not None:
        gone, message = says
        look.evidence["libraries"] = {"loader": message}
        driver = gone.startswith("libcuda.so") or gone.lower() == "nvcuda.dll"
        reason, needers = ((Reason.CUDA_DRIVER_LIBRARY_MISSING, [lib_name]) if driver else
                           (Reason.CUDA_LIBRARY_MISSING, [f"{lib_name} (the loader, through llamabundle-probe)"]))
        return _library_verdict(reason, gone, needers, searched=[str(look.root)], loader=message)
    lib = look.root / lib_name
    if not lib.is_file():
        look.evidence["libraries"] = f"{lib_name} is not in the bundle"
        return _library_verdict(Reason.CUDA_LIBRARY_MISSING, lib_name, ["llama-server (ggml's backend loader)"],
                                searched=[str(look.root)])
    if not is_elf(lib):
        look.evidence["libraries"] = f"not checked: {lib_name} is not an ELF file (the PE closure is not checked here)"
        look.errors.append(f"libraries: {lib_name} is not an ELF file")
        return None
    policy = linux_policy()
    dirs = list(look.sight.lib_dirs) if look.sight.lib_dirs is not None else \
        system_library_dirs(policy, ldconfig_output=ldconfig_cache())
    closure = resolve_closure([lib], products=[look.root], policy=policy, system_dirs=dirs)
    searched = [str(look.root), *map(str, dirs)]
    if closure.missing:
        name, by = next(iter(closure.missing.items()))
        look.evidence["libraries"] = {"missing": {k: list(v) for k, v in closure.missing.items()}}
        return _library_verdict(Reason.CUDA_LIBRARY_MISSING, name, list(by), searched=searched,
                                also=[k for k in closure.missing if k != name])
    root_info: ElfInfo = read_elf(lib)

    def present(name: str) -> bool:
        for d in dirs:
            cand = d / name
            if cand.is_file() and is_elf(cand):
                try:
                    info = read_elf(cand.resolve())
                except VerifyError:
                    continue
                if (info.machine, info.elfclass) == (root_info.machine, root_info.elfclass):
                    return True
        return False

    absent = [d for d in closure.driver if not present(d)]
    look.evidence["libraries"] = {"bundled": sorted(closure.bundled), "driver": list(closure.driver),
                                  "driver_absent": absent, "searched": searched}
    if absent:
        return _library_verdict(Reason.CUDA_DRIVER_LIBRARY_MISSING, absent[0], list(closure.needed_by.get(absent[0], ())),
                                searched=[str(d) for d in dirs], also=absent[1:])
    return None


def _library_verdict(reason: Reason, name: str, by: list[str], *, searched: list[str], also: list[str] | None = None,
                     loader: str | None = None) -> Verdict:
    """`loader`: the loader's own message, where the bundle's probe quoted it (in the cause and the facts)."""
    said = {"loader_message": loader} if loader is not None else {}
    cause = {"code": reason.value, "library": name, "needed_by": by, "searched": searched, "also_missing": also or [],
             **said}
    return reason, {"library": name, "needed_by": ", ".join(by) or "?", "cause": cause, **said}


def _archs_of(look: Look) -> tuple[list[str], list[str]] | None:
    cuda = section.read(look.manifest)
    if cuda is None or not (cuda.sass or cuda.ptx):
        look.errors.append("archs: bundle.json records no CUDA archs")
        return None
    return list(cuda.sass), list(cuda.ptx)


def _arch_facts(look: Look, ccs: list[tuple[int, int]], sass: list[str], ptx: list[str]) -> dict[str, Any]:
    shown = ", ".join(dict.fromkeys(f"{a}.{b}" for a, b in ccs))
    fixes = "; ".join(dict.fromkeys(arch_fix(cc, look.toolkit or "?") for cc in ccs))
    return {"compute_cap": shown, "bundle_sass": ", ".join(sass) or "none", "bundle_ptx": ", ".join(ptx) or "none",
            "arch_fix": fixes}


def _arch_cause(look: Look) -> Verdict | None:
    """No listed GPU has SASS or PTX in the bundle that runs on it (the rules of report.py)."""
    archs = _archs_of(look)
    ccs = look.compute_caps()
    if archs is None or not ccs:
        return None
    sass, ptx = archs
    served = {f"{a}.{b}": serving((a, b), sass=sass, ptx=ptx) for a, b in ccs}
    look.evidence["served"] = {cc: {"status": str(s), "via": via} for cc, (s, via) in served.items()}
    if any(s is not Status.UNSUPPORTED for s, _via in served.values()):
        return None
    more = _arch_facts(look, ccs, sass, ptx)
    cause = {"code": Reason.CUDA_ARCH_UNSUPPORTED.value, "compute_cap": list(served), "sass": sass, "ptx": ptx,
             "toolkit": look.toolkit}
    return Reason.CUDA_ARCH_UNSUPPORTED, {**more, "cause": cause}


def _ptx_cause(look: Look) -> Verdict | None:
    """No GPU has SASS, one runs PTX through the JIT, and the driver cannot JIT the PTX of the bundle's toolkit: it
    supports an older CUDA (nvidia-smi's header), or, without that header, it is older than every driver of
    that toolkit's major.minor in data/cuda.json."""
    archs = _archs_of(look)
    ccs = look.compute_caps()
    toolkit = look.toolkit
    if archs is None or not ccs or toolkit is None or _major_minor(toolkit) is None:
        return None
    sass, ptx = archs
    served = [(cc, *serving(cc, sass=sass, ptx=ptx)) for cc in ccs]
    if any(s is Status.SASS for _cc, s, _via in served):
        return None
    jit = [(cc, via) for cc, s, via in served if s is Status.PTX_JIT]
    if not jit:
        return None
    too_old = _driver_behind(look, toolkit, for_ptx=True)
    if too_old is None:
        return None
    evidence, basis, floor = too_old
    more = _arch_facts(look, [cc for cc, _via in jit], sass, ptx)
    via = ", ".join(dict.fromkeys(v for _cc, v in jit if v))
    cause = {"code": Reason.CUDA_PTX_TOO_NEW.value, "compute_cap": [f"{a}.{b}" for (a, b), _v in jit], "ptx": via,
             "toolkit": toolkit, "driver": look.scan.driver, "driver_cuda": look.evidence.get("driver_cuda"),
             "basis": basis, "toolkit_floor": floor}
    return Reason.CUDA_PTX_TOO_NEW, {**more, "ptx_via": via, "toolkit": toolkit, "toolkit_floor": floor or "?",
                                     "driver_evidence": evidence, "cause": cause}


def _driver_behind(look: Look, toolkit: str, *, for_ptx: bool) -> tuple[str, str, str | None] | None:
    """(words, basis, floor) when the driver is behind `toolkit`, else None. With nvidia-smi's header: its CUDA
    version below the toolkit's major.minor (PTX) or major (the runtime, by minor-version compatibility);
    without it: the driver older than data/cuda.json's floor (PTX: the lowest of the same major.minor)."""
    exact, lowest = look.toolkit_floors()
    floor = lowest if for_ptx else exact
    need = _major_minor(toolkit)
    assert need is not None
    have = look.driver_cuda()
    if have is not None:
        behind = have < need if for_ptx else have[0] < need[0]
        return (f"it supports CUDA {have[0]}.{have[1]}", "nvidia-smi: CUDA Version", floor) if behind else None
    driver = look.scan.driver
    if floor is None or driver is None or not is_driver_version(driver):
        look.errors.append(f"driver: CUDA {toolkit}'s driver floor is not in data/cuda.json" if floor is None
                           else "driver: the driver version is not known")
        return None
    if not driver_older(driver, floor):
        return None
    what = (f"the oldest driver data/cuda.json gives for CUDA {need[0]}.{need[1]}" if for_ptx else
            f"the driver of CUDA {toolkit}'s installer in data/cuda.json")
    return f"it is older than {floor}, {what}", "data/cuda.json driver floor", floor


def _driver_cause(look: Look) -> Verdict | None:
    """The driver is too old for the bundle's CUDA runtime. Below the floor bundle.json records is driver_too_old,
    decided before the bundle runs; here: when bundle.json records no floor, below the toolkit's floor in
    data/cuda.json (or nvidia-smi's older CUDA major); with a floor it meets, nvidia-smi saying it runs an older
    CUDA major than the toolkit's (a floor recorded too low)."""
    toolkit, driver = look.toolkit, look.scan.driver
    if toolkit is None or _major_minor(toolkit) is None:
        return None
    info = section.read(look.manifest)
    recorded = info.driver_floor if info is not None else None
    if recorded:  # the bundle's own floor is met: only the driver's CUDA version can still say it is behind
        have = look.driver_cuda()
        need = _major_minor(toolkit)
        if have is None or need is None or have[0] >= need[0]:
            return None
        found: tuple[str, str, str | None] | None = (f"it supports CUDA {have[0]}.{have[1]}", "nvidia-smi: CUDA Version",
                                                     look.toolkit_floors()[0])
    else:
        found = _driver_behind(look, toolkit, for_ptx=False)
    if found is None:
        return None
    evidence, basis, floor = found
    if not recorded:
        evidence += "; the bundle records no driver floor"
    cause = {"code": Reason.CUDA_DRIVER_TOO_OLD_FOR_TOOLKIT.value, "driver": driver, "toolkit": toolkit,
             "driver_cuda": look.evidence.get("driver_cuda"), "toolkit_floor": floor, "basis": basis}
    return Reason.CUDA_DRIVER_TOO_OLD_FOR_TOOLKIT, {"toolkit": toolkit, "toolkit_floor": floor or "?",
                                                   "driver_evidence": evidence, "cause": cause}
