"""Path arguments of the CLI that are checked before anything opens them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


class InputFile(click.Path):
    """A file the command reads. A FIFO, device or socket is refused before it is opened (reading a FIFO
    blocks for ever): a usage error, exit 2."""

    def __init__(self, *, exists: bool = False) -> None:
        super().__init__(exists=exists, dir_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        p = Path(rv)
        if p.exists() and not p.is_file():
            self.fail(f"{p} is not a regular file (a FIFO, device or socket)", param, ctx)
        return rv
