"""llamabundle/settings.py is the one reader of environment values: every variable lands in a field of the
frozen Settings, a bad number is a UsageError naming it, and no other module of the package reads
os.environ (a test below reads the sources, so the habit stays)."""

from __future__ import annotations

import ast
import dataclasses
import io
import re
from pathlib import Path
from typing import Any

import platformdirs
import pytest
from rich.console import Console

import llamabundle.settings as settings_mod
from llamabundle.errors import RecipeError, UsageError
from llamabundle.log import Log
from llamabundle.runtime.install import data_root
from llamabundle.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llamabundle"
README = ROOT / "README.md"

# ------------------------------------------------------------------------------------ each variable


def _cases(tmp: Path) -> list[tuple[dict[str, str], str, Any]]:
    """(environment, field, the field's value)."""
    return [
        ({"LLAMABUNDLE_CACHE_DIR": str(tmp / "c")}, "cache_dir", (tmp / "c").resolve()),
        ({"LLAMABUNDLE_DATA_DIR": str(tmp / "d")}, "data_dir_set", (tmp / "d").resolve()),
        ({"LLAMABUNDLE_DATA_DIR": str(tmp / "d")}, "data_dir", (tmp / "d").resolve()),
        ({"LLAMABUNDLE_STORE": "github:o/r"}, "store", "github:o/r"),
        ({"LLAMABUNDLE_DEBUG": "1"}, "debug", True),
        ({"LLAMABUNDLE_DEBUG": "true"}, "debug", False),  # exactly "1", as main() always took it
        ({"LLAMABUNDLE_GITHUB_ARCHIVE_URL": "http://127.0.0.1:9/"}, "github_archive_url", "http://127.0.0.1:9"),
        ({"LLAMABUNDLE_GITHUB_API_URL": "http://127.0.0.1:9/"}, "github_api_url", "http://127.0.0.1:9"),
        ({"GITHUB_API_URL": "https://ghe.example.com/api/v3/"}, "github_api_url", "https://ghe.example.com/api/v3"),
        ({"GITHUB_API_URL": "https://ghe", "LLAMABUNDLE_GITHUB_API_URL": "http://mine"}, "github_api_url", "http://mine"),
        ({"GITHUB_TOKEN": "t1"}, "github_token", "t1"),
        ({"GH_TOKEN": "t2"}, "github_token", "t2"),
        ({"GITHUB_TOKEN": "t1", "GH_TOKEN": "t2"}, "github_token", "t1"),
        ({"LLAMABUNDLE_REGISTRY_USER": "u"}, "registry_user", "u"),
        ({"LLAMABUNDLE_REGISTRY_PASSWORD": "p"}, "registry_password", "p"),
        ({"LLAMABUNDLE_REGISTRY_INSECURE": "1"}, "registry_insecure", True),
        ({"LLAMABUNDLE_REGISTRY_INSECURE": "true"}, "registry_insecure", False),  # exactly "1"
        ({"LLAMABUNDLE_REGISTRY_MOUNT_FROM": "org/a, org/b,"}, "registry_mount_from", ("org/a", "org/b")),
        ({"LLAMABUNDLE_PIP_INDEX_URL": "http://127.0.0.1:9/simple"}, "pip_index_url", "http://127.0.0.1:9/simple"),
        ({"LLAMABUNDLE_CUDA_REDIST_URL": "http://127.0.0.1:9/redist/"}, "cuda_redist_url", "http://127.0.0.1:9/redist"),
        ({"LLAMABUNDLE_CUDA_INSTALLER": str(tmp / "cuda.exe")}, "cuda_installer", tmp / "cuda.exe"),
        ({"LLAMABUNDLE_CUDA_INSTALLER_SHA256": "ab" * 32}, "cuda_installer_sha256", "ab" * 32),
        ({"LLAMABUNDLE_CONNECT_TIMEOUT": " 2.5 "}, "connect_timeout", 2.5),
        ({"LLAMABUNDLE_BUILD_TIMEOUT": "60"}, "build_timeout", 60.0),
        ({"LLAMABUNDLE_CACHE_MAX": "20G"}, "cache_max", 20 << 30),
        ({"LLAMABUNDLE_COMPILER_CACHE": "SCCache"}, "compiler_cache", "sccache"),
        ({"SOURCE_DATE_EPOCH": "1700000000"}, "source_date_epoch", 1700000000),
        ({"GITHUB_ACTIONS": "true"}, "github_actions", True),
        ({"GITHUB_ACTIONS": "1"}, "github_actions", False),  # exactly "true", as the runner sets it
        ({"GITHUB_ACTIONS": "true", "GITHUB_OUTPUT": str(tmp / "o")}, "github_output", tmp / "o"),
        ({"GITHUB_OUTPUT": str(tmp / "o")}, "github_output", None),  # only under Actions
        ({"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(tmp / "s")}, "github_step_summary", tmp / "s"),
        ({"GITHUB_STEP_SUMMARY": str(tmp / "s")}, "github_step_summary", None),
        ({"GITHUB_WORKSPACE": str(tmp / "w")}, "github_workspace", tmp / "w"),
    ]


def test_each_variable_is_read_into_its_field(tmp_path: Path) -> None:
    for env, name, want in _cases(tmp_path):
        assert getattr(Settings.from_env(env), name) == want, (env, name)


def test_every_field_is_read_from_some_variable(tmp_path: Path) -> None:
    covered = {name for _, name, _ in _cases(tmp_path)}
    assert covered >= {f.name for f in dataclasses.fields(Settings)}


def _variables_read() -> set[str]:
    """The names settings.py reads: every string literal it passes to env.get(…) / env[…] / number(…)."""
    tree = ast.parse((PACKAGE / "settings.py").read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        arg: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "get")
                or (isinstance(node.func, ast.Name) and node.func.id in ("number", "seconds"))):
            arg = node.args[0]
        elif isinstance(node, ast.Subscript):
            arg = node.slice
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and re.fullmatch(r"[A-Z][A-Z0-9_]+", arg.value):
            names.add(arg.value)
    return names


def test_the_docstring_and_the_readme_list_every_variable() -> None:
    names = _variables_read()
    assert len(names) >= 20, names
    doc = settings_mod.Settings.__doc__ or ""
    assert sorted(n for n in names if not re.search(rf"\b{n}\b", doc)) == [], "not in the Settings docstring"
    readme = README.read_text(encoding="utf-8")
    table = readme[readme.index("## Environment"):]
    table = table[:table.index("\n## ")]
    assert sorted(n for n in names if f"`{n}`" not in table) == [], "not in the README's Environment table"
    listed = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", table))
    assert sorted(listed - names) == [], "in the README's Environment table but not read by settings.py"


# ------------------------------------------------------------------------------------ defaults, bad values


def test_defaults() -> None:
    s = Settings.from_env({})
    assert s.cache_dir == Path(platformdirs.user_cache_dir("llamabundle", appauthor=False)).expanduser().resolve()
    assert s.data_dir == Path(platformdirs.user_data_dir("llamabundle", appauthor=False)).expanduser().resolve()
    assert (s.store, s.debug, s.github_token, s.pip_index_url, s.source_date_epoch) == (None, False, None, None, None)
    assert (s.github_archive_url, s.github_api_url) == ("https://codeload.github.com", "https://api.github.com")
    assert s.cuda_redist_url == "https://developer.download.nvidia.com/compute/cuda/redist"
    assert (s.cuda_installer, s.cuda_installer_sha256) == (None, None)
    assert (s.connect_timeout, s.build_timeout) == (10.0, 21600.0)
    assert (s.github_actions, s.github_output, s.github_step_summary, s.github_workspace) == (False, None, None, None)
    assert Settings(cache_dir=s.cache_dir) == s  # the dataclass defaults are from_env's
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.debug = True  # type: ignore[misc]


def test_empty_values_are_unset(tmp_path: Path) -> None:
    names = _variables_read()
    # As before the move: these two take an empty value as it is (env.get(name, default)), every other
    # variable treats empty as unset.
    as_is = {"LLAMABUNDLE_GITHUB_ARCHIVE_URL": "github_archive_url", "LLAMABUNDLE_CUDA_REDIST_URL": "cuda_redist_url"}
    s = Settings.from_env(dict.fromkeys(names, ""))
    assert {f: getattr(s, f) for f in as_is.values()} == dict.fromkeys(as_is.values(), "")
    assert dataclasses.replace(s, **{f: getattr(Settings.from_env({}), f) for f in as_is.values()}) == Settings.from_env({})
    assert Settings.from_env({"LLAMABUNDLE_CONNECT_TIMEOUT": "  ", "SOURCE_DATE_EPOCH": " "}) == Settings.from_env({})


@pytest.mark.parametrize("var, value, wanted", [
    ("LLAMABUNDLE_CONNECT_TIMEOUT", "abc", "a number of seconds greater than 0 (e.g. 10)"),
    ("LLAMABUNDLE_CONNECT_TIMEOUT", "-1", "a number of seconds greater than 0 (e.g. 10)"),
    ("LLAMABUNDLE_CONNECT_TIMEOUT", "0", "a number of seconds greater than 0 (e.g. 10)"),
    ("LLAMABUNDLE_CONNECT_TIMEOUT", "nan", "a number of seconds greater than 0 (e.g. 10)"),
    ("LLAMABUNDLE_CONNECT_TIMEOUT", "inf", "a number of seconds greater than 0 (e.g. 10)"),
    ("LLAMABUNDLE_BUILD_TIMEOUT", "6h", "a number of seconds greater than 0 (e.g. 21600)"),
    ("LLAMABUNDLE_BUILD_TIMEOUT", "-5", "a number of seconds greater than 0 (e.g. 21600)"),
    ("SOURCE_DATE_EPOCH", "yesterday", "a Unix timestamp from 315532800 (1980-01-01) to 4354819199 (2107-12-31), the dates a zip can hold"),
    ("SOURCE_DATE_EPOCH", "1.5", "a Unix timestamp from 315532800 (1980-01-01) to 4354819199 (2107-12-31), the dates a zip can hold"),
    ("SOURCE_DATE_EPOCH", "-1", "a Unix timestamp from 315532800 (1980-01-01) to 4354819199 (2107-12-31), the dates a zip can hold"),
])
def test_a_bad_number_is_the_same_usage_error(var: str, value: str, wanted: str) -> None:
    e = pytest.raises(UsageError, Settings.from_env, {var: f" {value}"}).value
    assert e.what == f"{var}={' ' + value!r} is not {wanted}"
    assert e.why == f"{var} is read from the environment"
    assert e.fix == f"set {var} to {wanted}, or unset it"
    assert e.exit_code == 2


# ------------------------------------------------------------------------------------ the values are used


def test_the_data_root_is_dest_else_the_settings(tmp_path: Path) -> None:
    s = Settings(cache_dir=tmp_path / "c", data_dir_set=tmp_path / "d")
    assert data_root(s) == tmp_path / "d"
    assert data_root(s, tmp_path / "dest") == tmp_path / "dest"
    assert data_root(Settings.from_env({"LLAMABUNDLE_DATA_DIR": str(tmp_path / "e")})) == (tmp_path / "e").resolve()


def test_the_log_makes_annotation_paths_relative_to_its_workspace(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GITHUB_WORKSPACE", raising=False)
    buf = io.StringIO()
    log = Log(github_actions=True, console=Console(file=buf, width=80, highlight=False),
              workspace=Settings.from_env({"GITHUB_WORKSPACE": str(tmp_path)}).github_workspace)
    log.error(RecipeError("x", file=str(tmp_path / "recipes" / "a.yaml"), line=1, col=1))
    log.error(RecipeError("y", file="/elsewhere/b.yaml", line=1, col=1))
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("::error file=recipes/a.yaml,line=1,col=1,")
    assert lines[1].startswith("::error file=/elsewhere/b.yaml,line=1,col=1,")


# ------------------------------------------------------------------------------------ nobody else reads it

ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
ALLOWED = {
    "settings.py",  # the reader (it takes a Mapping; the CLI hands it os.environ)
    "proc.py",  # may build a child process's environment from this one's
    "api.py",  # the Python API, an entry point like the CLI: one snapshot when the app passes no env
    "backends/cuda/nvcc_launch.py",  # a standalone script CMake runs in front of nvcc (sets LD_PRELOAD and PWD for it)
}
CLI_SNAPSHOTS = 1  # the cli package takes one snapshot, dict(os.environ), and builds Settings from it


def env_mentions(source: str) -> list[int]:
    """Lines where the module touches the process environment: os.environ / os.getenv / … however `os` is
    imported (`import os as o`, `from os import environ`)."""
    tree = ast.parse(source)
    os_names = {"os"}
    lines: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in ENV_NAMES]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and isinstance(node.value, ast.Name)
                and node.value.id in os_names):
            lines.append(node.lineno)
    return sorted(lines)


def test_env_mentions_finds_every_spelling() -> None:
    src = ("import os\nimport os as o\nfrom os import getenv\n"
           "a = os.environ.get('X')\nb = o.environ['X']\nc = os.getenv('X')\nd = {**os.environ}\n"
           "e = os.path.join('a')\n# os.environ in a comment\n'os.environ in a string'\n")
    assert env_mentions(src) == [3, 4, 5, 6, 7]


def test_only_settings_reads_the_environment() -> None:
    offenders: list[str] = []
    cli_lines: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        lines = env_mentions(path.read_text(encoding="utf-8"))
        if not lines:
            continue
        found = [f"llamabundle/{rel}:{n}" for n in lines]
        if rel.startswith("cli/"):
            cli_lines += found
        else:
            offenders += found
    if len(cli_lines) > CLI_SNAPSHOTS:
        offenders += cli_lines
    assert offenders == [], (
        "these modules read os.environ themselves; read the variable in llamabundle/settings.py (a Settings field) "
        "and pass the value down, or take the env as a parameter: " + ", ".join(offenders))
