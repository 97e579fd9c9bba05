"""click parameters that several commands share: `--json`, `--store`, `--dest`, `--nvidia-smi`, the RECIPE
argument, and `InputFile` (a file argument that is checked before anything opens it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

JSON_OPT = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (schema 1) on stdout.")
STORE_OPT = click.option("--store", "store_url", metavar="URL",
                         help="Bundle store: a directory, file://DIR, github:OWNER/REPO or oci://HOST[:PORT]/REPO (default: $LLAMABUNDLE_STORE or <cache>/store).")


def owned(whose: str) -> Any:
    """A click callback naming whose the directory a path option gives is (errors.own): a disk error under it says so."""
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None:
            from ..errors import own

            own(value, whose)
        return value
    return callback


DEST_OPT = click.option("--dest", type=click.Path(file_okay=False, path_type=Path), callback=owned("the install root, --dest"),
                        help="Install root (default: $LLAMABUNDLE_DATA_DIR or the user data directory).")
SMI_OPT = click.option("--nvidia-smi", "nvidia_smi", metavar="PATH", help="The nvidia-smi to run (default: the one on PATH).")
RECIPE_ARG = click.argument("recipe_path", metavar="RECIPE", type=click.Path(dir_okay=False, path_type=Path))


class InputFile(click.Path):
    """A file the command reads. A FIFO, device or socket is refused before it is opened (reading a FIFO
    blocks for ever): a usage error, exit 2."""

    def __init__(self, *, exists: bool = False) -> None:
        super().__init__(exists=exists, dir_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        p = Path(os.fsdecode(rv))
        if p.exists() and not p.is_file():
            self.fail(f"{p} is not a regular file (a FIFO, device or socket)", param, ctx)
        return rv
