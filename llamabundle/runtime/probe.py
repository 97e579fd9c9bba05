"""Which backend will run, and why (DESIGN §8): the NVIDIA GPU and driver (gpus.py), then each GPU backend's
verdict on the installed bundle (Backend.verdict: CUDA's checks and diagnosis, Vulkan's), combined in probe's
decision order: CUDA on NVIDIA when its checks pass, else Vulkan when it lists a GPU, else the CPU (a
preference is honoured where that backend works). One reason code per result, with the facts, the GPUs seen
(one physical GPU once) and the llama-server flags that select it (docs/probe.md).

Results are cached (runtime/results.py) for the same bundle directory in the same state (a digest of its
entries' names, sizes and mtimes); an older probe that finishes last never overwrites a newer result."""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import backends, gpus, platforms
from ..backends.probing import Sight, device_name
from ..bundle import read_manifest
from ..bundle.manifest import Manifest
from ..errors import LlamaBundleError, VerifyError
from ..log import Log
from ..platforms.load import Loaded
from ..reasons import Chosen, Reason, backend_for, explain
from ..store.base import Store
from . import results
from .install import DigestList, Installed, install_bundle, list_installed
from .results import parse_utc_timestamp, utc_timestamp

DEFAULT_TTL = 30.0
CACHE = "probe.json"
# the codes probe gives itself; every other one comes from a GPU backend's verdict (Backend.reasons)
OWN_REASONS = (Reason.BINARY_MISSING_NVIDIA_DETECTED, Reason.GPU_MISSING, Reason.CPU_PREFERRED,
               Reason.CUDA_GPU_LAYERS_ZERO, Reason.CUDA_BUNDLE_INSTALL_FAILED, Reason.BUNDLE_INVALID)


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    backend: Chosen
    reason: Reason
    sentence: str
    fix: str
    facts: dict[str, Any] = field(default_factory=dict)
    token: int = 0  # taken when the probe started; a newer one is never overwritten by an older one
    probed_at: int = 0  # when it started (Unix seconds; JSON: utc_timestamp, YYYY-MM-DDTHH:MM:SSZ)
    cached: bool = False

    @classmethod
    def make(cls, reason: Reason, facts: dict[str, Any], **kw: Any) -> ProbeResult:
        sentence, fix = explain(reason, facts)
        return cls(backend=backend_for(reason), reason=reason, sentence=sentence, fix=fix, facts=facts, **kw)

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, "backend": self.backend.value, "reason": self.reason.value, "sentence": self.sentence,
                "fix": self.fix, "facts": self.facts, "token": self.token, "probed_at": utc_timestamp(self.probed_at),
                "cached": self.cached}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeResult:
        return cls(backend=Chosen(data["backend"]), reason=Reason(data["reason"]), sentence=str(data["sentence"]),
                   fix=str(data["fix"]), facts=dict(data["facts"]), token=int(data["token"]),
                   probed_at=parse_utc_timestamp(data["probed_at"]))


def with_gpu_layers(result: ProbeResult, ngl: int | None) -> ProbeResult:
    """A planned -ngl of 0 leaves a working CUDA bundle on the CPU: cuda_gpu_layers_zero."""
    if ngl is None:
        return result
    facts = {**result.facts, "ngl": ngl}
    if ngl == 0 and result.reason is Reason.OK:
        return ProbeResult.make(Reason.CUDA_GPU_LAYERS_ZERO, facts, token=result.token, probed_at=result.probed_at,
                                cached=result.cached)
    return replace(result, facts=facts)


def with_rpc(result: ProbeResult, servers: Sequence[str], *, timeout: float | None = None) -> ProbeResult:
    """The RPC servers the app configured (HOST:PORT, in order), each checked now (never cached: a server comes and
    goes) and reported in facts.rpc_servers with its own reason code (runtime/rpc_servers.py). Those that answered
    join server_args: `--rpc` names them (first: llama-server checks `--device` as it reads it) and `--device`
    gains the devices they serve (RPC0, …), so llama-server never gets a server that would abort it. The result's own reason and backend stay the local ones."""
    if not servers:
        return result
    from . import rpc_servers

    has_rpc = False
    if isinstance(result.facts.get("bundle_dir"), str):
        try:
            has_rpc = "rpc" in read_manifest(Path(result.facts["bundle_dir"])).backends
        except LlamaBundleError:  # an unreadable bundle uses no server
            pass
    checked = rpc_servers.check_all(servers, bundle_has_rpc=has_rpc,
                                    timeout=timeout if timeout is not None else rpc_servers.DEFAULT_TIMEOUT)
    facts: dict[str, Any] = {**result.facts, "rpc_servers": [s.to_json() for s in checked]}
    usable = [s for s in checked if s.device_names]
    args = list(facts.get("server_args") or [])
    if usable and "--device" in args:
        i = args.index("--device") + 1
        local = [] if args[i] == "none" else [args[i]]
        args[i] = ",".join([*local, *(n for s in usable for n in s.device_names)])
        facts["server_args"] = ["--rpc", ",".join(s.endpoint for s in usable), *args]  # before --device, which
        # llama-server checks as it reads it
    return replace(result, facts=facts)


def _has_gpu(i: Installed) -> bool:
    return any(b.gpu for b in backends.of(tuple(i.backends)))


def candidates(root: Path, *, nvidia: bool = True) -> list[Installed]:
    """Every installed bundle for this machine's platform, in the order probe considers them: those with CUDA
    first where an NVIDIA GPU is present, then the other ones with a GPU backend, then the CPU-only ones; the
    most recently installed first within each."""
    host = platforms.host_name()
    mine = sorted((i for i in list_installed(root) if i.manifest.platform == host), key=lambda i: i.installed_at,
                  reverse=True)
    return sorted(mine, key=lambda i: 0 if nvidia and "cuda" in i.backends else 1 if _has_gpu(i) else 2)


def gpu_candidate(root: Path, *, nvidia: bool = True) -> Installed | None:
    """The first installed bundle with a GPU backend that probe considers (candidates)."""
    return next((i for i in candidates(root, nvidia=nvidia) if _has_gpu(i)), None)


def probe(*, root: Path, env: Mapping[str, str], cache_dir: Path | None = None, max_age: float = 0.0,
          bundle: Path | None = None, nvidia_smi: str | None = None, proc_version: Path | None = gpus.PROC_VERSION,
          smi_timeout: float = gpus.SMI_TIMEOUT, prefer: str | None = None,
          lib_dirs: Sequence[Path] | None = None) -> ProbeResult:
    """Probe now, or return the cached result when it is younger than max_age and about the same bundle (and
    preference). `bundle` is an unpacked bundle directory to probe instead of the installed one; `prefer`
    (cuda, vulkan, cpu) is honoured when that backend works here. `lib_dirs`: this machine's library
    directories, where a failed CUDA backend's imports are looked up (default: ldconfig's, then the usual)."""
    target: tuple[Path, Manifest] | None
    others: list[Installed] = []  # the GPU bundles considered next when the first one's GPU backend does not work
    if bundle is not None:
        target = (bundle.resolve(), read_manifest(bundle))
    else:  # NVIDIA's driver, cheaply (nvidia-smi runs after the token is taken): its CUDA bundle first
        nvidia = bool(proc_version is not None and proc_version.exists()) or bool(gpus.find(env, nvidia_smi))
        found = candidates(root, nvidia=nvidia)
        target = (found[0].path, found[0].manifest) if found else None
        others = [i for i in found[1:] if _has_gpu(i)]
    context = {"bundle_dir": str(target[0]) if target else None, "bundle_key": target[1].key if target else None,
               "bundle_stamp": _stamp(target[0]) if target else None, "prefer": prefer}
    if cache_dir is not None and max_age > 0:
        last = read_cached(cache_dir)
        if last is not None and 0 <= time.time() - last.probed_at < max_age and _answers(last.facts, context):
            return replace(last, cached=True)
    token = results.take_token(cache_dir) if cache_dir is not None else 0
    scan = gpus.scan_gpus(env=env, nvidia_smi=nvidia_smi, proc_version=proc_version, timeout=smi_timeout)
    def now(t: tuple[Path, Manifest] | None, ctx: dict[str, Any]) -> ProbeResult:
        return _probe_now(t, ctx, scan=scan, token=token, started=int(time.time()), prefer=prefer,
                          wine_prefix=cache_dir / "wine" if cache_dir is not None else None, env=env,
                          smi_timeout=smi_timeout, lib_dirs=tuple(lib_dirs) if lib_dirs is not None else None)

    result = now(target, context)
    if result.backend is Chosen.CPU and prefer != "cpu":  # the next installed GPU bundle, where one may work
        for other in others:
            got = now((other.path, other.manifest), {**context, "bundle_dir": str(other.path),
                                                      "bundle_key": other.manifest.key})
            if got.backend is not Chosen.CPU:
                result = replace(got, facts={**got.facts, "bundle_stamp": _stamp(other.path),
                                             "passed_over": {"bundle_dir": context["bundle_dir"],
                                                             "bundle_key": context["bundle_key"],
                                                             "bundle_stamp": context["bundle_stamp"],
                                                             "reason": result.reason.value}})
                break
    if cache_dir is not None:
        store_result(cache_dir, result)
    return result


def _answers(facts: Mapping[str, Any], context: Mapping[str, Any]) -> bool:
    """Whether a cached result's facts answer the probe of `context` (the first candidate, its stamp, the
    preference): where that bundle was passed over for a later one, the passed-over one is what was asked, and
    the one chosen must be unchanged too."""
    passed = facts.get("passed_over")
    if not isinstance(passed, Mapping):
        return {k: facts.get(k) for k in context} == context
    asked = {**{k: passed.get(k) for k in ("bundle_dir", "bundle_key", "bundle_stamp")}, "prefer": facts.get("prefer")}
    chosen = facts.get("bundle_dir")
    return asked == dict(context) and isinstance(chosen, str) and _stamp(Path(chosen)) == facts.get("bundle_stamp")


def _stamp(bundle_dir: Path) -> str | None:
    """A digest of the bundle directory's entries (name, size, mtime): what a file added, removed, replaced or
    rewritten in it changes. A few dozen stat calls."""
    try:
        entries = sorted((e.name, e.stat(follow_symlinks=False)) for e in os.scandir(bundle_dir))
    except OSError:
        return None
    listing = "\n".join(f"{name}\t{st.st_size}\t{st.st_mtime_ns}" for name, st in entries)
    return hashlib.sha256(listing.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def pair_devices(devices: list[str], bus_ids: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """One entry per physical GPU: the same GPU seen through CUDA and Vulkan (`CUDA0: NVIDIA H200 (…)`,
    `Vulkan0: NVIDIA H200 (…)`). Where the bundle's probe gave their PCI bus ids (`bus_ids`), devices pair by
    id, as llama.cpp itself skips the second one when it loads a model; else by name, in order."""
    seen: list[dict[str, Any]] = []
    for line in devices:
        dev, _, desc = line.partition(": ")
        name = device_name(desc)
        bus = (bus_ids or {}).get(dev)
        if bus is not None:
            same = next((g for g in seen if g.get("bus_id") == bus), None)
        else:
            family = re.sub(r"\d+$", "", dev)
            same = next((g for g in seen if "bus_id" not in g and g["name"] == name and not any(
                re.sub(r"\d+$", "", d) == family for d in g["devices"])), None)
        if same is None:
            seen.append({"name": name, "devices": [dev], **({"bus_id": bus} if bus is not None else {})})
        else:
            same["devices"].append(dev)
    return seen


def server_flags(chosen: Chosen, manifest: Manifest, device: str | None) -> tuple[list[str], dict[str, str]]:
    """The llama-server arguments and environment that make it use `chosen` (and hide the other GPU backends:
    each one's variable set and empty, e.g. GGML_VK_VISIBLE_DEVICES=, takes it no device)."""
    if chosen is Chosen.CPU:
        return ["--device", "none"], {}
    runs = backends.get(chosen.value)
    env = {b.hide_env: "" for b in backends.of(manifest.backends) if b.gpu and b is not runs and b.hide_env}
    return ["--device", device or f"{runs.loader_name}0"], env


def _probe_now(target: tuple[Path, Manifest] | None, context: dict[str, Any], *, scan: gpus.GpuScan, token: int,
               started: int, wine_prefix: Path | None, prefer: str | None = None, env: Mapping[str, str] | None = None,
               smi_timeout: float = gpus.SMI_TIMEOUT, lib_dirs: tuple[Path, ...] | None = None) -> ProbeResult:
    facts: dict[str, Any] = {**scan.to_json(), **context, "host": platforms.host_name()}
    facts["gpu"] = ", ".join(g.name for g in scan.gpus) or ("an NVIDIA GPU" if scan.present else None)

    def done(reason: Reason, **more: Any) -> ProbeResult:
        result = ProbeResult.make(reason, {**facts, **more}, token=token, probed_at=started)
        if target is not None:
            device = None if result.backend is Chosen.CPU else more.get(backends.get(result.backend.value).device_fact)
            args, hide = server_flags(result.backend, target[1], device if isinstance(device, str) else None)
            result = replace(result, facts={**result.facts, "server_args": args, "server_env": hide})
        return result

    gpu_backends = {b.name for b in backends.of(target[1].backends) if b.gpu} if target else set()
    if target is None or not gpu_backends:
        return done(Reason.BINARY_MISSING_NVIDIA_DETECTED if scan.present else Reason.GPU_MISSING,
                    **({} if scan.present else {"detail": scan.error or "no NVIDIA driver found"}))
    root, manifest = target
    facts.update(bundle=f"{manifest.name} ({manifest.key[:12]})")
    listed: dict[str, Any] = {}

    def list_devices() -> Loaded | VerifyError:
        """verify's own run of llama-server --verbose --list-devices (clean env, timeout), once."""
        if "loaded" not in listed:
            try:
                loaded = platforms.get(manifest.platform).check_load(
                    root, manifest, host=platforms.host_name(), wine_prefix=wine_prefix,
                    keep=backends.run_keep(manifest))
                listed["loaded"] = loaded
                facts.update(backends_loaded=dict(loaded.backends), devices=list(loaded.devices),
                             gpu_devices=pair_devices([d for d in loaded.devices if not d.startswith("CPU")],
                                                      loaded.device_ids),
                             load_source=loaded.source, **({"modules": dict(loaded.modules)} if loaded.modules else {}))
            except VerifyError as e:
                listed["loaded"] = e
        out: Loaded | VerifyError = listed["loaded"]
        return out

    sight = Sight(root=root, manifest=manifest, scan=scan, facts=facts, list_devices=list_devices, env=env or {},
                  smi_timeout=smi_timeout, lib_dirs=lib_dirs)
    cuda = backends.get("cuda").verdict(sight) if "cuda" in gpu_backends else None
    vulkan = backends.get("vulkan").verdict(sight) if "vulkan" in gpu_backends else None
    if prefer == "cpu":
        working = next((v for v in (cuda, vulkan) if v is not None and v[0] in (Reason.OK, Reason.VULKAN_OK)), None)
        return done(Reason.CPU_PREFERRED, device=(working[1].get("device") or working[1].get("cuda_device")) if working
                    else "none works here", **(working[1] if working else {}))
    if vulkan is not None and vulkan[0] is Reason.VULKAN_OK and (prefer == "vulkan" or cuda is None or cuda[0] is not Reason.OK):
        not_cuda = ("Vulkan was asked for" if prefer == "vulkan" and cuda is not None and cuda[0] is Reason.OK else
                    "the bundle has no CUDA backend" if cuda is None else
                    f"CUDA is not used: {explain(cuda[0], {**facts, **cuda[1]})[0]}")
        return done(Reason.VULKAN_OK, not_cuda=not_cuda, cuda_reason=cuda[0].value if cuda else None, **vulkan[1],
                    **({"cuda_cause": cuda[1]["cause"]} if cuda and cuda[1].get("cause") else {}))
    if cuda is not None and (cuda[0] is not Reason.GPU_MISSING or vulkan is None):
        return done(cuda[0], vulkan_reason=vulkan[0].value if vulkan else None, **cuda[1],
                    **({"vulkan_detail": vulkan[1].get("detail")} if vulkan else {}))
    assert vulkan is not None
    return done(vulkan[0], cuda_reason=cuda[0].value if cuda else None, **vulkan[1])


def read_cached(cache_dir: Path) -> ProbeResult | None:
    return results.read(cache_dir / CACHE, ProbeResult.from_json)


def store_result(cache_dir: Path, result: ProbeResult) -> bool:
    """Write the result unless a probe that started later has already written one. True if written."""
    return results.store(cache_dir / CACHE, result.to_json(), token=result.token)


def ensure_backend(*, store: Store | None, key: str | None, root: Path, env: Mapping[str, str], log: Log,
                   cache_dir: Path | None = None, commit: str | None = None, toolkit: str | None = None,
                   expect_sha256: str | None = None, digests: DigestList | None = None,
                   backends_wanted: str | None = None, **probe_kw: Any) -> ProbeResult:
    """Probe; on binary_missing_nvidia_detected (the only reason that installs) install `key` from `store`
    (its zip pinned by `expect_sha256` or `digests`, its backends chosen by `backends_wanted`, as install_bundle
    does both) and probe again. Any other
    reason, or a failed install (a zip the pin refuses: bundle_invalid), is CPU with that reason."""
    first = probe(root=root, env=env, cache_dir=cache_dir, **probe_kw)
    if first.reason is not Reason.BINARY_MISSING_NVIDIA_DETECTED or store is None or key is None:
        return first
    try:
        install_bundle(store, key, root=root, log=log, commit=commit, toolkit=toolkit, expect_sha256=expect_sha256,
                       digests=digests, backends_wanted=backends_wanted)
    except LlamaBundleError as e:
        reason = Reason.BUNDLE_INVALID if getattr(e, "reason", None) is Reason.BUNDLE_INVALID else Reason.CUDA_BUNDLE_INSTALL_FAILED
        facts = {**first.facts, "detail": e.what, "install_error": e.render()}
        result = ProbeResult.make(reason, facts, token=first.token, probed_at=first.probed_at)
        if cache_dir is not None:
            store_result(cache_dir, result)
        return result
    return probe(root=root, env=env, cache_dir=cache_dir, **{**probe_kw, "max_age": 0.0})
