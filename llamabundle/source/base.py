"""What every source kind answers (one module per kind: github, git, path, pypi): a tree fetched into a
scratch directory with the commit proven, how it was proven, and the commit's time when the source knows it.
A source that cannot be reached is unavailable (the next one is tried); one that delivers another commit is
a mismatch, never used."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import proc
from ..errors import SourceError, VerifyError


class SourceUnavailable(SourceError):
    """This source could not deliver anything (network, missing file): try the next one."""


class SourceMismatch(VerifyError):
    """A source delivered something other than the pinned commit: never used."""


@dataclass(frozen=True, kw_only=True)
class Fetched:
    tree: Path
    commit_time: int | None  # the commit's committer time, when the source proves it
    proof: dict[str, Any]  # how the commit was proven, recorded in the marker


def query(argv: list[str], *, what: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """A short git query through the subprocess gateway; a hang or a git that cannot start is unavailable."""
    try:
        return proc.capture(argv, timeout=timeout)
    except proc.Timeout:
        raise SourceUnavailable(f"{what}: git did not answer in {timeout:.0f}s") from None
    except OSError as e:
        raise SourceUnavailable(f"{what}: git could not be started", why=str(e)) from None
