"""Recipes (DESIGN §4): frozen dataclasses, strict YAML loading with file:line in every error, and
the cache key.

This is the only module that reads recipe YAML: everything downstream gets frozen values. Settings from
the environment are in settings.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import string
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from . import data, platforms
from .backends.cuda.archs import PATTERN as ARCH_PATTERN
from .errors import RecipeError, ToolchainError

SCHEMA_VERSION = 1
BUNDLE_FORMAT = 1
MAX_RECIPE_BYTES = 256 * 1024

Platform = Literal["linux-x86_64", "windows-x86_64"]  # each one a module in platforms/ (a test checks they agree)
Backend = Literal["cpu", "cuda", "vulkan"]  # each one a module in backends/
Compiler = Literal["gcc", "clang", "msvc", "mingw"]
CudaSourceKind = Literal["redist", "installer", "pypi", "system"]
OpenMP = Literal["auto", "vcomp", "libomp", "none"]
LatentCompanions = Literal["ship", "omit"]

TEMPLATE_FIELDS = ("name", "key", "key12", "commit", "commit12", "platform")

_HEX40 = r"^[0-9a-f]{40}$"
_HEX64 = r"^[0-9a-f]{64}$"
_VERSION = r"^[0-9]+(\.[0-9]+)*$"
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


def _f(doc: str, *, pattern: str = "", default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    meta = {"doc": doc, "pattern": pattern}
    if default is dataclasses.MISSING and "default_factory" not in kw:
        return field(metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


# ---------------------------------------------------------------------------------------- model


@dataclass(frozen=True, kw_only=True)
class GithubSource:
    repo: str = _f("OWNER/NAME on GitHub; the archive tarball of the commit", pattern=r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
    kind: typing.ClassVar[str] = "github"


@dataclass(frozen=True, kw_only=True)
class GitSource:
    url: str = _f("a git remote URL; the exact commit is fetched and HEAD checked")
    kind: typing.ClassVar[str] = "git"


@dataclass(frozen=True, kw_only=True)
class PathSource:
    path: str = _f("a local llama.cpp git checkout (relative to the recipe file)")
    kind: typing.ClassVar[str] = "path"


@dataclass(frozen=True, kw_only=True)
class PypiSource:
    package: str = _f("PyPI project whose sdist vendors llama.cpp", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    version: str = _f("exact version of the sdist", pattern=r"^[0-9A-Za-z.+!-]+$")
    sha256: str = _f("sha256 of the sdist file", pattern=_HEX64)
    kind: typing.ClassVar[str] = "pypi"


Source = GithubSource | GitSource | PathSource | PypiSource
SOURCE_KINDS: dict[str, type[Source]] = {c.kind: c for c in (GithubSource, GitSource, PathSource, PypiSource)}
# Short forms: `- github: ggml-org/llama.cpp` means {repo: ggml-org/llama.cpp}.
SOURCE_SHORT_FIELD = {"github": "repo", "git": "url", "path": "path"}


@dataclass(frozen=True, kw_only=True)
class LlamaCpp:
    commit: str = _f("the llama.cpp commit, 40 lowercase hex digits", pattern=_HEX40)
    sources: tuple[Source, ...] = _f("where to get it, tried in order; each must prove the same commit")


@dataclass(frozen=True, kw_only=True)
class Toolchain:
    compiler: Compiler = _f("C/C++ compiler family")
    msvc_version: str | None = _f("MSVC version range, e.g. \"[17.0,18.0)\" (msvc only)", default=None,
                                  pattern=r"^([\[(][0-9.]*,[0-9.]*[\])]|[0-9]+(\.[0-9]+)*)$")
    version: str | None = _f("the C++ compiler's version (gcc, clang, mingw): \"12.2\" is any 12.2.x, \"[12.2,13)\" "
                             "a range; in the cache key. Without it the key holds the exact version of the "
                             "compiler found here", default=None,
                             pattern=r"^([\[(][0-9.]*,[0-9.]*[\])]|[0-9]+(\.[0-9]+)*)$")


@dataclass(frozen=True, kw_only=True)
class DriverFloor:
    windows: str | None = _f("minimum NVIDIA driver on Windows", default=None, pattern=_VERSION)
    linux: str | None = _f("minimum NVIDIA driver on Linux", default=None, pattern=_VERSION)


@dataclass(frozen=True, kw_only=True)
class Cuda:
    toolkit: str = _f("CUDA toolkit version, e.g. 12.8.1", pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")
    source: CudaSourceKind = _f("where the toolkit comes from", default="redist")
    components: tuple[str, ...] = _f("redist components to install", pattern=r"^[a-z][a-z0-9_]*$")
    archs: tuple[str, ...] = _f("GPU architectures: NN[a|f][-real|-virtual]", pattern=ARCH_PATTERN)
    driver_floor: DriverFloor | None = _f("minimum driver; derived from the toolkit when absent", default=None)
    libraries: tuple[str, ...] = _f("toolkit libraries to ship although nothing imports or loads them, by file name "
                                    "(nvJitLink_120_0.dll); each comes from the toolkit with its own imports",
                                    default=(), pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
    latent_companions: LatentCompanions = _f("ship the libraries a bundled CUDA library may load by name at run time "
                                             "(cuBLASLt names NVRTC), or omit them (data/cuda_runtime.json says why "
                                             "each is latent)", default="ship")


@dataclass(frozen=True, kw_only=True)
class VulkanHeaders:
    url: str = _f("an archive of the Vulkan headers ggml-vulkan compiles against (vulkan/vulkan.hpp): a Debian "
                  "libvulkan-dev .deb, or a .tar.gz/.tar.xz/.zip of Vulkan-Headers", pattern=r"^https?://\S+$")
    sha256: str = _f("sha256 of that archive", pattern=_HEX64)
    version: str = _f("the headers' Vulkan version, e.g. 1.4.309 (checked against vulkan_core.h)", pattern=_VERSION)
    include: str = _f("the directory inside the archive that holds vulkan/", default="usr/include",
                      pattern=r"^[A-Za-z0-9._+-]+(/[A-Za-z0-9._+-]+)*$")


@dataclass(frozen=True, kw_only=True)
class Vulkan:
    headers: VulkanHeaders = _f("the pinned Vulkan headers (the system's are often too old for the pinned llama.cpp)")
    glslc: str | None = _f("the glslc (shaderc) version to build with, e.g. \"2023.2\"; without it any glslc on PATH. "
                           "Either way the key holds the exact version found and the shader extensions it supports",
                           default=None, pattern=_VERSION)


@dataclass(frozen=True, kw_only=True)
class GlslcFound:
    """The shader compiler found on this machine: its versions and the shader extensions it supports (what
    ggml-vulkan's configure step will find), part of the key of a Vulkan recipe."""
    path: str = field(compare=False)
    version: str  # shaderc's, e.g. 2023.2-1
    versions: tuple[tuple[str, str], ...]  # shaderc, spirv-tools, glslang
    features: tuple[str, ...]  # the supported extensions of data/vulkan.json's glslc_features, sorted


@dataclass(frozen=True, kw_only=True)
class Runtime:
    openmp: OpenMP = _f("OpenMP runtime to ship", default="auto")


@dataclass(frozen=True, kw_only=True)
class CpuVariants:
    exclude: tuple[str, ...] = _f("GGML_CPU_ALL_VARIANTS variants not to build, e.g. [sapphirerapids]",
                                  default=(), pattern=r"^[a-z0-9_.]+$")


@dataclass(frozen=True, kw_only=True)
class Publish:
    tag: str = _f("release tag template; fields: " + ", ".join(TEMPLATE_FIELDS), default="{name}-{key12}")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    recipe: int = _f("recipe schema version (1)")
    name: str = _f("bundle name", pattern=_NAME)
    platform: Platform = _f("target platform")
    llama_cpp: LlamaCpp = _f("the pinned llama.cpp")
    backends: tuple[Backend, ...] = _f("ggml backends to build (cpu is required)")
    toolchain: Toolchain = _f("compiler")
    cuda: Cuda | None = _f("CUDA toolkit (required when backends has cuda)", default=None)
    vulkan: Vulkan | None = _f("Vulkan headers and shader compiler (required when backends has vulkan)", default=None)
    cmake: tuple[tuple[str, str], ...] = _f("extra CMake cache options (values ON/OFF/strings)", default=())
    cpu_variants: CpuVariants = _f("which CPU backend variants GGML_CPU_ALL_VARIANTS builds",
                                   default_factory=CpuVariants)
    targets: tuple[str, ...] = _f("CMake targets whose programs go into the bundle", pattern=r"^[A-Za-z0-9_.+-]+$")
    runtime: Runtime = _f("runtime library policy", default_factory=Runtime)
    publish: Publish = _f("publish settings (not part of the cache key)", default_factory=Publish)
    # Not from YAML: where the recipe came from (for relative paths and messages).
    origin: str = field(default="", compare=False, metadata={"internal": True})
    # Not from YAML: the exact version of the compiler found on this machine, for a recipe that does not
    # pin toolchain.version (it is then part of the key); None where there is none or a pin.
    host_compiler: str | None = field(default=None, metadata={"internal": True})
    # Not from YAML: the glslc found on this machine, for a recipe with the vulkan backend (its versions and
    # shader extensions are part of the key); None where there is none.
    host_glslc: GlslcFound | None = field(default=None, metadata={"internal": True})

    # ---- derived values

    @property
    def cmake_options(self) -> dict[str, str]:
        return dict(self.cmake)

    @property
    def driver_floor(self) -> str | None:
        """The floor for this recipe's platform: the recipe's, or the toolkit's own default."""
        if self.cuda is None:
            return None
        os_name = self.platform.split("-")[0]
        if self.cuda.driver_floor is not None:
            value = getattr(self.cuda.driver_floor, os_name)
            if value:
                return str(value)
        return str(data.cuda_toolkits()[self.cuda.toolkit]["driver_floor"][os_name])

    def all_cpu_variants(self) -> tuple[str, ...]:
        """The CPU variants ggml builds with GGML_CPU_ALL_VARIANTS for this compiler (data/build.json)."""
        table = data.build_knowledge()["cpu_variants"]
        return tuple(table["x86_64-msvc" if self.toolchain.compiler == "msvc" else "x86_64"])

    def key_inputs(self) -> dict[str, Any]:
        """Every input that changes the bundle's files, in canonical form (DESIGN §4)."""
        cuda = None
        if self.cuda is not None:
            cuda = {
                "toolkit": self.cuda.toolkit,
                "components": sorted(self.cuda.components),
                "archs": sorted(self.cuda.archs),
                "driver_floor": self.driver_floor,
            }
            if self.cuda.libraries:  # only when set: the keys of recipes without them stay as they were
                cuda["libraries"] = sorted(self.cuda.libraries)
            if self.cuda.latent_companions != "ship":
                cuda["latent_companions"] = self.cuda.latent_companions
        toolchain: dict[str, Any] = {"compiler": self.toolchain.compiler}
        if self.compiler_key() is not None:
            toolchain["version"] = self.compiler_key()
        if self.toolchain.msvc_version:
            toolchain["msvc_version"] = self.toolchain.msvc_version
        extra: dict[str, Any] = {}
        if self.vulkan is not None:  # only with the backend: the keys of other recipes stay as they were
            extra["vulkan"] = self.vulkan_key()
        if self.cpu_variants.exclude:  # only when set: the keys of recipes without it stay as they were
            extra["cpu_variants"] = {"exclude": sorted(self.cpu_variants.exclude)}
        return {
            **extra,
            "recipe": self.recipe,
            "bundle_format": BUNDLE_FORMAT,
            "derivation": derivation(),
            "platform": self.platform,
            "commit": self.llama_cpp.commit,
            "backends": sorted(self.backends),
            "toolchain": toolchain,
            "cuda": cuda,
            "cmake": dict(sorted(self.cmake)),
            "targets": sorted(self.targets),
            "runtime": {"openmp": self.runtime.openmp},
        }

    def vulkan_key(self) -> dict[str, Any]:
        """The Vulkan part of the key: the pinned headers, and the glslc found here with the shader
        extensions it supports (two shader sets never share a key)."""
        assert self.vulkan is not None
        found = self.host_glslc
        if found is None:
            raise ToolchainError(f"{self.origin or self.name}: the cache key needs glslc (the Vulkan shader compiler)",
                                 why="a Vulkan recipe's key holds the version of the glslc that compiles its shaders "
                                     "and the shader extensions it supports, and there is no glslc on PATH here",
                                 fix="install glslc (Debian/Ubuntu: apt-get install glslc; or the Vulkan SDK) and put it on PATH")
        pin = self.vulkan.glslc
        if pin and not (found.version == pin or found.version.startswith((pin + ".", pin + "-"))):
            raise ToolchainError(f"{self.origin or self.name} pins glslc {pin}, the glslc here is {found.version}",
                                 why=f"found {found.path}", fix=f"put glslc {pin} first on PATH, or change vulkan.glslc")
        h = self.vulkan.headers
        return {"headers": {"version": h.version, "sha256": h.sha256, "include": h.include},
                "glslc": {"version": found.version, "versions": dict(found.versions), "features": list(found.features)}}

    def key(self) -> str:
        return hashlib.sha256(canonical_json(self.key_inputs()).encode()).hexdigest()

    @property
    def pins_compiler(self) -> bool:
        return bool(self.toolchain.version or (self.toolchain.compiler == "msvc" and self.toolchain.msvc_version))

    def compiler_key(self) -> str | None:
        """The compiler's part of the key: the recipe's pin, else `=<exact version found here>`
        (None for MSVC pinned by msvc_version, which is in the key itself)."""
        if self.toolchain.version:
            return self.toolchain.version
        if self.toolchain.compiler == "msvc" and self.toolchain.msvc_version:
            return None
        if self.host_compiler:
            return "=" + self.host_compiler
        from .compilers import cxx_program

        raise ToolchainError(f"{self.origin or self.name}: the cache key needs the version of {cxx_program(self.toolchain.compiler)}",
                             why="the recipe does not pin toolchain.version, so its key holds the exact version of the "
                                 "compiler that builds it, and there is no such compiler on PATH here",
                             fix="pin the compiler in the recipe (toolchain: {compiler: "
                                 f"{self.toolchain.compiler}, version: \"12.2\"}}), or install it here")

    def tag(self) -> str:
        key = self.key()
        commit = self.llama_cpp.commit
        return self.publish.tag.format(
            name=self.name, key=key, key12=key[:12], commit=commit, commit12=commit[:12], platform=self.platform
        )


# What the tool itself derives from a recipe (the CMake flags and files of build.py, the CPU-variant
# sets, the mingw compatibility header, the collection of runtime libraries): a new llamabundle that
# builds differently must never serve an old bundle as a hit. Bump DERIVATION with any change to that
# code; the knowledge files' digest follows their data by itself. tests/unit/test_key.py records the
# flags each version derives and fails when they change without a bump.
DERIVATION = 7  # 4: every registered backend switch (GGML_VULKAN=OFF) in the configure; 5: CUDA through
#                 nvcc_launch.py at fixed-length paths; 6: the CUDA toolkit through a fixed-length path too,
#                 nvcc's and cicc's getcwd/realpath/readlink answered with the fixed paths, gcc's system
#                 headers not canonicalised under nvcc; 7: llamabundle-memory (data/programs) built into every bundle
DERIVATION_DATA = ("build.json", "mingw.json", "msvc.json", "cuda_runtime.json")


def derivation() -> dict[str, Any]:
    blob = canonical_json({name: data.load(name) for name in DERIVATION_DATA})
    return {"version": DERIVATION, "data": hashlib.sha256(blob.encode()).hexdigest()[:16]}


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


# -------------------------------------------------------------------------------------- loading


class _Ctx:
    def __init__(self, file: str) -> None:
        self.file = file
        self.marks: dict[str, tuple[int, int]] = {}

    def fail(self, node: Node | None, path: str, msg: str, fix: str = "") -> RecipeError:
        where = self.file
        line: int | None = None
        col: int | None = None
        if node is not None:
            line, col = node.start_mark.line + 1, node.start_mark.column + 1
        elif path in self.marks:
            line, col = self.marks[path]
        if line is not None:
            where += f":{line}:{col}"
        key = f" {path}:" if path else ""
        return RecipeError(f"{where}:{key} {msg}", why="the recipe does not match schema 1 (DESIGN §4)",
                           fix=fix or "correct the recipe; `llamabundle recipe lint FILE` checks it",
                           file=self.file, line=line, col=col)


def shipped_recipes() -> dict[str, Path]:
    """The recipes that come with llamabundle, by name: from the source checkout it runs from, else from
    the install's data directory (`<prefix>/share/llamabundle/recipes`, where pip, pipx and uvx put them)."""
    import site
    import sys
    import sysconfig

    here = Path(__file__).resolve().parent
    dirs = [here.parent / "recipes", Path(sysconfig.get_path("data")) / "share" / "llamabundle" / "recipes",
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


def load_recipe(path: str | Path, *, env: Mapping[str, str] | None = None) -> Recipe:
    """Load and validate a recipe file (or a shipped recipe by name). Every problem is a RecipeError
    naming file, line and key path."""
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
    return parse_recipe(text, file=str(p), env=env)


def parse_recipe(text: str, *, file: str = "<recipe>", env: Mapping[str, str] | None = None) -> Recipe:
    """A recipe from YAML text. `env`: the environment whose PATH names the host compiler an unpinned
    toolchain is keyed by (default: none, so the system's default search path)."""
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
    recipe = dataclasses.replace(recipe, origin=file)
    _check(recipe, ctx)
    if not recipe.pins_compiler:
        from .compilers import detect_version

        recipe = dataclasses.replace(recipe, host_compiler=detect_version(recipe.toolchain.compiler, env=env))
    if recipe.vulkan is not None:
        from .backends.vulkan import detect_glslc

        recipe = dataclasses.replace(recipe, host_glslc=detect_glslc(env=env))
    return recipe


def _compose(text: str, ctx: _Ctx) -> Node:
    # Aliases are refused before anything is built: no exponential expansion ("billion laughs").
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                m = event.start_mark  # always set by the parser; typed optional
                line, col = (m.line + 1, m.column + 1) if m else (None, None)
                where = f"{ctx.file}:{line}:{col}" if m else ctx.file
                raise RecipeError(f"{where}: YAML aliases (*{event.anchor}) are not allowed in recipes",
                                  why="a recipe is read as plain data; anchors, aliases and merge keys hide what is pinned",
                                  fix="write the values out in full", file=ctx.file, line=line, col=col)
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
    if isinstance(vnode, ScalarNode) and kind in SOURCE_SHORT_FIELD:
        short = ScalarNode("tag:yaml.org,2002:str", SOURCE_SHORT_FIELD[kind], vnode.start_mark, vnode.end_mark)
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
    """Rules that span fields (DESIGN §4)."""
    if not r.llama_cpp.sources:
        raise ctx.fail(None, "llama_cpp.sources", "the source list is empty", fix="add at least one source, e.g. `- github: ggml-org/llama.cpp`")
    if len(set(r.backends)) != len(r.backends):
        raise ctx.fail(None, "backends", "a backend is listed twice")
    if "cpu" not in r.backends:
        raise ctx.fail(None, "backends", "'cpu' is required: every bundle ships the CPU backend", fix="add cpu to backends")
    allowed = platforms.get(r.platform).compilers
    if r.toolchain.compiler not in allowed:
        raise ctx.fail(None, "toolchain.compiler", f"compiler '{r.toolchain.compiler}' cannot target {r.platform}",
                       fix="use one of: " + ", ".join(allowed))
    if r.toolchain.msvc_version and r.toolchain.compiler != "msvc":
        raise ctx.fail(None, "toolchain.msvc_version", "msvc_version is only for compiler: msvc")
    if r.toolchain.version and r.toolchain.compiler == "msvc":
        raise ctx.fail(None, "toolchain.version", "compiler: msvc is pinned by msvc_version (a Visual Studio range)",
                       fix='use msvc_version: "[17.0,18.0)"')
    if not r.targets:
        raise ctx.fail(None, "targets", "no targets", fix="add llama-server")
    if ("cuda" in r.backends) != (r.cuda is not None):
        if r.cuda is None:
            raise ctx.fail(None, "backends", "cuda is listed but there is no cuda: section", fix="add cuda: {toolkit, components, archs}")
        raise ctx.fail(None, "cuda", "a cuda: section without the cuda backend", fix="add cuda to backends, or remove the cuda: section")
    if r.cuda is not None:
        _check_cuda(r.cuda, ctx)
    if ("vulkan" in r.backends) != (r.vulkan is not None):
        if r.vulkan is None:
            raise ctx.fail(None, "backends", "vulkan is listed but there is no vulkan: section",
                           fix="add vulkan: {headers: {url, sha256, version}}")
        raise ctx.fail(None, "vulkan", "a vulkan: section without the vulkan backend",
                       fix="add vulkan to backends, or remove the vulkan: section")
    if r.vulkan is not None and r.platform != "linux-x86_64":
        raise ctx.fail(None, "backends", f"this version builds the vulkan backend for linux-x86_64 only, not {r.platform}",
                       fix="remove vulkan from backends, or use platform: linux-x86_64")
    if r.cpu_variants.exclude:
        _check_cpu_variants(r, ctx)
    _check_template(r.publish.tag, ctx)


def _check_cuda(c: Cuda, ctx: _Ctx) -> None:
    toolkits = data.cuda_toolkits()
    if c.toolkit not in toolkits:
        raise ctx.fail(None, "cuda.toolkit", f"CUDA toolkit {c.toolkit} is not known to this llamabundle",
                       fix="use one of: " + ", ".join(toolkits))
    known = toolkits[c.toolkit]
    if not c.components:
        raise ctx.fail(None, "cuda.components", "the component list is empty")
    manifest = data.cuda_manifest(c.toolkit)
    for i, comp in enumerate(c.components):
        if comp not in manifest:
            hint = difflib.get_close_matches(comp, list(manifest), n=1)
            raise ctx.fail(None, f"cuda.components[{i}]", f"'{comp}' is not a component of CUDA {c.toolkit}",
                           fix=f"did you mean '{hint[0]}'?" if hint else "see NVIDIA's redistrib manifest")
    if len(set(c.components)) != len(c.components):
        raise ctx.fail(None, "cuda.components", "a component is listed twice")
    if len({n.lower() for n in c.libraries}) != len(c.libraries):
        raise ctx.fail(None, "cuda.libraries", "a library is listed twice")
    from .backends.cuda.archs import (
        check_archs,  # local: archs imports this module's errors only
    )

    check_archs(c.archs, known["archs"], toolkit=c.toolkit, fail=lambda i, msg, fix: ctx.fail(None, f"cuda.archs[{i}]" if c.archs else "cuda.archs", msg, fix))


def _check_cpu_variants(r: Recipe, ctx: _Ctx) -> None:
    exclude, known = r.cpu_variants.exclude, r.all_cpu_variants()
    if r.cmake_options.get("GGML_CPU_ALL_VARIANTS") != "ON":
        raise ctx.fail(None, "cpu_variants.exclude", "variants can be left out only of a GGML_CPU_ALL_VARIANTS build",
                       fix="set cmake: {GGML_CPU_ALL_VARIANTS: ON, GGML_BACKEND_DL: ON}, or remove cpu_variants:")
    for i, name in enumerate(exclude):
        if name not in known:
            hint = difflib.get_close_matches(name, known, n=1)
            raise ctx.fail(None, f"cpu_variants.exclude[{i}]",
                           f"'{name}' is not a CPU variant ggml builds with {r.toolchain.compiler}",
                           fix=f"did you mean '{hint[0]}'?" if hint else "use some of: " + ", ".join(known))
    if len(set(exclude)) != len(exclude):
        raise ctx.fail(None, "cpu_variants.exclude", "a variant is listed twice")
    if set(known) <= set(exclude):
        raise ctx.fail(None, "cpu_variants.exclude", "every CPU variant is excluded: the bundle would have no CPU backend",
                       fix="keep at least one (x64 runs on every x86-64 CPU)")


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


# --------------------------------------------------------------------------------- JSON schema


def json_schema() -> dict[str, Any]:
    """The recipe's JSON schema, generated from the dataclasses above (committed; a test checks drift)."""
    schema = _schema_for(Recipe)
    schema["properties"]["recipe"] = {"const": SCHEMA_VERSION, "description": "recipe schema version"}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "llamabundle recipe", **schema}


def _schema_for(tp: Any, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    meta = meta or {}
    out: dict[str, Any] = {}
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if set(args) == set(get_args(Source)):
            out = {"oneOf": [_source_schema(c) for c in SOURCE_KINDS.values()]}
        else:
            out = _schema_for(args[0], meta)
    elif dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = [f for f in dataclasses.fields(tp) if not f.metadata.get("internal")]
        out = {
            "type": "object",
            "additionalProperties": False,
            "properties": {f.name: _schema_for(hints[f.name], f.metadata) for f in fields},
            "required": [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING],
        }
    elif origin is tuple:
        elem = get_args(tp)[0]
        if get_origin(elem) is tuple:
            out = {"type": "object", "additionalProperties": {"type": ["string", "boolean", "integer"]},
                   "propertyNames": {"pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"}}
        else:
            item = _schema_for(elem)
            if meta.get("pattern"):
                item["pattern"] = meta["pattern"]
            out = {"type": "array", "items": item}
    elif origin is Literal:
        out = {"enum": list(get_args(tp))}
    elif tp is str:
        out = {"type": "string"}
        if meta.get("pattern"):
            out["pattern"] = meta["pattern"]
    elif tp is int:
        out = {"type": "integer"}
    if meta.get("doc"):
        out["description"] = meta["doc"]
    return out


def _source_schema(cls: type[Source]) -> dict[str, Any]:
    body = _schema_for(cls)
    options: list[dict[str, Any]] = [body]
    if cls.kind in SOURCE_SHORT_FIELD:
        options.append(body["properties"][SOURCE_SHORT_FIELD[cls.kind]])
    return {"type": "object", "additionalProperties": False, "required": [cls.kind],
            "properties": {cls.kind: options[0] if len(options) == 1 else {"oneOf": options}}}
