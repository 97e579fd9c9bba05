"""The README's two first commands are the contract with a new user: (a) builds a shipped recipe by
name in a venv, (b) is exactly what CI runs, from empty caches."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from llamabundle import keys
from llamabundle.recipe import shipped_recipes

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def commands() -> dict[str, str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block is not None and README.index("```bash") < README.index("## "), "the README starts with the commands"
    lines = block.group(1).splitlines()
    found = {}
    for i, line in enumerate(lines):
        m = re.match(r"# \(([ab])\)", line)
        if m:
            found[m.group(1)] = lines[i + 1]
    return found


def test_command_a_builds_a_shipped_recipe_by_name_in_a_venv() -> None:
    a = commands()["a"]
    parts = [shlex.split(p) for p in a.split("&&")]
    assert parts[0][:3] == ["python3", "-m", "venv"]  # PEP 668: no bare pip install on Debian/Ubuntu
    build = parts[-1]
    assert build[0].endswith("llamabundle") and build[1] == "build"
    name = build[2]
    assert name in shipped_recipes() and "/" not in name
    assert keys.load(name).platform == "linux-x86_64" and keys.load(name).backends == ("cpu",)


def test_ci_runs_command_b_as_written_from_empty_caches() -> None:
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    lines = [ln for ln in script.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    got = lines[-1]  # the last thing CI does
    assert "pytest" in got and "-e '.[test,tools]'" in got
    assert 'LLAMABUNDLE_CACHE_DIR="$cache/cache"' in script and 'LLAMABUNDLE_E2E_CACHE_DIR="$cache/cache"' in script
    assert "actions/cache" not in (ROOT / ".github" / "workflows" / "ci.yml").read_text(encoding="utf-8")
