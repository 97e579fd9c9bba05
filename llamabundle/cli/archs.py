"""`llamabundle archs RECIPE [--json]`: per GPU generation, whether the recipe's bundle runs it from SASS,
from PTX through the driver's JIT, or not at all, and the driver floor that follows.

click command only (DESIGN §8); registered on the main `cli` group by cli.py; ctx.obj is cli.Ctx.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..backends.cuda.report import ArchReport, Status, arch_report
from ..recipe import load_recipe
from . import output as cli_json

_STYLE = {Status.SASS: "green", Status.PTX_JIT: "yellow", Status.UNSUPPORTED: "red"}


def _header(report: ArchReport) -> list[str]:
    lines = [f"recipe   {report.recipe}  ({report.platform}, key {report.key[:12]})"]
    if report.toolkit is not None:
        lines.append(f"cuda     {report.toolkit}; archs {' '.join(report.archs)}; driver >= {report.driver_floor}")
    return lines


def plain_lines(report: ArchReport) -> list[str]:
    """The report as plain text: one line per generation and compute capability, then the summary."""
    rows = [(r.generation, r.cc, str(r.status), r.via or "-", ", ".join(r.examples[:2]), r.notes) for r in report.rows]
    head = ("generation", "cc", "status", "via", "examples", "notes")
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(5)]
    table = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[5] for row in (head, *rows)]
    return [*_header(report), *(line.rstrip() for line in table), f"summary  {report.summary()}"]


def print_table(report: ArchReport, console: Console) -> None:
    """The report as a rich table (on a terminal)."""
    for line in _header(report):
        console.print(line, markup=False, highlight=False)
    table = Table("Generation", "CC", "Status", "Via", "Examples", "Notes", show_lines=False)
    for r in report.rows:
        table.add_row(r.generation, r.cc, f"[{_STYLE[r.status]}]{r.status}[/]", r.via or "-", ", ".join(r.examples[:2]), r.notes)
    console.print(table)
    console.print(f"summary  {report.summary()}", markup=False, highlight=False)


@click.command("archs")
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (schema 1) on stdout.")
@click.pass_obj
def archs_cmd(c: Any, recipe_path: Path, as_json: bool) -> None:
    """Per GPU generation: does the bundle run it from SASS, from PTX through the driver's JIT, or not at all."""
    report = arch_report(load_recipe(recipe_path))
    if as_json:
        cli_json.emit(report.to_json())
    elif c.log.console.is_terminal and sys.stdout.isatty():
        print_table(report, c.log.console)
    else:
        for line in plain_lines(report):
            click.echo(line)
