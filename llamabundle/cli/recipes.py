"""`llamabundle recipe lint|list|schema`, `show` and `key`: commands that read recipes and run nothing.

click only: parse, call llamabundle.recipe (and pipeline.show_plan), print, exit code."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import LlamaBundleError, ToolchainError
from .context import Ctx, pass_ctx
from .options import JSON_OPT, RECIPE_ARG
from .output import emit, error_json

if TYPE_CHECKING:
    from ..recipe import HostFacts, Recipe


@click.group()
def recipe() -> None:
    """Recipe tools."""


@recipe.command("lint")
@click.argument("paths", metavar="RECIPE...", nargs=-1, required=True, type=click.Path(path_type=Path))
@JSON_OPT
@pass_ctx
def recipe_lint(c: Ctx, paths: tuple[Path, ...], as_json: bool) -> None:
    """Check recipes against schema 1; exit 2 on the first problem of any file. The key is shown where this
    machine can compute it (an unpinned compiler's needs that compiler; an unpinned glslc's, glslc). A warning
    names each CMake setting known to download at build time (a build stops there: it runs without a network)
    and each tool the recipe does not pin."""
    from .. import keys, offline

    failed: list[LlamaBundleError] = []
    results: list[dict[str, Any]] = []
    for p in paths:
        try:
            r = keys.load(p)
        except LlamaBundleError as e:
            c.log.error(e)  # the error itself: under GitHub Actions an annotation at its file, line and column
            failed.append(e)
            results.append({"path": str(p), "ok": False, "name": None, "key": None, "error": error_json(e), "warnings": []})
            continue
        try:  # a valid recipe whose key needs a tool this machine lacks (glslc, an unpinned compiler) is still valid
            key, why = keys.resolve(r, env=c.env).key, ""
        except ToolchainError as e:
            key, why = None, e.what.removeprefix(f"{r.origin}: ")
        said = [("downloads at build time", why) for _, why in offline.downloading(dict(r.cmake))]
        said += [("not pinned", why) for why in keys.unpinned(r)]
        warnings = [why for _, why in said]
        results.append({"path": str(p), "ok": True, "name": r.name, "key": key, "error": None, "warnings": warnings})
        if not as_json:
            click.echo(f"ok  {p}  ({r.name}, key {key[:12]})" if key else f"ok  {p}  ({r.name}; no key here: {why})")
            for kind, w in said:
                c.log.warn(f"{p}: {kind}: {w}")
    if as_json:  # one object, also on failure: the first problem is its error
        emit({"recipes": results, **({"error": error_json(failed[0])} if failed else {})}, ok=not failed)
    if failed:
        raise SystemExit(failed[0].exit_code)


@recipe.command("list")
@JSON_OPT
@pass_ctx
def recipe_list(c: Ctx, as_json: bool) -> None:
    """The recipes that ship with llamabundle (any RECIPE argument takes their name)."""
    from .. import keys
    from ..recipe import shipped_recipes

    rows: list[dict[str, Any]] = []
    for name, path in shipped_recipes().items():
        r = keys.load(path)
        rows.append({"name": name, "path": str(path), "platform": r.platform, "backends": list(r.backends),
                     "compiler": r.toolchain.compiler, "cuda": r.cuda.toolkit if r.cuda else None})
    if as_json:
        emit({"recipes": rows})
        return
    for row in rows:
        cuda = f", CUDA {row['cuda']}" if row["cuda"] else ""
        click.echo(f"{row['name']:28} {row['platform']:16} {'+'.join(row['backends'])} ({row['compiler']}{cuda})")


@recipe.command("schema")
def recipe_schema() -> None:
    """Print the recipe's JSON schema."""
    from ..recipe.schema import json_schema

    click.echo(json.dumps(json_schema(), indent=2, sort_keys=True))  # the schema itself, not a report


@click.command()
@RECIPE_ARG
@JSON_OPT
@pass_ctx
def show(c: Ctx, recipe_path: Path, as_json: bool) -> None:
    """Show a recipe, its key, its toolchain and its build plan (nothing is built; for MSVC, vswhere and
    vcvars64.bat run to show the environment the build would use)."""
    from .. import backends, keys, pipeline
    from .. import source as source_mod

    keyed = keys.resolve(keys.load(recipe_path), env=c.env)
    r = keyed.recipe
    from .. import platforms
    from ..build import locate_tools
    from ..log import Log
    from ..platforms.base import HostToolchain

    try:  # the tools the build would run, pinned ones too (glslc's path reaches CMake)
        keyed = keys.for_build(keyed, env=c.env)
        toolchain = platforms.get(r.platform).setup_toolchain(r, keyed.host, env=c.env, log=Log(quiet=True))
        unavailable = None
    except LlamaBundleError as e:  # shown, not fatal: show also runs where the recipe cannot be built
        toolchain, unavailable = HostToolchain(), f"{e.what}" + (f" ({e.why})" if e.why else "")
    # the tools the build would find: on the PATH the toolchain's environment sets (vcvars adds VS's cmake)
    plan = pipeline.show_plan(keyed, c.settings, locate_tools(path={**c.env, **toolchain.env}.get("PATH"),
                                                                   compiler_cache_choice=c.settings.compiler_cache), toolchain)
    pin = pin_line(r, keyed.host)
    from ..platforms.load import planned_env

    load_env = planned_env(r.platform)
    data: dict[str, Any] = {"schema": 1, "name": r.name, "key": keyed.key, "tag": keyed.tag, "platform": r.platform,
                            "commit": r.llama_cpp.commit, "backends": list(r.backends), "driver_floor": r.driver_floor,
                            "sources": [source_mod.describe(s) for s in r.llama_cpp.sources],
                            "toolchain": {"pin": pin, "summary": list(toolchain.summary), "unavailable": unavailable,
                                          "runtime_dirs": {str(d): o for d, o in toolchain.runtime_dirs}},
                            "plan": plan.to_json(), "load_env": load_env}
    if as_json:
        emit(data)
        return
    click.echo(f"recipe    {recipe_path} ({r.name})")
    click.echo(f"platform  {r.platform}   backends {', '.join(r.backends)}   compiler {r.toolchain.compiler}")
    click.echo(f"llama.cpp {r.llama_cpp.commit}  from {' | '.join(data['sources'])}")
    for b in backends.of(r):
        if (line := b.show_line(r, keyed.host)) is not None:
            click.echo(f"{b.name:<10}{line}")
    click.echo(f"key       {data['key']}")
    click.echo(f"tag       {data['tag']}")
    click.echo(f"pinned    {pin}")
    for line in toolchain.summary:
        click.echo(f"toolchain {line}")
    if unavailable:
        click.echo(f"toolchain not set up here: {unavailable}")
    for name, value in plan.env:
        click.echo(f"env       {name}={value}")
    for fixed, real in plan.links:
        click.echo(f"links     {fixed} -> {real}")
    for path, _text in plan.files:
        click.echo(f"writes    {path}")
    for command in plan.commands:
        click.echo("runs      " + shlex.join(command))
    click.echo("configure " + shlex.join(plan.configure))
    click.echo("build     " + shlex.join(plan.build))
    click.echo("bundle    " + ", ".join(plan.programs + plan.backends))
    click.echo("load env  " + " ".join(f"{k}={v}" for k, v in load_env.items()))


def pin_line(r: Recipe, host: HostFacts) -> str:
    """The compiler the key holds and where it comes from: the recipe's pin, or what was found here."""
    t = r.toolchain
    if t.compiler == "msvc":
        from ..platforms.windows.msvc import pin_summary

        return pin_summary(r)
    if t.version:
        kind = ("exactly that version" if t.version.startswith("=") else
                "any such version (the recipe says they are interchangeable)")
        return f"{t.compiler} {t.version}: {kind}; `build` stops on another"
    return f"{t.compiler} not pinned: the key holds the one found here ({host.compiler or 'none'})"


@click.command()
@RECIPE_ARG
@click.option("--explain", is_flag=True, help="Print the canonical JSON the key is the sha256 of.")
@JSON_OPT
@pass_ctx
def key(c: Ctx, recipe_path: Path, explain: bool, as_json: bool) -> None:
    """Print the recipe's cache key."""
    from .. import keys
    from ..digest import canonical_json

    keyed = keys.resolve(keys.load(recipe_path), env=c.env)
    if as_json:
        emit({"schema": 1, "key": keyed.key, "inputs": keyed.inputs})
    elif explain:
        click.echo(canonical_json(keyed.inputs))
        click.echo(f"sha256 = {keyed.key}")
    else:
        click.echo(keyed.key)


COMMANDS: tuple[click.Command, ...] = (recipe, show, key)
