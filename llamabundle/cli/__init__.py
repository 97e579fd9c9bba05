"""The `llamabundle` command line: click commands only. Each command parses its arguments, calls one
function of the library, prints its result (text, or one JSON object with --json) and returns an exit code
(DESIGN §8); no build, store or verification logic lives here.

entry.py holds the top group and main(); context.py the Ctx every command gets; output.py the --json
contract; options.py shared parameters; one module per group of commands (recipes, bundles, toolkit,
archs, app, plan, deps)."""

from __future__ import annotations

from .entry import cli, main

__all__ = ["cli", "main"]
