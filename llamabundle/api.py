"""The declared Python API for apps that embed Python (docs/python-api.md): probe, install, installed,
uninstall and plan_offload, thin wrappers over `llamabundle.runtime` that return frozen values.

Only the names in `__all__` are the API; everything else in the package may change. Failures raise
`LlamaBundleError` (what, why, fix, exit_code), as the CLI prints them; nothing here prints to stdout or
exits the process. Like the CLI, a call reads the environment once (`env`, default `os.environ`) into the
run's settings: the install root (`$LLAMABUNDLE_DATA_DIR`), the cache (`$LLAMABUNDLE_CACHE_DIR`), the
default store (`$LLAMABUNDLE_STORE`) and the GitHub token."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from .errors import LlamaBundleError, UsageError
from .log import Log
from .settings import Settings

if TYPE_CHECKING:
    from .runtime.install import Installed

__all__ = [
    "InstallResult",
    "InstalledBundle",
    "LlamaBundleError",
    "OffloadPlan",
    "ProbeReport",
    "install",
    "installed",
    "plan_offload",
    "probe",
    "uninstall",
]

Prefer = Literal["cuda", "vulkan", "cpu"]


def _settings(env: Mapping[str, str] | None) -> tuple[dict[str, str], Settings]:
    environ = dict(os.environ if env is None else env)
    return environ, Settings.from_env(environ)


def _root(settings: Settings, root: str | os.PathLike[str] | None) -> Path:
    from .runtime.install import data_root

    return data_root(settings, Path(root) if root is not None else None)


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


# ------------------------------------------------------------------------------------------ probe


@dataclass(frozen=True, kw_only=True)
class ProbeReport:
    """Which backend llama-server will use here, and why (docs/probe.md)."""

    backend: str  # cuda | vulkan | cpu
    reason: str  # a reason code of data/reasons.json
    sentence: str
    fix: str
    server_args: tuple[str, ...]  # e.g. ("--device", "CUDA0"); () when no bundle was probed
    server_env: Mapping[str, str]  # e.g. {"GGML_VK_VISIBLE_DEVICES": ""}
    facts: Mapping[str, Any]  # everything probe found, read-only (docs/probe.md, "Facts")
    probed_at: str  # YYYY-MM-DDTHH:MM:SSZ
    cached: bool

    def to_json(self) -> dict[str, Any]:
        """The object `llamabundle probe --json` prints (without `schema` and `ok`)."""
        return {"backend": self.backend, "reason": self.reason, "sentence": self.sentence, "fix": self.fix,
                "server_args": list(self.server_args), "server_env": dict(self.server_env),
                "probed_at": self.probed_at, "cached": self.cached}


def probe(*, root: str | os.PathLike[str] | None = None, bundle: str | os.PathLike[str] | None = None,
          ngl: int | None = None, prefer: Prefer | None = None, max_age: float = 0.0,
          nvidia_smi: str | None = None, env: Mapping[str, str] | None = None,
          rpc: Sequence[str] = ()) -> ProbeReport:
    """Probe as `llamabundle probe` does: the installed bundle under `root` (default: $LLAMABUNDLE_DATA_DIR, else
    the user data directory), or the unpacked bundle directory `bundle`. `ngl`: the planned -ngl (0 turns ok into
    cuda_gpu_layers_zero); `prefer`: a backend to use where it works; `max_age`: reuse a cached result younger
    than this many seconds (0: probe now); `rpc`: the RPC servers (HOST:PORT) the app will give llama-server, each
    checked now and reported in facts["rpc_servers"] with its own code, the usable ones added to server_args (as
    `probe --rpc`). The result is cached where the CLI caches it (the RPC servers' part is never cached), so that
    `llamabundle doctor` shows it."""
    from .gpus import PROC_VERSION
    from .runtime import probe as probe_mod
    from .runtime.results import utc_timestamp

    if prefer is not None and prefer not in ("cuda", "vulkan", "cpu"):
        raise UsageError(f"prefer={prefer!r} is not a backend", fix="pass 'cuda', 'vulkan', 'cpu' or None")
    if ngl is not None and ngl < 0:
        raise UsageError(f"ngl={ngl} is negative", fix="pass the planned -ngl (0 or more) or None")
    environ, settings = _settings(env)
    result = probe_mod.probe(root=_root(settings, root), env=environ, cache_dir=Path(settings.cache_dir) / "runtime",
                             max_age=max_age, bundle=Path(bundle) if bundle is not None else None,
                             nvidia_smi=nvidia_smi, proc_version=PROC_VERSION, prefer=prefer)
    result = probe_mod.with_rpc(probe_mod.with_gpu_layers(result, ngl), [str(e) for e in rpc])
    facts = result.facts
    return ProbeReport(backend=result.backend.value, reason=result.reason.value, sentence=result.sentence,
                       fix=result.fix, server_args=tuple(str(a) for a in facts.get("server_args") or ()),
                       server_env=MappingProxyType({str(k): str(v) for k, v in (facts.get("server_env") or {}).items()}),
                       facts=_frozen(facts), probed_at=utc_timestamp(result.probed_at), cached=result.cached)


# ---------------------------------------------------------------------------------------- install


@dataclass(frozen=True, kw_only=True)
class InstalledBundle:
    """One install under the install root (docs/install-rules.md)."""

    name: str
    key: str
    path: Path  # the unpacked bundle: llama-server, bundle.json, …
    installed_at: str  # YYYY-MM-DDTHH:MM:SSZ
    platform: str
    commit: str
    backends: tuple[str, ...]
    toolkit: str | None  # CUDA toolkit, None without CUDA
    driver_floor: str | None

    @property
    def server(self) -> Path:
        """The llama-server program of the install."""
        from . import platforms

        return self.path / platforms.get(self.platform).program_file("llama-server")


@dataclass(frozen=True, kw_only=True)
class InstallResult:
    bundle: InstalledBundle
    reused: bool  # the same key was installed and intact: nothing was downloaded
    replaced: str | None  # the key of the install of that name it replaced
    pinned_by: str | None = None  # what pinned the zip's sha256: '--expect-sha256', or 'FILE:LINE' of the digest list
    transfer: str = "none"  # how the files came: "zip", "blobs" (only those the machine lacked), "none" (reused)
    downloaded_bytes: int = 0  # what was downloaded (the zip, or the missing blobs)


def _installed(i: Installed) -> InstalledBundle:
    cuda = i.cuda_info
    return InstalledBundle(name=i.name, key=i.key, path=i.path, installed_at=i.installed_at, platform=i.manifest.platform,
                           commit=i.manifest.llama_cpp.commit, backends=tuple(i.manifest.backends),
                           toolkit=cuda.toolkit if cuda else None, driver_floor=cuda.driver_floor if cuda else None)


def install(*, store: str | os.PathLike[str] | None = None, key: str | None = None,
            recipe: str | os.PathLike[str] | None = None, root: str | os.PathLike[str] | None = None,
            expect_commit: str | None = None, expect_toolkit: str | None = None, expect_sha256: str | None = None,
            digests: str | os.PathLike[str] | None = None, backends: str | None = None, quiet: bool = True,
            env: Mapping[str, str] | None = None) -> InstallResult:
    """Install a bundle as `llamabundle install` does: from `store` (a directory, file://DIR, github:OWNER/REPO or oci://HOST[:PORT]/REPO;
    default $LLAMABUNDLE_STORE, else <cache>/store), by `key` or by `recipe` (a path or a shipped recipe's name:
    its key, and unless given its commit and CUDA toolkit as the expected ones), into `root`. Everything is
    checked before the install replaces the previous one of that name (docs/install-rules.md); a refused bundle
    raises a LlamaBundleError with exit_code 5. `expect_sha256` pins the zip's sha256, or `digests` (at most one of
    them), a digest list the app ships (SHA256SUMS lines: the zip's name or the key, and its sha256); a zip the
    pin refuses raises with exit_code 5. `backends`: "auto" or a comma-separated list installs only the CPU part
    and those backends (install --backends). `quiet`: no progress lines on stderr."""
    from . import keys
    from .runtime.install import install_bundle, load_digests
    from .store import open_store

    if (key is None) == (recipe is None):
        raise UsageError("pass exactly one of key and recipe", fix="install(store=..., key=KEY) or install(store=..., recipe=RECIPE)")
    environ, settings = _settings(env)
    if recipe is not None:
        keyed = keys.resolve(keys.load(recipe if isinstance(recipe, str) else Path(recipe)), env=environ)
        r, key = keyed.recipe, keyed.key
        expect_commit = expect_commit or r.llama_cpp.commit
        expect_toolkit = expect_toolkit or (r.cuda.toolkit if r.cuda else None)
    assert key is not None
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise UsageError(f"'{key}' is not a key", fix="a key is 64 hex digits (llamabundle key RECIPE)")
    url = os.fspath(store) if store is not None else (settings.store or str(Path(settings.cache_dir) / "store"))
    opened = open_store(url, settings=settings, log=Log(quiet=quiet))
    if expect_sha256 is not None and digests is not None:
        raise UsageError("pass at most one of expect_sha256 and digests", fix="pin the zip by one of them")
    listed = load_digests(Path(digests)) if digests is not None else None
    out = install_bundle(opened, key, root=_root(settings, root), log=Log(quiet=quiet), commit=expect_commit,
                         toolkit=expect_toolkit, expect_sha256=expect_sha256, digests=listed, backends_wanted=backends)
    return InstallResult(bundle=_installed(out.installed), reused=out.reused, replaced=out.replaced,
                         pinned_by=out.pinned.where if out.pinned is not None else None,
                         transfer=out.transfer.by, downloaded_bytes=out.transfer.downloaded)


def installed(*, root: str | os.PathLike[str] | None = None,
              env: Mapping[str, str] | None = None) -> tuple[InstalledBundle, ...]:
    """The installs under `root`, as `llamabundle list` shows them (sorted by name)."""
    from .runtime.install import list_installed

    _environ, settings = _settings(env)
    return tuple(_installed(i) for i in list_installed(_root(settings, root)))


def uninstall(what: str, *, root: str | os.PathLike[str] | None = None,
              env: Mapping[str, str] | None = None) -> InstalledBundle:
    """Remove the install whose key, name or unique key prefix (6+ digits) is `what`; returns what was removed."""
    from .runtime.install import uninstall as uninstall_bundle

    _environ, settings = _settings(env)
    return _installed(uninstall_bundle(_root(settings, root), what))


# ---------------------------------------------------------------------------------------- offload


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """The most-offloaded llama-server choice that fits the free VRAM (docs/python-api.md)."""

    ngl: int
    n_cpu_moe: int
    ctx: int  # the -c to pass: total over all slots
    ctx_requested: int
    n_parallel: int
    kv_type: str
    flash_attn: bool
    blocks_on_gpu: int
    output_on_gpu: bool
    moe: bool
    gpu_bytes: Mapping[str, int]  # weights, kv, compute, headroom, total
    flags: tuple[str, ...]  # the llama-server arguments: -ngl … -c … -np … [--n-cpu-moe …] -fa on|off
    reasons: tuple[str, ...]  # why this choice, in words
    estimate_by: str = "closed form"  # or "llama.cpp dry run": the bundle's llamabundle-memory sized the rungs
    warnings: tuple[str, ...] = ()


def plan_offload(model: str | os.PathLike[str], *, free_vram: int | str, ctx: int | None = None,
                 min_ctx: int | None = None, n_parallel: int = 1, kv_type: str | None = None, flash_attn: bool = True,
                 headroom: str | None = None, bundle: str | os.PathLike[str] | None = None) -> OffloadPlan:
    """The -ngl (and --n-cpu-moe) that fits `free_vram` (bytes, or a size such as '24GiB') for the GGUF `model`,
    as `llamabundle plan` computes it; `headroom` such as '5%+256MiB' (default: data/offload.json). `bundle`: an
    unpacked bundle directory whose llamabundle-memory sizes each rung (llama.cpp's own dry run; None, or a
    bundle that cannot run here: the closed-form estimate, with a warning for the latter). Raises a
    LlamaBundleError (exit_code 2) when even -ngl 0 does not fit or the model is not a GGUF."""
    from .runtime import dryrun, offload
    from .runtime.gguf_model import read_model

    vram = offload.parse_size(free_vram) if isinstance(free_vram, str) else int(free_vram)
    dry = dryrun.open_dry_run(Path(bundle)) if bundle is not None else None
    p = offload.plan_offload(read_model(Path(model)), free_vram=vram, ctx=ctx, min_ctx=min_ctx,
                             n_parallel=n_parallel, kv_type=kv_type, flash_attn=flash_attn,
                             headroom=offload.parse_headroom(headroom) if headroom is not None else None,
                             dry_run=dry if isinstance(dry, dryrun.DryRun) else None)
    return OffloadPlan(ngl=p.ngl, n_cpu_moe=p.n_cpu_moe, ctx=p.ctx, ctx_requested=p.ctx_requested,
                       n_parallel=p.n_parallel, kv_type=p.kv_type, flash_attn=p.flash_attn, blocks_on_gpu=p.blocks_on_gpu,
                       output_on_gpu=p.output_on_gpu, moe=p.model.is_moe,
                       gpu_bytes=MappingProxyType(dict(p.estimate.to_json())), flags=tuple(p.flags()),
                       reasons=tuple(p.reasons), estimate_by=p.estimate_by,
                       warnings=(*p.warnings, *((dry,) if isinstance(dry, str) else ())))
