"""SHA256SUMS, as a store writes it beside each zip and an app ships it as a digest list: UTF-8 text, one
`<sha256>  <name>` line per file (64 lower-case hex digits, two spaces or a space and `*`, then a file name
without a directory), as `sha256sum` prints it. The one grammar every reader of such a file uses."""

from __future__ import annotations

import re

NAME = "SHA256SUMS"
_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")


def line(sha256: str, name: str) -> str:
    """One line, as the stores write it."""
    return f"{sha256}  {name}\n"


def read_line(text: str) -> tuple[str, str] | None:
    """(sha256, name) of one line, or None when it is not a line of the grammar (a name with a directory
    or `.`/`..` is not)."""
    m = _LINE.fullmatch(text)
    if m is None:
        return None
    name = m.group(2)
    if "/" in name or "\\" in name or name in (".", ".."):
        return None
    return m.group(1), name
