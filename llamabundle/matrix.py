"""`llamabundle matrix`: the GitHub Actions matrix of a release, the recipes whose bundles a store does not have
yet. Every key is computed without build tools (the shipped recipes pin them) and the store is asked once per
recipe, so the job that runs it needs Python and nothing else; a release whose bundles are all published gets
an empty matrix and builds nothing. A legs file gives each recipe's runner settings (its image, its caches)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import keys
from .errors import UsageError
from .keys import Keyed
from .recipe import shipped_recipes
from .store.base import Store

LEGS_MAX_BYTES = 1 << 20
# a leg's setting: a name GitHub's matrix takes, and a scalar value (the workflow reads them as matrix.<name>)
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-_")


@dataclass(frozen=True, kw_only=True)
class Row:
    recipe: str
    key: str
    tag: str
    hit: bool
    location: str | None
    leg: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "key": self.key, "tag": self.tag, "hit": self.hit, "location": self.location}


@dataclass(frozen=True, kw_only=True)
class Matrix:
    rows: tuple[Row, ...]

    @property
    def misses(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if not r.hit)

    def include(self) -> list[dict[str, Any]]:
        """The matrix's `include`: each miss's leg settings, its recipe's name and its key."""
        return [{**r.leg, "recipe": r.recipe, "key": r.key} for r in self.misses]


def load_legs(path: Path) -> dict[str, dict[str, Any]]:
    """A legs file: `legs:`, a list of mappings, each a `recipe:` name and that leg's settings (scalars)."""
    def bad(why: str) -> UsageError:
        return UsageError(f"{path} is not a legs file", why=why,
                          fix="write `legs:` as a list of mappings, each with `recipe: NAME` and scalar settings")

    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}", why=e.strerror or str(e), fix="pass the legs file's path") from None
    if len(raw) > LEGS_MAX_BYTES:
        raise bad(f"it is {len(raw)} bytes, more than {LEGS_MAX_BYTES}")
    try:
        doc = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError) as e:
        raise bad(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    legs = doc.get("legs") if isinstance(doc, dict) else None
    if not isinstance(legs, list) or not legs:
        raise bad("it has no `legs:` list")
    out: dict[str, dict[str, Any]] = {}
    for i, leg in enumerate(legs):
        if not isinstance(leg, dict) or not isinstance(leg.get("recipe"), str):
            raise bad(f"leg {i} is not a mapping with a `recipe:` name")
        for name, value in leg.items():
            if not isinstance(name, str) or not name or set(name) - _NAME_CHARS:
                raise bad(f"leg {i}: {name!r} is not a setting name (lowercase letters, digits, - and _)")
            if not isinstance(value, (str, int, float, bool)):
                raise bad(f"leg {i}: {name} is not a scalar")
        if leg["recipe"] in out:
            raise bad(f"{leg['recipe']} has two legs")
        out[leg["recipe"]] = {k: v for k, v in leg.items() if k != "recipe"}
    return out


def recipes_of(names: Sequence[str], legs: Mapping[str, Any] | None) -> list[str]:
    """What to plan: the names or paths given, else the legs file's recipes, else every shipped recipe."""
    if names:
        return list(names)
    if legs is not None:
        return list(legs)
    return list(shipped_recipes())


def keyed_recipes(names: Sequence[str], *, env: Mapping[str, str]) -> list[Keyed]:
    """Each recipe loaded and keyed (a name twice is planned once)."""
    out: dict[str, Keyed] = {}
    for name in names:
        k = keys.resolve(keys.load(name), env=env)
        out.setdefault(k.recipe.name, k)
    return list(out.values())


def plan(keyed: Sequence[Keyed], store: Store, *, legs: Mapping[str, Mapping[str, Any]] | None) -> Matrix:
    """One store query per recipe; a recipe the legs file does not name has no leg to run on (exit 2)."""
    if legs is not None:
        missing = [k.recipe.name for k in keyed if k.recipe.name not in legs]
        if missing:
            raise UsageError(f"no leg for {', '.join(missing)} in the legs file",
                             why="each recipe of the matrix runs on the runner its leg names",
                             fix="add a leg for it (recipe, os, and its caches), or leave the recipe out")
    rows = []
    for k in keyed:
        entry = store.lookup(k.key)
        rows.append(Row(recipe=k.recipe.name, key=k.key, tag=k.tag, hit=entry is not None,
                        location=entry.location if entry else None, leg=dict((legs or {}).get(k.recipe.name, {}))))
    return Matrix(rows=tuple(rows))
