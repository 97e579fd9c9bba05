"""The recipe as frozen values (DESIGN §4): what a release engineer pins, and nothing of the machine that reads
it. No host probing, no registry, no backend: the key (keys.py) adds what this machine contributes, and the
rules that need a platform or a backend's knowledge are checked there too."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .. import data
from ..errors import RecipeError
from ..names import ARCH_PATTERN, Backend, Platform

SCHEMA_VERSION = 1
BUNDLE_FORMAT = 1

Compiler = Literal["gcc", "clang", "msvc", "mingw"]
CudaSourceKind = Literal["redist", "installer", "pypi", "system"]
OpenMP = Literal["auto", "vcomp", "libomp", "none"]
LatentCompanions = Literal["ship", "omit"]
WebUi = Literal["build", "none"]

TEMPLATE_FIELDS = ("name", "key", "key12", "commit", "commit12", "platform")

_HEX40 = r"^[0-9a-f]{40}$"
_HEX64 = r"^[0-9a-f]{64}$"
_VERSION = r"^[0-9]+(\.[0-9]+)*$"
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_TOOL_VERSION = r"^[0-9A-Za-z][0-9A-Za-z.+~:-]*$"
_RANGE = r"^([\[(][0-9.]*,[0-9.]*[\])]|[0-9]+(\.[0-9]+)*)$"
_PIN = r"^([\[(][0-9.]*,[0-9.]*[\])]|=?[0-9]+(\.[0-9]+)*)$"  # a range, or =X.Y.Z exactly (a compiler's version)


def _f(doc: str, *, pattern: str = "", default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    meta = {"doc": doc, "pattern": pattern}
    if default is dataclasses.MISSING and "default_factory" not in kw:
        return field(metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True, kw_only=True)
class GithubSource:
    """A recipe's `github:` source: the commit's archive tarball."""

    repo: str = _f("OWNER/NAME on GitHub; the archive tarball of the commit", pattern=r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
    kind: typing.ClassVar[str] = "github"
    short: typing.ClassVar[str | None] = "repo"  # `- github: ggml-org/llama.cpp` means {repo: ggml-org/llama.cpp}


@dataclass(frozen=True, kw_only=True)
class GitSource:
    """A recipe's `git:` source: a remote, the exact commit fetched."""

    url: str = _f("a git remote URL; the exact commit is fetched and HEAD checked")
    kind: typing.ClassVar[str] = "git"
    short: typing.ClassVar[str | None] = "url"


@dataclass(frozen=True, kw_only=True)
class PathSource:
    """A recipe's `path:` source: a local checkout."""

    path: str = _f("a local llama.cpp git checkout (relative to the recipe file)")
    kind: typing.ClassVar[str] = "path"
    short: typing.ClassVar[str | None] = "path"


@dataclass(frozen=True, kw_only=True)
class PypiSource:
    """A recipe's `pypi:` source: an sdist that vendors llama.cpp with its git index."""

    package: str = _f("PyPI project whose sdist vendors llama.cpp", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    version: str = _f("exact version of the sdist", pattern=r"^[0-9A-Za-z.+!-]+$")
    sha256: str = _f("sha256 of the sdist file", pattern=_HEX64)
    kind: typing.ClassVar[str] = "pypi"
    short: typing.ClassVar[str | None] = None


Source = GithubSource | GitSource | PathSource | PypiSource
SOURCE_KINDS: dict[str, type[Source]] = {c.kind: c for c in get_args(Source)}  # the vocabulary; source/ fetches each


@dataclass(frozen=True, kw_only=True)
class LlamaCpp:
    """The recipe's `llama_cpp:` section: the pinned commit and where to get it."""

    commit: str = _f("the llama.cpp commit, 40 lowercase hex digits", pattern=_HEX40)
    sources: tuple[Source, ...] = _f("where to get it, tried in order; each must prove the same commit")


@dataclass(frozen=True, kw_only=True)
class Toolchain:
    """The recipe's `toolchain:` section: the compiler and its pins."""

    compiler: Compiler = _f("C/C++ compiler family")
    msvc_version: str | None = _f("MSVC version range, e.g. \"[17.0,18.0)\" (msvc only)", default=None, pattern=_RANGE)
    version: str | None = _f("the C++ compiler's version (gcc, clang, mingw): \"=12.2.0\" exactly that one, \"12.2\" "
                             "any 12.2.x, \"[12.2,13)\" a range (a range says those compilers are interchangeable); "
                             "in the cache key. Without it the key holds the exact version of the compiler found "
                             "here, so computing it needs that compiler", default=None, pattern=_PIN)
    toolset: str | None = _f("the exact MSVC toolset (msvc only), e.g. \"14.44.35207\": selected with vcvars64.bat "
                             "-vcvars_ver and in the cache key. Without it any toolset of a Visual Studio in "
                             "msvc_version builds, under one key", default=None, pattern=r"^14\.[0-9]+\.[0-9]+$")
    build_host: str | None = _f("linux-aarch64: the machine the build runs on, linux-x86_64 (cross-built with the "
                                "distribution's cross compiler and sysroot) or linux-aarch64 (native): in the cache "
                                "key. Without it the key holds this machine's", default=None,
                                pattern=r"^linux-(x86_64|aarch64)$")
    glibc: str | None = _f("the glibc the build links against (linux-aarch64: the cross toolchain's sysroot, or the "
                           "arm64 machine's own), e.g. \"2.36\": checked before the build and in the cache key. Without "
                           "it the key holds the version found here", default=None, pattern=r"^[0-9]+\.[0-9]+$")


@dataclass(frozen=True, kw_only=True)
class DriverFloor:
    """The minimum NVIDIA driver, per system."""

    windows: str | None = _f("minimum NVIDIA driver on Windows", default=None, pattern=_VERSION)
    linux: str | None = _f("minimum NVIDIA driver on Linux", default=None, pattern=_VERSION)


@dataclass(frozen=True, kw_only=True)
class Cuda:
    """The recipe's `cuda:` section."""

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
    """The pinned Vulkan headers archive."""

    url: str = _f("an archive of the Vulkan headers ggml-vulkan compiles against (vulkan/vulkan.hpp): a Debian "
                  "libvulkan-dev .deb, or a .tar.gz/.tar.xz/.zip of Vulkan-Headers", pattern=r"^https?://\S+$")
    sha256: str = _f("sha256 of that archive", pattern=_HEX64)
    version: str = _f("the headers' Vulkan version, e.g. 1.4.309 (checked against vulkan_core.h)", pattern=_VERSION)
    include: str = _f("the directory inside the archive that holds vulkan/", default="usr/include",
                      pattern=r"^[A-Za-z0-9._+-]+(/[A-Za-z0-9._+-]+)*$")


@dataclass(frozen=True, kw_only=True)
class GlslcPin:
    """The glslc a Vulkan recipe builds with."""

    shaderc: str = _f("shaderc's version as glslc --version says it, e.g. 2023.2-1", pattern=_TOOL_VERSION)
    spirv_tools: str = _f("SPIRV-Tools' version, e.g. 2022.4+1.3.236.0-1", pattern=_TOOL_VERSION)
    glslang: str = _f("glslang's version, e.g. 11.13.0-1", pattern=_TOOL_VERSION)
    features: tuple[str, ...] = _f("the shader extensions of data/vulkan.json's glslc_features it supports (ggml's "
                                   "configure step checks each)", default=(), pattern=r"^GL_[A-Za-z0-9_]+$")


@dataclass(frozen=True, kw_only=True)
class Vulkan:
    """The recipe's `vulkan:` section."""

    headers: VulkanHeaders = _f("the pinned Vulkan headers (the system's are often too old for the pinned llama.cpp)")
    glslc: GlslcPin | None = _f("the exact glslc to build with and the shader extensions it supports, as "
                                "`llamabundle key --explain` shows them: the key holds this pin, so it can be computed "
                                "without glslc. Without it the key holds the glslc found on PATH", default=None)


@dataclass(frozen=True, kw_only=True)
class UiArchive:
    """A web UI archive the recipe pins (`ui:`)."""

    url: str = _f("a web UI archive made by `llamabundle ui pack` from this commit's tools/ui (where you published "
                  "it: a release asset, a mirror)", pattern=r"^https?://\S+$")
    sha256: str = _f("sha256 of that archive: checked before use, and in the cache key", pattern=_HEX64)


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """The recipe's `runtime:` section."""

    openmp: OpenMP = _f("OpenMP runtime to ship", default="auto")


@dataclass(frozen=True, kw_only=True)
class CpuVariants:
    """The recipe's `cpu_variants:` section."""

    exclude: tuple[str, ...] = _f("GGML_CPU_ALL_VARIANTS variants not to build, e.g. [sapphirerapids]",
                                  default=(), pattern=r"^[a-z0-9_.]+$")


@dataclass(frozen=True, kw_only=True)
class Publish:
    """The recipe's `publish:` section."""

    tag: str = _f("release tag template; fields: " + ", ".join(TEMPLATE_FIELDS), default="{name}-{key12}")


def word_or_form(args: tuple[Any, ...]) -> tuple[Any, Any] | None:
    """(the Literal, the dataclass) of a field that takes a word or a mapping (ui: build | {url, sha256}); None
    for any other union. The loader and the JSON schema read such a field alike."""
    words = [a for a in args if typing.get_origin(a) is Literal]
    forms = [a for a in args if dataclasses.is_dataclass(a)]
    return (words[0], forms[0]) if len(args) == 2 and len(words) == len(forms) == 1 else None


Marks = Mapping[str, tuple[int, int]]  # key path -> (line, column) of where the YAML set it


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A recipe (schema 1, DESIGN §4): what a bundle is built from, as the loader checked it."""

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
    ui: WebUi | UiArchive = _f("llama-server's web UI: build (from the pinned commit's tools/ui with npm, once per UI "
                               "source, kept in the cache and reused), {url, sha256} (an archive `llamabundle ui pack` "
                               "made, pinned by sha256: every machine embeds the same bytes) or none (llama-server "
                               "answers GET / with 404)", default="none")
    publish: Publish = _f("publish settings (not part of the cache key)", default_factory=Publish)
    # Not from YAML: where the recipe came from (for relative paths and messages), and where in it each key
    # path was set (for the messages of checks made after loading).
    origin: str = field(default="", compare=False, metadata={"internal": True})
    marks: Marks = field(default_factory=dict, compare=False, repr=False, metadata={"internal": True})

    @property
    def cmake_options(self) -> dict[str, str]:
        return dict(self.cmake)

    @property
    def embeds_ui(self) -> bool:
        """Whether llama-server embeds the web UI (built here or a pinned archive)."""
        return self.ui != "none"

    @property
    def ui_said(self) -> str:
        """The recipe's ui: as a message names it."""
        return self.ui if isinstance(self.ui, str) else f"{{url: {self.ui.url}, sha256: {self.ui.sha256[:12]}…}}"

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

    @property
    def pins_compiler(self) -> bool:
        """Whether the key can be computed without the compiler: a pin or a range (toolchain.version; MSVC's
        toolset or its Visual Studio range)."""
        t = self.toolchain
        return bool(t.version or (t.compiler == "msvc" and (t.toolset or t.msvc_version)))

    def all_cpu_variants(self) -> tuple[str, ...]:
        """The CPU variants ggml builds with GGML_CPU_ALL_VARIANTS for this platform and compiler (data/build.json;
        Arm Linux: data/linux_aarch64.json)."""
        if self.platform == "linux-aarch64":
            return tuple(data.load("linux_aarch64.json")["cpu_variants"])
        table = data.build_knowledge()["cpu_variants"]
        return tuple(table["x86_64-msvc" if self.toolchain.compiler == "msvc" else "x86_64"])

    def error(self, path: str, msg: str, fix: str = "") -> RecipeError:
        """A problem found after loading, at the line and column where `path` was set."""
        return recipe_error(self.origin or self.name, path, msg, fix=fix, at=self.marks.get(path))


def recipe_error(file: str, path: str, msg: str, *, fix: str = "", at: tuple[int, int] | None = None) -> RecipeError:
    """`FILE:LINE:COL: PATH: MSG`, the one shape of a recipe problem (the loader's and the later checks')."""
    line, col = at if at is not None else (None, None)
    where = f"{file}:{line}:{col}" if line is not None else file
    key = f" {path}:" if path else ""
    return RecipeError(f"{where}:{key} {msg}", why="the recipe does not match schema 1 (DESIGN §4)",
                       fix=fix or "correct the recipe; `llamabundle recipe lint FILE` checks it",
                       file=file, line=line, col=col)


@dataclass(frozen=True, kw_only=True)
class ToolFound:
    """A tool of this machine that the key names (a backend's shader compiler): its versions and the features
    it supports. Found by the key's module (keys.host_facts), never by the model."""
    path: str = field(compare=False)
    version: str  # e.g. glslc's shaderc 2023.2-1
    versions: tuple[tuple[str, str], ...]  # its parts (shaderc, spirv-tools, glslang)
    features: tuple[str, ...]  # what it supports of what the backend asks (shader extensions), sorted


@dataclass(frozen=True, kw_only=True)
class HostFacts:
    """What this machine contributes to a recipe's key: the exact version of its compiler, for a recipe that
    does not pin toolchain.version (None where there is none or a pin), and each backend's tool (by backend
    name). Data only: keys.host_facts finds them."""
    compiler: str | None = None
    tools: Mapping[str, ToolFound] = field(default_factory=dict)


NO_HOST = HostFacts()  # nothing found (a recipe that pins everything, or a check made without looking)
