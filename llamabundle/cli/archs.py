"""`llamabundle archs RECIPE [--json]`: per GPU generation, whether the recipe's bundle runs it from SASS,
from PTX through the driver's JIT, or not at all, and the driver floor that follows.

click only: parse, call backends.cuda.report, print (a rich table on a terminal, plain lines elsewhere).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from rich.console import Console

    from ..backends.cuda.report import ArchReport

from .context import Ctx, pass_ctx
from .options import JSON_OPT, RECIPE_ARG
from .output import emit

_STYLE = {"sass": "green", "ptx-jit": "yellow", "unsupported": "red"}  # report.Status


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
    table = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[5] for row in (head, *rows)]
    return [*_header(report), *(line.rstrip() for line in table), f"summary  {report.summary()}"]


def print_table(report: ArchReport, console: Console) -> None:
    """The report as a rich table (on a terminal)."""
    from rich.table import Table

    for line in _header(report):
        console.print(line, markup=False, highlight=False)
    table = Table("Generation", "CC", "Status", "Via", "Examples", "Notes", show_lines=False)
    for r in report.rows:
        table.add_row(r.generation, r.cc, f"[{_STYLE[r.status]}]{r.status}[/]", r.via or "-", ", ".join(r.examples[:2]), r.notes)
    console.print(table)
    console.print(f"summary  {report.summary()}", markup=False, highlight=False)


@click.command("archs")
@RECIPE_ARG
@JSON_OPT
@pass_ctx
def archs_cmd(c: Ctx, recipe_path: Path, as_json: bool) -> None:
    """Per GPU generation: does the bundle run it from SASS, from PTX through the driver's JIT, or not at all."""
    from .. import keys
    from ..backends.cuda.report import arch_report

    keyed = keys.resolve(keys.load(recipe_path), env=c.env)
    report = arch_report(keyed.recipe, key=keyed.key)
    if as_json:
        emit(report.to_json())
    elif c.log.console.is_terminal and sys.stdout.isatty():
        print_table(report, c.log.console)
    else:
        for line in plain_lines(report):
            click.echo(line)


COMMANDS: tuple[click.Command, ...] = (archs_cmd,)
