"""bundle.json as typed, frozen values (DESIGN §5), and the one trust check every user of a bundle runs.

`parse` is the only reader of a manifest's JSON: a wrong type or a missing field is a verification
error (exit 5) that names the field. `trust` is the only check of a bundle against its manifest and
against what the caller asked for: the format is known, the key is the sha256 of the inputs the
manifest records, the recorded platform/commit/toolkit are those inputs, the key, platform, commit
and toolkit are the ones asked for, and (given the files) every file has its size and sha256 and no
file is outside the list. `verify`, `fetch`, `publish`, `install` and a build's cache hit all call it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, get_args

from .. import untrusted
from ..data import SCHEMA_DRAFT, schema_id
from ..digest import sha256_file, sha256_json, walk
from ..errors import VerifyError
from ..names import Backend, Platform

MANIFEST = "bundle.json"
FORMAT = 1
ROLES = ("exe", "backend", "runtime", "license")
PLATFORMS: tuple[str, ...] = get_args(Platform)  # a bundle is for a platform a recipe can name
SECTIONS: tuple[str, ...] = get_args(Backend)  # a backend's own section is named after it (cuda, vulkan)
HEX64 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
MAX_MANIFEST_BYTES = 16 << 20
FIX = "do not use this bundle; fetch it again from a trusted store, or rebuild and publish it"


class ManifestError(VerifyError):
    """bundle.json is not a manifest this version can trust (exit 5); `field` names what is wrong."""

    def __init__(self, what: str, *, field: str = "", why: str = "", fix: str = FIX) -> None:
        super().__init__(what, why=why, fix=fix)
        self.field = field


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a bundle, as bundle.json lists it."""

    path: str
    sha256: str
    size: int
    role: str
    origin: str | None = None
    why: str | None = None


@dataclass(frozen=True, kw_only=True)
class LlamaCpp:
    """bundle.json's `llama_cpp`: the commit built and where it came from."""

    commit: str
    version: str | None = None
    source: str | None = None


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A bundle.json, read and checked field by field (docs/bundle-format.md)."""

    name: str
    key: str
    inputs: Mapping[str, Any]  # read-only view; the canonical key inputs
    llama_cpp: LlamaCpp
    platform: str
    backends: tuple[str, ...]
    sections: Mapping[str, Mapping[str, Any]]  # each backend's own section, read-only (its backend reads it typed)
    files: tuple[FileEntry, ...]
    system_deps: tuple[str, ...]
    glibc_floor: str | None
    publish_tag: str | None
    tool: str | None
    built_at: str | None
    parts: Mapping[str, tuple[str, ...]] | None = None  # GPU backend -> the files only it needs (bundle.parts)
    cut: Mapping[str, Any] | None = None  # a subset of a published bundle: what it was cut from (bundle.parts.cut)
    _raw: str  # the JSON as it was read, canonical (unknown fields of format 1 are kept)

    def file(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)

    def toolkit(self, section: str) -> str | None:
        """The toolkit release a backend's section records (cuda: 12.8.1), or None."""
        value = self.sections.get(section, {}).get("toolkit")
        return value if isinstance(value, str) else None

    def to_json(self) -> dict[str, Any]:
        """The manifest as it was read (a new copy: unknown fields of format 1 are kept)."""
        data: dict[str, Any] = json.loads(self._raw)
        return data

    def text(self) -> str:
        """bundle.json as the tool writes it."""
        return json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"

    def inputs_key(self) -> str:
        """The sha256 of the recorded inputs: what the key must be."""
        return sha256_json(self.to_json()["inputs"])


# ------------------------------------------------------------------------------------- parsing


def field_error(field: str, what: str) -> ManifestError:
    """A field of bundle.json that is not what it must be (`field`: its path, e.g. cuda.archs.sass)."""
    return ManifestError(f"{MANIFEST}: '{field}' {what}", field=field,
                         why="the manifest does not have the form of a bundle.json")


def as_obj(value: Any, field: str) -> Mapping[str, Any]:
    """A field's value as an object, else a ManifestError naming it (also for a backend reading its section)."""
    if not isinstance(value, Mapping):
        raise field_error(field, f"is {_kind(value)}, not an object")
    return value


def as_str(value: Any, field: str, *, pattern: re.Pattern[str] | None = None, optional: bool = False,
           what: str = "") -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise field_error(field, f"is {_kind(value)}, not a string")
    if pattern is not None and not pattern.fullmatch(value):
        raise field_error(field, f"is {value[:80]!r}, not {what}")
    return value


def as_strs(value: Any, field: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise field_error(field, f"is {_kind(value)}, not a list")
    for i, v in enumerate(value):
        as_str(v, f"{field}[{i}]")
    return tuple(value)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: f"the string {str(value)[:40]!r}",
            list: "a list", tuple: "a list", dict: "an object", MappingProxyType: "an object"}.get(type(value),
                                                                                                type(value).__name__)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def parse(data: Any) -> Manifest:
    """A manifest from decoded JSON. Raises ManifestError naming the first field that is wrong."""
    if not isinstance(data, dict):
        raise ManifestError(f"{MANIFEST} is {_kind(data)}, not an object", why="a bundle.json is one JSON object")
    fmt = data.get("format")
    if fmt != FORMAT or isinstance(fmt, bool):
        raise ManifestError(f"{MANIFEST} has unknown format {fmt!r}", field="format",
                            why=f"this llamabundle reads format {FORMAT}", fix="upgrade llamabundle")
    for k in ("name", "key", "inputs", "llama_cpp", "platform", "files"):
        if k not in data:
            raise ManifestError(f"{MANIFEST} lacks '{k}'", field=k, why="every bundle.json records it")
    name = as_str(data["name"], "name", pattern=_NAME, what="a bundle name")
    key = as_str(data["key"], "key", pattern=HEX64, what="64 lowercase hex digits")
    inputs = as_obj(data["inputs"], "inputs")
    ll = as_obj(data["llama_cpp"], "llama_cpp")
    llama = LlamaCpp(commit=as_str(ll.get("commit"), "llama_cpp.commit", pattern=_COMMIT, what="a 40-digit commit") or "",
                     version=as_str(ll.get("version"), "llama_cpp.version", optional=True),
                     source=as_str(ll.get("source"), "llama_cpp.source", optional=True))
    platform = as_str(data["platform"], "platform") or ""
    if platform not in PLATFORMS:
        raise ManifestError(f"{MANIFEST}: 'platform' is {platform[:40]!r}, which this llamabundle does not know",
                            field="platform", why=f"known platforms: {', '.join(PLATFORMS)}", fix="upgrade llamabundle")
    backends = as_strs(data.get("backends", []), "backends")
    sections = {}  # each read typed by its backend (Backend.read_section); here: an object, its toolkit a string
    for section in SECTIONS:
        if data.get(section) is not None:
            sections[section] = as_obj(data[section], section)
            as_str(sections[section].get("toolkit"), f"{section}.toolkit", optional=True)
    if not isinstance(data["files"], list):
        raise field_error("files", f"is {_kind(data['files'])}, not a list")
    files: list[FileEntry] = []
    seen: set[str] = set()
    for i, f in enumerate(data["files"]):
        where = f"files[{i}]"
        f = as_obj(f, where)
        path = as_str(f.get("path"), f"{where}.path") or ""
        if (not path or path.startswith("/") or "\\" in path or ".." in path.split("/") or path == MANIFEST
                or ":" in path.split("/")[0]):
            raise field_error(f"{where}.path", f"is {path[:80]!r}, not a relative path inside the bundle")
        if path.lower() in seen:
            raise field_error(f"{where}.path", f"lists {path!r} twice")
        seen.add(path.lower())
        size = f.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise field_error(f"{where}.size", f"is {_kind(size)}, not a size in bytes")
        role = as_str(f.get("role"), f"{where}.role") or ""
        if role not in ROLES:
            raise field_error(f"{where}.role", f"is {role[:40]!r}, not one of {', '.join(ROLES)}")
        files.append(FileEntry(path=path, sha256=as_str(f.get("sha256"), f"{where}.sha256", pattern=HEX64,
                                                      what="64 lowercase hex digits") or "",
                               size=size, role=role, origin=as_str(f.get("origin"), f"{where}.origin", optional=True),
                               why=as_str(f.get("why"), f"{where}.why", optional=True)))
    publish = data.get("publish")
    tag = None
    if publish is not None:
        tag = as_str(as_obj(publish, "publish").get("tag"), "publish.tag", optional=True)
    toolchain = data.get("toolchain")
    if toolchain is not None:
        as_obj(toolchain, "toolchain")
    parts = _parts(data.get("parts"), backends, {f.path for f in files})
    cut = _cut(data.get("cut"))
    return Manifest(parts=parts, cut=cut, name=name or "", key=key or "", inputs=_freeze(inputs), llama_cpp=llama, platform=platform,
                    backends=backends, sections=_freeze(sections), files=tuple(files),
                    system_deps=as_strs(data.get("system_deps") or [], "system_deps"),
                    glibc_floor=as_str(data.get("glibc_floor"), "glibc_floor", optional=True),
                    publish_tag=tag, tool=as_str(data.get("tool"), "tool", optional=True),
                    built_at=as_str(data.get("built_at"), "built_at", optional=True), _raw=json.dumps(data, sort_keys=True))


def _parts(value: Any, backends: tuple[str, ...], paths: set[str]) -> Mapping[str, tuple[str, ...]] | None:
    """`parts`: each GPU backend the bundle holds -> files it lists (null: a bundle packed before parts)."""
    if value is None:
        return None
    parts = {}
    for b, listed in as_obj(value, "parts").items():
        if b not in backends or b == "cpu":
            raise field_error(f"parts.{b}", "names a backend the bundle does not hold as a GPU part")
        for i, p in enumerate(as_strs(listed, f"parts.{b}")):
            if p not in paths:
                raise field_error(f"parts.{b}[{i}]", f"is {p[:80]!r}, which the bundle does not list")
        parts[b] = tuple(listed)
    return MappingProxyType(parts)


CUT_BY = ("auto", "list")


def _cut(value: Any) -> Mapping[str, Any] | None:
    """`cut`: what a partial install was cut from (null: a whole bundle)."""
    if value is None:
        return None
    cut = as_obj(value, "cut")
    as_strs(cut.get("from_backends"), "cut.from_backends")
    as_strs(cut.get("dropped"), "cut.dropped")
    by = as_str(cut.get("by"), "cut.by")
    if by not in CUT_BY:
        raise field_error("cut.by", f"is {str(by)[:20]!r}, not one of {', '.join(CUT_BY)}")
    for k, v in as_obj(cut.get("why", {}), "cut.why").items():
        as_str(v, f"cut.why.{k}")
    as_str(cut.get("from_manifest_sha256"), "cut.from_manifest_sha256", pattern=HEX64, what="64 lowercase hex digits")
    frozen: Mapping[str, Any] = _freeze(dict(cut))
    return frozen


def schema_text(pattern: re.Pattern[str] | None = None, **more: Any) -> dict[str, Any]:
    """A string field's schema (anchored pattern, description …)."""
    return {"type": "string", **({"pattern": f"^{pattern.pattern}$"} if pattern else {}), **more}


def schema_maybe(schema: dict[str, Any]) -> dict[str, Any]:
    """A field that may also be null."""
    return {"anyOf": [schema, {"type": "null"}]}


SCHEMA_STRINGS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}


def json_schema(sections: Mapping[str, dict[str, Any]], *, backends: tuple[str, ...]) -> dict[str, Any]:
    """bundle.json's JSON schema, generated from the rules `parse` applies (patterns, roles, platforms) and each
    backend's section schema (`sections`, by name; `backends`: the names this version knows): committed as
    data/schemas/bundle.schema.json (backends.bundle_schema), and a test fails when it drifts. Apps in any
    language can validate a manifest with it before `trust`'s own checks."""
    text, maybe, strings = schema_text, schema_maybe, SCHEMA_STRINGS
    file_entry = {
        "type": "object",
        "required": ["path", "sha256", "size", "role"],
        "properties": {
            "path": text(description="relative path inside the bundle ('/' separated, no '..', not bundle.json)"),
            "sha256": text(HEX64),
            "size": {"type": "integer", "minimum": 0},
            "role": {"enum": list(ROLES)},
            "origin": maybe(text()),
            "why": maybe(text()),
        },
    }
    return {
        "$schema": SCHEMA_DRAFT,
        "$id": schema_id("bundle"),
        "title": "llamabundle bundle.json",
        "type": "object",
        "required": ["format", "name", "key", "inputs", "llama_cpp", "platform", "files"],
        "properties": {
            "format": {"const": FORMAT},
            "name": text(_NAME),
            "key": text(HEX64, description="sha256 of the canonical JSON of `inputs`"),
            "inputs": {"type": "object", "description": "the recipe's canonical key inputs"},
            "llama_cpp": {"type": "object", "required": ["commit"],
                          "properties": {"commit": text(_COMMIT), "version": maybe(text()), "source": maybe(text())}},
            "platform": {"enum": list(PLATFORMS)},
            "backends": {"type": "array", "items": {"type": "string"},
                         "description": "the ggml backends it carries; this version knows " + ", ".join(backends)},
            **{name: maybe(schema) for name, schema in sections.items()},
            "toolchain": maybe({"type": "object", "additionalProperties": maybe(text())}),
            "system_deps": maybe(strings),
            "glibc_floor": maybe(text()),
            "files": {"type": "array", "items": file_entry},
            "publish": maybe({"type": "object", "properties": {"tag": maybe(text())}}),
            "tool": maybe(text()),
            "built_at": maybe(text()),
            "parts": maybe({"type": "object", "additionalProperties": strings,
                            "description": "each GPU backend -> the files only it needs (every other file is the CPU "
                                           "part, which every install holds)"}),
            "cut": maybe({"type": "object", "required": ["from_backends", "dropped", "by", "from_manifest_sha256"],
                          "description": "a partial install: the backends of the published bundle, those left out, "
                                         "how they were chosen and why, and the sha256 of the published bundle.json",
                          "properties": {"from_backends": strings, "dropped": strings, "by": {"enum": list(CUT_BY)},
                                         "why": {"type": "object", "additionalProperties": text()},
                                         "from_manifest_sha256": text(HEX64)}}),
        },
    }


def loads(raw: bytes | str, *, where: str = MANIFEST) -> Manifest:
    """Parse bundle.json's bytes (UTF-8 JSON). `where` names it in messages (a path, a zip member, a release)."""
    if isinstance(raw, bytes):
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where} is larger than {MAX_MANIFEST_BYTES >> 20} MiB",
                                why="a bundle.json is a few KiB")
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ManifestError(f"{where} is not UTF-8 text", why=str(e)) from None
    try:
        data = untrusted.loads(raw, max_bytes=MAX_MANIFEST_BYTES)
    except untrusted.Untrusted as e:  # nested past the limit: refused before json.loads recurses
        raise ManifestError(f"{where} is {e}", why="a bundle.json is a few KiB, nested at most 5 levels deep") from None
    except ValueError as e:
        raise ManifestError(f"{where} is not valid JSON", why=str(e)[:200]) from None
    try:
        return parse(data)
    except ManifestError as e:
        if where != MANIFEST:
            e.what = e.what.replace(MANIFEST, where, 1)
            e.args = (e.what,)
        raise


def read(root: Path) -> Manifest:
    """The manifest at the root of an unpacked bundle."""
    path = root / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{root} has no {MANIFEST}", why="every bundle carries its manifest at the root",
                            fix="this is not a llamabundle bundle, or it is incomplete")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ManifestError(f"cannot read {path}", why=e.strerror or str(e), fix="check its permissions") from None
    return loads(raw)


# ---------------------------------------------------------------------------------------- trust


@dataclass(frozen=True, kw_only=True)
class Expect:
    """What the caller asked for; None: not asked (the manifest's own consistency is still checked)."""
    key: str | None = None
    platform: str | None = None
    commit: str | None = None
    toolkits: Mapping[str, str] = field(default_factory=dict)  # backend name -> its toolkit: {"cuda": "12.8.1"}


ANYTHING = Expect()  # nothing asked for: the manifest's own consistency (and the files) only


def check_consistent(m: Manifest, expect: Expect = ANYTHING) -> None:
    """The manifest against its own inputs and against what was asked for (no file is read)."""
    inputs = m.inputs
    checks = [
        (m.inputs_key() == m.key, f"its key {m.key[:12]} is not the sha256 of the inputs its {MANIFEST} records",
         "the manifest was edited, or its inputs are not what the bundle was built from"),
        (inputs.get("platform", m.platform) == m.platform,
         f"it says platform {m.platform}, its inputs say {inputs.get('platform')}", "the manifest was edited"),
        (inputs.get("commit", m.llama_cpp.commit) == m.llama_cpp.commit,
         f"it says llama.cpp {m.llama_cpp.commit[:12]}, its inputs say {str(inputs.get('commit'))[:12]}",
         "the manifest was edited"),
    ]
    # what it claims to hold: the backends its inputs name (every key since the list was added to the inputs;
    # without it, each section's toolkit is still checked against the inputs below), each backend's section
    # only for a backend it holds
    recorded_backends = inputs.get("backends")
    if isinstance(recorded_backends, (list, tuple)):
        allowed = sorted(str(b) for b in recorded_backends)
        holds = sorted(m.backends) if m.cut is not None else allowed  # a cut holds some of them, named by its cut
        unclaimed = [s for s in m.sections if s not in holds]
        if m.cut is not None:
            cut_from, dropped = sorted(m.cut["from_backends"]), sorted(m.cut["dropped"])
            checks += [
                (cut_from == allowed, f"it says it was cut from backends {', '.join(cut_from)}, its inputs say "
                                      f"{', '.join(allowed) or 'none'}", "the manifest was edited"),
                (set(m.backends) <= set(allowed) and ("cpu" in m.backends or "cpu" not in allowed)
                 and dropped == sorted(set(allowed) - set(m.backends)),
                 f"it holds backends {', '.join(m.backends)} and says it dropped {', '.join(dropped) or 'none'} of "
                 f"{', '.join(allowed)}", "a partial install holds the CPU part and some of its inputs' backends"),
            ]
        checks += [
            (not m.backends or sorted(m.backends) == holds,
             f"it says backends {', '.join(m.backends)}, its inputs say {', '.join(allowed) or 'none'}",
             "the manifest was edited: the backends a bundle holds are part of its key"),
            (not unclaimed, f"it has a {', '.join(unclaimed)} section, its inputs name no such backend",
             "the manifest was edited: a backend's section belongs to a backend the key names"),
        ]
    for name in SECTIONS:  # a backend's toolkit: the one its section records is the one its inputs record
        if name in inputs and not (m.cut is not None and name in m.cut["dropped"]):
            recorded = inputs[name].get("toolkit") if isinstance(inputs[name], Mapping) else None
            said = m.toolkit(name)
            checks.append((recorded == said, f"it says {name.upper()} {said or 'none'}, its inputs say "
                                             f"{recorded or 'none'}", "the manifest was edited"))
    checks += [
        (expect.key is None or m.key == expect.key, f"its {MANIFEST} names key {m.key[:12]}, not {(expect.key or '')[:12]}",
         "it is stored under a key that is not its own"),
        (expect.platform is None or m.platform == expect.platform,
         f"it is built for {m.platform}, not {expect.platform}", "a bundle runs only on its own platform"),
        (expect.commit is None or m.llama_cpp.commit == expect.commit,
         f"it holds llama.cpp {m.llama_cpp.commit}, expected {expect.commit}", "the commit differs"),
    ]
    for name, want in expect.toolkits.items():
        got = m.toolkit(name)
        checks.append((got == want, f"it was built with {name.upper()} {got}, expected {want}" if got
                       else f"it was built without {name.upper()}, expected {name.upper()} {want}", "the toolkit differs"))
    for ok, what, why in checks:
        if not ok:
            raise ManifestError(f"bundle {m.key[:12]} refused: {what}", why=why)


@dataclass(frozen=True, kw_only=True)
class ContentCheck:
    """What a bundle's content check counted: its files and their bytes."""

    files: int
    bytes: int


def check_files(root: Path, m: Manifest, *, hashes: Mapping[str, str] | None = None,
                name: Callable[[str], str] | None = None) -> ContentCheck:
    """Every listed file exists with its size and sha256; no file outside the list. `hashes` (path -> sha256)
    are digests of files just written by an unpack that hashed them as it went, so they are not read again.
    `name` says a member as the messages name it (verify: `bundle.zip:LICENSE`; default: its path)."""
    shown = name or str
    listed = {f.path: f for f in m.files}
    present = set(walk(root)) - {MANIFEST}
    extra = sorted(present - set(listed))
    if extra:
        raise VerifyError(f"{shown(extra[0])} is in the bundle but not in {MANIFEST}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""),
                          why="a bundle holds exactly the files its manifest lists", fix=FIX)
    total = 0
    for path, entry in sorted(listed.items()):
        f = root / path
        if f.is_symlink() or not f.is_file():
            raise VerifyError(f"{shown(path)} is listed in {MANIFEST} but " + ("is not a regular file" if f.exists() or f.is_symlink()
                                                                                 else "missing"), fix="fetch or rebuild the bundle")
        size = f.stat().st_size
        if size != entry.size:
            raise VerifyError(f"{shown(path)} has size {size}, {MANIFEST} says {entry.size}",
                              why="the file was changed after the bundle was made", fix="fetch or rebuild the bundle")
        got = hashes[path] if hashes is not None and path in hashes else sha256_file(f)
        if got != entry.sha256:
            raise VerifyError(f"{shown(path)} does not match its sha256 in {MANIFEST}",
                              why="the file was changed after the bundle was made", fix="fetch or rebuild the bundle")
        total += size
    return ContentCheck(files=len(listed), bytes=total)


def trust(m: Manifest, root: Path | None = None, expect: Expect = ANYTHING, *,
          hashes: Mapping[str, str] | None = None, name: Callable[[str], str] | None = None) -> ContentCheck | None:
    """The one trust check (DESIGN §5): consistency and what was asked for, then (root given) the files
    (`name`: how their messages name a member, check_files)."""
    check_consistent(m, expect)
    return check_files(root, m, hashes=hashes, name=name) if root is not None else None
