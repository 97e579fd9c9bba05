"""`llamabundle index`: a static site (index.html + index.json, for GitHub Pages) of every bundle in a store.

click only: parse, call llamabundle.index_site, print, exit code."""

from __future__ import annotations

from pathlib import Path

import click

from .context import Ctx, pass_ctx
from .options import JSON_OPT, STORE_OPT, owned
from .output import emit


@click.command("index")
@STORE_OPT
@click.option("--out", required=True, metavar="DIR", type=click.Path(path_type=Path), callback=owned("--out"),
              help="The site's directory: new, empty, or a previous index (replaced as a whole, atomically).")
@JSON_OPT
@pass_ctx
def index_cmd(c: Ctx, store_url: str | None, out: Path, as_json: bool) -> None:
    """Write a static site of every bundle in the store: DIR/index.html (one self-contained page, grouped by
    platform, sortable) and DIR/index.json (the same data). Nothing is half-written: the site is written
    beside DIR and renamed into place."""
    from .. import index_site
    from ..runtime.results import utc_timestamp

    store = c.store(store_url)
    epoch = c.settings.source_date_epoch  # a reproducible site when SOURCE_DATE_EPOCH is set
    outcome = index_site.build_index(store, out, generated_at=utc_timestamp(epoch), log=c.log)
    if as_json:
        emit(outcome.to_json())
        return
    n = len(outcome.site.rows)
    click.echo(f"indexed {n} bundle{'' if n == 1 else 's'} of {store.url}: {outcome.out / 'index.html'}")


COMMANDS: tuple[click.Command, ...] = (index_cmd,)
