"""click commands only: parse arguments, call one function, print, return an exit code (DESIGN §8)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import click

from .. import __version__
from ..errors import LlamaBundleError, from_os_error
from ..lazy import lazy_import
from ..log import Log
from ..recipe import (
    Recipe,
    Settings,
    canonical_json,
    json_schema,
    load_recipe,
    shipped_recipes,
)
from ..store.base import Store, open_store
from . import output as cli_json

pipeline = lazy_import("llamabundle.pipeline")
verify_mod = lazy_import("llamabundle.verify")
LEVELS = ("static", "load", "gpu")  # verify.Level, spelled out so that the CLI starts without importing it


class Ctx:
    def __init__(self, *, debug: bool, quiet: bool) -> None:
        self.env = dict(os.environ)
        self.settings = Settings.from_env(self.env)
        self.log = Log(quiet=quiet, github_actions=self.settings.github_actions)
        self.debug = debug

    def store(self, url: str | None, recipe: Recipe | None = None) -> Store:
        """The store; given the recipe, a GitHub store looks its release up by the recipe's tag."""
        return open_store(url or self.env.get("LLAMABUNDLE_STORE") or str(self.settings.cache_dir / "store"),
                          settings=self.settings, log=self.log, tags={recipe.key(): recipe.tag()} if recipe else None)


    def actions_report(self, *, key: str, hit: bool, location: str | None, zip_path: Path | None = None) -> None:
        """Under GitHub Actions: step outputs (key, hit, location: the names and values of the --json output)
        and a line of the step summary."""
        s = self.settings
        if s.github_output is not None:
            with open(s.github_output, "a", encoding="utf-8") as f:
                f.write(f"key={key}\nhit={'true' if hit else 'false'}\nlocation={location or ''}\n")
        if s.github_step_summary is not None:
            size = sha = ""
            if zip_path is not None and zip_path.is_file():
                from ..bundle import sha256_file

                size, sha = f"{zip_path.stat().st_size / 1e6:.1f} MB", f"`{sha256_file(zip_path)}`"
            with open(s.github_step_summary, "a", encoding="utf-8") as f:
                if f.tell() == 0:
                    f.write("| key | result | size | sha256 |\n|---|---|---|---|\n")
                f.write(f"| `{key[:12]}` | {'hit' if hit else ('built' if zip_path else 'miss')} | {size} | {sha} |\n")


pass_ctx = click.make_pass_decorator(Ctx)
STORE_OPT = click.option("--store", "store_url", metavar="URL",
                         help="Bundle store: a directory, file://DIR or github:OWNER/REPO (default: $LLAMABUNDLE_STORE or <cache>/store).")
JSON_OPT = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (schema 1) on stdout.")
RECIPE_ARG = click.argument("recipe_path", metavar="RECIPE", type=click.Path(dir_okay=False, path_type=Path))


def _emit(data: Any) -> None:
    cli_json.emit(data)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llamabundle")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.option("--quiet", "-q", is_flag=True, help="Only errors and results.")
@click.pass_context
def cli(ctx: click.Context, debug: bool, quiet: bool) -> None:
    """Build, verify, cache and publish llama.cpp binary bundles from YAML recipes."""
    ctx.obj = Ctx(debug=debug, quiet=quiet)


@cli.group()
def recipe() -> None:
    """Recipe tools."""


@recipe.command("lint")
@click.argument("paths", metavar="RECIPE...", nargs=-1, required=True, type=click.Path(path_type=Path))
@JSON_OPT
@pass_ctx
def recipe_lint(c: Ctx, paths: tuple[Path, ...], as_json: bool) -> None:
    """Check recipes against schema 1; exit 2 on the first problem of any file."""
    failed: list[LlamaBundleError] = []
    results: list[dict[str, Any]] = []
    for p in paths:
        try:
            r = load_recipe(p)
        except LlamaBundleError as e:
            c.log.error(e)  # the error itself: under GitHub Actions an annotation at its file, line and column
            failed.append(e)
            results.append({"path": str(p), "ok": False, "name": None, "key": None, "error": cli_json.error_json(e)})
            continue
        results.append({"path": str(p), "ok": True, "name": r.name, "key": r.key(), "error": None})
        if not as_json:
            click.echo(f"ok  {p}  ({r.name}, key {r.key()[:12]})")
    if as_json:  # one object, also on failure: the first problem is its error
        cli_json.emit({"recipes": results, **({"error": cli_json.error_json(failed[0])} if failed else {})}, ok=not failed)
    if failed:
        raise SystemExit(failed[0].exit_code)


@recipe.command("list")
@JSON_OPT
def recipe_list(as_json: bool) -> None:
    """The recipes that ship with llamabundle (any RECIPE argument takes their name)."""
    rows = []
    for name, path in shipped_recipes().items():
        r = load_recipe(path)
        rows.append({"name": name, "path": str(path), "platform": r.platform, "backends": list(r.backends),
                     "compiler": r.toolchain.compiler, "cuda": r.cuda.toolkit if r.cuda else None})
    if as_json:
        _emit({"recipes": rows})
        return
    for row in rows:
        cuda = f", CUDA {row['cuda']}" if row["cuda"] else ""
        click.echo(f"{row['name']:28} {row['platform']:16} {'+'.join(row['backends'])} ({row['compiler']}{cuda})")


@recipe.command("schema")
def recipe_schema() -> None:
    """Print the recipe's JSON schema."""
    click.echo(json.dumps(json_schema(), indent=2, sort_keys=True))  # the schema itself, not a report


@cli.command()
@RECIPE_ARG
@JSON_OPT
@pass_ctx
def show(c: Ctx, recipe_path: Path, as_json: bool) -> None:
    """Show a recipe, its key and its build plan (nothing is run)."""
    r = load_recipe(recipe_path)
    from ..build import locate_tools

    plan = pipeline.show_plan(r, c.settings, locate_tools(path=c.env.get("PATH")))
    data = {"schema": 1, "name": r.name, "key": r.key(), "tag": r.tag(), "platform": r.platform,
            "commit": r.llama_cpp.commit, "backends": list(r.backends), "driver_floor": r.driver_floor,
            "sources": [pipeline.source_mod.describe(s) for s in r.llama_cpp.sources], "plan": plan.to_json()}
    if as_json:
        _emit(data)
        return
    click.echo(f"recipe    {recipe_path} ({r.name})")
    click.echo(f"platform  {r.platform}   backends {', '.join(r.backends)}   compiler {r.toolchain.compiler}")
    click.echo(f"llama.cpp {r.llama_cpp.commit}  from {' | '.join(data['sources'])}")
    if r.cuda:
        click.echo(f"cuda      {r.cuda.toolkit} ({r.cuda.source}); archs {' '.join(r.cuda.archs)}; driver >= {r.driver_floor}")
    click.echo(f"key       {data['key']}")
    click.echo(f"tag       {data['tag']}")
    for path, _text in plan.files:
        click.echo(f"writes    {path}")
    click.echo("configure " + shlex.join(plan.configure))
    click.echo("build     " + shlex.join(plan.build))
    click.echo("bundle    " + ", ".join(plan.programs + plan.backends))


@cli.command()
@RECIPE_ARG
@click.option("--explain", is_flag=True, help="Print the canonical JSON the key is the sha256 of.")
@JSON_OPT
def key(recipe_path: Path, explain: bool, as_json: bool) -> None:
    """Print the recipe's cache key."""
    r = load_recipe(recipe_path)
    if as_json:
        _emit({"schema": 1, "key": r.key(), "inputs": r.key_inputs()})
    elif explain:
        click.echo(canonical_json(r.key_inputs()))
        click.echo(f"sha256 = {r.key()}")
    else:
        click.echo(r.key())


@cli.command()
@RECIPE_ARG
@STORE_OPT
@JSON_OPT
@pass_ctx
def check(c: Ctx, recipe_path: Path, store_url: str | None, as_json: bool) -> None:
    """Is a bundle for this recipe's inputs in the store? Exit 0 on a hit, 1 on a miss."""
    r = load_recipe(recipe_path)
    store = c.store(store_url, r)
    entry = store.lookup(r.key())
    c.actions_report(key=r.key(), hit=entry is not None, location=entry.location if entry else None)
    if as_json:
        _emit({"schema": 1, "key": r.key(), "hit": entry is not None, "store": store.url,
               "location": entry.location if entry else None})
    elif entry:
        click.echo(f"hit   {r.key()}  {entry.location}")
    else:
        click.echo(f"miss  {r.key()}  not in {store.url}")
    raise SystemExit(0 if entry else 1)


@cli.command()
@RECIPE_ARG
@STORE_OPT
@click.option("--force", is_flag=True, help="Build even when the store has this key.")
@click.option("--publish/--no-publish", default=None,
              help="Store the result (default: yes for a local directory store, no for github:).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Leave the unpacked bundle in this new directory.")
@click.option("--jobs", "-j", type=click.IntRange(1), help="Parallel compile jobs (default: ninja's).")
@click.option("--clean", is_flag=True, help="Remove the cached build directory first.")
@click.option("--toolkit-source", type=click.Choice(["redist", "pypi", "installer", "system"]),
              help="Where the CUDA toolkit comes from, overriding cuda.source (not part of the key).")
@click.option("--check-reproducible", is_flag=True,
              help="Build, then build again from the source copied elsewhere in a new build directory; "
                   "exit 5 naming the files (and first offsets) that differ unless both zips are identical.")
@JSON_OPT
@pass_ctx
def build(c: Ctx, recipe_path: Path, store_url: str | None, force: bool, publish: bool | None, out: Path | None,
          jobs: int | None, clean: bool, toolkit_source: str | None, check_reproducible: bool, as_json: bool) -> None:
    """Build the recipe's bundle, or fetch and verify it when the store already has it."""
    r = load_recipe(recipe_path)
    store = c.store(store_url, r)
    if publish is None:  # a local directory store is a cache: fill it; a remote one only when asked
        from ..store.local import LocalStore

        publish = isinstance(store, LocalStore)
    outcome = pipeline.build(r, settings=c.settings, store=store, log=c.log, env=c.env, force=force,
                             publish=publish, out=out, jobs=jobs, clean=clean,
                             toolkit_source=toolkit_source, check_reproducible=check_reproducible)
    c.actions_report(key=outcome.key, hit=outcome.hit, location=outcome.location, zip_path=outcome.zip_path)
    if as_json:
        _emit(outcome.to_json())
        return
    what = "cache hit, verified" if outcome.hit else "built and verified"
    click.echo(f"{what}: {outcome.zip_path}")
    if outcome.reproducible:
        click.echo(f"reproducible: a second build elsewhere gave the same zip (sha256 {outcome.reproducible['sha256']})")
    if outcome.location and not outcome.hit:
        click.echo(f"stored: {outcome.location}")


@cli.command()
@click.argument("what", metavar="RECIPE|KEY")
@STORE_OPT
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="New directory to unpack into.")
@click.option("--level", type=click.Choice(LEVELS), default="static", show_default=True,
              help="Verification level (load runs llama-server from the bundle; gpu also wants a CUDA device).")
@JSON_OPT
@pass_ctx
def fetch(c: Ctx, what: str, store_url: str | None, out: Path, level: str, as_json: bool) -> None:
    """Fetch a bundle from the store, verify it and unpack it (download, sha256 and unpack in one pass)."""
    is_key = re.fullmatch(r"[0-9a-f]{64}", what) is not None and not os.path.exists(what)
    r = None if is_key else load_recipe(Path(what))  # anything else is a recipe path (exit 2 if not)
    key_ = what if r is None else r.key()
    outcome = pipeline.fetch(key_, store=c.store(store_url, r), settings=c.settings, log=c.log, out=out,
                             level=verify_mod.Level(level), expect=pipeline.expect_for(r) if r is not None else None)
    if as_json:
        _emit(outcome.to_json(fetch=True))
        return
    click.echo(f"fetched and verified: {outcome.out_dir}")


@cli.command()
@click.argument("path", metavar="BUNDLE", type=click.Path(path_type=Path))
@click.option("--level", type=click.Choice(LEVELS), default="static", show_default=True,
              help="static: manifest, imports, GPU archs; load: also run llama-server --list-devices from a copy; "
                   "gpu: also a CUDA device must be listed (skipped without an NVIDIA driver).")
@click.option("--require-gpu", is_flag=True, help="Fail, rather than skip, the gpu level when no GPU is usable.")
@JSON_OPT
@pass_ctx
def verify(c: Ctx, path: Path, level: str, require_gpu: bool, as_json: bool) -> None:
    """Verify a bundle zip or directory."""
    report = verify_mod.verify_bundle(path, level=verify_mod.Level(level), require_gpu=require_gpu)
    if as_json:
        _emit(report.to_json())
        return
    click.echo(f"verified {path}: {report.files} files, {report.bytes / 1e6:.1f} MB, key {report.key[:12]}")
    for line in report.lines():
        click.echo(f"  {line}")


@cli.command()
@click.argument("path", metavar="BUNDLE.zip", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@STORE_OPT
@JSON_OPT
@pass_ctx
def publish(c: Ctx, path: Path, store_url: str | None, as_json: bool) -> None:
    """Verify a bundle zip and publish it to the store."""
    store = c.store(store_url)
    report, done = pipeline.publish_zip(path, store=store, settings=c.settings)
    if as_json:
        _emit({"key": report.key, "created": done.created, "store": store.url, "location": done.entry.location,
               "verify": report.to_json()})
        return
    state = "published" if done.created else "already published"
    click.echo(f"{state}: {report.key} -> {done.entry.location}")


def _run(args: list[str]) -> None:
    """The command; under --json a failure also prints its JSON object on stdout (then main() reports it)."""
    try:
        try:
            cli.main(args=args, prog_name="llamabundle", standalone_mode=False)
        except OSError as e:  # a full, read-only or missing disk path that no step named: still one clear message
            raise from_os_error(e) from e
    except SystemExit:
        raise
    except BaseException as e:
        if cli_json.wants_json(args):
            cli_json.emit_failure(e)
        raise


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (a CI cancel, `kill`) cleans up as Ctrl-C does: children ended, exit 130


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    if argv is None and hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, _terminated)
    debug = "--debug" in args or os.environ.get("LLAMABUNDLE_DEBUG") == "1"
    try:
        _run(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        code = 130
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        code = 130
    except click.ClickException as e:
        e.show()
        code = 2 if isinstance(e, click.UsageError) else e.exit_code
    except LlamaBundleError as e:
        Log(github_actions=os.environ.get("GITHUB_ACTIONS") == "true").error(e)
        if debug:
            traceback.print_exc()
        code = e.exit_code
    except Exception as e:  # a bug in llamabundle: say so plainly
        click.echo(f"internal error: {type(e).__name__}: {e}", err=True)
        click.echo("  this is a bug in llamabundle; rerun with --debug and report the traceback", err=True)
        if debug:
            traceback.print_exc()
        code = 70
    sys.exit(code)


from .toolkit import toolkit_group; cli.add_command(toolkit_group)  # noqa: E402,E702
from .archs import archs_cmd; cli.add_command(archs_cmd)  # noqa: E402,E702
from .app import register as register_app; register_app(cli)  # noqa: E402,E702
from .plan import plan_command; cli.add_command(plan_command)  # noqa: E402,E702
from .deps import deps_command; cli.add_command(deps_command)  # noqa: E402,E702
