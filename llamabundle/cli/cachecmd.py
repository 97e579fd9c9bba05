"""`llamabundle cache list|prune`: what the cache holds by area and what a prune may remove, least recently
used first; and the prune itself, to a size (default: LLAMABUNDLE_CACHE_MAX). click only."""

from __future__ import annotations

import time

import click

from .context import Ctx, pass_ctx
from .options import JSON_OPT
from .output import emit


@click.group("cache")
def cache_group() -> None:
    """Show and trim the cache (LLAMABUNDLE_CACHE_DIR; bound: LLAMABUNDLE_CACHE_MAX)."""


def _size(raw: str | None) -> int | None:
    from ..settings import parse_size

    if raw is None:
        return None
    try:
        size = parse_size(raw)
    except ValueError:
        raise click.BadParameter(f"{raw!r} is not a size in bytes, or with K, M, G or T (e.g. 20G)") from None
    if size is None:
        raise click.BadParameter("give a size to prune to (e.g. 20G, or 0 for everything a prune may remove)")
    return size


@cache_group.command("list")
@JSON_OPT
@pass_ctx
def list_cmd(c: Ctx, as_json: bool) -> None:
    """Bytes per area, and each entry a prune may remove (fetched bundles, built zips, build trees, downloads,
    sources, toolkits, built web UIs, the deflate streams pack keeps), least recently used first."""
    from .. import cache

    areas = cache.usage(c.settings.cache_dir)
    found = cache.entries(c.settings.cache_dir)
    if as_json:
        emit({"cache": str(c.settings.cache_dir), "max": c.settings.cache_max, "bytes": sum(areas.values()),
              "areas": areas, "entries": [e.to_json() for e in found]})
        return
    bound = "no bound" if c.settings.cache_max is None else f"bound {c.settings.cache_max / 1e9:.1f} GB"
    click.echo(f"{c.settings.cache_dir}: {sum(areas.values()) / 1e6:.1f} MB ({bound}, LLAMABUNDLE_CACHE_MAX)")
    for area, size in areas.items():
        click.echo(f"  {area:10s} {size / 1e6:10.1f} MB")
    if found:
        click.echo("a prune removes these first (least recently used first):")
    now = time.time()
    for e in found:
        click.echo(f"  {e.area}/{e.path.name}  {e.size / 1e6:.1f} MB, used {(now - e.used) / 3600:.1f} h ago")


@cache_group.command("prune")
@click.option("--max", "max_size", metavar="SIZE", help="Prune to this size (default: LLAMABUNDLE_CACHE_MAX; 0: all a prune may remove).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@JSON_OPT
@pass_ctx
def prune_cmd(c: Ctx, max_size: str | None, dry_run: bool, as_json: bool) -> None:
    """Remove the least recently used fetched bundles, built zips, build trees, downloads, sources, toolkits and web UIs
    until the cache holds at most SIZE. Anything used in the last two minutes stays; so does a build tree
    another process is building in, and every source, toolkit and download while a build runs on this cache."""
    from .. import cache

    limit = _size(max_size)
    if limit is None:
        if c.settings.cache_max is None:
            raise click.UsageError("LLAMABUNDLE_CACHE_MAX is off: give --max SIZE")
        limit = c.settings.cache_max
    cache.sweep(c.settings.cache_dir)
    removed = cache.prune(c.settings.cache_dir, limit=limit, dry_run=dry_run)
    left = sum(cache.usage(c.settings.cache_dir).values())
    if as_json:
        emit({"cache": str(c.settings.cache_dir), "max": limit, "dry_run": dry_run,
              "removed": [e.to_json() for e in removed], "bytes": left})
        return
    verb = "would remove" if dry_run else "removed"
    for e in removed:
        click.echo(f"{verb} {e.area}/{e.path.name} ({e.size / 1e6:.1f} MB)")
    freed = sum(e.size for e in removed)
    click.echo(f"{verb} {len(removed)} entries, {freed / 1e6:.1f} MB; the cache holds {left / 1e6:.1f} MB"
               + (f" (over {limit / 1e6:.1f} MB: what is left is this run's, recent, or in use by a build running now)"
                  if left > limit and not dry_run else ""))


COMMANDS: tuple[click.Command, ...] = (cache_group,)
