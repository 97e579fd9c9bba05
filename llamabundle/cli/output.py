"""The one output contract of `--json` (DESIGN §8), shared by every command.

A report is one JSON object on stdout: `"schema": 1`, `"ok": true` and the command's data. A command run
with `--json` that fails prints one object too, `{"schema": 1, "ok": false, "error": {"what", "why", "fix",
"exit_code"}}` (a command with a partial result, e.g. `deps` with a missing library, keeps its data beside
the error); the human message still goes to stderr. Each command's output has a JSON schema in
`llamabundle/data/schemas/cli-<command>.schema.json` (`cli-error.schema.json` for failures)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import click

from ..errors import LlamaBundleError

SCHEMA = 1
INTERNAL_ERROR = 70
INTERRUPTED = 130
_REPORT = "json_report"  # the attribute of an error that carries the partial result printed with it


def emit(data: Mapping[str, Any], *, ok: bool = True) -> None:
    """Print one report: schema and ok first, then the command's data (sorted keys, indented)."""
    click.echo(json.dumps({"schema": SCHEMA, "ok": ok, **data}, indent=2, sort_keys=True))


def wants_json(args: Sequence[str]) -> bool:
    """Did the command line ask for JSON? `--json` among the options (before a `--` that ends them).
    Read from the arguments, not from what click parsed, so that a usage error is reported in JSON too."""
    args = list(args)
    return "--json" in (args[:args.index("--")] if "--" in args else args)


def with_report(error: LlamaBundleError, report: Mapping[str, Any]) -> LlamaBundleError:
    """The error, carrying the command's partial result: with --json it is printed beside the error."""
    setattr(error, _REPORT, dict(report))
    return error


def error_json(exc: BaseException) -> dict[str, Any]:
    """The `error` object of a failure: what failed, why, what to do, and the process's exit code."""
    if isinstance(exc, LlamaBundleError):
        out: dict[str, Any] = {"what": exc.what, "why": exc.why, "fix": exc.fix, "exit_code": exc.exit_code}
        if exc.details:
            out["details"] = exc.details.rstrip()
        for k in ("file", "line", "col"):  # where in a file, when the error knows (recipe errors)
            if getattr(exc, k, None) is not None:
                out[k] = getattr(exc, k)
        return out
    if isinstance(exc, click.ClickException):
        ctx = getattr(exc, "ctx", None)
        fix = f"see `{ctx.command_path} --help`" if ctx is not None else "see `llamabundle --help`"
        return {"what": exc.format_message(), "why": "the command line is not valid", "fix": fix,
                "exit_code": 2 if isinstance(exc, click.UsageError) else exc.exit_code}
    if isinstance(exc, (KeyboardInterrupt, click.exceptions.Abort)):
        return {"what": "interrupted", "why": "", "fix": "", "exit_code": INTERRUPTED}
    return {"what": f"internal error: {type(exc).__name__}: {exc}", "why": "this is a bug in llamabundle",
            "fix": "rerun with --debug and report the traceback", "exit_code": INTERNAL_ERROR}


def emit_failure(exc: BaseException) -> None:
    """Print the failure object for `exc` on stdout (the CLI's main() calls this under --json)."""
    report = getattr(exc, _REPORT, None) or {}
    emit({**report, "error": error_json(exc)}, ok=False)
