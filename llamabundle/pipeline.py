"""The user's jobs of DESIGN §2, orchestrated: build (lookup → source → toolkit → plan → build → package →
verify → publish), fetch and publish. Each step lives in its own module; this file only calls them in order."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import bundle as bundle_mod
from . import cache, platforms, scratch
from .archive import tmp_beside
from .bundle import manifest as manifest_mod
from .bundle import zipstream
from .bundle.manifest import Expect, Manifest
from .digest import sha256_file
from .errors import LlamaBundleError, ToolchainError, UsageError, VerifyError
from .log import Log
from .platforms import Collected
from .platforms.base import HostToolchain
from .settings import Settings
from .store import blobcache
from .store.base import BlobStore, Entry, Published, Store, blob_source
from .verify import Level, Naming, VerifyReport, verify_bundle, verify_unpacked

if TYPE_CHECKING:  # what only building needs (the web UI, packing, a second build, the recipe and the key with
    # every backend's rules) is imported when a build runs: a fetch or an install starts without it (requests, the
    # packer, yaml and the backends are most of the tool's import time)
    from . import webui
    from .backends import Prepared
    from .build import BuildPlan, BuildResult, BuildTools
    from .keys import Keyed
    from .package import Made
    from .recipe import Recipe
    from .source import SourceTree


@dataclass(kw_only=True)
class BuildOutcome:
    """What build (and fetch) did. The JSON names are those of `check --json` and of the GitHub Actions step
    outputs: `hit` (the store had the key), `location` (where the store keeps the bundle), `store`."""
    key: str
    hit: bool  # the store had it: fetched and verified, nothing built
    zip_path: Path | None  # None: fetched by content (no zip read)
    manifest: Manifest
    verify: VerifyReport
    store: str = ""  # the store's URL
    location: str | None = None  # where the store keeps the bundle (None: it was not stored)
    out_dir: Path | None = None
    bundled_libs: dict[str, str] = field(default_factory=dict)
    compiled: int = 0
    reproducible: dict[str, Any] | None = None  # with --check-reproducible: the zip sha256 both builds gave
    ops_tool: Path | None = None  # with --ops-tool: test-backend-ops from the same build tree, beside the zip
    transfer: dict[str, Any] = field(default_factory=dict)  # fetch: how the files came (by zip or blobs), bytes
    compiler_cache: dict[str, Any] | None = None  # a build's: what its compiler cache did (compiler_cache.py)

    def to_json(self, *, fetch: bool = False) -> dict[str, Any]:
        """build --json (fetch=True: fetch --json, without what only a build has)."""
        out = {"schema": 1, "key": self.key, "store": self.store, "location": self.location,
               "zip": str(self.zip_path) if self.zip_path else None,
               "out": str(self.out_dir) if self.out_dir else None, "verify": self.verify.to_json()}
        if fetch:
            return {**out, "transfer": self.transfer}
        return {**out, "hit": self.hit, "bundled_libs": self.bundled_libs, "compiled": self.compiled,
                "reproducible": self.reproducible, "ops_tool": str(self.ops_tool) if self.ops_tool else None,
                "compiler_cache": self.compiler_cache}


def sweep_cache(settings: Settings) -> None:
    cache.sweep(settings.cache_dir)


def expect_for(keyed: Keyed) -> Expect:
    """What a bundle of this recipe must be: its key, platform, commit and each backend's toolkit."""
    recipe = keyed.recipe
    toolkits = {name: part["toolkit"] for name, part in keyed.inputs.items()
                if isinstance(part, dict) and isinstance(part.get("toolkit"), str)}
    return Expect(key=keyed.key, platform=recipe.platform, commit=recipe.llama_cpp.commit, toolkits=toolkits)


def show_plan(keyed: Keyed, settings: Settings, tools: BuildTools, toolchain: HostToolchain) -> BuildPlan:
    """The build plan `show` prints (with the tools build.locate_tools finds without running anything, and
    the environment the platform set the compiler up in)."""
    from .build import plan_build

    return plan_build(keyed.recipe, keyed.host, source_dir=cache.source_dir(settings.cache_dir, keyed.recipe.llama_cpp.commit),
                      build_dir=cache.build_dir(settings.cache_dir, keyed.key, tools.ids), tools=tools,
                      env=toolchain.env, fixed_root=cache.fixed_dir(settings.cache_dir), compilers=toolchain.compilers)


def verify_level_for(platform: str) -> Level:
    """What a build (or a hit) verifies its bundle at: load where this machine runs the platform's programs, natively
    or under an emulator (an Arm bundle under qemu-aarch64 on x86-64), else static (a Windows bundle on Linux: Wine
    runs it only when asked, `verify --level load`)."""
    host = platforms.host_name()
    return Level.LOAD if platform == host or platforms.get(platform).runner(host) is not None else Level.STATIC


def bound_cache(settings: Settings, log: Log, *, keep: str) -> None:
    """Hold the cache to LLAMABUNDLE_CACHE_MAX after a build or fetch added to it: the least recently used
    fetched bundles, built zips, build trees, downloads, sources and toolkits go first (never this key's, nor
    one in use). The cache is measured at most every BOUND_EVERY seconds (a walk of every file: not on each
    cache hit)."""
    if settings.cache_max is None or not cache.bound_due(settings.cache_dir):
        return
    removed = cache.prune(settings.cache_dir, limit=settings.cache_max, keep=[keep])
    if removed:
        freed = sum(e.size for e in removed) / 1e6
        log.info(f"cache over LLAMABUNDLE_CACHE_MAX ({settings.cache_max / 1e9:.1f} GB): removed the {len(removed)} "
                 f"least recently used ({freed:.1f} MB): " + ", ".join(f"{e.area}/{e.path.name}" for e in removed[:5])
                 + (" …" if len(removed) > 5 else ""))


def build(keyed: Keyed, *, settings: Settings, store: Store, log: Log, env: Mapping[str, str], force: bool = False,
          publish: bool = True, out: Path | None = None, jobs: int | None = None, clean: bool = False,
          toolkit_source: str | None = None, check_reproducible: bool = False, ops_tool: bool = False) -> BuildOutcome:
    """build_once, then the cache held to its bound (bound_cache)."""
    outcome = build_once(keyed, settings=settings, store=store, log=log, env=env, force=force, publish=publish, out=out,
                         jobs=jobs, clean=clean, toolkit_source=toolkit_source, check_reproducible=check_reproducible,
                         ops_tool=ops_tool)
    bound_cache(settings, log, keep=keyed.key)
    return outcome


def build_once(keyed: Keyed, *, settings: Settings, store: Store, log: Log, env: Mapping[str, str], force: bool = False,
               publish: bool = True, out: Path | None = None, jobs: int | None = None, clean: bool = False,
               toolkit_source: str | None = None, check_reproducible: bool = False, ops_tool: bool = False) -> BuildOutcome:
    """Fetch the recipe's bundle from the store, or build it. `ops_tool` builds it (even on a hit) and llama.cpp's
    test-backend-ops from the same tree beside the zip (`<zip>.test-backend-ops`, for verify --level ops).
    `check_reproducible` builds it (again, even on a
    hit), then a second time from a copy of the source at another path in a fresh build directory, and
    fails (exit 5) naming the files that differ and where, unless both zips are byte-identical."""
    recipe, key = keyed.recipe, keyed.key
    force = force or check_reproducible or ops_tool
    check_out(out)
    sweep_cache(settings)
    if not force:
        entry = store.lookup(key)
        if entry is not None:
            log.info(f"cache hit: {key[:12]} in {store.url}")
            return _hit(entry, store=store, settings=settings, log=log, out=out, expect=expect_for(keyed))
        log.info(f"cache miss: {key[:12]} not in {store.url}; building")
    host = platforms.host_name()
    if not platforms.get(recipe.platform).can_build_on(host, recipe.toolchain.compiler):
        raise UsageError(f"{recipe.platform} bundles cannot be built on {host} by this version",
                         fix=f"run the build on a {recipe.platform} machine (or cross-build with toolchain: {{compiler: mingw}})")
    with making(settings, key, log):
        if not force:
            entry = store.lookup(key)
            if entry is not None:  # the process we waited for stored it
                log.info(f"cache hit: {key[:12]} in {store.url} (stored while we waited)")
                return _hit(entry, store=store, settings=settings, log=log, out=out, expect=expect_for(keyed))
        return _build_locked(keyed, settings=settings, store=store, log=log, env=env, publish=publish,
                             out=out, jobs=jobs, clean=clean, toolkit_source=toolkit_source,
                             check_reproducible=check_reproducible, ops_tool=ops_tool)


@contextmanager
def making(settings: Settings, key: str, log: Log) -> Iterator[None]:
    """One process at a time makes the bundle of a key with a cache (`build`, `bundle`): its build tree and
    its zip in out/ are the cache's, not the process's; another waits, saying so. Meanwhile the cache's
    sources, toolkits and downloads are in use (no prune removes them)."""
    with cache.waiting_lock(cache.build_lock(settings.cache_dir, key), log,
                            f"another llamabundle process is making {key[:12]} with this cache; waiting for it"):
        with cache.in_use(settings.cache_dir):
            yield


def _build_locked(keyed: Keyed, *, settings: Settings, store: Store, log: Log, env: Mapping[str, str],
                  publish: bool, out: Path | None, jobs: int | None, clean: bool,
                  toolkit_source: str | None, check_reproducible: bool = False, ops_tool: bool = False) -> BuildOutcome:
    from . import backends, compiler_cache, keys
    from .build import plan_build, resolve_tools

    keyed = keys.for_build(keyed, env=env)  # before anything starts: the tools the key names (pinned ones too)
    recipe, key, host = keyed.recipe, keyed.key, keyed.host
    platform = platforms.get(recipe.platform)
    toolchain = platform.setup_toolchain(recipe, host, env=env, log=log)  # and the compiler
    env = {**env, **toolchain.env}
    with log.step(f"source llama.cpp {recipe.llama_cpp.commit[:12]}"):
        src = _fetch_source(recipe, settings, log, env=env)
    chosen = compiler_cache.choose(settings.compiler_cache, path=env.get("PATH"))
    if chosen is not None and (why := compiler_cache.not_byte_identical(chosen, recipe.backends)):
        log.warn(why)
    tools = resolve_tools(path=env.get("PATH"), compiler_cache=chosen.program if chosen else None)
    prepared: dict[str, Prepared] = {}
    for backend in backends.of(recipe):  # each backend's toolkit (CUDA's), found or installed and checked
        got = backend.prepare(recipe, host, settings=settings, log=log, env=env, source=toolkit_source)
        if got is not None:
            prepared[backend.name] = got
    sde = settings.source_date_epoch if settings.source_date_epoch is not None else src.commit_time
    if sde is None:
        log.warn("the commit's date is unknown (this source does not prove it): built_at and the zip's timestamps "
                 "come from the clock, so the bundle is not reproducible; set SOURCE_DATE_EPOCH to fix them")
    build_env = {**env, "SOURCE_DATE_EPOCH": str(sde)} if sde is not None else env
    ui = web_ui(recipe, src.path, settings=settings, log=log, env=env) if recipe.embeds_ui else None
    from .package import Made

    made = Made(keyed=keyed, src=src, tools=tools, prepared=prepared, sde=sde, ui=ui)
    build_dir = cache.build_dir(settings.cache_dir, key, tools.ids, made.toolkit_roots.values())
    plan = plan_build(recipe, host, source_dir=src.path, build_dir=build_dir, tools=tools, jobs=jobs,
                      toolkit_roots=made.toolkit_roots, env=toolchain.env, fixed_root=cache.fixed_dir(settings.cache_dir),
                      compilers=toolchain.compilers)
    one_server = (cache.waiting_lock(cache.compiler_cache_lock(settings.cache_dir, chosen.kind), log,
                                     f"another llamabundle build on this cache runs its {chosen.kind} server (one at a "
                                     "time: its local cache takes one); waiting for it")
                  if chosen is not None and chosen.kind == "sccache" else nullcontext())
    with one_server, compiler_cache.session(chosen, base_dir=settings.cache_dir, env=build_env) as cc:
        if cc is not None:  # open until the ops tool is built too (sccache's server)
            log.info(f"    compiling through {cc.cache.name} ({cc.cache.program})")
        outcome = _build_in(made, plan, keyed, toolchain=toolchain, settings=settings, store=store, log=log,
                            env=cc.apply(build_env) if cc is not None else build_env, clean=clean, ops_tool=ops_tool)
    if cc is not None:
        log.info(f"    compiler cache: {compiler_cache.describe(cc.stats)}")
        outcome.compiler_cache = cc.stats
    out_zip, manifest = outcome.zip_path, outcome.manifest
    assert out_zip is not None
    if check_reproducible:
        from . import repro

        outcome.reproducible = repro.rebuild_elsewhere(made, out_zip, toolchain=toolchain, jobs=jobs, cache_dir=settings.cache_dir,
                                                       build_timeout=settings.build_timeout, log=log, env=build_env)
    if publish:
        with log.step(f"store in {store.url}"):
            published = store.publish(out_zip, manifest)
            outcome.location = published.entry.location
            if not published.created:
                log.info("    an identical key was already stored by another run; kept that one")
    if out is not None:
        outcome.out_dir = unpack_to(out_zip, out, expect_for(keyed))
        log.info(f"bundle unpacked in {out}")
    return outcome


def _build_in(made: Made, plan: BuildPlan, keyed: Keyed, *, toolchain: HostToolchain, settings: Settings, store: Store,
              log: Log, env: Mapping[str, str], clean: bool, ops_tool: bool) -> BuildOutcome:
    """Compile the plan, then collect, pack and verify the zip in out/ (and the ops tool from the same tree)."""
    from . import backends, opscheck
    from .build import build_ops_tool, run_build

    recipe, key, host, ui, src = keyed.recipe, keyed.key, keyed.host, made.ui, made.src
    build_dir = plan.build_dir
    result = run_build(plan, log=log, env=env, clean=clean, timeout=settings.build_timeout, lay=lambda d: made.lay(d, log))
    for used in (build_dir, src.path, *made.toolkit_roots.values(), *([ui.dist.parent] if ui else [])):  # used now (the bound removes the least recently used first)
        cache.touch_used(settings.cache_dir, used)
    configure_log = result.log_path.read_text(encoding="utf-8", errors="replace")
    for backend in backends.of(recipe):
        backend.after_configure(recipe, host, configure_log)
    if toolchain.compiler is not None and result.compiler.rsplit(" ", 1)[-1] != toolchain.compiler:
        raise ToolchainError(f"CMake built with {result.compiler}, not the {recipe.toolchain.compiler} "
                             f"{toolchain.compiler} the cache key names", why=f"CMake's record in {plan.build_dir}",
                             fix="rerun with --clean, with one compiler of that family on PATH")
    out_zip = cache.out_zip(settings.cache_dir, recipe.name, key)
    manifest, collected, report = assemble(made, plan, result, out_zip, toolchain=toolchain, settings=settings, log=log)
    outcome = BuildOutcome(key=key, hit=False, zip_path=out_zip, manifest=manifest, verify=report, store=store.url,
                           bundled_libs={k: str(v) for k, v in collected.bundled.items()}, compiled=result.compiled)
    if ops_tool:
        outcome.ops_tool = build_ops_tool(plan, opscheck.sibling_tool(out_zip), log=log, env=env,
                                          timeout=settings.build_timeout)
        for backend in backends.of(recipe):  # what a backend's part of the ops level needs beside the tool
            backend.after_ops_tool(outcome.ops_tool, build_dir=build_dir, platform=platforms.get(recipe.platform), log=log,
                                   env={**env, **dict(plan.env)})
    return outcome


def _fetch_source(recipe: Recipe, settings: Settings, log: Log, *, env: Mapping[str, str]) -> SourceTree:
    """llama.cpp at the recipe's commit (source.fetch_source: imported when a build runs, with the network)."""
    from . import source

    return source.fetch_source(recipe, settings, log, env=env)


def web_ui(recipe: Recipe, src: Path, *, settings: Settings, log: Log, env: Mapping[str, str]) -> webui.Assets:
    """The web UI the recipe's ui: names for the source tree src: built with npm (or the kept one), or the pinned
    archive (downloaded once). The last step of a build with a network: npm's registry or the archive's host."""
    from . import webui

    if isinstance(recipe.ui, str):
        return webui.built(src, cache_dir=settings.cache_dir, log=log, env=env, timeout=settings.build_timeout)
    return webui.pinned(recipe.ui.url, recipe.ui.sha256, src, cache_dir=settings.cache_dir, log=log)


@dataclass(frozen=True, kw_only=True)
class PackedUi:
    """A web UI archive made by `ui pack`."""

    assets: webui.Assets
    commit: str
    path: Path
    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"commit": self.commit, "source": self.assets.source, "digest": self.assets.digest,
                "files": self.assets.files, "archive": str(self.path), "sha256": self.sha256, "size": self.size}


def pack_ui(recipe: Recipe, *, settings: Settings, log: Log, env: Mapping[str, str], out_dir: Path) -> PackedUi:
    """`ui pack`: the web UI of the recipe's commit, built with npm (or the kept one), as an archive in out_dir
    that recipes pin with ui: {url, sha256} once it is published."""
    from . import webui

    if not recipe.embeds_ui:
        raise UsageError(f"{recipe.origin} says ui: none", why="there is no web UI to pack",
                         fix="use a recipe with ui: build (or {url, sha256})")
    with cache.in_use(settings.cache_dir):
        with log.step(f"source llama.cpp {recipe.llama_cpp.commit[:12]}"):
            src = _fetch_source(recipe, settings, log, env=env)
        assets = webui.built(src.path, cache_dir=settings.cache_dir, log=log, env=env, timeout=settings.build_timeout)
    path = webui.pack(assets, out_dir)
    return PackedUi(assets=assets, commit=recipe.llama_cpp.commit, path=path, sha256=sha256_file(path),
                    size=path.stat().st_size)


def assemble(made: Made, plan: BuildPlan, result: BuildResult, out_zip: Path, *, toolchain: HostToolchain,
             settings: Settings, log: Log) -> tuple[Manifest, Collected, VerifyReport]:
    """Collect, write bundle.json, pack and verify: what `build` does after compiling, and all that `bundle`
    does with a build made elsewhere."""
    from .package import package

    manifest, collected = package(made, plan, result, out_zip, toolchain=toolchain, cache_dir=settings.cache_dir,
                                  log=log)
    level = verify_level_for(made.recipe.platform)
    with log.step(f"verify ({level})"):
        report = verify_bundle(out_zip, level=level, expect=expect_for(made.keyed), cache_dir=settings.cache_dir)
        _log_report(report, log)
    return manifest, collected, report


def _hit(entry: Entry, *, store: Store, settings: Settings, log: Log, out: Path | None, expect: Expect) -> BuildOutcome:
    """A cache hit of `build`: the bundle verified at its platform's level (in `out` when given), and its zip in
    the cache, since a build's result is a zip on disk. From a store on this disk that keeps files by content, with
    an `out`, the bundle is assembled from the blobs (unpacked on the cores there are) while the zip is copied into
    the cache beside it, each checked by its sha256: nothing is read twice from the network, as both lie here. Else
    the zip is fetched, hashed and unpacked in one pass (_from_store)."""
    src = blob_source(store, entry) if out is not None and getattr(store, "on_this_disk", False) else None
    if src is None or out is None:
        return _from_store(entry, store=store, settings=settings, log=log, out=out, expect=expect)
    dest = cache.fetched_dir(settings.cache_dir, entry.key)
    with ThreadPoolExecutor(1) as pool:  # leaving the block waits for the copy, whatever happened meanwhile
        copied = pool.submit(store.fetch, entry, dest)
        outcome = _by_content(entry, src, settings=settings, log=log, out=out, expect=expect,
                              level=verify_level_for(entry.manifest.platform), before_place=copied.result)
        outcome.zip_path = copied.result()  # a damaged zip was raised before --out was filled
    cache.touch(dest)  # used now (the bound removes the least recently used first)
    return outcome


def _from_store(entry: Entry, *, store: Store, settings: Settings, log: Log, out: Path | None,
                level: Level | None = None, expect: Expect | None = None) -> BuildOutcome:
    """Download, unpack and verify in one pass over the bytes (zipstream), then move into `out` (when given).
    The zip stays in the cache; nothing is left in `out` unless everything passed. The unpacked bundle is
    trusted (manifest.trust) against `expect` (default: the entry's key) and must be the manifest the store
    listed."""
    dest = cache.fetched_dir(settings.cache_dir, entry.key)
    expect = expect or Expect(key=entry.key)
    manifest_mod.check_consistent(entry.manifest, expect)  # before a byte is downloaded
    level = level or verify_level_for(entry.manifest.platform)
    if out is not None:
        tmp = tmp_beside(out, exist_ok=True)  # (an empty --out, or one another run of this key fills meanwhile)
    else:
        tmp = scratch.make_dir(cache.tmp_dir(settings.cache_dir), cache.UNPACK_PREFIX)
    stream: zipstream.Pipelined | None = None
    try:  # from here on an interrupt leaves nothing behind
        # messages name --out (or the stored zip), never the directory the bundle is checked in before the rename
        naming = Naming.of([tmp], out if out is not None else entry.location, is_zip=out is None, partial=False)
        stream = zipstream.Pipelined(bundle_mod.stream(tmp, label=entry.zip_name))
        with log.step("fetch from the store"):
            try:
                zip_path = store.fetch(entry, dest, sink=stream)
                cache.touch(dest)  # used now (the bound removes the least recently used first)
                try:
                    hashes: dict[str, str] | None = {m.name: m.sha256 for m in stream.finish()}
                except zipstream.NotStreamable:
                    bundle_mod.extract_unstreamed(zip_path, tmp)
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
                report = naming.report(verify_unpacked(tmp, manifest, check, level=level, label=str(zip_path),
                                                             wine_prefix=cache.wine_prefix(settings.cache_dir)))
            except LlamaBundleError as e:
                naming.error(e)
                raise
            _log_report(report, log)
        if out is not None:
            place(tmp, out, entry.manifest, log)
    finally:
        if stream is not None:
            stream.close()
        shutil.rmtree(tmp, ignore_errors=True)
    outcome = BuildOutcome(key=entry.key, hit=True, zip_path=zip_path, manifest=entry.manifest, verify=report,
                           store=store.url, location=entry.location)
    if out is not None:
        outcome.out_dir = out
        log.info(f"bundle unpacked in {out}")
    return outcome


def fetch(key: str, *, store: Store, settings: Settings, log: Log, out: Path, level: Level = Level.STATIC,
          expect: Expect | None = None, zip_: bool = False) -> BuildOutcome:
    """The store's bundle `key`, trusted against `expect` (a recipe's: key, platform, commit, toolkit). From a
    store that keeps its files by content only the files the cache's blobs lack are downloaded (unless `zip_`:
    the zip, kept in the cache). An --out that already holds this very bundle (another fetch of it finished
    first) is a success, not a clash."""
    check_out(out, bundle_ok=True)
    sweep_cache(settings)
    entry = store.lookup(key)
    if entry is None:
        raise UsageError(f"no bundle with key {key[:12]} in {store.url}", fix="build it first: llamabundle build RECIPE")
    src = None if zip_ else blob_source(store, entry)
    if src is not None:
        outcome = _by_content(entry, src, settings=settings, log=log, out=out, level=level, expect=expect)
    else:
        outcome = _from_store(entry, store=store, settings=settings, log=log, out=out, level=level, expect=expect)
        n = len(entry.manifest.files)
        outcome.transfer = {"by": "zip", "downloaded_bytes": entry.zip_size, "cached_bytes": 0, "files": n,
                            "files_downloaded": n}
    bound_cache(settings, log, keep=entry.key)
    return outcome


def _by_content(entry: Entry, src: BlobStore, *, settings: Settings, log: Log, out: Path, level: Level,
                expect: Expect | None, before_place: Callable[[], object] | None = None) -> BuildOutcome:
    """The bundle assembled in a directory beside --out from the cache's blobs (store.blobcache: only what they
    lack is downloaded), trusted and verified as an unpacked zip is, then moved into --out. No zip is read.
    `before_place`: called before the move; what it raises leaves --out as it was."""
    expect = expect or Expect(key=entry.key)
    manifest_mod.check_consistent(entry.manifest, expect)  # before a byte is downloaded
    blobs = cache.blob_dir(settings.cache_dir)
    tmp = tmp_beside(out, exist_ok=True)
    try:
        naming = Naming.of([tmp], out, is_zip=False, partial=False)
        try:
            got = blobcache.assemble(src, entry, entry.manifest, blobs, tmp, log=log)
            with log.step(f"verify ({level})"):
                # the files were hashed as they were written or found (assemble): not read again
                manifest, check = bundle_mod.check_unpacked(tmp, hashes=got.hashes, expect=expect)
                report = naming.report(verify_unpacked(tmp, manifest, check, level=level, label=str(out),
                                                       wine_prefix=cache.wine_prefix(settings.cache_dir)))
                _log_report(report, log)
        except LlamaBundleError as e:
            naming.error(e)
            raise
        if before_place is not None:
            before_place()
        place(tmp, out, entry.manifest, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    blobcache.prune(blobs)
    log.info(f"bundle unpacked in {out} (by content: {got.fetched} of {got.files} files downloaded, "
             f"{got.downloaded / 1e6:.1f} MB; {got.from_cache / 1e6:.1f} MB from the cache)")
    outcome = BuildOutcome(key=entry.key, hit=True, zip_path=None, manifest=entry.manifest, verify=report,
                           store=src.url, location=entry.location)
    outcome.out_dir = out
    outcome.transfer = {"by": "blobs", "downloaded_bytes": got.downloaded, "cached_bytes": got.from_cache,
                        "files": got.files, "files_downloaded": got.fetched}
    return outcome


def place(tmp: Path, out: Path, manifest: Manifest, log: Log) -> None:
    """Move the checked bundle in `tmp` to `out` (missing or empty). Another run that put this very bundle
    there first (the same bundle.json, every file as it lists) is a success too: concurrent fetches of one key
    into one --out all end with it."""
    try:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        os.replace(tmp, out)
        return
    except OSError as e:
        placed = e
    try:
        there = bundle_mod.read_manifest(out)
        same = there == manifest and manifest_mod.check_files(out, there) is not None
    except (LlamaBundleError, OSError):
        same = False
    if not same:
        raise UsageError(f"--out {out} exists and is not empty", why=f"it does not hold this bundle ({placed.strerror or placed})",
                         fix="pass a new or empty directory")
    log.info(f"{out} already holds this bundle (put there by another run meanwhile)")


def check_out(out: Path | None, *, bundle_ok: bool = False) -> None:
    """--out must be a new or empty directory whose parent can be written; checked before any work.
    `bundle_ok`: it may hold a bundle (fetch: `place` accepts it at the end if it is the one fetched)."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is not a directory", fix="pass a new or empty directory")
    if out.is_dir() and any(out.iterdir()) and not (bundle_ok and (out / bundle_mod.MANIFEST).is_file()):
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


def publish_zip(zip_path: Path, *, store: Store, settings: Settings) -> tuple[VerifyReport, Published]:
    """Verify a bundle zip (static; the one trust check) and put it in the store under the key its manifest
    names, which is the sha256 of the inputs it records."""
    sweep_cache(settings)
    verified: list[Manifest] = []
    report = verify_bundle(zip_path, level=Level.STATIC, verified=verified,
                           cache_dir=settings.cache_dir)
    return report, store.publish(zip_path, verified[0])


def unpack_to(zip_path: Path, out: Path, expect: Expect) -> Path:
    if out.exists():
        out.rmdir()  # empty (checked before any work)
    bundle_mod.unpack(zip_path, out, expect)
    return out


def _log_report(report: VerifyReport, log: Log) -> None:
    for line in report.lines():
        log.info(f"    {line}")
