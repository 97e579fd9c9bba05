"""The only rich Console: steps with timings, progress bars on a TTY, plain lines elsewhere,
GitHub Actions groups and annotations when running there, and the step outputs and step summary a bundle
step leaves for the rest of the workflow."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import LlamaBundleError

if TYPE_CHECKING:  # rich is imported when the first line is printed: a command that prints nothing never loads it
    from rich.console import Console
    from rich.progress import Progress

# ------------------------------------------------------------------ GitHub Actions workflow commands
# https://docs.github.com/actions/reference/workflow-commands-for-github-actions: a command is one line
# `::name k=v,k=v::data`; the runner reads only that line, so data and values are escaped, never wrapped.


def escape_data(text: str) -> str:
    """A workflow command's message: `%`, CR and LF as %25, %0D, %0A (as the runner's toolkit does)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A workflow command's property value: as message data, and `:` and `,` as %3A and %2C."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def workflow_command(name: str, message: str = "", properties: Mapping[str, object] | None = None) -> str:
    """`::name k=v,…::message`, escaped; properties whose value is None or empty are left out."""
    props = ",".join(f"{k}={escape_property(str(v))}" for k, v in (properties or {}).items()
                     if v is not None and str(v) != "")
    return f"::{name}{' ' + props if props else ''}::{escape_data(message)}"


def actions_report(*, output: Path | None, summary: Path | None, key: str, hit: bool, location: str | None,
                   zip_path: Path | None = None, zip_name: str | None = None) -> None:
    """A bundle step's result for later steps and for the run's page: the step outputs key, hit and location
    (the names and values of the --json output) and zip appended to `output` ($GITHUB_OUTPUT), and one row of
    a markdown table (key, hit/built/miss, the zip's size and sha256) appended to `summary`
    ($GITHUB_STEP_SUMMARY), the table's header first when the file is empty. A None path is not written.
    `zip`: the zip on this machine (`zip_path`, build's) with forward slashes, as actions/upload-artifact takes
    a path on Windows too; else the stored zip's file name (`zip_name`, check's hit); else empty (a miss)."""
    if output is not None:
        zip_out = zip_path.as_posix() if zip_path is not None else zip_name or ""
        with open(output, "a", encoding="utf-8") as f:
            f.write(f"key={key}\nhit={'true' if hit else 'false'}\nlocation={location or ''}\nzip={zip_out}\n")
    if summary is not None:
        size = sha = ""
        if zip_path is not None and zip_path.is_file():
            from .digest import sha256_file

            size, sha = f"{zip_path.stat().st_size / 1e6:.1f} MB", f"`{sha256_file(zip_path)}`"
        with open(summary, "a", encoding="utf-8") as f:
            if f.tell() == 0:
                f.write("| key | result | size | sha256 |\n|---|---|---|---|\n")
            f.write(f"| `{key[:12]}` | {'hit' if hit else ('built' if zip_path else 'miss')} | {size} | {sha} |\n")


def actions_matrix(*, output: Path | None, summary: Path | None, matrix: Mapping[str, Any],
                   rows: Sequence[tuple[str, str, bool]]) -> None:
    """A release plan for later jobs and the run's page: the step outputs `matrix` (the matrix as one line of
    JSON, for `fromJSON`) and `count` (its legs) appended to `output`, and a row per recipe (name, key, hit or
    to build) appended to `summary`. A None path is not written."""
    if output is not None:
        with open(output, "a", encoding="utf-8") as f:
            f.write(f"matrix={json.dumps(matrix, separators=(',', ':'), sort_keys=True)}\n"
                    f"count={len(matrix.get('include', []))}\n")
    if summary is not None:
        with open(summary, "a", encoding="utf-8") as f:
            if f.tell() == 0:
                f.write("| recipe | key | result |\n|---|---|---|\n")
            for name, key, hit in rows:
                f.write(f"| {name} | `{key[:12]}` | {'published' if hit else 'to build'} |\n")


_TITLES = {2: "usage or recipe error", 3: "toolchain error", 4: "build failed", 5: "verification failed",
           6: "store or network error"}  # DESIGN §8


def _annotation_file(path: str, ws: str | os.PathLike[str] | None) -> str:
    """A path as an annotation wants it: relative to the checkout (`ws`, $GITHUB_WORKSPACE) when inside it."""
    if ws and os.path.isabs(path):
        try:
            rel = os.path.relpath(path, ws)
        except ValueError:  # another drive (Windows)
            return path
        if not rel.startswith(".."):
            return rel.replace(os.sep, "/")
    return path


def _parts(err: str | LlamaBundleError) -> tuple[str, str, str, str]:
    """(what, why, fix, details) of an error, or of text rendered like LlamaBundleError.render()."""
    if isinstance(err, LlamaBundleError):
        return err.what, err.why, err.fix, err.details.rstrip()
    first, _, rest = str(err).partition("\n")
    what = first.removeprefix("error: ")
    why = fix = ""
    details: list[str] = []
    for line in rest.splitlines():
        if not details and line.startswith("  why: ") and not why and not fix:
            why = line[len("  why: "):]
        elif not details and line.startswith("  fix: ") and not fix:
            fix = line[len("  fix: "):]
        else:
            details.append(line)
    return what, why, fix, "\n".join(details).rstrip()


class Log:
    """Where every human-facing line goes (stderr). Library code gets one passed in. `console`: a rich Console
    to print to (default: one on stderr, made when the first line is printed); `workspace`: the checkout
    (Settings.github_workspace), for annotation paths."""

    def __init__(self, *, quiet: bool = False, github_actions: bool = False, console: Console | None = None,
                 workspace: str | os.PathLike[str] | None = None) -> None:
        self.quiet, self.github_actions, self.workspace = quiet, github_actions, workspace
        self._console = console

    @property
    def console(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True, highlight=False)
        return self._console

    def info(self, msg: str) -> None:
        if not self.quiet:
            self.console.print(msg, markup=False, soft_wrap=True)

    def raw(self, line: str) -> None:
        """One line exactly as given: no wrapping, markup, emoji or tab expansion (workflow commands)."""
        f = self.console.file
        f.write(line + "\n")
        f.flush()

    def warn(self, msg: str | LlamaBundleError) -> None:
        """A warning; under GitHub Actions one `::warning::` annotation (what, why, fix; location if known)."""
        if self.github_actions:
            details = self._annotate("warning", msg, title=None, rendered=False)
            if details:
                self.console.print(details, markup=False, soft_wrap=True)
        else:
            text = msg.render().removeprefix("error: ") if isinstance(msg, LlamaBundleError) else msg
            self.console.print(f"warning: {text}", style="yellow", markup=False, soft_wrap=True)

    def error(self, err: str | LlamaBundleError) -> None:
        """The one message of a failure (DESIGN §8). Under GitHub Actions one `::error::` annotation holding what,
        why and fix (and file/line/col when the error knows them), then any details as plain lines."""
        if not self.github_actions:
            text = err.render() if isinstance(err, LlamaBundleError) else err
            self.console.print(text, style="red", markup=False, soft_wrap=True)
            return
        code = err.exit_code if isinstance(err, LlamaBundleError) else 1
        details = self._annotate("error", err, title=f"llamabundle: {_TITLES.get(code, 'error')}", rendered=True)
        if details:
            self.console.print(details, markup=False, soft_wrap=True)

    def _annotate(self, kind: str, err: str | LlamaBundleError, *, title: str | None, rendered: bool) -> str:
        """Write the `::kind …::` line; returns the details, which are not part of it. Text is taken whole,
        or (`rendered`) as LlamaBundleError.render() wrote it."""
        what, why, fix, details = _parts(err) if rendered or isinstance(err, LlamaBundleError) else (err, "", "", "")
        lines = [what] + ([f"why: {why}"] if why else []) + ([f"fix: {fix}"] if fix else [])
        props: dict[str, object] = {}
        if isinstance(err, LlamaBundleError) and err.file:
            ws = self.workspace
            props = {"file": _annotation_file(err.file, ws), "line": err.line, "col": err.col}
        if title:
            props["title"] = title
        self.raw(workflow_command(kind, "\n".join(lines), props))
        return details

    def command(self, argv: list[str]) -> None:
        self.info("+ " + " ".join(argv))

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        start = time.monotonic()
        if self.github_actions:
            self.raw(workflow_command("group", title))
        else:
            self.info(f"==> {title}")
        ok = False
        try:
            yield
            ok = True
        finally:
            took = time.monotonic() - start
            if self.github_actions:
                self.raw("::endgroup::")
            mark = "done" if ok else "FAILED"
            self.info(f"    {title}: {mark} in {took:.1f}s")

    @contextmanager
    def progress(self, title: str, total: int | None = None, *, unit: str = "") -> Iterator[ProgressHandle]:
        """A progress bar on a TTY; on a pipe, a plain line every 10 percent. unit="bytes": sizes and a rate."""
        if self.quiet or not self.console.is_terminal:
            yield _PlainProgress(self, title, total, unit=unit)
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

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
