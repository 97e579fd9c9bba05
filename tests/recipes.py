"""The shipped recipes as text, and small checked edits of them: each broken recipe a test makes is one
`edit` of a real one, and `line_of` finds where the error must point."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
LINUX_PATH = RECIPES / "linux-x86_64-cpu.yaml"
WINDOWS_PATH = RECIPES / "windows-x86_64-cuda12.8.yaml"
LINUX = LINUX_PATH.read_text(encoding="utf-8")
WINDOWS = WINDOWS_PATH.read_text(encoding="utf-8")


def edit(text: str, old: str, new: str) -> str:
    """Replace exactly one occurrence of `old` (so each broken recipe is one small, checked edit)."""
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
    return text.replace(old, new)


def line_of(text: str, needle: str) -> int:
    """1-based line of the only line containing `needle`."""
    hits = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(hits) == 1, f"{needle!r} on lines {hits}"
    return hits[0]
