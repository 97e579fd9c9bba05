"""JSON from outside (a bundle.json, a marker, a pointer, an API answer) parsed within limits: at most
MAX_BYTES, nested at most MAX_DEPTH levels, the depth counted by a linear scan before json.loads recurses.
A refusal is `Untrusted` (a ValueError naming the limit); each caller turns it into its own file's error.
`preview` shows the first bytes of an answer that is not what it should be, printable and escaped; `misfit` says
which field of a parsed object is missing or of another type."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Mapping
from itertools import accumulate
from pathlib import Path
from typing import Any

MAX_BYTES = 64 << 20  # a real bundle.json is a few KiB, a source marker a few hundred KiB, an API answer a few MiB
MAX_DEPTH = 64  # the deepest file the tool reads or writes is nested 14 levels (a JSON schema); a manifest at most 5
PREVIEW = 80

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, its escapes honoured
_OTHER = bytes(sorted(set(range(256)) - set(b"[]{}")))  # what the depth scan drops
_SQUARE = bytes.maketrans(b"{}", b"[]")  # objects nest as arrays do
_STEP = [0] * 256
_STEP[ord("[")], _STEP[ord("]")] = 1, -1


class Untrusted(ValueError):
    """Bytes refused before they are parsed: str() says which limit, as it reads after "is" ("nested
    deeper than 64 levels", "larger than 64 MiB")."""


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n} bytes"


def depth(raw: bytes | str, *, limit: int = MAX_DEPTH) -> int:
    """How deep arrays and objects nest in JSON text, brackets in strings aside; exact for one JSON value
    (more, never less, for text that is not one) and at most limit + 1 (deeper is not counted)."""
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    brackets = _STRING.sub(b"", data).translate(_SQUARE, _OTHER)
    peeled = 0  # each pass removes the innermost pairs: one level, at C speed, while it halves what is left
    while b"[]" in brackets and peeled <= limit:
        shorter = brackets.replace(b"[]", b"")
        peeled += 1
        halved = len(shorter) * 2 <= len(brackets)
        brackets = shorter
        if not halved:
            break
    if peeled > limit or b"[" * (limit + 1 - peeled) in brackets:
        return limit + 1
    return min(limit + 1, peeled + max(0, max(accumulate(map(_STEP.__getitem__, brackets)), default=0)))


def check(raw: bytes | str, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> None:
    """Raise Untrusted when `raw` (UTF-8 bytes, or text) is longer than max_bytes or nests arrays and objects
    deeper than max_depth. Linear; brackets inside strings do not count."""
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    if len(data) > max_bytes:
        raise Untrusted(f"larger than {_size(max_bytes)} ({len(data)} bytes)")
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return  # too few brackets to nest that deep, in strings or not
    if depth(data, limit=max_depth) > max_depth:
        raise Untrusted(f"nested deeper than {max_depth} levels")


def loads(raw: bytes | str, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads within the limits: Untrusted for a limit; ValueError (UnicodeDecodeError, JSONDecodeError)
    for bytes that are not UTF-8 or not JSON, as json.loads would raise them."""
    check(raw, max_bytes=max_bytes, max_depth=max_depth)
    return json.loads(raw.decode("utf-8-sig") if isinstance(raw, bytes) else raw)


def read(path: Path, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """A JSON file's value within the limits, never more than max_bytes + 1 of it read. A path that is not a
    regular file (a FIFO is never waited on) is an OSError, as is one that cannot be opened."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    return loads(raw, max_bytes=max_bytes, max_depth=max_depth)


def preview(body: bytes, n: int = PREVIEW) -> str:
    """The first `n` bytes of a body, quoted and printable (escapes for the rest), with … when there is more."""
    text = body[:n].decode("utf-8", "backslashreplace")  # a byte that is not UTF-8 reads \xff
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return f"'{shown}'" + ("…" if len(body) > n else "")


def misfit(obj: Any, fields: Mapping[str, Any], where: str, *, closed: bool = False) -> str:
    """What is wrong with `obj` as an object of `fields` (name -> a type, None for null, or a tuple of them; a
    bool is not an int), '' when nothing is: the first field missing or of another type, or (`closed`) one it
    has that `fields` does not name. `where` names obj in the answer."""
    if not isinstance(obj, dict):
        return f"{where} is not an object"
    for name, kinds in fields.items():
        value = obj.get(name, ...)
        if not any(value is None if k is None else isinstance(value, k) and not (k is int and isinstance(value, bool))
                   for k in (kinds if isinstance(kinds, tuple) else (kinds,))):
            return f"{where}.{name} is {'missing' if value is ... else repr(value)[:60]}"
    if closed and (extra := sorted(set(obj) - set(fields))):
        return f"{where} has a field the schema does not name: {extra[0][:60]!r}"
    return ""
