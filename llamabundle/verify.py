"""Verification levels (DESIGN §7): manifest (the one trust check), static (imports resolve: asked of the
bundle's platform; GPU architectures: asked of its backends), load (llama-server loads its backends from
inside the bundle: the platform runs it), gpu (a GPU backend lists its device, and one the bundle's code runs on)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from . import backends, cache, opscheck, platforms, scratch
from . import bundle as bundle_mod
from .bundle.manifest import ANYTHING, Expect, Manifest
from .errors import DiskError, LlamaBundleError, UsageError, VerifyError, disk_fix
from .platforms.load import Loaded, clean_env, run_list_devices


class Level(StrEnum):
    STATIC = "static"  # manifest, imports, RUNPATH, GPU architectures
    LOAD = "load"  # + llama-server --list-devices loads the CPU backend from inside a copy
    GPU = "gpu"  # + a GPU backend came from inside the copy and listed its device
    OPS = "ops"  # + llama.cpp's test-backend-ops, run from inside the copy, agrees with the CPU backend on each GPU device


@dataclass(kw_only=True)
class VerifyReport:
    """What verify found, level by level (`verify --json`)."""

    path: str
    key: str
    platform: str
    files: int
    bytes: int
    levels: dict[str, str] = field(default_factory=dict)  # level -> passed | skipped: reason
    backends_loaded: dict[str, str] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    compute_caps: dict[str, str] = field(default_factory=dict)  # CUDA0 -> 9.0: what ggml-cuda reported
    ops: list[dict[str, Any]] = field(default_factory=list)  # the ops level: per device, counts and failing cases
    load_env: dict[str, str] = field(default_factory=dict)  # the environment the load check ran the bundle in
    load_source: str | None = None  # what answered the load check: llamabundle-probe, or llama-server's log lines
    modules: dict[str, str] = field(default_factory=dict)  # (probe) backend module -> outcome or the loader's message
    device_ids: dict[str, str] = field(default_factory=dict)  # (probe) device -> PCI bus id

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, **asdict(self)}

    def merge(self, other: VerifyReport) -> None:
        """What another check of the same bundle found (its levels after this one's)."""
        self.levels.update(other.levels)
        self.backends_loaded.update(other.backends_loaded)
        self.devices.extend(other.devices)
        self.compute_caps.update(other.compute_caps)
        self.ops.extend(other.ops)
        self.load_env.update(other.load_env)
        self.load_source = other.load_source if other.load_source is not None else self.load_source
        self.modules.update(other.modules)
        self.device_ids.update(other.device_ids)

    def lines(self) -> list[str]:
        """The human summary: one line per level, loaded backend and device."""
        out = [f"{level}: {result}" for level, result in self.levels.items()]
        out += [f"{name} backend loaded from {where}" for name, where in self.backends_loaded.items()]
        out += [f"device {dev}" for dev in self.devices]
        out += [f"{name}: {why}" for name, why in self.modules.items() if why not in ("loaded", "not_chosen")]
        for o in self.ops:
            serving = f" (serving {o['serves']})" if o.get("serves") else ""
            out.append(f"ops {o['device']}{serving}: {o['passed']} passed, {o['failed']} failed, {o['not_supported']} "
                       f"not supported ({', '.join(o['ops_run'])}; {o['seconds']:.0f}s)")
        return out


@dataclass(frozen=True, kw_only=True)
class Naming:
    """How messages name the files of a bundle that is checked in a temporary directory: by the zip or
    directory the user gave (`bundle.zip:libggml-cpu.so`, `DIR/libggml-cpu.so`), never by the temporary path."""

    temps: tuple[str, ...]  # regular expressions of the temporary directories that hold the bundle's files
    origin: str  # the user's zip or directory
    is_zip: bool

    @classmethod
    def of(cls, temps: list[Path], origin: Path | str, *, is_zip: bool, partial: bool = True) -> Naming:
        """`temps`, and (partial) the `.NAME.partial-N` directory an unpack into one of them fills first."""
        pats: list[str] = []
        for t in temps:
            for variant in dict.fromkeys((str(t), str(t.resolve()))):
                pats.append(re.escape(variant))
                if partial:
                    pats.append(re.escape(str(Path(variant).parent / f".{t.name}.partial-")) + r"[0-9a-f-]+")
        return cls(temps=tuple(sorted(pats, key=len, reverse=True)), origin=str(origin), is_zip=is_zip)

    def name(self, rel: str) -> str:
        if not rel:
            return self.origin
        return f"{self.origin}:{rel}" if self.is_zip else os.path.join(self.origin, rel)

    def text(self, text: str) -> str:
        for pat in self.temps:
            text = re.sub(pat + r"(?![^/\s'\":,;()\[\]])(?:/([^\s'\":,;()\[\]]*))?",
                          lambda m: self.name(m.group(1) or ""), text)
        return text

    def error(self, e: LlamaBundleError) -> LlamaBundleError:
        """The error with its messages naming the user's paths (the same object, rewritten)."""
        e.what, e.why, e.fix, e.details = self.text(e.what), self.text(e.why), self.text(e.fix), self.text(e.details)
        e.args = (e.what, *e.args[1:])
        return e

    def report(self, r: VerifyReport) -> VerifyReport:
        r.backends_loaded = {k: self.text(v) for k, v in r.backends_loaded.items()}
        r.load_env = {k: self.text(v) for k, v in r.load_env.items()}
        return r


def sweep_scratch(cache_dir: Path) -> None:
    """Remove the verify copies of dead runs (and those older versions left in the system temp directory)."""
    scratch.sweep(cache.tmp_dir(cache_dir), [cache.VERIFY_PREFIX])
    scratch.sweep(Path(tempfile.gettempdir()), ["llamabundle-verify-"])


def verify_bundle(path: Path, *, level: Level, cache_dir: Path, require_gpu: bool = False,
                  wine_prefix: Path | None = None, expect: Expect = ANYTHING,
                  verified: list[Manifest] | None = None, ops_tool: Path | None = None,
                  ops_budget: float | None = None) -> VerifyReport:
    """Verify a bundle zip or directory up to `level`, trusting it (manifest.trust) against `expect`. Raises
    VerifyError naming what failed (UsageError: a path that is missing or cannot be read). Messages name
    `path`, never the temporary copy, which lies in `<cache_dir>/tmp` (a Windows bundle loads under Wine in
    `wine_prefix`, by default `<cache_dir>/wine`). `verified`, when given, receives the trusted manifest."""
    _check_readable(path)
    base = cache.tmp_dir(cache_dir)
    sweep_scratch(cache_dir)
    wine_prefix = wine_prefix or cache.wine_prefix(cache_dir)
    try:
        tmp = scratch.make_dir(base, cache.VERIFY_PREFIX)
    except OSError as cache_error:  # verify needs no cache: a read-only or full one sends it to the system's temp
        system = Path(tempfile.gettempdir())
        try:
            tmp = scratch.make_dir(system, "llamabundle-verify-")
        except OSError as e:
            raise DiskError(f"cannot make a scratch directory in {base} (the cache) or {system}",
                            why=f"{cache_error.strerror or cache_error}; {e.strerror or e}", fix=disk_fix(e)) from None
    try:
        naming = Naming.of([tmp / "bundle"], path, is_zip=path.is_file())
        try:
            if path.is_file():
                root = tmp / "bundle"
                manifest, check = bundle_mod.unpack(path, root, expect, name=naming.name)  # `bundle.zip:LICENSE`
            else:
                manifest, check = bundle_mod.check_unpacked(path, hashes=None, expect=expect, name=naming.name)
                root = tmp / "bundle"
                if level is not Level.STATIC:  # run a copy, never the original
                    shutil.copytree(path, root, symlinks=False)
                else:
                    root = path
            report = verify_unpacked(root, manifest, check, level=level, require_gpu=require_gpu, label=str(path),
                                     wine_prefix=wine_prefix, ops_tool=ops_tool or opscheck.sibling_tool(path),
                                     ops_budget=ops_budget)
        except LlamaBundleError as e:
            naming.error(e)
            raise
        except OSError as e:  # the scratch disk, not the bundle
            raise UsageError(f"cannot copy {path} into {base} to check it", why=e.strerror or str(e),
                             fix="free space there, or point LLAMABUNDLE_CACHE_DIR at a writable disk") from None
        if verified is not None:
            verified.append(manifest)
        return naming.report(report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_readable(path: Path) -> None:
    """A usage error (exit 2) unless `path` is a file or directory that can be read."""
    fix = "pass a bundle zip or an unpacked bundle directory"
    if not path.exists():
        raise UsageError(f"{path} does not exist", fix=fix)
    try:
        if path.is_file():
            with open(path, "rb") as f:
                f.read(1)
        elif path.is_dir():
            os.listdir(path)
        else:
            raise UsageError(f"{path} is neither a file nor a directory", fix=fix)
    except OSError as e:
        raise UsageError(f"cannot read {path}", why=e.strerror or str(e), fix="check the path and its permissions") from None


def verify_unpacked(root: Path, manifest: Manifest, check: bundle_mod.ContentCheck, *, level: Level,
                    require_gpu: bool = False, label: str, wine_prefix: Path | None = None,
                    ops_tool: Path | None = None, ops_budget: float | None = None) -> VerifyReport:
    """The levels above the manifest, on a bundle directory whose contents were just checked (`check`),
    asked of the bundle's platform and backends. The load level runs the binaries in `root`: pass a copy,
    or a directory of one's own."""
    platform = platforms.get(manifest.platform)
    report = VerifyReport(path=label, key=manifest.key, platform=manifest.platform,
                          files=check.files, bytes=check.bytes)
    backends.read_sections(manifest)  # each backend's section, typed (a wrong field names itself)
    report.levels["manifest"] = "passed"
    with ThreadPoolExecutor(1) as pool:  # leaving the block waits for the load check, whatever happened
        # the load level runs the bundle's programs (waiting for its GPU's driver) while the static checks read its
        # files (every file's sha256 was checked already); each result in the report in the levels' order, and the
        # static check's failure is the one raised
        loaded = VerifyReport(path=label, key=manifest.key, platform=manifest.platform, files=0, bytes=0)
        loading = (pool.submit(check_load, root, manifest, loaded, wine_prefix=wine_prefix)
                   if level is not Level.STATIC else None)
        check_static(root, manifest)
        report.levels["static"] = "passed"
        for backend in backends.of(manifest.backends):
            report.levels.update(backend.check(root, manifest, platform=platform))
        if loading is not None:
            loading.result()
            report.merge(loaded)
    if level in (Level.GPU, Level.OPS):
        check_gpu(manifest, report, require_gpu=require_gpu)
    if level is Level.OPS:
        check_ops(root, manifest, report, tool=ops_tool, budget=ops_budget or opscheck.DEFAULT_BUDGET)
    return report


def check_ops(root: Path, manifest: Manifest, report: VerifyReport, *, tool: Path | None, budget: float) -> None:
    """test-backend-ops from inside `root` against every GPU device the bundle lists (with the caller's
    GGML_VK_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES: GGML_VK_VISIBLE_DEVICES=0 makes lavapipe a device here) and
    every device a backend adds (RPC: its own server's), each compared with the bundle's CPU backend. Fails naming
    the failing cases."""
    if report.levels.get("load", "").startswith("skipped"):
        report.levels["ops"] = "skipped: " + report.levels["load"].removeprefix("skipped: ")
        return
    platform = platforms.get(manifest.platform)
    keep = backends.run_keep(manifest, *opscheck.DEVICE_ENV)
    listed = run_list_devices(root, exe_name=platform.program_file("llama-server"), keep=keep)
    devices = [d.split(":", 1)[0] for d in listed.devices if not d.startswith("CPU")]
    adds = [b for b in backends.of(manifest.backends) if b.adds_ops_devices]
    if tool is None and (devices or adds):
        raise UsageError("the ops level needs test-backend-ops", fix="pass --ops-tool PATH")
    env = clean_env(root, keep)
    runs: dict[str, backends.base.RunEnv] = {}
    served: dict[str, str | None] = {}  # an added device (RPC0) -> the device of this machine behind it
    skipped: list[str] = []
    if tool is not None:
        runner = platform.runner(platforms.host_name())
        for b in adds:
            extra = b.ops_devices(root, manifest, platform=platform, runner=runner, env=env, tool=tool, gpus=devices)
            runs.update(extra.devices)
            served.update(dict.fromkeys(extra.devices, extra.serves))
            if extra.skipped:
                skipped.append(f"{b.loader_name}: {extra.skipped}")
                report.levels[f"ops {b.name}"] = f"skipped: {extra.skipped}"
    devices += [d for d in runs if d not in devices]
    if not devices:
        report.levels["ops"] = "skipped: the bundle lists no GPU device here (GGML_VK_VISIBLE_DEVICES=0 makes a " \
                               "CPU Vulkan implementation one)" + "".join(f"; {s}" for s in skipped)
        return
    assert tool is not None
    results = opscheck.run_ops(root, tool, devices, env=env, budget=budget, device_runs=runs)
    for r in results:
        r.serves = served.get(r.device)
    report.ops = [r.to_json() for r in results]
    failed = [f"{r.device} {case}" for r in results for case in r.failures]
    summary = "; ".join(r.summary() for r in results)
    if failed:
        raise VerifyError(f"test-backend-ops: {len(failed)} case(s) disagree with the CPU backend", why=summary,
                          details="\n".join(failed[:50]), fix="look at the failing cases; a tolerance failure of one "
                          "case may be llama.cpp's own (compare with its CI), a wrong answer is the bundle's")
    if not any(r.passed for r in results):
        raise VerifyError("test-backend-ops ran no case on any device", why=summary,
                          fix="raise --ops-budget, or check that the devices are usable")
    report.levels["ops"] = f"passed ({summary})"


def check_static(root: Path, manifest: Manifest) -> list[str]:
    """The platform's static check: every import of every binary resolves inside the bundle, in the system
    set or the driver set. Returns the system imports."""
    return platforms.get(manifest.platform).check_static(root, manifest)


def check_load(root: Path, manifest: Manifest, report: VerifyReport, *, wine_prefix: Path | None = None) -> None:
    """llama-server --verbose --list-devices from `root` on this host (under Wine for a Windows bundle on
    Linux): the CPU backend, and every backend that loads, must come from inside `root`. Then what a backend runs
    of the bundle itself (RPC's server and llama-server using it): for a bundle this machine runs natively, at the
    same time as the platform's check (each starts its GPU's driver: they wait for it together), its result
    reported only when the platform's check passed, whose failure is still the one raised."""
    platform, host = platforms.get(manifest.platform), platforms.host_name()
    keep = backends.run_keep(manifest)
    runner = platform.runner(host)
    with ThreadPoolExecutor() as pool:  # leaving the block waits for what runs beside, whatever happened

        def start(env: Mapping[str, str]) -> list[Future[dict[str, str]]]:
            return [pool.submit(b.check_loaded, root, manifest, platform=platform, runner=runner, env=env)
                    for b in backends.of(manifest.backends)]

        # native: beside the platform's check, in the clean environment it runs in (load.run_list_devices)
        beside = start(clean_env(root, keep)) if runner == [] else []
        loaded = platform.check_load(root, manifest, host=host, wine_prefix=wine_prefix, keep=keep)
        _report_loaded(loaded, report)
        if loaded.level.startswith("skipped"):
            return
        for f in beside or start(dict(loaded.env) or clean_env(root, keep)):
            report.levels.update(f.result())


def _report_loaded(loaded: Loaded, report: VerifyReport) -> None:
    report.backends_loaded.update(loaded.backends)
    report.devices.extend(loaded.devices)
    report.compute_caps.update(loaded.compute_caps)
    report.load_env = dict(loaded.env)
    report.load_source = loaded.source if not loaded.level.startswith("skipped") else None
    report.modules.update(loaded.modules)
    report.device_ids.update(loaded.device_ids)
    report.levels["load"] = loaded.level


def check_gpu(manifest: Manifest, report: VerifyReport, *, require_gpu: bool) -> None:
    """Every GPU backend of the bundle, on its own: loaded from inside it and listing its device (passed), or
    skipped with a reason where this machine has no such device (a CPU implementation of Vulkan, lavapipe,
    is not listed by ggml-vulkan and so does not count). The gpu level passes when one of them passed and
    none failed; each backend's result is the level `gpu <name>`."""
    gpus = [b for b in backends.of(manifest.backends) if b.gpu]
    results: dict[str, str] = {}
    if not gpus:
        report.levels["gpu"] = "skipped: the bundle has no GPU backend"
    elif report.levels.get("load", "").startswith("skipped"):
        report.levels["gpu"] = "skipped: " + report.levels["load"].removeprefix("skipped: ")
    else:
        for b in gpus:
            results[b.loader_name] = _gpu_of(b, manifest, report)
        if len(gpus) > 1:
            report.levels.update({f"gpu {name}": result for name, result in results.items()})
        passed = [name for name, result in results.items() if result == "passed"]
        report.levels["gpu"] = (f"passed ({', '.join(passed)})" if len(gpus) > 1 else "passed") if passed else \
            "skipped: " + "; ".join(r.removeprefix("skipped: ") for r in results.values())
    if require_gpu and not report.levels["gpu"].startswith("passed"):
        raise VerifyError(f"GPU check {report.levels['gpu']}", why="--require-gpu was given",
                          fix=f"run the check on a machine with {' or '.join(b.device_hint for b in gpus) or 'a GPU'}")


def _gpu_of(b: backends.Backend, manifest: Manifest, report: VerifyReport) -> str:
    """One GPU backend's gpu check: passed, skipped: reason, or VerifyError. A listed device that no kernel of
    the bundle runs on (a GPU of another generation than the bundle's archs) is skipped with that reason."""
    if b.loader_name in report.backends_loaded:
        if any(d.startswith(b.loader_name) for d in report.devices):
            why = b.unserved(manifest, report.devices, report.compute_caps)
            return f"skipped: {why}" if why else "passed"
        if b.device_present():
            raise VerifyError(f"the {b.loader_name} backend loaded but listed no {b.loader_name} device",
                              why=f"this machine has a {b.driver_name}", details="\n".join(report.devices))
        return f"skipped: the {b.loader_name} backend loaded but found no device; it needs {b.device_hint}"
    if b.device_present():
        raise VerifyError(f"a {b.driver_name} is present but the bundle's {b.loader_name} backend did "
                          "not load", why=f"ggml-{b.name} or a {b.loader_name} library it needs failed "
                                      "to load from the bundle",
                          fix="run the bundle's llama-server --verbose --list-devices to see why")
    return f"skipped: no {b.driver_name} on this machine"
