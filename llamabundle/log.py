"""The only rich Console: steps with timings, progress bars on a TTY, plain lines elsewhere,
GitHub Actions groups and annotations when running there."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn, TransferSpeedColumn)


@dataclass
class Log:
    """Where every human-facing line goes (stderr). Library code gets one passed in."""

    quiet: bool = False
    github_actions: bool = False
    console: Console = field(default_factory=lambda: Console(stderr=True, highlight=False))

    def info(self, msg: str) -> None:
        if not self.quiet:
            self.console.print(msg, markup=False, soft_wrap=True)

    def warn(self, msg: str) -> None:
        if self.github_actions:
            self.console.print(f"::warning::{msg}", markup=False)
        else:
            self.console.print(f"warning: {msg}", style="yellow", markup=False, soft_wrap=True)

    def error(self, text: str) -> None:
        first, _, rest = text.partition("\n")
        if self.github_actions:
            self.console.print(f"::error::{first}", markup=False, soft_wrap=True)
            if rest:
                self.console.print(rest, markup=False, soft_wrap=True)
        else:
            self.console.print(text, style="red", markup=False, soft_wrap=True)

    def command(self, argv: list[str]) -> None:
        self.info("+ " + " ".join(argv))

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        start = time.monotonic()
        if self.github_actions:
            self.console.print(f"::group::{title}", markup=False)
        else:
            self.info(f"==> {title}")
        ok = False
        try:
            yield
            ok = True
        finally:
            took = time.monotonic() - start
            if self.github_actions:
                self.console.print("::endgroup::", markup=False)
            mark = "done" if ok else "FAILED"
            self.info(f"    {title}: {mark} in {took:.1f}s")

    @contextmanager
    def progress(self, title: str, total: int | None = None, *, unit: str = "") -> Iterator["ProgressHandle"]:
        """A progress bar on a TTY; on a pipe, a plain line every 10 percent. unit="bytes": sizes and a rate."""
        if self.quiet or not self.console.is_terminal:
            yield _PlainProgress(self, title, total, unit=unit)
            return
        counts = ((DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()) if unit == "bytes"
                  else (MofNCompleteColumn(), TimeElapsedColumn()))
        with Progress(
            TextColumn("    {task.description}"),
            BarColumn(),
            *counts,
            console=self.console,
            transient=False,
        ) as bar:
            task = bar.add_task(title, total=total)
            yield _RichProgress(bar, task)


class ProgressHandle:
    def update(self, done: int, total: int | None = None) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class _RichProgress(ProgressHandle):
    def __init__(self, bar: Progress, task: object) -> None:
        self.bar, self.task = bar, task

    def update(self, done: int, total: int | None = None) -> None:
        self.bar.update(self.task, completed=done, total=total)  # type: ignore[arg-type]


class _PlainProgress(ProgressHandle):
    def __init__(self, log: Log, title: str, total: int | None, *, unit: str = "") -> None:
        self.log, self.title, self.total, self.last_decile, self.unit = log, title, total, -1, unit
        self.t0 = time.monotonic()

    def update(self, done: int, total: int | None = None) -> None:
        total = total or self.total
        if not total:
            return
        decile = done * 10 // total
        if decile != self.last_decile:
            self.last_decile = decile
            if self.unit == "bytes":
                rate = done / max(time.monotonic() - self.t0, 1e-6) / 1e6
                self.log.info(f"    {self.title}: {done / 1e6:.1f}/{total / 1e6:.1f} MB ({decile * 10}%, {rate:.0f} MB/s)")
            else:
                self.log.info(f"    {self.title}: {done}/{total} ({decile * 10}%)")
