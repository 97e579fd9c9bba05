"""Strict YAML loading of a recipe into the frozen model: every problem is a RecipeError naming the file, the
line and column, and the key path, with a "did you mean" where one is close. Anchors, aliases and explicit
tags are refused, so what is read is what is pinned, as is a file past the limits (MAX_RECIPE_BYTES, and
MAX_RECIPE_DEPTH levels of nesting, refused before anything recurses). Where each key path was set is kept
on the recipe (Recipe.marks) for the checks made after loading (keys.check)."""

from __future__ import annotations

import dataclasses
import difflib
import re
import string
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .. import data
from ..errors import RecipeError
from ..names import Backend
from .model import SCHEMA_VERSION, SOURCE_KINDS, TEMPLATE_FIELDS, Recipe, Source, recipe_error, word_or_form

MAX_RECIPE_BYTES = 256 * 1024
MAX_RECIPE_DEPTH = 64  # a shipped recipe nests 5 levels


class _Ctx:
    def __init__(self, file: str) -> None:
        self.file = file
        self.marks: dict[str, tuple[int, int]] = {}

    def fail(self, node: Node | None, path: str, msg: str, fix: str = "") -> RecipeError:
        at = (node.start_mark.line + 1, node.start_mark.column + 1) if node is not None else self.marks.get(path)
        return recipe_error(self.file, path, msg, fix=fix, at=at)


def shipped_recipes() -> dict[str, Path]:
    """The recipes that come with llamabundle, by name: from the source checkout it runs from, else from
    the install's data directory (`<prefix>/share/llamabundle/recipes`, where pip, pipx and uvx put them)."""
    import site
    import sys
    import sysconfig

    checkout = Path(__file__).resolve().parents[2]  # llamabundle/recipe/loader.py in a source checkout
    dirs = [checkout / "recipes", Path(sysconfig.get_path("data")) / "share" / "llamabundle" / "recipes",
            Path(sys.prefix) / "share" / "llamabundle" / "recipes",
            Path(site.getuserbase()) / "share" / "llamabundle" / "recipes"]
    for d in dirs:
        found = {f.stem: f for f in sorted(d.glob("*.yaml"))} if d.is_dir() else {}
        if found:
            return found
    return {}


def find_recipe(arg: str | Path) -> Path:
    """A recipe file: the path itself when it exists, else a shipped recipe of that name
    (`linux-x86_64-cpu` or `linux-x86_64-cpu.yaml`)."""
    p = Path(arg)
    if p.exists() or len(p.parts) != 1:
        return p
    shipped = shipped_recipes()
    name = p.name[:-5] if p.name.endswith(".yaml") else p.name
    return shipped.get(name, p)


def load_recipe(path: str | Path) -> Recipe:
    """Load and validate a recipe file (or a shipped recipe by name) against the model. Every problem is a
    RecipeError naming file, line and key path. The rules that need a platform or a backend are keys.check's."""
    p = find_recipe(path)
    try:
        if p.exists() and not p.is_file():  # a directory, a FIFO, a device: never opened (a FIFO would block)
            raise RecipeError(f"{p}: not a regular file", fix="pass the path of a recipe YAML file")
        raw = p.read_bytes()
    except FileNotFoundError:
        names = ", ".join(shipped_recipes()) or "none found"
        raise RecipeError(f"{p}: no such recipe file", why=f"nor a shipped recipe of that name (shipped: {names})",
                          fix="pass the path of a recipe YAML file, or a name from `llamabundle recipe list`") from None
    except OSError as e:
        raise RecipeError(f"{p}: cannot read the recipe", why=str(e)) from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{p}: recipe is {len(raw)} bytes; the limit is {MAX_RECIPE_BYTES}",
                          fix="a recipe is a short YAML file; check that the right file was passed", file=str(p))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{p}: recipe is not UTF-8 text", why=str(e), file=str(p)) from None
    return parse_recipe(text, file=str(p))


def parse_recipe(text: str, *, file: str = "<recipe>") -> Recipe:
    """A recipe from YAML text, checked against the model (keys.check adds the platform's and backends' rules)."""
    ctx = _Ctx(file)
    root = _compose(text, ctx)
    if not isinstance(root, MappingNode):
        raise ctx.fail(root, "", "the recipe must be a mapping of keys (recipe:, name:, platform:, …)")
    version_node = _mapping_items(root, ctx, "").get("recipe")
    if version_node is None:
        raise ctx.fail(root, "recipe", "missing required key 'recipe' (the schema version)", fix="add `recipe: 1`")
    version = _scalar(version_node[1])
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise ctx.fail(version_node[1], "recipe", f"unknown recipe schema version {_describe(version_node[1])}",
                       fix=f"this llamabundle reads schema {SCHEMA_VERSION}; upgrade llamabundle or use `recipe: 1`")
    recipe = typing.cast(Recipe, _convert(root, Recipe, "", ctx))
    recipe = dataclasses.replace(recipe, origin=file, marks=dict(ctx.marks))
    _check(recipe, ctx)
    return recipe


def _compose(text: str, ctx: _Ctx) -> Node:
    # Aliases and deep nesting are refused in the event stream, before the composer (which recurses) builds
    # anything: no exponential expansion ("billion laughs"), no RecursionError.
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.AliasEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += not isinstance(event, yaml.AliasEvent)
                if isinstance(event, yaml.AliasEvent) or depth > MAX_RECIPE_DEPTH:
                    raise _refused(event, ctx)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        docs = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.MarkedYAMLError as e:
        m = e.problem_mark
        where = f"{ctx.file}:{m.line + 1}:{m.column + 1}" if m else ctx.file
        raise RecipeError(f"{where}: malformed YAML: {e.problem}", why=str(e.context or "the file is not valid YAML"),
                          fix="fix the YAML syntax at that line", file=ctx.file,
                          line=m.line + 1 if m else None, col=m.column + 1 if m else None) from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{ctx.file}: malformed YAML", why=str(e), file=ctx.file) from None
    if len(docs) != 1 or docs[0] is None:
        raise RecipeError(f"{ctx.file}: expected exactly one YAML document, found {len(docs)}",
                          fix="a recipe is a single YAML mapping", file=ctx.file)
    _check_scalars(docs[0], ctx, "")
    return docs[0]


def _refused(event: yaml.Event, ctx: _Ctx) -> RecipeError:
    """An alias, or a mapping or list nested deeper than MAX_RECIPE_DEPTH, as the error naming where it is."""
    m = event.start_mark  # always set by the parser; typed optional
    line, col = (m.line + 1, m.column + 1) if m else (None, None)
    where = f"{ctx.file}:{line}:{col}" if m else ctx.file
    if isinstance(event, yaml.AliasEvent):
        return RecipeError(f"{where}: YAML aliases (*{event.anchor}) are not allowed in recipes",
                           why="a recipe is read as plain data; anchors, aliases and merge keys hide what is pinned",
                           fix="write the values out in full", file=ctx.file, line=line, col=col)
    return RecipeError(f"{where}: the recipe nests mappings and lists deeper than {MAX_RECIPE_DEPTH} levels",
                       why="a recipe is nested a few levels deep (recipe.schema.json); deeper is refused before it is read",
                       fix="check that the right file was passed", file=ctx.file, line=line, col=col)


def _check_scalars(node: Node, ctx: _Ctx, path: str) -> None:
    """Every scalar must construct (explicit tags like `!foo` or `!!int abc`, or an impossible date, do not)."""
    if isinstance(node, ScalarNode):
        try:
            _scalar(node)
        except (yaml.YAMLError, ValueError, TypeError, OverflowError) as e:
            problem = getattr(e, "problem", None) or str(e)
            raise ctx.fail(node, path, f"cannot read the value {node.value!r} (tag {node.tag}): {problem}",
                           fix="write plain values without YAML tags; quote strings") from None
    elif isinstance(node, MappingNode):
        for knode, vnode in node.value:
            _check_scalars(knode, ctx, path)
            _check_scalars(vnode, ctx, _join(path, knode.value if isinstance(knode, ScalarNode) else "?"))
    elif isinstance(node, SequenceNode):
        for i, item in enumerate(node.value):
            _check_scalars(item, ctx, _join(path, i))


_SCALARS = SafeConstructor()


def _scalar(node: Node) -> Any:
    if not isinstance(node, ScalarNode):
        return node
    return _SCALARS.construct_object(node, deep=True)


def _mapping_items(node: MappingNode, ctx: _Ctx, path: str) -> dict[str, tuple[Node, Node]]:
    items: dict[str, tuple[Node, Node]] = {}
    for knode, vnode in node.value:
        key = _scalar(knode)
        if not isinstance(key, str):
            raise ctx.fail(knode, path, f"keys must be strings, got {key!r}")
        if key in items:
            first = items[key][0].start_mark.line + 1
            raise ctx.fail(knode, _join(path, key), f"duplicate key '{key}' (first set on line {first})",
                           fix="keep one of the two")
        items[key] = (knode, vnode)
    return items


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, get_args(tp)))
    if origin is tuple:
        return "a list"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {str: "a string", int: "an integer", bool: "true/false"}.get(tp, str(tp))


def _convert(node: Node, tp: Any, path: str, ctx: _Ctx) -> Any:
    ctx.marks.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if isinstance(node, ScalarNode) and _scalar(node) is None:
            return None
        if tp == Source or set(args) == set(get_args(Source)):
            return _convert_source(node, path, ctx)
        if (pair := word_or_form(tuple(args))) is not None:  # a word, or a mapping (ui: build | {url, sha256})
            word, form = pair
            if isinstance(node, MappingNode):
                return _convert(node, form, path, ctx)
            if isinstance(node, ScalarNode) and _scalar(node) not in get_args(word):
                keys = ", ".join(f.name for f in dataclasses.fields(form))
                raise ctx.fail(node, path, f"'{_scalar(node)}' is not one of {', '.join(get_args(word))}, or a mapping of {keys}",
                               fix="use one of: " + ", ".join(get_args(word)) + f", or {{{keys}}}")
            return _convert(node, word, path, ctx)
        (inner,) = args
        return _convert(node, inner, path, ctx)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _convert_dataclass(node, tp, path, ctx)
    if origin is tuple:
        elem = get_args(tp)[0]
        if elem is not Ellipsis and get_origin(elem) is tuple:  # tuple[tuple[str, str], ...]: the cmake mapping
            return _convert_cmake(node, path, ctx)
        if not isinstance(node, SequenceNode):
            raise ctx.fail(node, path, f"expected a list, got {_describe(node)}")
        return tuple(_convert(item, elem, _join(path, i), ctx) for i, item in enumerate(node.value))
    if not isinstance(node, ScalarNode):
        raise ctx.fail(node, path, f"expected {_type_name(tp)}, got {_describe(node)}")
    value = _scalar(node)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            fix = f"did you mean '{hint[0]}'?" if hint else "use one of: " + ", ".join(map(str, allowed))
            raise ctx.fail(node, path, f"'{value}' is not one of {', '.join(map(str, allowed))}", fix=fix)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ctx.fail(node, path, f"expected an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ctx.fail(node, path, f"expected a string, got {value!r} ({type(value).__name__})",
                           fix=f"quote the value: '{node.value}'")
        return value
    raise AssertionError(f"unsupported type {tp}")  # pragma: no cover - the model only uses the types above


def _describe(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    return repr(_scalar(node))


def _convert_dataclass(node: Node, tp: type, path: str, ctx: _Ctx) -> Any:
    if not isinstance(node, MappingNode):
        raise ctx.fail(node, path, f"expected a mapping, got {_describe(node)}")
    hints = typing.get_type_hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp) if not f.metadata.get("internal")}
    items = _mapping_items(node, ctx, path)
    kwargs: dict[str, Any] = {}
    for key, (knode, vnode) in items.items():
        if key not in fields:
            hint = difflib.get_close_matches(key, list(fields), n=1)
            fix = f"did you mean '{hint[0]}'?" if hint else "allowed keys: " + ", ".join(fields)
            raise ctx.fail(knode, _join(path, key), f"unknown key '{key}'", fix=fix)
        ctx.marks[_join(path, key)] = (knode.start_mark.line + 1, knode.start_mark.column + 1)  # the key's line, not its block's
        kwargs[key] = _convert(vnode, hints[key], _join(path, key), ctx)
        pattern = fields[key].metadata.get("pattern")
        if pattern:
            values = kwargs[key] if isinstance(kwargs[key], tuple) else (kwargs[key],)
            for i, v in enumerate(values):
                if isinstance(v, str) and not re.fullmatch(pattern, v):
                    sub = _join(path, key) if len(values) == 1 and not isinstance(kwargs[key], tuple) else _join(_join(path, key), i)
                    at = vnode.value[i] if isinstance(vnode, SequenceNode) else vnode
                    raise ctx.fail(at, sub, f"'{v}' is not valid: {fields[key].metadata['doc']}",
                                   fix=f"it must match {pattern}")
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ctx.fail(node, _join(path, name), f"missing required key '{name}' ({f.metadata.get('doc', '')})")
    return tp(**kwargs)


def _convert_source(node: Node, path: str, ctx: _Ctx) -> Source:
    if not isinstance(node, MappingNode) or len(node.value) != 1:
        raise ctx.fail(node, path, "a source is a one-key mapping: github:, git:, path: or pypi:",
                       fix="e.g. `- github: ggml-org/llama.cpp`")
    (kind, (knode, vnode)), = _mapping_items(node, ctx, path).items()
    cls = SOURCE_KINDS.get(kind)
    if cls is None:
        hint = difflib.get_close_matches(kind, list(SOURCE_KINDS), n=1)
        raise ctx.fail(knode, _join(path, kind), f"unknown source kind '{kind}'",
                       fix=f"did you mean '{hint[0]}'?" if hint else "use github, git, path or pypi")
    if isinstance(vnode, ScalarNode) and cls.short is not None:
        short = ScalarNode("tag:yaml.org,2002:str", cls.short, vnode.start_mark, vnode.end_mark)
        vnode = MappingNode("tag:yaml.org,2002:map", [(short, vnode)], vnode.start_mark, vnode.end_mark)
    return typing.cast(Source, _convert_dataclass(vnode, cls, _join(path, kind), ctx))


def _convert_cmake(node: Node, path: str, ctx: _Ctx) -> tuple[tuple[str, str], ...]:
    if not isinstance(node, MappingNode):
        raise ctx.fail(node, path, f"expected a mapping of CMake options, got {_describe(node)}")
    owned = set(data.build_knowledge()["tool_owned_cmake"])
    out = []
    for key, (knode, vnode) in _mapping_items(node, ctx, path).items():
        sub = _join(path, key)
        if not re.fullmatch(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise ctx.fail(knode, sub, f"'{key}' is not a CMake variable name")
        if key in owned:
            raise ctx.fail(knode, sub, f"{key} is set by llamabundle and cannot be set in cmake:",
                           fix="remove it; it is derived from cuda.archs, backends, toolchain or the toolkit")
        value = _scalar(vnode)
        if isinstance(value, bool):
            value = "ON" if value else "OFF"
        elif isinstance(value, int):
            value = str(value)
        elif not isinstance(value, str):
            raise ctx.fail(vnode, sub, f"expected ON/OFF or a string, got {_describe(vnode)}")
        out.append((key, value))
    return tuple(sorted(out))


def _check(r: Recipe, ctx: _Ctx) -> None:
    """Rules that span fields and need nothing but the model (DESIGN §4)."""
    if not r.llama_cpp.sources:
        raise ctx.fail(None, "llama_cpp.sources", "the source list is empty", fix="add at least one source, e.g. `- github: ggml-org/llama.cpp`")
    if len(set(r.backends)) != len(r.backends):
        raise ctx.fail(None, "backends", "a backend is listed twice")
    if "cpu" not in r.backends:
        raise ctx.fail(None, "backends", "'cpu' is required: every bundle ships the CPU backend", fix="add cpu to backends")
    if r.toolchain.msvc_version and r.toolchain.compiler != "msvc":
        raise ctx.fail(None, "toolchain.msvc_version", "msvc_version is only for compiler: msvc")
    if r.toolchain.version and r.toolchain.compiler == "msvc":
        raise ctx.fail(None, "toolchain.version", "compiler: msvc is pinned by toolset (and msvc_version, a Visual Studio range)",
                       fix='use toolset: "14.44.35207" and msvc_version: "[17.0,18.0)"')
    if r.toolchain.toolset and r.toolchain.compiler != "msvc":
        raise ctx.fail(None, "toolchain.toolset", "toolset is only for compiler: msvc", fix="pin the compiler with version:")
    if not r.targets:
        raise ctx.fail(None, "targets", "no targets", fix="add llama-server")
    if r.embeds_ui:  # llamabundle lays the UI into the build: llama.cpp must neither download nor npm-build it
        cmake = dict(r.cmake)
        for name in ("LLAMA_USE_PREBUILT_UI", "LLAMA_BUILD_UI"):
            if str(cmake.get(name, "ON" if name == "LLAMA_USE_PREBUILT_UI" else "OFF")).upper() != "OFF":
                raise ctx.fail(None, f"cmake.{name}" if name in cmake else "ui",
                               f"ui: {'build' if r.ui == 'build' else '{url, sha256}'} lays the web UI into the build itself, and {name} "
                               f"{'is ON' if name in cmake else 'defaults to ON'} (llama.cpp would "
                               f"{'download' if name == 'LLAMA_USE_PREBUILT_UI' else 'npm-build'} it during the build)",
                               fix=f"set {name}: OFF in cmake:")
    for name in SECTIONS:  # a backend with a section of its own (cuda:, vulkan:) has it exactly when it is listed
        if (name in r.backends) != (getattr(r, name) is not None):
            if getattr(r, name) is None:
                raise ctx.fail(None, "backends", f"{name} is listed but there is no {name}: section",
                               fix=f"add {name}: {_required(typing.get_type_hints(Recipe)[name])}")
            raise ctx.fail(None, name, f"a {name}: section without the {name} backend",
                           fix=f"add {name} to backends, or remove the {name}: section")
    _check_template(r.publish.tag, ctx)


SECTIONS = tuple(name for name in get_args(Backend) if name in {f.name for f in dataclasses.fields(Recipe)})


def _required(tp: Any) -> str:
    """The required keys of a section, nested: {headers: {url, sha256, version}}."""
    (inner,) = [a for a in get_args(tp) if a is not type(None)] or [tp]
    hints = typing.get_type_hints(inner)
    parts = []
    for f in dataclasses.fields(inner):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            sub = hints[f.name]
            parts.append(f"{f.name}: {_required(sub)}" if dataclasses.is_dataclass(sub) else f.name)
    return "{" + ", ".join(parts) + "}"


def _check_template(tag: str, ctx: _Ctx) -> None:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(tag) if name is not None]
    except ValueError as e:
        raise ctx.fail(None, "publish.tag", f"bad template '{tag}': {e}", fix="use {field} placeholders") from None
    for name in names:
        if name not in TEMPLATE_FIELDS:
            hint = difflib.get_close_matches(name, TEMPLATE_FIELDS, n=1)
            raise ctx.fail(None, "publish.tag", f"template field '{{{name}}}' does not exist",
                           fix=(f"did you mean '{{{hint[0]}}}'? " if hint else "") + "fields: " + ", ".join(TEMPLATE_FIELDS))
    if not re.fullmatch(r"^[A-Za-z0-9._{}-]+$", tag):
        raise ctx.fail(None, "publish.tag", f"'{tag}' has characters a git tag cannot hold")
    if not tag.endswith(("{key}", "{key12}")):
        raise ctx.fail(None, "publish.tag", f"template '{tag}' does not end with {{key}} or {{key12}}",
                       fix="one release per cache key: end the tag with the key, e.g. '{name}-{key12}' "
                           "(a store that knows only the key finds the release by it)")
