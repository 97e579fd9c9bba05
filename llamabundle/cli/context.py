"""What every command gets from the top group: `Ctx` (the environment read once, the settings, the log, the
store) and `pass_ctx`, the decorator that hands it to a command as its first argument."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .. import errors
from ..log import Log, actions_matrix, actions_report
from ..settings import Settings

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..keys import Keyed
    from ..matrix import Row
    from ..store import Store


def environment() -> dict[str, str]:
    """The process environment, read once per command line: the CLI's only look at `os.environ`. Settings
    are read from it, and child processes (cmake, git, nvcc) inherit it."""
    return dict(os.environ)


class Ctx:
    """The state of one command line: the environment read once, the Settings from it, and the Log."""

    def __init__(self, *, debug: bool, quiet: bool) -> None:
        self.env = environment()
        self.settings = Settings.from_env(self.env)
        errors.forget_owners()  # a new command line (several run in one process under the tests)
        errors.own(self.settings.cache_dir, "the cache, LLAMABUNDLE_CACHE_DIR")
        self.log = Log(quiet=quiet, github_actions=self.settings.github_actions,
                       workspace=self.settings.github_workspace)
        self.debug = debug

    def store(self, url: str | None, keyed: Keyed | Sequence[Keyed] | None = None) -> Store:
        """The store; given keyed recipes, a GitHub store looks each one's release up by the recipe's tag."""
        from ..store import open_store

        given: list[Keyed] = list(keyed) if isinstance(keyed, (list, tuple)) else [keyed] if keyed is not None else []  # type: ignore[list-item]
        store = open_store(url or self.settings.store or str(self.settings.cache_dir / "store"),
                           settings=self.settings, log=self.log, tags={k.key: k.tag for k in given} if given else None)
        if store.url and "://" not in store.url and not store.url.startswith("github:"):
            errors.own(store.url, "the store")
        return store

    @property
    def runtime_cache(self) -> Path:
        """Where probe and telemetry cache their results."""
        return Path(self.settings.cache_dir) / "runtime"

    def actions_report(self, *, key: str, hit: bool, location: str | None, zip_path: Path | None = None,
                       zip_name: str | None = None) -> None:
        """Under GitHub Actions: the step outputs and the step summary's row of this key (log.actions_report)."""
        actions_report(output=self.settings.github_output, summary=self.settings.github_step_summary,
                       key=key, hit=hit, location=location, zip_path=zip_path, zip_name=zip_name)


    def actions_matrix(self, matrix: dict[str, Any], *, rows: Sequence[Row]) -> None:
        """Under GitHub Actions: the step outputs `matrix` (one line of JSON) and `count`, and a summary row per
        recipe (log.actions_matrix)."""
        actions_matrix(output=self.settings.github_output, summary=self.settings.github_step_summary,
                       matrix=matrix, rows=[(r.recipe, r.key, r.hit) for r in rows])


pass_ctx = click.make_pass_decorator(Ctx)
"""Pass the command line's Ctx (set by the top group) as a command's first argument."""
