"""One error root. Every failure carries what failed, why, and what to do, and an exit code (DESIGN §8)."""

from __future__ import annotations


class LlamaBundleError(Exception):
    """Root of every error the tool reports. Printed once by the CLI, without a traceback."""

    exit_code: int = 1

    def __init__(self, what: str, *, why: str = "", fix: str = "", details: str = "",
                 file: str | None = None, line: int | None = None, col: int | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.why = why
        self.fix = fix
        self.details = details
        # where in a file the problem is (1-based), when known: a GitHub annotation points there.
        # The message (`what`) already names it for people; these are for machines.
        self.file = file
        self.line = line
        self.col = col

    def render(self) -> str:
        lines = [f"error: {self.what}"]
        if self.why:
            lines.append(f"  why: {self.why}")
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        if self.details:
            lines.append(self.details.rstrip())
        return "\n".join(lines)


class UsageError(LlamaBundleError):
    exit_code = 2


class RecipeError(LlamaBundleError):
    exit_code = 2


class ToolchainError(LlamaBundleError):
    exit_code = 3


class BuildError(LlamaBundleError):
    exit_code = 4


class VerifyError(LlamaBundleError):
    exit_code = 5


class StoreError(LlamaBundleError):
    exit_code = 6


class SourceError(StoreError):
    """The pinned source could not be fetched (network) or did not prove the pinned commit."""
