"""`llamabundle ui pack`: the web UI of a recipe's commit as an archive a recipe pins by sha256.

click only: parse, call llamabundle.pipeline.pack_ui, print, exit code."""

from __future__ import annotations

from pathlib import Path

import click

from .context import Ctx, pass_ctx
from .options import JSON_OPT, RECIPE_ARG, owned
from .output import emit


@click.group("ui")
def ui() -> None:
    """llama-server's web UI."""


@ui.command("pack")
@RECIPE_ARG
@click.option("--out", default=".", show_default=True, metavar="DIR", type=click.Path(file_okay=False, path_type=Path),
              callback=owned("--out"), help="Where the archive is written (webui-<source12>-<digest12>.tar).")
@JSON_OPT
@pass_ctx
def ui_pack(c: Ctx, recipe_path: Path, out: Path, as_json: bool) -> None:
    """Build the web UI of the recipe's llama.cpp commit (npm ci and npm run build in tools/ui; the one kept in
    the cache when there is one) and write it as a deterministic archive. Publish it (a release asset) and pin
    it in recipes as `ui: {url: …, sha256: …}`: every machine that builds them then embeds these bytes."""
    from .. import keys, pipeline

    recipe = keys.load(recipe_path)
    packed = pipeline.pack_ui(recipe, settings=c.settings, log=c.log, env=c.env, out_dir=out)
    if as_json:
        emit({"recipe": recipe.name, **packed.to_json()})
        return
    click.echo(f"{packed.path}  ({packed.assets.files} files, {packed.size} bytes; web UI source "
               f"{packed.assets.source[:12]}, digest {packed.assets.digest[:12]})")
    click.echo("publish it, then pin it in recipes of this commit:")
    click.echo(f"ui:\n  url: https://…/{packed.path.name}\n  sha256: {packed.sha256}")


COMMANDS: tuple[click.Command, ...] = (ui,)
