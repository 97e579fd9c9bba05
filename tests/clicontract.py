"""The CLI's contract as the tests check it: `all_commands` walks the click group (every command and group,
the top one as []), and `valid` checks an object against its JSON schema, llamabundle/data/schemas/cli-<command>.schema.json."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import click
import jsonschema

from llamabundle.cli import cli

SCHEMAS = resources.files("llamabundle.data") / "schemas"


def schema(name: str) -> dict[str, Any]:
    """The schema of a command's --json output (name: `recipe-lint` for `recipe lint`; `error` for a failure)."""
    return json.loads((SCHEMAS / f"cli-{name}.schema.json").read_text(encoding="utf-8"))


def valid(name: str, obj: Any) -> Any:
    """obj, validated against schemas/cli-<name>.schema.json."""
    jsonschema.Draft202012Validator(schema(name)).validate(obj)
    return obj


def all_commands() -> list[list[str]]:
    out: list[list[str]] = [[]]

    def walk(group, prefix: list[str]) -> None:  # type: ignore[no-untyped-def]
        ctx = click.Context(group)
        for name in group.list_commands(ctx):  # the top group imports a command's module when asked (cli.entry)
            cmd = group.get_command(ctx, name)
            out.append([*prefix, name])
            if hasattr(cmd, "commands"):
                walk(cmd, [*prefix, name])

    walk(cli, [])
    return out
