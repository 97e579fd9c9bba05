"""The floors of the house (DESIGN §3): imports run one way, down the layers ground < models < platforms <
backends < key/build/verify < pipeline < app and CLI. Every import counts, wherever it is written (at the
top, inside a function, under TYPE_CHECKING), and importing `a.b.c` runs `a` and `a.b` first. No circle, no
arrow up, no module using another's private name, every module on a floor, and every module's docstring
short (what and why in at most 10 lines; derivations and lab notes belong in docs/ or bench/results/).

`python -m tests.unit.test_layers` prints the figures: modules per layer, the largest circle, arrows up."""

from __future__ import annotations

import ast
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "llamabundle"

# Bottom to top. A module belongs to the layer of its longest matching prefix; a new module must be placed.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground", ("llamabundle", "llamabundle.errors", "llamabundle.digest", "llamabundle.data", "llamabundle.log",
                "llamabundle.settings", "llamabundle.proc", "llamabundle.net", "llamabundle.scratch",
                "llamabundle.archive", "llamabundle.sevenzip", "llamabundle.gitindex", "llamabundle.pyindex",
                "llamabundle.compilers", "llamabundle.deps", "llamabundle.cache", "llamabundle.reasons",
                "llamabundle.gpus", "llamabundle.untrusted", "llamabundle.offline", "llamabundle.webui",
                "llamabundle.names")),
    ("models", ("llamabundle.recipe", "llamabundle.bundle")),
    ("platforms", ("llamabundle.platforms",)),
    ("backends", ("llamabundle.backends",)),
    ("key/build/verify", ("llamabundle.keys", "llamabundle.build", "llamabundle.verify", "llamabundle.opscheck",
                          "llamabundle.source", "llamabundle.package", "llamabundle.repro", "llamabundle.store")),
    ("pipeline", ("llamabundle.pipeline", "llamabundle.repair", "llamabundle.matrix")),
    ("app and CLI", ("llamabundle.runtime", "llamabundle.api", "llamabundle.index_site", "llamabundle.cli",
                     "llamabundle.__main__")),
)


@dataclass(frozen=True)
class Arrow:
    source: str
    target: str
    line: int


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _source(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a `from … import` takes from, absolute."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    """The package's modules an import statement names (a `from X import y` may name the module X.y)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        prefix = _source(module, path, node)
        names = [prefix, *(f"{prefix}.{a.name}" for a in node.names)]
    return [n for n in names if n in known]


def arrows() -> list[Arrow]:
    """Every import of the package by the package, with the package __init__ modules an import runs on the
    way (not a module's own ancestors, which are running already)."""
    known = modules()
    out: list[Arrow] = []
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(module, path, node, known):
                parts = name.split(".")
                for k in range(2, len(parts) + 1):
                    target = ".".join(parts[:k])
                    if target in known and target != module and not module.startswith(target + "."):
                        out.append(Arrow(module, target, node.lineno))
    return sorted(set(out), key=lambda a: (a.source, a.target, a.line))


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for i, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return best[0] if best is not None else None


def circles(edges: list[Arrow]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for a in edges:
        graph[a.source].add(a.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def private_uses() -> list[str]:
    """`from X import _name` and `X._name` where X is another module of the package (dunders aside)."""
    known = modules()
    out = []
    for module, path in sorted(known.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _source(module, path, node)
                for a in node.names:
                    if f"{base}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in known and base != module and a.name.startswith("_") and not a.name.startswith("__"):
                        out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} from {base} import {a.name}")
            elif isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names if a.name in known})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != module):
                out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    return out


# ------------------------------------------------------------------------------------------------ tests


def test_every_module_is_on_a_floor() -> None:
    assert [m for m in modules() if layer_of(m) is None] == []


def test_no_circle_counting_every_import() -> None:
    assert circles(arrows()) == []


def test_imports_run_down_the_floors() -> None:
    up = [f"{a.source}:{a.line} ({LAYERS[layer_of(a.source) or 0][0]}) imports {a.target} "
          f"({LAYERS[layer_of(a.target) or 0][0]})" for a in arrows()
          if (layer_of(a.target) or 0) > (layer_of(a.source) or 0)]
    assert up == []


def test_no_module_uses_another_modules_private_name() -> None:
    assert private_uses() == []


# Text the build writes into the build tree: part of what the tool derives (docs/key.md), so a change of a word
# would change the key of every CUDA recipe. Its docstring keeps its lab notes.
WRITTEN_INTO_BUILDS = ("backends/cuda/nvcc_launch.py",)


def test_module_docstrings_are_at_most_ten_lines() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in WRITTEN_INTO_BUILDS:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
        if len(doc.strip("\n").splitlines()) > 10:
            long.append(f"{path.relative_to(PACKAGE)}: {len(doc.strip(chr(10)).splitlines())} lines")
    assert long == []


def test_the_checks_see_what_they_must_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks are not vacuous: an arrow up (inside a function), a circle and private names written into a
    copy of the package are found."""
    copy = tmp_path / "llamabundle"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "errors.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _late() -> None:\n    from .cli import entry  # noqa\n")
    with open(copy / "digest.py", "a", encoding="utf-8") as f:
        f.write("\nfrom .net import _Retry  # noqa\nfrom . import proc  # noqa\nproc._reader  # noqa\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    found = arrows()
    assert any(a.source == "llamabundle.errors" and a.target == "llamabundle.cli.entry" for a in found)
    assert any("llamabundle.errors" in c and "llamabundle.cli.entry" in c for c in circles(found))
    uses = private_uses()
    assert any("from llamabundle.net import _Retry" in u for u in uses) and any("llamabundle.proc._reader" in u for u in uses)


def figures() -> str:
    edges = arrows()
    per = Counter(LAYERS[layer_of(m) or 0][0] for m in modules())
    up = sum((layer_of(a.target) or 0) > (layer_of(a.source) or 0) for a in edges)
    biggest = max((len(c) for c in circles(edges)), default=0)
    rows = [f"{name:18} {per[name]:3} modules" for name, _ in LAYERS]
    return "\n".join([*rows, f"{'in all':18} {len(modules()):3} modules, {len(edges)} import arrows",
                      f"largest circle: {biggest} modules; arrows up: {up}; private names used across modules: "
                      f"{len(private_uses())}"])


if __name__ == "__main__":
    print(figures())
