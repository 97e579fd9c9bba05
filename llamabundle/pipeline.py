"""The pipeline of DESIGN §2, one function per user job. Each step is a module; this only wires them."""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from . import bundle as bundle_mod
from . import data, proc, scratch
from . import source as source_mod
from .archive import _tmp_beside, extract_zip
from .backends.cuda.fatbin import binary_archs
from .backends.cuda.toolkit.layout import Toolkit
from .backends.cuda.toolkit.resolve import check_toolkit, resolve_toolkit
from .build import (
    BuildPlan,
    BuildTools,
    library_file,
    plan_build,
    resolve_tools,
    run_build,
)
from .bundle import manifest as manifest_mod
from .bundle import zipstream
from .bundle.manifest import Expect, Manifest
from .compilers import check_host
from .deps import elf, pe
from .deps.policy import linux_policy
from .errors import LlamaBundleError, ToolchainError, UsageError, VerifyError
from .log import Log
from .recipe import Recipe, Settings
from .store.base import Entry, Published, Store
from .verify import SCRATCH as VERIFY_SCRATCH
from .verify import (
    Level,
    Naming,
    VerifyReport,
    host_platform_name,
    verify_bundle,
    verify_unpacked,
)

LICENSE_FILES = {"LICENSE": "LICENSE", "licenses/LICENSE-jsonhpp": "LICENSE-jsonhpp"}


@dataclass(kw_only=True)
class BuildOutcome:
    """What build (and fetch) did. The JSON names are those of `check --json` and of the GitHub Actions step
    outputs: `hit` (the store had the key), `location` (where the store keeps the bundle), `store`."""
    key: str
    hit: bool  # the store had it: fetched and verified, nothing built
    zip_path: Path
    manifest: Manifest
    verify: VerifyReport
    store: str = ""  # the store's URL
    location: str | None = None  # where the store keeps the bundle (None: it was not stored)
    out_dir: Path | None = None
    bundled_libs: dict[str, str] = field(default_factory=dict)
    compiled: int = 0
    reproducible: dict[str, Any] | None = None  # with --check-reproducible: the zip sha256 both builds gave

    def to_json(self, *, fetch: bool = False) -> dict[str, Any]:
        """build --json (fetch=True: fetch --json, without what only a build has)."""
        out = {"schema": 1, "key": self.key, "store": self.store, "location": self.location, "zip": str(self.zip_path),
               "out": str(self.out_dir) if self.out_dir else None, "verify": self.verify.to_json()}
        if fetch:
            return out
        return {**out, "hit": self.hit, "bundled_libs": self.bundled_libs, "compiled": self.compiled,
                "reproducible": self.reproducible}


TMP_PREFIXES = ("stage-", "repro-", "unpack-", VERIFY_SCRATCH, source_mod.TMP_PREFIX)  # what commands make in <cache>/tmp


def sweep_cache(settings: Settings) -> None:
    """Remove what killed runs left in the cache: their scratch directories in <cache>/tmp (never a live
    run's). Every command that uses the cache calls this first."""
    scratch.sweep(settings.cache_dir / "tmp", TMP_PREFIXES)


def expect_for(recipe: Recipe) -> Expect:
    """What a bundle of this recipe must be: its key, platform, commit and toolkit."""
    return Expect(key=recipe.key(), platform=recipe.platform, commit=recipe.llama_cpp.commit,
                  toolkit=recipe.cuda.toolkit if recipe.cuda else None)


def build_dir_for(recipe: Recipe, settings: Settings, tools: BuildTools, cuda_root: Path | None = None) -> Path:
    """One incremental build tree per key and set of build tools (a venv's cmake and the system's,
    or two toolkits of one version, each keep their own instead of wiping each other's)."""
    tools_id = hashlib.sha256(f"{tools.cmake}|{tools.ninja}|{tools.ccache}|{cuda_root}".encode()).hexdigest()[:8]
    return settings.cache_dir / "build" / f"{recipe.key()[:16]}-{tools_id}"


def source_dir_for(recipe: Recipe, settings: Settings) -> Path:
    return settings.cache_dir / "src" / recipe.llama_cpp.commit


def show_plan(recipe: Recipe, settings: Settings, tools: BuildTools) -> BuildPlan:
    return plan_build(recipe, source_dir=source_dir_for(recipe, settings), build_dir=build_dir_for(recipe, settings, tools),
                      tools=tools)


def zip_name(recipe: Recipe) -> str:
    return f"{recipe.name}-{recipe.key()[:12]}.zip"


def verify_level_for(platform: str) -> Level:
    return Level.LOAD if platform == host_platform_name() else Level.STATIC


def can_build_here(recipe: Recipe) -> bool:
    """Native builds, and Windows bundles cross-built on Linux with mingw."""
    host = host_platform_name()
    return recipe.platform == host or (recipe.toolchain.compiler == "mingw" and host == "linux-x86_64")


def build(recipe: Recipe, *, settings: Settings, store: Store, log: Log, env: Mapping[str, str], force: bool = False,
          publish: bool = True, out: Path | None = None, jobs: int | None = None, clean: bool = False,
          toolkit_source: str | None = None, check_reproducible: bool = False) -> BuildOutcome:
    """Fetch the recipe's bundle from the store, or build it. `check_reproducible` builds it (again, even on a
    hit), then a second time from a copy of the source at another path in a fresh build directory, and
    fails (exit 5) naming the files that differ and where, unless both zips are byte-identical."""
    key = recipe.key()
    force = force or check_reproducible
    _check_out(out)
    sweep_cache(settings)
    if not force:
        entry = store.lookup(key)
        if entry is not None:
            log.info(f"cache hit: {key[:12]} in {store.url}")
            return _from_store(entry, store=store, settings=settings, log=log, out=out, expect=expect_for(recipe))
        log.info(f"cache miss: {key[:12]} not in {store.url}; building")
    if not can_build_here(recipe):
        raise UsageError(f"{recipe.platform} bundles cannot be built on {host_platform_name()} by this version",
                         fix=f"run the build on a {recipe.platform} machine (or cross-build with toolchain: {{compiler: mingw}})")
    locks = settings.cache_dir / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(locks / f"build-{key[:16]}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info(f"another llamabundle process is building {key[:12]} with this cache; waiting for it")
        lock.acquire()
    try:  # one build per key and cache at a time
        if not force:
            entry = store.lookup(key)
            if entry is not None:  # the process we waited for stored it
                log.info(f"cache hit: {key[:12]} in {store.url} (stored while we waited)")
                return _from_store(entry, store=store, settings=settings, log=log, out=out, expect=expect_for(recipe))
        return _build_locked(recipe, key=key, settings=settings, store=store, log=log, env=env, publish=publish,
                             out=out, jobs=jobs, clean=clean, toolkit_source=toolkit_source,
                             check_reproducible=check_reproducible)
    finally:
        lock.release()


def _build_locked(recipe: Recipe, *, key: str, settings: Settings, store: Store, log: Log, env: Mapping[str, str],
                  publish: bool, out: Path | None, jobs: int | None, clean: bool,
                  toolkit_source: str | None, check_reproducible: bool = False) -> BuildOutcome:
    compiler = None
    if recipe.toolchain.compiler != "msvc":  # before anything starts: the compiler the key names
        compiler = check_host(recipe.toolchain.compiler, pin=recipe.toolchain.version, keyed=recipe.host_compiler,
                              path=env.get("PATH"))
        log.info(f"    compiler: {recipe.toolchain.compiler} {compiler} (key: {recipe.compiler_key()})")
    with log.step(f"source llama.cpp {recipe.llama_cpp.commit[:12]}"):
        src = source_mod.fetch_source(recipe, settings, log)
    tools = resolve_tools(path=env.get("PATH"))
    toolkit: Toolkit | None = None
    checked: dict[str, str] = {}
    if recipe.cuda is not None:
        with log.step(f"CUDA toolkit {recipe.cuda.toolkit}"):
            toolkit = resolve_toolkit(recipe, settings=settings, log=log, env=env, source=toolkit_source)
            checked = check_toolkit(toolkit, recipe, env=env)
            log.info(f"    nvcc {checked['nvcc']} at {toolkit.nvcc}; host compiler {checked['host']}")
    cuda_root = toolkit.root if toolkit else None
    sde = settings.source_date_epoch if settings.source_date_epoch is not None else src.commit_time
    if sde is None:
        log.warn("the commit's date is unknown (this source does not prove it): built_at and the zip's timestamps "
                 "come from the clock, so the bundle is not reproducible; set SOURCE_DATE_EPOCH to fix them")
    build_env = {**env, "SOURCE_DATE_EPOCH": str(sde)} if sde is not None else env
    plan = plan_build(recipe, source_dir=src.path, build_dir=build_dir_for(recipe, settings, tools, cuda_root), tools=tools,
                      jobs=jobs, cuda_root=cuda_root)
    result = run_build(plan, log=log, env=build_env, clean=clean, timeout=settings.build_timeout)
    if compiler is not None and result.compiler.rsplit(" ", 1)[-1] != compiler:
        raise ToolchainError(f"CMake built with {result.compiler}, not the {recipe.toolchain.compiler} {compiler} "
                             "the cache key names", why=f"CMake's record in {plan.build_dir}",
                             fix="rerun with --clean, with one compiler of that family on PATH")
    made = Made(recipe=recipe, key=key, src=src, tools=tools, toolkit=toolkit, checked=checked, sde=sde)
    out_zip = settings.cache_dir / "out" / zip_name(recipe)
    manifest, closure = _package(made, plan, result, out_zip, settings=settings, log=log)
    with log.step(f"verify ({verify_level_for(recipe.platform)})"):
        report = verify_bundle(out_zip, level=verify_level_for(recipe.platform), expect=expect_for(recipe))
        _log_report(report, log)
    outcome = BuildOutcome(key=key, hit=False, zip_path=out_zip, manifest=manifest, verify=report, store=store.url,
                           bundled_libs={k: str(v) for k, v in closure.bundled.items()}, compiled=result.compiled)
    if check_reproducible:
        outcome.reproducible = _rebuild_elsewhere(made, out_zip, jobs=jobs, settings=settings, log=log, env=build_env)
    if publish:
        with log.step(f"store in {store.url}"):
            published = store.publish(out_zip, manifest)
            outcome.location = published.entry.location
            if not published.created:
                log.info("    an identical key was already stored by another run; kept that one")
    if out is not None:
        outcome.out_dir = _unpack_to(out_zip, out, expect_for(recipe))
        log.info(f"bundle unpacked in {out}")
    return outcome


@dataclass(frozen=True, kw_only=True)
class Made:
    """What a build of one recipe was made with: enough to package it, or to build it again elsewhere."""
    recipe: Recipe
    key: str
    src: source_mod.SourceTree
    tools: BuildTools
    toolkit: Toolkit | None
    checked: Mapping[str, str]
    sde: int | None  # SOURCE_DATE_EPOCH: the commit's date unless the environment sets it


def _package(made: Made, plan: BuildPlan, result: Any, out_zip: Path, *, settings: Settings,
             log: Log) -> tuple[Manifest, elf.Closure | WindowsCollected]:
    """Collect the build's products and their runtime libraries, write bundle.json, pack the zip."""
    recipe, tools, checked = made.recipe, made.tools, made.checked
    tmp = scratch.make_dir(settings.cache_dir / "tmp", "stage-")
    try:
        stage = tmp / "bundle"
        stage.mkdir()
        with log.step("collect runtime libraries"):
            if recipe.platform.startswith("windows"):
                closure, roles = collect_windows(plan, stage, log=log, source_dir=made.src.path,
                                                 runtime_dirs=windows_runtime_dirs(recipe))
            else:
                closure, roles = collect_linux(plan, stage, log=log, source_dir=made.src.path, toolkit=made.toolkit)
        manifest_fields = {
            "name": recipe.name,
            "key": made.key,
            "inputs": recipe.key_inputs(),
            "llama_cpp": {"commit": recipe.llama_cpp.commit, "version": llama_version(plan.build_dir),
                          "source": made.src.origin},
            "platform": recipe.platform,
            "backends": sorted(recipe.backends),
            "cuda": _cuda_manifest(recipe, stage, checked) if recipe.cuda else None,
            "toolchain": {"cmake": tools.cmake_version, "ninja": tools.ninja_version, "compiler": result.compiler,
                          **({"nvcc": checked["nvcc"]} if checked else {})},
            "system_deps": closure.system_deps,
            "glibc_floor": closure.glibc_floor,
            "files": bundle_mod.file_entries(stage, roles),
            "built_at": bundle_mod.built_at(made.sde),
            "publish": {"tag": recipe.tag()},
        }
        manifest = bundle_mod.write_manifest(stage, manifest_fields)
        with log.step("pack"):
            bundle_mod.pack(stage, out_zip, source_date_epoch=made.sde)
            log.info(f"    {out_zip} ({out_zip.stat().st_size / 1e6:.1f} MB, {len(manifest.files)} files)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest, closure


def _rebuild_elsewhere(made: Made, zip_a: Path, *, jobs: int | None, settings: Settings, log: Log,
                       env: Mapping[str, str]) -> dict[str, Any]:
    """Build again from a copy of the source at another path, in a new build directory; compare the zips."""
    work = scratch.make_dir(settings.cache_dir / "tmp", "repro-")
    try:
        with log.step("second build elsewhere (reproducibility check)"):
            src_b = work / "elsewhere" / "src" / "llama.cpp"
            shutil.copytree(made.src.path, src_b, symlinks=True)
            plan_b = plan_build(made.recipe, source_dir=src_b, build_dir=work / "b" / "build", tools=made.tools,
                                jobs=jobs, cuda_root=made.toolkit.root if made.toolkit else None)
            result_b = run_build(plan_b, log=log, env=env, clean=True, timeout=settings.build_timeout)
        zip_b = work / zip_a.name
        _package(replace(made, src=replace(made.src, path=src_b)), plan_b, result_b, zip_b, settings=settings, log=log)
        diffs = bundle_mod.diff_zips(zip_a, zip_b)
        sha_a, sha_b = bundle_mod.sha256_file(zip_a), bundle_mod.sha256_file(zip_b)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if diffs or sha_a != sha_b:
        lines = "\n".join(f"    {d}" for d in diffs) or "    (same members; the zip containers differ)"
        raise VerifyError("the bundle is not reproducible: a second build elsewhere gave other bytes",
                          why=f"zip sha256 {sha_a[:16]}… vs {sha_b[:16]}…", details=lines,
                          fix="look for paths, dates or build-order effects in the files listed")
    log.info(f"    reproducible: both builds give zip sha256 {sha_a}")
    return {"sha256": sha_a, "second_build": "other source path and build directory"}


def _cuda_manifest(recipe: Recipe, stage: Path, checked: Mapping[str, str]) -> dict[str, Any]:
    assert recipe.cuda is not None
    found = binary_archs(stage / library_file(recipe, "ggml-cuda"))
    return {"toolkit": recipe.cuda.toolkit, "nvcc": checked.get("nvcc"), "archs": found.to_json(),
            "driver_floor": recipe.driver_floor,
            "compression_mode": recipe.cmake_options.get("GGML_CUDA_COMPRESSION_MODE", "size")}


def collect_linux(plan: BuildPlan, stage: Path, *, log: Log, source_dir: Path,
                  toolkit: Toolkit | None = None) -> tuple[elf.Closure, dict[str, str]]:
    policy = linux_policy()
    roots = [plan.output_dir / n for n in plan.programs + plan.backends]
    lib_dirs = (toolkit.lib_dirs if toolkit else []) + elf.system_library_dirs(policy, ldconfig_output=elf.ldconfig_cache())
    closure = elf.resolve_closure(roots, products=[plan.output_dir], policy=policy, system_dirs=lib_dirs)
    companions = cuda_companions(closure.bundled, lib_dirs)
    if companions:  # libraries loaded at run time without a DT_NEEDED entry (e.g. nvrtc's builtins)
        closure = elf.resolve_closure(roots + companions, products=[plan.output_dir], policy=policy, system_dirs=lib_dirs)
    products = {p.name for p in plan.output_dir.iterdir()}
    copied_in = sorted(n for n, p in closure.bundled.items() if n not in products)
    log.info(f"    bundled from the build: {len(closure.bundled) - len(copied_in)}; "
             f"copied from the system: {', '.join(copied_in) or 'none'}")
    log.info(f"    system: {', '.join(closure.system) or 'none'}; driver: {', '.join(closure.driver) or 'none'}")
    if closure.missing:
        lines = [f"{name} (needed by {', '.join(by)})" for name, by in closure.missing.items()]
        raise VerifyError(f"{len(closure.missing)} libraries needed by the bundle were not found",
                          why="missing: " + "; ".join(lines),
                          fix="install them on the build machine (they are then copied into the bundle)")
    elf.apply_closure(closure, stage, log=log)
    roles = {n: "exe" for n in plan.programs} | {n: "backend" for n in plan.backends}
    roles |= {n: "runtime" for n in closure.bundled if n not in roles}
    roles |= _copy_licenses(source_dir, stage)
    if toolkit is not None:
        roles |= copy_cuda_licenses(closure.bundled, toolkit, stage)
    return closure, roles


@dataclass(frozen=True, kw_only=True)
class WindowsCollected:
    """What collect_windows put into a Windows bundle (the fields _package reads, as elf.Closure has them)."""
    closure: pe.PeClosure
    bundled: dict[str, Path]  # file name in the bundle -> where it came from
    glibc_floor: None = None

    @property
    def system_deps(self) -> list[str]:
        return self.closure.system_deps


def windows_runtime_dirs(recipe: Recipe) -> list[Path]:
    """Where a Windows build's runtime DLLs come from: for mingw, the directories the compiler names for
    its runtime DLLs (-print-file-name), then those of data/mingw.json that exist."""
    if recipe.toolchain.compiler != "mingw":
        return []
    mingw = data.load("mingw.json")
    dirs: list[Path] = []
    for dll in mingw["runtime_dlls"]:
        try:
            out = proc.capture([mingw["toolchain"]["c_compiler"], f"-print-file-name={dll}"], timeout=30).stdout.strip()
        except OSError:
            break  # no compiler: only the listed directories
        if os.path.isabs(out) and Path(out).is_file():
            dirs.append(Path(out).parent)
    for pattern in mingw["runtime_dirs"]:
        dirs += sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_dir())
    return list(dict.fromkeys(d.resolve() for d in dirs))


def collect_windows(plan: BuildPlan, stage: Path, *, log: Log, source_dir: Path,
                    runtime_dirs: Sequence[Path] = ()) -> tuple[WindowsCollected, dict[str, str]]:
    """The programs and backends of a Windows build, with every DLL of their PE import closure found in
    the build's output or in runtime_dirs; system and driver DLLs are never looked up or copied."""
    roots = [plan.output_dir / n for n in plan.programs + plan.backends]
    closure = pe.resolve_closure(roots, bundle_dir=plan.output_dir, extra_dirs=runtime_dirs)
    if closure.missing:
        lines = [f"{name} (imported by {', '.join(by)})" for name, by in closure.missing.items()]
        raise VerifyError(f"{len(closure.missing)} DLLs needed by the bundle were not found",
                          why="missing: " + "; ".join(lines),
                          fix="install the runtime that provides them on the build machine (for mingw: the "
                              "gcc-mingw-w64-x86-64-posix-runtime and mingw-w64-x86-64-dev packages)")
    bundled = {p.name: p for p in roots} | {d.path.name: d.path for d in closure.deps
                                            if d.cls not in pe.NOT_BUNDLED and d.path is not None}
    for name, path in bundled.items():
        shutil.copyfile(path, stage / name)
    copied_in = sorted(f"{d.path.name} ({d.cls})" for d in closure.deps
                       if d.path is not None and d.path.parent != plan.output_dir)
    log.info(f"    bundled from the build: {len(bundled) - len(copied_in)}; copied from the toolchain: "
             f"{', '.join(copied_in) or 'none'}")
    log.info(f"    system: {', '.join(closure.system_deps) or 'none'}")
    roles = {n: "exe" for n in plan.programs} | {n: "backend" for n in plan.backends}
    roles |= {n: "runtime" for n in bundled if n not in roles}
    roles |= _copy_licenses(source_dir, stage)
    if any(d.cls is pe.DllClass.MINGW_RUNTIME for d in closure.deps):
        for name, src in data.load("mingw.json")["licenses"].items():
            if Path(src).is_file():
                shutil.copyfile(src, stage / name)
                roles[name] = "license"
    return WindowsCollected(closure=closure, bundled=bundled), roles


def _copy_licenses(source_dir: Path, stage: Path) -> dict[str, str]:
    roles: dict[str, str] = {}
    for src_rel, name in LICENSE_FILES.items():
        if (source_dir / src_rel).is_file():
            shutil.copyfile(source_dir / src_rel, stage / name)
            roles[name] = "license"
    if "LICENSE" not in roles:
        raise VerifyError("llama.cpp's LICENSE file is missing from the source tree", fix="check the source")
    return roles


def cuda_companions(bundled: Mapping[str, Path], lib_dirs: list[Path]) -> list[Path]:
    table = data.cuda_runtime()["companions"]
    found: list[Path] = []
    for name in bundled:
        for pattern, wanted in table.items():
            if fnmatch.fnmatchcase(name, pattern):
                for w in wanted:
                    for d in lib_dirs:
                        hits = sorted(p for p in d.glob(w) if p.is_file())
                        if hits:
                            found.append(hits[-1])
                            break
    return found


def copy_cuda_licenses(bundled: Mapping[str, Path], toolkit: Toolkit, stage: Path) -> dict[str, str]:
    """The license text of every CUDA component whose libraries the bundle redistributes."""
    table = data.cuda_runtime()["components"]
    comps = sorted({c for name in bundled for pattern, c in table.items() if fnmatch.fnmatchcase(name, pattern)})
    roles: dict[str, str] = {}
    for comp in comps:
        for cand in (toolkit.root / f"LICENSE.{comp}", toolkit.root / "EULA.txt", toolkit.root / "DOCS" / "EULA.txt",
                     toolkit.root / "LICENSE"):
            if cand.is_file():
                name = f"LICENSE-CUDA-{comp}.txt" if cand.name.startswith("LICENSE.") else "LICENSE-CUDA.txt"
                shutil.copyfile(cand, stage / name)
                roles[name] = "license"
                break
        else:  # a system toolkit without its license files (some container images strip them)
            notice = resources.files(data.__name__).joinpath("CUDA-EULA-NOTICE.txt").read_text(encoding="utf-8")
            (stage / "LICENSE-CUDA.txt").write_text(notice, encoding="utf-8")
            roles["LICENSE-CUDA.txt"] = "license"
    return roles


def llama_version(build_dir: Path) -> str | None:
    """'b<N>' from the build's generated build-info, when llama.cpp knew its build number."""
    for f in build_dir.glob("common/build-info.cpp"):
        m = re.search(r"LLAMA_BUILD_NUMBER\s*=\s*(\d+)", f.read_text())
        if m and int(m.group(1)) > 0:
            return f"b{m.group(1)}"
    return None


def _from_store(entry: Entry, *, store: Store, settings: Settings, log: Log, out: Path | None,
                level: Level | None = None, expect: Expect | None = None) -> BuildOutcome:
    """Download, unpack and verify in one pass over the bytes (zipstream), then move into `out` (when given).
    The zip stays in the cache; nothing is left in `out` unless everything passed. The unpacked bundle is
    trusted (manifest.trust) against `expect` (default: the entry's key) and must be the manifest the store
    listed."""
    dest = settings.cache_dir / "fetched" / entry.key
    expect = expect or Expect(key=entry.key)
    manifest_mod.check_consistent(entry.manifest, expect)  # before a byte is downloaded
    level = level or verify_level_for(entry.manifest.platform)
    if out is not None and out.exists():
        out.rmdir()  # empty (checked before any work)
    if out is not None:
        tmp = _tmp_beside(out)
    else:
        tmp = scratch.make_dir(settings.cache_dir / "tmp", "unpack-")
    # messages name --out (or the stored zip), never the directory the bundle is checked in before the rename
    naming = Naming.of([tmp], out if out is not None else entry.location, is_zip=out is None, partial=False)
    stream = zipstream.Pipelined(zipstream.ZipStream(tmp, label=entry.zip_name))
    try:
        with log.step("fetch from the store"):
            try:
                zip_path = store.fetch(entry, dest, sink=stream)
                try:
                    hashes: dict[str, str] | None = {m.name: m.sha256 for m in stream.finish()}
                except zipstream.NotStreamable:
                    extract_zip(zip_path, tmp)
                    hashes = None
            except LlamaBundleError as e:
                naming.error(e)  # a full --out names --out, not the directory it is unpacked in first
                raise
        with log.step(f"verify ({level})"):
            try:
                manifest, check = bundle_mod.check_unpacked(tmp, hashes=hashes, expect=expect)
                if manifest != entry.manifest:  # the same JSON (every field is read from it)
                    raise VerifyError(f"the bundle.json inside {entry.zip_name} is not the one {store.url} lists",
                                      why="the store's manifest and the zip's disagree", fix="publish the bundle again")
                report = naming.report(verify_unpacked(tmp, manifest, check, level=level, label=str(zip_path)))
            except LlamaBundleError as e:
                naming.error(e)
                raise
            _log_report(report, log)
        if out is not None:
            os.replace(tmp, out)
    finally:
        stream.close()
        shutil.rmtree(tmp, ignore_errors=True)
    outcome = BuildOutcome(key=entry.key, hit=True, zip_path=zip_path, manifest=entry.manifest, verify=report,
                           store=store.url, location=entry.location)
    if out is not None:
        outcome.out_dir = out
        log.info(f"bundle unpacked in {out}")
    return outcome


def fetch(key: str, *, store: Store, settings: Settings, log: Log, out: Path, level: Level = Level.STATIC,
          expect: Expect | None = None) -> BuildOutcome:
    """The store's bundle `key`, trusted against `expect` (a recipe's: key, platform, commit, toolkit)."""
    _check_out(out)
    sweep_cache(settings)
    entry = store.lookup(key)
    if entry is None:
        raise UsageError(f"no bundle with key {key[:12]} in {store.url}", fix="build it first: llamabundle build RECIPE")
    return _from_store(entry, store=store, settings=settings, log=log, out=out, level=level, expect=expect)


def _check_out(out: Path | None) -> None:
    """--out must be a new or empty directory whose parent can be written; checked before any work."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is not a directory", fix="pass a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"--out {out} exists and is not empty", fix="pass a new or empty directory")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK) or _read_only(parent):
        raise UsageError(f"--out {out} cannot be written", why=f"{parent} is read-only",
                         fix="pass a directory on a writable disk")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def publish_zip(zip_path: Path, *, store: Store, settings: Settings | None = None) -> tuple[VerifyReport, Published]:
    """Verify a bundle zip (static; the one trust check) and put it in the store under the key its manifest
    names, which is the sha256 of the inputs it records."""
    if settings is not None:
        sweep_cache(settings)
    verified: list[Manifest] = []
    report = verify_bundle(zip_path, level=Level.STATIC, verified=verified)
    return report, store.publish(zip_path, verified[0])


def _unpack_to(zip_path: Path, out: Path, expect: Expect) -> Path:
    if out.exists():
        out.rmdir()  # empty (checked before any work)
    bundle_mod.unpack(zip_path, out, expect)
    return out


def _log_report(report: VerifyReport, log: Log) -> None:
    for line in report.lines():
        log.info(f"    {line}")
