"""The README's two first commands are the contract with a new user: (a) builds a shipped recipe by
name in a venv, (b) is exactly what CI runs, from empty caches. Its Commands table has a row for every command,
and the exit codes each row lists are the ones the command gives: a bad option, and its own failures."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from llamabundle import keys
from llamabundle.recipe import shipped_recipes
from tests.clirun import run

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


# ------------------------------------------------------------------------ the Commands table's exit codes

ALSO_IN = {"list": "install", "uninstall": "install"}  # commands the install row names (`list`, `uninstall KEY`)


def exit_code_rows() -> dict[str, set[int]]:
    """The Commands table: command ("recipe lint") -> the exit codes its row lists ("0, 2–6" is 0, 2, 3, 4, 5, 6;
    "0 hit, 1 miss" is 0, 1)."""
    table = README[README.index("## Commands"):]
    rows: dict[str, set[int]] = {}
    for line in table.splitlines()[4:]:
        if not line.startswith("| `llamabundle "):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        words = cells[0].split("`")[1].split()[1:]
        name = " ".join(itertools.takewhile(lambda w: re.fullmatch(r"[a-z][a-z-]*", w) is not None, words))
        codes: set[int] = set()
        for lo, hi in re.findall(r"(\d+)(?:\s*[–-]\s*(\d+))?", cells[2]):
            codes |= set(range(int(lo), int(hi or lo) + 1))
        rows[name] = codes
    for name, row in ALSO_IN.items():
        assert f"`{name}" in README.split(f"| `llamabundle {row} ", 1)[1].split("\n", 1)[0]
        rows[name] = rows[row]
    return rows


def leaf_commands() -> list[str]:
    from tests.clicontract import all_commands

    paths = all_commands()
    return sorted(" ".join(p) for p in paths if p and not any(q[:len(p)] == p and len(q) > len(p) for q in paths))


def test_every_command_has_a_row_with_its_exit_codes() -> None:
    rows = exit_code_rows()
    assert set(leaf_commands()) == set(rows), "every command has a row of the Commands table, and no row is extra"
    assert all(0 in codes for codes in rows.values())


@pytest.mark.parametrize("command", leaf_commands())
def test_a_usage_error_exits_with_a_code_of_its_row(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown option is a usage error (exit 2, click's), which every row lists (issue 32: `recipe list`, `check`
    and `telemetry` did not)."""
    code, out, err = run(capsys, *command.split(), "--no-such-option")
    assert code == 2 and "No such option" in err, (command, err)
    assert code in exit_code_rows()[command], f"the README's row of `{command}` lists {sorted(exit_code_rows()[command])}"


UNPINNED = re.sub(r"toolchain: \{compiler: gcc, version: \"=12\.2\.0\"\}", "toolchain: {compiler: gcc}",
                  (ROOT / "recipes" / "linux-x86_64-cpu.yaml").read_text(encoding="utf-8"))


def failures(tmp: Path) -> list[tuple[tuple[object, ...], int]]:
    """(argv, the exit code it gives) for each command's failure cases beyond a bad option; `{…}` in argv are
    made by failure_world()."""
    dead = "github:o/r"  # LLAMABUNDLE_GITHUB_API_URL: a loopback port nothing listens on
    unpinned = tmp / "unpinned.yaml"  # no compiler pin, and no g++ on PATH: its key cannot be computed (exit 3)
    empty = tmp / "empty"  # not a bundle
    out = tmp / "out"
    return [
        (("recipe", "list", "extra"), 2), (("recipe", "schema", "extra"), 2),
        (("recipe", "lint", tmp / "none.yaml"), 2),
        (("key", unpinned), 3), (("show", unpinned), 3), (("archs", unpinned), 3),
        (("check", unpinned, "--store", tmp / "s"), 3), (("fetch", unpinned, "--out", out, "--store", tmp / "s"), 3),
        (("install", "--recipe", unpinned, "--store", tmp / "s", "--dest", tmp / "d"), 3),
        (("build", unpinned, "--store", tmp / "s"), 3), (("matrix", unpinned, "--store", tmp / "s"), 3),
        (("check", "linux-x86_64-cpu", "--store", tmp / "damaged"), 5),
        (("check", "linux-x86_64-cpu", "--store", dead), 6), (("matrix", "linux-x86_64-cpu", "--store", dead), 6),
        (("install", "--recipe", "linux-x86_64-cpu", "--store", dead, "--dest", tmp / "d"), 6),
        (("index", "--store", dead, "--out", out), 6),
        (("probe", "--bundle", empty), 5), (("doctor", "--bundle", empty), 5),  # issue 32: rows said 0
        (("plan", tmp / "m.gguf", "--free-vram", "8GiB", "--bundle", empty), 5),
        (("telemetry", "--pid", "0"), 2), (("uninstall", "nothing-installed", "--dest", tmp / "d"), 2),
        (("list", "--dest", tmp / "m.gguf"), 2),
        (("verify", tmp / "none.zip"), 2), (("verify", empty), 5), (("publish", tmp / "notabundle.zip"), 5),
        (("deps", tmp / "none.so"), 2), (("bundle", "linux-x86_64-cpu", empty, "--out", out), 2),
        (("cache", "prune", "--max", "lots"), 2), (("cache", "list", "extra"), 2),
        (("ui", "pack", tmp / "none.yaml"), 2),
        (("toolkit", "plan", "linux-x86_64-cpu"), 2),
        (("toolkit", "plan", "--version", "12.8.1", "--components", "cuda_nvcc,cuda_compat", "--platform",
          "windows-x86_64"), 3),
        (("toolkit", "install", "--version", "13.0.2", "--components", "cuda_crt", "--platform", "linux-x86_64"), 2),
    ]


def failure_world(tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What failures() names: an unpinned recipe, a directory that is no bundle, a model, a zip that is no bundle,
    a local store whose entry is damaged, a GitHub API nothing answers on, and a PATH without g++."""
    import socket
    import zipfile

    from tests.clibundles import LINUX_KEY, make_bundle_zip
    from tests.ggufs import write

    (tmp / "unpinned.yaml").write_text(UNPINNED, encoding="utf-8")
    (tmp / "empty").mkdir()
    write(tmp / "m.gguf")
    with zipfile.ZipFile(tmp / "notabundle.zip", "w") as z:
        z.writestr("llama-server", "x")
    (tmp / "b").mkdir()
    zip_path = make_bundle_zip(tmp / "b")
    assert run(capsys, "publish", zip_path, "--store", tmp / "damaged")[0] == 0
    stored = tmp / "damaged" / LINUX_KEY / zip_path.name
    data = bytearray(stored.read_bytes())
    data[-30] ^= 0xFF
    stored.write_bytes(bytes(data))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    monkeypatch.setenv("LLAMABUNDLE_GITHUB_API_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("PATH", str(tmp / "no-tools"))


def test_each_commands_failures_exit_with_a_code_of_its_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Beyond a bad option, each command's own failures (a recipe whose key needs a tool that is not here, a bad
    --bundle, a damaged or unreachable store, …) exit with a code the README's row of that command lists
    (issue 32: probe and doctor exit 5 for a bad --bundle, and their rows said 0)."""
    failure_world(tmp_path, monkeypatch, capsys)
    rows = exit_code_rows()
    covered, wrong, untrue = set(), [], []
    for argv, want in failures(tmp_path):
        code, _, err = run(capsys, *argv)
        command = " ".join(map(str, argv[:2])) if " ".join(map(str, argv[:2])) in rows else str(argv[0])
        said = next((line for line in err.splitlines() if line.lower().startswith("error")), err.strip()[-200:])
        if (code, "Traceback" in err) != (want, False):
            wrong.append(f"{' '.join(map(str, argv))}: exit {code}, not {want} ({said})")
        elif code not in rows[command]:
            untrue.append(f"`llamabundle {command}` exits {code} ({said}); its row lists {sorted(rows[command])}")
        covered.add(command)
    assert wrong == [], "the failure cases are not what they were meant to be:\n" + "\n".join(wrong)
    assert untrue == [], "the README's exit codes are not true:\n" + "\n".join(untrue)
    assert covered == set(rows), f"no failure case for {sorted(set(rows) - covered)}"
