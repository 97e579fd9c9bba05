"""The `llamabundle` command line: the top group and its global options (`--debug`, `--quiet`, `--version`),
the registration of every command module's commands, and `main()`, which runs a command line and turns
each kind of failure into its one message on stderr and its exit code (2 usage, 70 a bug, 130 interrupted;
LlamaBundleError its own). Under --json a failure's JSON object is printed on stdout too (cli.output)."""

from __future__ import annotations

import codecs
import importlib
import signal
import sys
from typing import NoReturn

import click

from .. import __version__
from ..errors import LlamaBundleError, UsageError, from_os_error
from ..log import Log
from ..settings import Settings
from .context import Ctx, environment
from .output import emit_failure, error_json, wants_json

# Each command's module (cli/<module>.py, whose COMMANDS it is in): imported when the command is looked up, so that
# a command line loads its own module only (`fetch` and `install` start sooner). tests/unit/test_cli_lazy.py holds
# this table to the modules' COMMANDS.
COMMAND_MODULES: dict[str, str] = {
    **dict.fromkeys(("recipe", "show", "key"), "recipes"),
    **dict.fromkeys(("check", "build", "fetch", "verify", "publish", "bundle", "matrix"), "bundles"),
    **dict.fromkeys(("probe", "install", "list", "uninstall", "doctor"), "app"),
    "toolkit": "toolkit", "archs": "archs", "plan": "plan", "deps": "deps", "index": "index", "telemetry": "telemetry",
    "cache": "cachecmd", "ui": "ui",
}


class LazyGroup(click.Group):
    """The top group: a command's module is imported the first time the command is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMAND_MODULES})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            module = importlib.import_module(f"{__package__}.{COMMAND_MODULES[cmd_name]}")
            for command in module.COMMANDS:
                self.add_command(command)
        return self.commands.get(cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llamabundle")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.option("--quiet", "-q", is_flag=True, help="Only errors and results.")
@click.pass_context
def cli(ctx: click.Context, debug: bool, quiet: bool) -> None:
    """Build, verify, cache and publish llama.cpp binary bundles from YAML recipes."""
    ctx.obj = Ctx(debug=debug, quiet=quiet)


def _run(args: list[str]) -> None:
    """The command; under --json a failure also prints its JSON object on stdout (then main() reports it)."""
    try:
        try:
            cli.main(args=args, prog_name="llamabundle", standalone_mode=False)
        except OSError as e:  # a full, read-only or missing disk path that no step named: still one clear message
            raise from_os_error(e) from e
    except SystemExit:
        raise
    except BaseException as e:
        if wants_json(args):
            emit_failure(e)
        raise


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (a CI cancel, `kill`) cleans up as Ctrl-C does: children ended, exit 130


def _raw_bytes(e: UnicodeError) -> tuple[bytes, int]:
    """Encoding error handler of our output: a file name's undecodable byte (a surrogate escape) is written as
    that byte, anything else unencodable as a backslash escape."""
    assert isinstance(e, UnicodeEncodeError)
    out = bytearray()
    for ch in e.object[e.start:e.end]:
        o = ord(ch)
        out += bytes([o - 0xDC00]) if 0xDC80 <= o <= 0xDCFF else ch.encode("ascii", "backslashreplace")
    return bytes(out), e.end


def utf8_output() -> None:
    """Write stdout and stderr as UTF-8 whatever the locale (LC_ALL=C with PYTHONUTF8=0 makes them ASCII): a
    path that is not ASCII is then printed as its own bytes, not as `\\udcc3` escapes or `??`."""
    codecs.register_error("llamabundle-raw", _raw_bytes)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and codecs.lookup(stream.encoding or "ascii").name != "utf-8":
            try:
                reconfigure(encoding="utf-8", errors="llamabundle-raw")
            except (ValueError, OSError):
                pass


def main(argv: list[str] | None = None) -> NoReturn:
    """Run `llamabundle` with `argv` (default: sys.argv[1:]) and exit with the command's exit code."""
    args = sys.argv[1:] if argv is None else argv
    if argv is None:
        utf8_output()
    if argv is None and hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, _terminated)
    # how a failure is printed (a bad setting is reported by the command itself, as a failure like any other)
    actions, workspace, debug_env = Settings.reporting(environment())
    debug = "--debug" in args or debug_env
    log = Log(github_actions=actions, workspace=workspace)
    try:
        _run(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        code = 130
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        code = 130
    except click.ClickException as e:  # a usage error click found (unknown option, missing argument, bad value)
        e.show()
        if actions:  # its annotation too, as every failure's (click's usage lines stay for people)
            log.error(_as_error(e))
        code = 2 if isinstance(e, click.UsageError) else e.exit_code
    except LlamaBundleError as e:
        log.error(e)
        if debug:
            _print_traceback()
        code = e.exit_code
    except Exception as e:  # a bug in llamabundle: say so plainly
        internal = LlamaBundleError(f"internal error: {type(e).__name__}: {e}", why="this is a bug in llamabundle",
                                    fix="rerun with --debug and report the traceback")
        if actions:
            log.error(internal)
        else:
            click.echo(internal.what, err=True)
            click.echo(f"  {internal.why}; {internal.fix}", err=True)
        if debug:
            _print_traceback()
        code = 70
    sys.exit(code)


def _print_traceback() -> None:
    import traceback  # only under --debug: a command line that succeeds never loads it

    traceback.print_exc()


def _as_error(e: click.ClickException) -> LlamaBundleError:
    """A click usage error as the tool's own (what, why, fix, exit code), for its annotation: as --json says it."""
    info = error_json(e)
    err = UsageError(info["what"], why=info["why"], fix=info["fix"])
    err.exit_code = info["exit_code"]
    return err
