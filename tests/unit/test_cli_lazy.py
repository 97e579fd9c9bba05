"""The top group imports a command's module when the command is looked up (cli.entry.COMMAND_MODULES): the table
names every command of every module, each in the module that defines it, and a command line loads only its own."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import click

from llamabundle.cli.entry import COMMAND_MODULES, cli

CLI = Path(__file__).resolve().parents[2] / "llamabundle" / "cli"
NOT_COMMANDS = {"__init__", "entry", "context", "output", "options"}  # the group, and what the commands share


def test_the_table_names_every_command_in_its_own_module() -> None:
    modules = sorted(p.stem for p in CLI.glob("*.py") if p.stem not in NOT_COMMANDS)
    defined = {}
    for name in modules:
        module = importlib.import_module(f"llamabundle.cli.{name}")
        assert hasattr(module, "COMMANDS"), f"cli/{name}.py has no COMMANDS (or belongs in NOT_COMMANDS)"
        for command in module.COMMANDS:
            assert command.name not in defined, f"{command.name} is in cli/{defined[command.name]}.py and cli/{name}.py"
            defined[command.name] = name
    assert COMMAND_MODULES == defined
    ctx = click.Context(cli)
    assert cli.list_commands(ctx) == sorted(defined)
    for name, module in defined.items():
        command = cli.get_command(ctx, name)
        assert command is not None and command in importlib.import_module(f"llamabundle.cli.{module}").COMMANDS
    assert cli.get_command(ctx, "no-such-command") is None


def test_a_command_line_loads_only_its_own_module() -> None:
    code = ("import sys\nfrom llamabundle.cli.entry import main\n"
            "try:\n    main(['fetch', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('llamabundle.cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = set(out.stdout.strip().splitlines()[-1].strip("[]").replace("'", "").split(", "))
    assert "bundles" in loaded and not loaded & {"plan", "app", "recipes", "toolkit", "index", "ui"}, loaded


def test_an_unknown_command_is_a_usage_error() -> None:
    res = subprocess.run([sys.executable, "-m", "llamabundle", "fecth"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "No such command 'fecth'" in res.stderr, res.stderr


def test_fetch_and_install_start_without_what_only_building_needs() -> None:
    """`fetch` and `install` (cli.bundles, cli.app and the pipeline they run) load neither the recipe model and its
    YAML loader, the key, the build, the compiler caches or CUDA's launcher (nor ctypes), nor tarfile or filelock (a
    hit takes no lock): what a cache hit does not use costs it nothing at start."""
    code = ("import sys, click\nfrom llamabundle.cli.entry import cli\n"
            "for name in ('fetch', 'install'):\n    cli.get_command(click.Context(cli), name)\n"
            "import llamabundle.pipeline\nprint('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = set(out.stdout.split())
    assert {"llamabundle.cli.bundles", "llamabundle.cli.app", "llamabundle.verify", "llamabundle.backends.cuda"} <= loaded
    unwanted = {"llamabundle.recipe", "llamabundle.recipe.model", "llamabundle.recipe.loader", "yaml", "llamabundle.keys",
                "llamabundle.build", "llamabundle.compiler_cache", "llamabundle.backends.cuda.determinism",
                "llamabundle.backends.cuda.nvcc_launch", "ctypes", "tarfile", "llamabundle.cli.plan", "filelock"}
    assert not loaded & unwanted, sorted(loaded & unwanted)


def test_a_command_line_reads_the_platforms_directories_only_when_it_uses_them(tmp_path: Path) -> None:
    """With LLAMABUNDLE_CACHE_DIR set (a CI job, an app), a command line that touches no install root (fetch, a
    build hit) never loads platformdirs; the install root is the platform's user data directory when asked for."""
    code = ("import sys\nfrom llamabundle.cli.context import Ctx\nfrom llamabundle.runtime.install import data_root\n"
            "c = Ctx(debug=False, quiet=True)\nbefore = 'platformdirs' in sys.modules\n"
            "root = data_root(c.settings)\nprint(before, 'platformdirs' in sys.modules, root)")
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMABUNDLE_DATA_DIR", "XDG_DATA_HOME")}
    env["LLAMABUNDLE_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60, env=env)
    before, after, root = out.stdout.split()
    assert (before, after) == ("False", "True")
    assert root == str(Path("~/.local/share/llamabundle").expanduser().resolve())


def test_an_install_or_fetch_by_key_runs_without_the_recipe_yaml_or_key_rules(tmp_path: Path) -> None:
    """Run, not only started: `install --key` (an app's install on demand) and `fetch KEY` of a published bundle
    load neither the recipe model, its YAML loader nor the key rules (`keys`): only `--recipe` needs them."""
    from llamabundle.bundle.manifest import parse
    from llamabundle.store.local import LocalStore
    from tests import bundles as tb

    zip_path, made = tb.make_zip(tmp_path / "made", {"llama-server": b"#!/bin/sh\n", "LICENSE": b"MIT\n"},
                                 {"llama-server": "exe", "LICENSE": "license"}, name="lazy", inputs=tb.inputs_for("lazy"))
    m = parse(made)
    LocalStore(tmp_path / "store").publish(zip_path, m)
    store = str(tmp_path / "store")
    for argv in (["install", "--store", store, "--key", m.key, "--dest", str(tmp_path / "root")],
                 ["fetch", m.key, "--store", store, "--out", str(tmp_path / "out")]):
        code = ("import sys\nfrom llamabundle.cli.entry import main\n"
                f"try:\n    main({['--quiet', *argv]!r})\nexcept SystemExit as e:\n    print('exit', e.code)\n"
                "print('\\n'.join(sorted(sys.modules)))")
        env = {**os.environ, "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        loaded = set(out.stdout.split())
        assert "exit 0" in out.stdout, (argv[0], out.stdout[-2000:], out.stderr[-2000:])
        assert not loaded & {"llamabundle.keys", "llamabundle.recipe", "llamabundle.recipe.model", "yaml"}, \
            (argv[0], sorted(loaded & {"llamabundle.keys", "llamabundle.recipe", "llamabundle.recipe.model", "yaml"}))
