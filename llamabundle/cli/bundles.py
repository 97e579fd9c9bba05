"""`llamabundle check | build | fetch | verify | publish`: a recipe's bundle in the store, built, fetched,
verified and published.

click only: parse, call llamabundle.pipeline or llamabundle.verify, print, exit code (a miss of `check`
is exit 1)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import click

from ..settings import COMPILER_CACHES
from .context import Ctx, pass_ctx
from .options import JSON_OPT, RECIPE_ARG, STORE_OPT, InputFile, owned
from .output import emit

LEVELS = ("static", "load", "gpu", "ops")  # verify.Level, spelled out so that the CLI starts without importing it


@click.command()
@RECIPE_ARG
@STORE_OPT
@JSON_OPT
@pass_ctx
def check(c: Ctx, recipe_path: Path, store_url: str | None, as_json: bool) -> None:
    """Is a bundle for this recipe's inputs in the store? Exit 0 on a hit, 1 on a miss."""
    from .. import keys

    keyed = keys.resolve(keys.load(recipe_path), env=c.env)
    store = c.store(store_url, keyed)
    entry = store.lookup(keyed.key)
    c.actions_report(key=keyed.key, hit=entry is not None, location=entry.location if entry else None,
                     zip_name=entry.zip_name if entry else None)
    if as_json:
        emit({"schema": 1, "key": keyed.key, "hit": entry is not None, "store": store.url,
              "location": entry.location if entry else None})
    elif entry:
        click.echo(f"hit   {keyed.key}  {entry.location}")
    else:
        click.echo(f"miss  {keyed.key}  not in {store.url}")
    raise SystemExit(0 if entry else 1)


@click.command()
@RECIPE_ARG
@STORE_OPT
@click.option("--force", is_flag=True, help="Build even when the store has this key.")
@click.option("--publish/--no-publish", default=None,
              help="Store the result (default: yes for a local directory store, no for github:).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), callback=owned("--out"), help="Leave the unpacked bundle in this new directory.")
@click.option("--jobs", "-j", type=click.IntRange(1), help="Parallel compile jobs (default: ninja's).")
@click.option("--clean", is_flag=True, help="Remove the cached build directory first.")
@click.option("--compiler-cache", type=click.Choice(COMPILER_CACHES),
              help="Compile C, C++ and CUDA through this compiler cache (default: LLAMABUNDLE_COMPILER_CACHE, else auto: "
                   "ccache, else sccache, when on PATH). Changes no byte and no key; its statistics are in --json.")
@click.option("--toolkit-source", type=click.Choice(["redist", "pypi", "installer", "system"]),
              help="Where the CUDA toolkit comes from, overriding cuda.source (not part of the key).")
@click.option("--check-reproducible", is_flag=True,
              help="Build, then build again from the source copied elsewhere in a new build directory; "
                   "exit 5 naming the files (and first offsets) that differ unless both zips are identical.")
@click.option("--ops-tool", is_flag=True,
              help="Also build llama.cpp's test-backend-ops in the same tree, beside the zip as <zip>.test-backend-ops "
                   "(never in the bundle), for verify --level ops. Builds even on a hit.")
@JSON_OPT
@pass_ctx
def build(c: Ctx, recipe_path: Path, store_url: str | None, force: bool, publish: bool | None, out: Path | None,
          jobs: int | None, clean: bool, compiler_cache: str | None, toolkit_source: str | None, check_reproducible: bool,
          ops_tool: bool, as_json: bool) -> None:
    """Build the recipe's bundle, or fetch and verify it when the store already has it."""
    from .. import keys, pipeline

    keyed = keys.resolve(keys.load(recipe_path), env=c.env)
    store = c.store(store_url, keyed)
    if publish is None:  # a local directory store is a cache: fill it; a remote one only when asked
        from ..store.local import LocalStore

        publish = isinstance(store, LocalStore)
    settings = dataclasses.replace(c.settings, compiler_cache=compiler_cache) if compiler_cache else c.settings
    outcome = pipeline.build(keyed, settings=settings, store=store, log=c.log, env=c.env, force=force,
                             publish=publish, out=out, jobs=jobs, clean=clean,
                             toolkit_source=toolkit_source, check_reproducible=check_reproducible, ops_tool=ops_tool)
    c.actions_report(key=outcome.key, hit=outcome.hit, location=outcome.location, zip_path=outcome.zip_path)
    if as_json:
        emit(outcome.to_json())
        return
    what = "cache hit, verified" if outcome.hit else "built and verified"
    click.echo(f"{what}: {outcome.zip_path}")
    if outcome.reproducible:
        click.echo(f"reproducible: a second build elsewhere gave the same zip (sha256 {outcome.reproducible['sha256']})")
    if outcome.location and not outcome.hit:
        click.echo(f"stored: {outcome.location}")


@click.command()
@click.argument("what", metavar="RECIPE|KEY")
@STORE_OPT
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), callback=owned("--out"), help="New directory to unpack into.")
@click.option("--level", type=click.Choice(LEVELS), default="static", show_default=True,
              help="Verification level (load runs llama-server from the bundle; gpu also wants a CUDA device).")
@click.option("--zip", "zip_", is_flag=True, help="Download the whole zip (kept in the cache) even from a store that keeps files by content.")
@JSON_OPT
@pass_ctx
def fetch(c: Ctx, what: str, store_url: str | None, out: Path, level: str, zip_: bool, as_json: bool) -> None:
    """Fetch a bundle from the store, verify it and unpack it: from a store that keeps files by content only the
    files the cache lacks (each checked as it is written); else the zip (download, sha256 and unpack in one pass)."""
    from .. import pipeline
    from .. import verify as verify_mod

    is_key = re.fullmatch(r"[0-9a-f]{64}", what) is not None and not os.path.exists(what)
    keyed = None
    if not is_key:  # a recipe path (exit 2 if not); a key needs no recipe loader and no backend's rules
        from .. import keys

        keyed = keys.resolve(keys.load(Path(what)), env=c.env)
    key_ = what if keyed is None else keyed.key
    outcome = pipeline.fetch(key_, store=c.store(store_url, keyed), settings=c.settings, log=c.log, out=out,
                             level=verify_mod.Level(level), expect=pipeline.expect_for(keyed) if keyed else None, zip_=zip_)
    if as_json:
        emit(outcome.to_json(fetch=True))
        return
    click.echo(f"fetched and verified: {outcome.out_dir}")


@click.command()
@click.argument("path", metavar="BUNDLE", type=click.Path(path_type=Path))
@click.option("--level", type=click.Choice(LEVELS), default="static", show_default=True,
              help="static: manifest, imports, GPU archs; load: also run llama-server --list-devices from a copy; "
                   "gpu: also each GPU backend must list its device (skipped where there is none); ops: also "
                   "llama.cpp's test-backend-ops against each GPU device, compared with the CPU backend.")
@click.option("--require-gpu", is_flag=True, help="Fail, rather than skip, the gpu level when no GPU is usable.")
@click.option("--ops-tool", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="The test-backend-ops of the bundle's build (default: <zip>.test-backend-ops beside the zip).")
@click.option("--ops-budget", type=click.FloatRange(10), metavar="SECONDS",
              help="Time for the ops level, all devices together (default: 300).")
@JSON_OPT
@pass_ctx
def verify(c: Ctx, path: Path, level: str, require_gpu: bool, ops_tool: Path | None, ops_budget: float | None,
           as_json: bool) -> None:
    """Verify a bundle zip or directory."""
    from .. import verify as verify_mod

    report = verify_mod.verify_bundle(path, level=verify_mod.Level(level), require_gpu=require_gpu,
                                      cache_dir=c.settings.cache_dir, ops_tool=ops_tool, ops_budget=ops_budget)
    if as_json:
        emit(report.to_json())
        return
    click.echo(f"verified {path}: {report.files} files, {report.bytes / 1e6:.1f} MB, key {report.key[:12]}")
    for line in report.lines():
        click.echo(f"  {line}")


@click.command()
@click.argument("path", metavar="BUNDLE.zip", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@STORE_OPT
@JSON_OPT
@pass_ctx
def publish(c: Ctx, path: Path, store_url: str | None, as_json: bool) -> None:
    """Verify a bundle zip and publish it to the store."""
    from .. import pipeline

    store = c.store(store_url)
    report, done = pipeline.publish_zip(path, store=store, settings=c.settings)
    if as_json:
        emit({"key": report.key, "created": done.created, "store": store.url, "location": done.entry.location,
              "verify": report.to_json()})
        return
    state = "published" if done.created else "already published"
    click.echo(f"{state}: {report.key} -> {done.entry.location}")


@click.command("bundle")
@RECIPE_ARG
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), callback=owned("--out"),
              help="A new or empty directory (the bundle unpacked there), or a path ending in .zip.")
@click.option("--toolkit-root", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The CUDA toolkit the build used (its bin/ and lib/): where the CUDA DLLs and libraries come from.")
@click.option("--msvc-redist", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Visual Studio's VC\\Redist\\MSVC\\<version> directory: where the CRT and OpenMP DLLs come from.")
@JSON_OPT
@pass_ctx
def bundle_command(c: Ctx, recipe_path: Path, build_dir: Path, out: Path, toolkit_root: Path | None,
                   msvc_redist: Path | None, as_json: bool) -> None:
    """Turn the output of an existing llama.cpp build into a verified bundle of the recipe: collect the
    runtime libraries, write bundle.json, pack and verify (what `build` does after compiling), on any OS."""
    from .. import keys, repair

    outcome = repair.bundle_build(keys.load(recipe_path), build_dir, out=out, toolkit_root=toolkit_root, msvc_redist=msvc_redist,
                                  settings=c.settings, log=c.log, env=c.env)
    if as_json:
        emit(outcome.to_json())
        return
    click.echo(f"bundled and verified: {outcome.out_dir or outcome.zip_path} (key {outcome.key[:12]})")


@click.command()
@click.argument("recipes", metavar="[RECIPE...]", nargs=-1)
@STORE_OPT
@click.option("--legs", "legs_path", type=InputFile(exists=True),
              help="A YAML file of the release's legs (`legs:`, each a `recipe:` and its runner settings, e.g. os and "
                   "cache sizes), copied into each leg of the matrix; without RECIPE its recipes are planned.")
@JSON_OPT
@pass_ctx
def matrix(c: Ctx, recipes: tuple[str, ...], store_url: str | None, legs_path: Path | None, as_json: bool) -> None:
    """The GitHub Actions matrix of the recipes whose bundles the store does not have yet (RECIPE: names or
    paths; default: the legs file's, else every shipped recipe). Keys are computed without build tools and the
    store is asked once per recipe. Under GitHub Actions the step outputs `matrix` and `count` are set."""
    from .. import matrix as matrix_mod

    legs = matrix_mod.load_legs(legs_path) if legs_path is not None else None
    keyed = matrix_mod.keyed_recipes(matrix_mod.recipes_of(recipes, legs), env=c.env)
    store = c.store(store_url, keyed)
    got = matrix_mod.plan(keyed, store, legs=legs)
    include = got.include()
    c.actions_matrix({"include": include}, rows=got.rows)
    if as_json:
        emit({"schema": 1, "store": store.url, "recipes": [r.to_json() for r in got.rows], "matrix": {"include": include},
              "count": len(include)})
        return
    for r in got.rows:
        click.echo(f"hit   {r.recipe}  {r.key}  {r.location}" if r.hit else f"miss  {r.recipe}  {r.key}")
    click.echo(f"{len(include)} of {len(got.rows)} to build")


COMMANDS: tuple[click.Command, ...] = (check, build, fetch, verify, publish, bundle_command, matrix)
