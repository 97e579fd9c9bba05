"""The runtime's cached results (probe's, telemetry's samples): JSON files in the runtime cache directory, each
written atomically and only by the newest of the runs that compete for it. A run takes a token (a counter under
a file lock) when it starts and writes its result only if no run with a newer token has written already, so an
older run that finishes last never overwrites a newer result. Timestamps are ISO 8601 UTC."""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from .. import scratch, untrusted

TOKEN = "probe.token"  # one counter for every cached result of the directory
LOCK = "probe.lock"
T = TypeVar("T")


def utc_timestamp(epoch: float | None = None) -> str:
    """ISO 8601 UTC to the second, `YYYY-MM-DDTHH:MM:SSZ`: every timestamp of a JSON output or of a file an
    app reads (now, or the given Unix time)."""
    when = dt.datetime.now(dt.UTC) if epoch is None else dt.datetime.fromtimestamp(epoch, dt.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_utc_timestamp(value: str | float) -> int:
    """Unix seconds of a `utc_timestamp` string (a number, as older caches wrote, is taken as it is)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    when = dt.datetime.strptime(str(value), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    return int(when.timestamp())


def write_atomic(path: Path, text: str) -> None:
    """Replace path's content in one step: a reader (or a SIGKILL) sees the old file or the new one, never half.
    The temporary file `.<name>.<owner>.tmp` names its owner (scratch); a killed writer's is removed by the
    next write of that file."""
    scratch.sweep(path.parent, [f".{path.name}."])
    tmp = scratch.owned(path.parent, f".{path.name}.", ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def lock(cache_dir: Path) -> FileLock:
    cache_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(str(cache_dir / LOCK), timeout=60)


def take_token(cache_dir: Path) -> int:
    """The next token: strictly greater than every token taken before in this directory, across processes."""
    with lock(cache_dir):
        try:
            last = int((cache_dir / TOKEN).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            last = 0
        write_atomic(cache_dir / TOKEN, f"{last + 1}\n")
        return last + 1


def read(path: Path, parse: Callable[[Mapping[str, Any]], T]) -> T | None:
    """The cached result at `path` (None: none, or one that does not parse)."""
    try:
        return parse(untrusted.read(path))  # past untrusted's limits: a ValueError, so none
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(path: Path, data: Mapping[str, Any], *, token: int) -> bool:
    """Write `data` (a result with a "token") unless a result with a newer token is there. True if written."""
    with lock(path.parent):
        last = read(path, lambda d: int(d["token"]))
        if last is not None and last > token:
            return False
        write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
        return True
