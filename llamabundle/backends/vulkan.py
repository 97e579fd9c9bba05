"""The Vulkan backend: ggml-vulkan, whose shaders glslc compiles at build time into the library. Its inputs
are pinned like CUDA's toolkit: the Vulkan headers come from a pinned archive (a .deb or a Vulkan-Headers
tarball, sha256-checked), and glslc is in the key with the shader extensions it supports (ggml's configure
step probes the same ones: data/vulkan.json): the recipe's pin (a build checks the glslc found against it),
else the glslc found here. Two shader sets never share a key. The Vulkan loader (libvulkan.so.1) belongs to the
machine's graphics stack and is never bundled.

Devices: ggml-vulkan lists no CPU implementation (lavapipe) unless GGML_VK_VISIBLE_DEVICES names it, so a
device that `--list-devices` shows in a plain environment is a GPU; verify's load level asks for the backend
only, its gpu level for such a device."""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import data, proc
from ..errors import BuildError, ToolchainError, VerifyError
from ..reasons import Reason, Verdict
from .base import NoExtras, Prepared

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest
    from ..log import Log
    from ..platforms.base import Platform
    from ..recipe import HostFacts, Recipe, VulkanHeaders
    from ..recipe.model import GlslcPin, ToolFound
    from ..settings import Settings
    from .probing import Sight

SHADER = "#version 460\n#extension {ext} : require\nvoid main()\n{{\n}}\n"


def knowledge() -> dict[str, Any]:
    info: dict[str, Any] = data.load("vulkan.json")
    return info


# ------------------------------------------------------------------------------------------ glslc


def detect_glslc(*, env: Mapping[str, str] | None = None) -> ToolFound | None:
    """The glslc first on env's PATH (else the system's default search path): its versions and the shader
    extensions it supports; None when there is none. Asked once per environment in a process."""
    return _detect(tuple(sorted((env or {}).items())))


@functools.lru_cache(maxsize=8)
def _detect(env_items: tuple[tuple[str, str], ...]) -> ToolFound | None:
    path = dict(env_items).get("PATH") or os.defpath
    exe = shutil.which("glslc", path=path)
    if exe is None:
        return None
    env = {**dict(env_items), "LC_ALL": "C", "PATH": path}
    try:
        res = proc.capture([exe, "--version"], env=env, timeout=30)
    except (OSError, proc.Timeout):
        return None
    # Debian: "shaderc 2023.2-1"; the Vulkan SDK and upstream: "shaderc v2023.8 v2023.8"
    versions = tuple((name, v.removeprefix("v")) for name, v in
                     re.findall(r"^(shaderc|spirv-tools|glslang) (\S+)", res.stdout, re.M))
    shaderc = dict(versions).get("shaderc")
    if res.returncode != 0 or not shaderc:
        return None
    from ..recipe.model import ToolFound  # here: reading a bundle (verify) loads this module, not the recipe's

    return ToolFound(path=exe, version=shaderc, versions=versions, features=probe_features(exe, env=env))


def probe_features(glslc: str, *, env: Mapping[str, str]) -> tuple[str, ...]:
    """The extensions of data/vulkan.json's glslc_features this glslc supports, by ggml's own rule: a compute
    shader that requires the extension compiles unless glslc says 'extension not supported: NAME'."""
    import tempfile

    info = knowledge()
    found = []
    with tempfile.TemporaryDirectory(prefix="llamabundle-glslc-") as tmp:
        for ext in info["glslc_features"]:
            shader = Path(tmp, f"{ext}.comp")
            shader.write_text(SHADER.format(ext=ext), encoding="utf-8")
            try:
                res = proc.capture([glslc, "-o", os.devnull, *info["glslc_probe_args"], str(shader)], env=env, timeout=30)
            except (OSError, proc.Timeout):
                continue
            if f"extension not supported: {ext}" not in res.stderr + res.stdout:
                found.append(ext)
    return tuple(sorted(found))


def configured_features(configure_log: str) -> tuple[str, ...] | None:
    """The extensions ggml-vulkan's configure step found ('-- NAME supported by glslc'), or None when its
    probe did not run (no such lines)."""
    said = re.findall(r"^-- (GL_\w+) (not supported|supported) by glslc", configure_log, re.M)
    if not said:
        return None
    return tuple(sorted(ext for ext, verdict in said if verdict == "supported"))


# ---------------------------------------------------------------------------------------- headers


def headers_root(cache_dir: Path, h: VulkanHeaders) -> Path:
    return cache_dir / "toolkits" / f"vulkan-headers-{h.version}-{h.sha256[:12]}"


def fetch_headers(h: VulkanHeaders, *, cache_dir: Path, log: Log, http: Any = None) -> Path:
    """The pinned headers, unpacked once into the cache (downloaded into <cache>/downloads/<sha256>/ and
    checked there): the directory that holds vulkan/. An archive whose version is not the pinned one is refused."""
    from filelock import FileLock

    from .. import cache

    root = headers_root(cache_dir, h)
    include = root / h.include
    if (include / "vulkan" / "vulkan_core.h").is_file():
        return include
    lock_dir = cache.lock_dir(cache_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / f"vulkan-headers-{h.sha256[:16]}.lock"), timeout=3600):  # one unpacker at a time
        if (include / "vulkan" / "vulkan_core.h").is_file():  # another run unpacked them while we waited
            return include
        return _fetch_unpack(h, root, include, cache_dir=cache_dir, log=log, http=http)


def _fetch_unpack(h: VulkanHeaders, root: Path, include: Path, *, cache_dir: Path, log: Log, http: Any) -> Path:
    from .. import net

    name = h.url.rstrip("/").rsplit("/", 1)[-1] or "vulkan-headers"
    dl = cache_dir / "downloads" / h.sha256 / name
    net.download(h.url, dl, http=http or net.session(), log=log, sha256=h.sha256, mismatch_error=ToolchainError)
    unpack_headers(dl, root)
    if not (include / "vulkan" / "vulkan_core.h").is_file():
        shutil.rmtree(root, ignore_errors=True)
        raise ToolchainError(f"{name} has no {h.include}/vulkan/vulkan_core.h",
                             why="vulkan.headers.include names the directory inside the archive that holds vulkan/",
                             fix="correct vulkan.headers.include (a libvulkan-dev .deb: usr/include; Vulkan-Headers: "
                                 "Vulkan-Headers-<version>/include)")
    found = header_version(include)
    if found != h.version:
        shutil.rmtree(root, ignore_errors=True)
        raise ToolchainError(f"{name} holds the Vulkan {found or 'unknown'} headers, not {h.version}",
                             why="vulkan_core.h's VK_HEADER_VERSION_COMPLETE", fix="correct vulkan.headers.version or the archive")
    return include


def header_version(include: Path) -> str | None:
    """1.4.309 from vulkan_core.h (VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION))."""
    try:
        text = (include / "vulkan" / "vulkan_core.h").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    patch = re.search(r"^#define VK_HEADER_VERSION (\d+)", text, re.M)
    full = re.search(r"^#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(\s*\d+,\s*(\d+),\s*(\d+),", text, re.M)
    return f"{full.group(1)}.{full.group(2)}.{patch.group(1)}" if patch and full else None


def unpack_headers(archive_path: Path, dest: Path) -> None:
    """A .deb (an ar archive whose data.tar.* holds the files), a tar or a zip, unpacked safely into dest."""
    import tempfile

    from .. import archive

    if dest.exists():
        shutil.rmtree(dest)
    if archive_path.name.endswith(".deb"):
        member, blob = deb_data(archive_path)
        with tempfile.TemporaryDirectory(dir=archive_path.parent) as tmp:
            inner = Path(tmp, member)
            inner.write_bytes(blob)
            archive.extract_tar(inner, dest)
    elif archive_path.name.endswith(".zip"):
        archive.extract_zip(archive_path, dest)
    else:
        archive.extract_tar(archive_path, dest)


def deb_data(deb: Path) -> tuple[str, bytes]:
    """The data.tar.* member of a Debian package (ar format: '!<arch>\\n', then 60-byte headers)."""
    import io
    import tarfile

    from .. import archive

    raw = deb.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise archive.UnsafeArchive(f"{deb.name} is not a Debian package", why="no ar archive signature",
                                    fix="pin the .deb file itself")
    at = 8
    while at + 60 <= len(raw):
        header = raw[at:at + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise archive.UnsafeArchive(f"{deb.name}: a damaged ar header at byte {at}") from None
        body = raw[at + 60:at + 60 + size]
        if len(body) != size:
            raise archive.UnsafeArchive(f"{deb.name} is truncated", why=f"{name} needs {size} bytes")
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                raise ToolchainError(f"{deb.name} packs its files as {name}", why="zstd tars need a module this "
                                     "llamabundle does not use", fix="pin a .deb with data.tar.xz (Debian) or a tarball")
            try:
                tarfile.open(fileobj=io.BytesIO(body)).close()
            except tarfile.TarError as e:
                raise archive.UnsafeArchive(f"{deb.name}: {name} is not a tar archive", why=str(e)) from None
            return name, body
        at += 60 + size + (size & 1)
    raise archive.UnsafeArchive(f"{deb.name} has no data.tar member", fix="pin a Debian binary package")


# ---------------------------------------------------------------------------------------- backend


def loader_path() -> str | None:
    """The system's Vulkan loader (what ggml-vulkan links against and loads at run time)."""
    name = knowledge()["loader"]["linux-x86_64"]
    for d in data.elf_policy()["system_dirs"]:
        if Path(d, name).exists():
            return str(Path(d, name))
    return None


SPIRV_PREFIX_ENV = ("SPIRV-Headers_ROOT", "CMAKE_PREFIX_PATH", "VULKAN_SDK")  # what CMake's find_package reads


def spirv_headers(env: Mapping[str, str]) -> Path | None:
    """The SPIR-V headers' CMake package, where ggml-vulkan's find_package(SPIRV-Headers CONFIG) looks: under
    the prefixes env names (SPIRV-Headers_ROOT, CMAKE_PREFIX_PATH, the Vulkan SDK), then /usr/local and /usr;
    in each, share/cmake, lib/cmake and lib/x86_64-linux-gnu/cmake. (Seen on the GPU machine: headers unpacked
    under a prefix on CMAKE_PREFIX_PATH were refused by a check that knew only /usr.)"""
    prefixes = [p for var in SPIRV_PREFIX_ENV for p in env.get(var, "").split(os.pathsep) if p]
    for prefix in [*prefixes, "/usr/local", "/usr"]:
        for sub in ("share/cmake", "lib/cmake", "lib/x86_64-linux-gnu/cmake"):
            f = Path(prefix, sub, "SPIRV-Headers", "SPIRV-HeadersConfig.cmake")
            if f.is_file():
                return f
    return None


SPIRV_HPP = ("spirv", "unified1", "spirv.hpp")
INCLUDE_ENV = ("CPLUS_INCLUDE_PATH", "CPATH")  # what gcc and clang add to a C++ compile's include path
SYSTEM_INCLUDE = ("/usr/local/include", "/usr/include")


def spirv_hpp(env: Mapping[str, str]) -> Path | None:
    """spirv/unified1/spirv.hpp where the C++ compiler finds it (CPLUS_INCLUDE_PATH, CPATH, /usr/local/include,
    /usr/include). ggml-vulkan includes it by __has_include and never adds the CMake package's include
    directory: headers found only under another prefix compile as "'spv' has not been declared" (seen on the
    GPU machine, 7 minutes into a build)."""
    dirs = [d for var in INCLUDE_ENV for d in env.get(var, "").split(os.pathsep) if d]
    for d in [*dirs, *SYSTEM_INCLUDE]:
        f = Path(d, *SPIRV_HPP)
        if f.is_file():
            return f
    return None


def check_spirv(env: Mapping[str, str]) -> None:
    """The SPIR-V headers as ggml-vulkan needs them: its CMake package found, and the header where the compiler
    looks (spirv_hpp); else ToolchainError, before any build."""
    config = spirv_headers(env)
    if config is None:
        raise ToolchainError("the SPIR-V headers are not installed here",
                             why="ggml-vulkan's CMake needs find_package(SPIRV-Headers CONFIG)",
                             fix="install them (Debian/Ubuntu: apt-get install spirv-headers; or the Vulkan SDK)")
    if spirv_hpp(env) is None:
        prefix = next((p for p in config.parents if (p / "include" / Path(*SPIRV_HPP)).is_file()), None)
        raise ToolchainError("the SPIR-V headers' CMake package is here, but the compiler would not find "
                             f"{'/'.join(SPIRV_HPP)}",
                             why=f"found {config}; ggml-vulkan includes the header by __has_include without that "
                                 "package's include directory, so the build would fail minutes in ('spv' has not "
                                 "been declared)",
                             fix=(f"add {prefix / 'include'} to CPLUS_INCLUDE_PATH" if prefix is not None else
                                  "put the headers' include directory on CPLUS_INCLUDE_PATH") +
                                 ", or install them under /usr (Debian/Ubuntu: apt-get install spirv-headers)")


@dataclass(frozen=True, kw_only=True)
class VulkanInfo:
    """bundle.json's `vulkan` section: the headers compiled against, the glslc that compiled the shaders and the
    shader extensions it supported (the shader set depends on them)."""
    headers: str | None
    headers_sha256: str | None
    glslc: str
    glslc_versions: tuple[tuple[str, str], ...]
    shader_extensions: tuple[str, ...]


def read_section(m: Manifest) -> VulkanInfo | None:
    from ..bundle.manifest import HEX64, as_obj, as_str, as_strs, field_error

    v = m.sections.get("vulkan")
    if v is None:
        return None
    versions = as_obj(v.get("glslc_versions", {}), "vulkan.glslc_versions")
    for name, value in versions.items():
        as_str(value, f"vulkan.glslc_versions.{name}")
    sha = as_str(v.get("headers_sha256"), "vulkan.headers_sha256", optional=True)
    if sha is not None and not HEX64.fullmatch(sha):
        raise field_error("vulkan.headers_sha256", f"is {sha[:80]!r}, not 64 lowercase hex digits")
    return VulkanInfo(headers=as_str(v.get("headers"), "vulkan.headers", optional=True), headers_sha256=sha,
                      glslc=as_str(v.get("glslc"), "vulkan.glslc") or "",
                      glslc_versions=tuple((str(k), str(x)) for k, x in versions.items()),
                      shader_extensions=as_strs(v.get("shader_extensions"), "vulkan.shader_extensions"))


def section_schema() -> dict[str, Any]:
    from ..bundle.manifest import HEX64, SCHEMA_STRINGS, schema_text

    text, strings = schema_text, SCHEMA_STRINGS
    return {
        "type": "object",
        "required": ["glslc", "shader_extensions"],
        "properties": {
            "headers": text(description="the Vulkan headers' version ggml-vulkan was compiled against, e.g. 1.4.309"),
            "headers_sha256": text(HEX64),
            "glslc": text(description="the shaderc version of the glslc that compiled the shaders"),
            "glslc_versions": {"type": "object", "additionalProperties": text()},
            "shader_extensions": {**strings, "description": "the shader extensions glslc supported (the shader set "
                                  "depends on them: GL_KHR_cooperative_matrix, GL_EXT_integer_dot_product, …)"},
        },
    }


def pinned_glslc(pin: GlslcPin) -> ToolFound:
    """The glslc a recipe pins, as the key holds it (nothing of this machine asked)."""
    from ..recipe.model import ToolFound

    return ToolFound(path="glslc", version=pin.shaderc,
                     versions=(("shaderc", pin.shaderc), ("spirv-tools", pin.spirv_tools), ("glslang", pin.glslang)),
                     features=tuple(sorted(pin.features)))


def describe(g: ToolFound) -> str:
    parts = dict(g.versions)
    return (f"shaderc {g.version} (spirv-tools {parts.get('spirv-tools', '?')}, glslang {parts.get('glslang', '?')}; "
            f"shader extensions: {', '.join(g.features) or 'none'})")


def glslc_of(recipe: Recipe, host: HostFacts) -> ToolFound:
    """The glslc the key names: the recipe's pin (vulkan.glslc), which a glslc found here (by a build) must
    match exactly; else the one found here."""
    assert recipe.vulkan is not None
    found, pin = host.tools.get("vulkan"), recipe.vulkan.glslc
    if pin is not None:
        want = pinned_glslc(pin)
        if found is not None and (found.version, dict(found.versions), found.features) != \
                (want.version, dict(want.versions), want.features):
            raise ToolchainError(f"{recipe.origin or recipe.name} pins glslc {describe(want)}; the glslc here is "
                                 f"{describe(found)}",
                                 why=f"found {found.path}; the shaders' bytes depend on glslc, so the key holds the pin",
                                 fix="put the pinned glslc first on PATH, or change vulkan.glslc to what "
                                     "`llamabundle key --explain` prints for an unpinned recipe here (a new key)")
        return found or want
    if found is None:
        raise ToolchainError(f"{recipe.origin or recipe.name}: the cache key needs glslc (the Vulkan shader compiler)",
                             why="a Vulkan recipe without vulkan.glslc keys the version of the glslc that compiles "
                                 "its shaders and the shader extensions it supports, and there is no glslc on PATH here",
                             fix="install glslc (Debian/Ubuntu: apt-get install glslc; or the Vulkan SDK) and put it on "
                                 "PATH, or pin it in the recipe (vulkan.glslc)")
    return found


class Vulkan(NoExtras):
    name = "vulkan"
    loader_name = "Vulkan"
    gpu = True
    cmake_switch: str | None = "GGML_VULKAN"
    manifest_key: str | None = "vulkan"
    driver_name = "Vulkan GPU driver"
    device_hint = "a Vulkan GPU and its driver, not a CPU implementation such as lavapipe"
    reasons: tuple[Reason, ...] = (Reason.VULKAN_OK, Reason.VULKAN_LOADER_MISSING, Reason.VULKAN_UNAVAILABLE,
                                   Reason.VULKAN_NO_GPU)
    works: Reason | None = Reason.VULKAN_OK
    device_fact = "device"
    hide_env: str | None = "GGML_VK_VISIBLE_DEVICES"
    run_env: tuple[str, ...] = tuple(knowledge()["passthrough_env"])

    def check_recipe(self, recipe: Recipe) -> None:
        if recipe.platform != "linux-x86_64":
            raise recipe.error("backends", f"this version builds the vulkan backend for linux-x86_64 only, not "
                               f"{recipe.platform}", fix="remove vulkan from backends, or use platform: linux-x86_64")

    def host_tool(self, recipe: Recipe, *, env: Mapping[str, str] | None, building: bool = False) -> ToolFound | None:
        """The glslc first on PATH: its versions and the shader extensions it supports (for a recipe that
        pins it, only when building)."""
        if recipe.vulkan is not None and recipe.vulkan.glslc is not None and not building:
            return None
        return detect_glslc(env=env)

    def pin_warning(self, recipe: Recipe) -> str | None:
        if recipe.vulkan is None or recipe.vulkan.glslc is not None:
            return None
        return ("vulkan.glslc is not set: the key holds the glslc found where it is computed, so a machine without "
                "glslc cannot compute the key; pin it (`llamabundle key --explain` prints the glslc found here)")

    def key_inputs(self, recipe: Recipe, host: HostFacts) -> dict[str, Any]:
        """Only with the backend (the keys of other recipes stay as they were): the pinned headers, and the glslc
        found here with the shader extensions it supports (two shader sets never share a key)."""
        if recipe.vulkan is None:
            return {}
        found = glslc_of(recipe, host)
        h = recipe.vulkan.headers
        return {"vulkan": {"headers": {"version": h.version, "sha256": h.sha256, "include": h.include},
                           "glslc": {"version": found.version, "versions": dict(found.versions),
                                     "features": list(found.features)}}}

    def targets(self, recipe: Recipe) -> tuple[str, ...]:
        return ("ggml-vulkan",)

    def prepare(self, recipe: Recipe, host: HostFacts, *, settings: Settings, log: Log, env: Mapping[str, str],
                source: str | None) -> Prepared | None:
        """The pinned headers (downloaded once), the glslc the key names, and the system loader to link."""
        assert recipe.vulkan is not None
        found = glslc_of(recipe, host)  # no glslc, or not the pinned one: the error says which
        h = recipe.vulkan.headers
        with log.step(f"Vulkan headers {h.version}"):
            include = fetch_headers(h, cache_dir=settings.cache_dir, log=log)
            log.info(f"    headers {include}; glslc {found.version} at {found.path}; shader extensions: "
                     f"{', '.join(found.features) or 'none'}")
        check_spirv(env)
        if loader_path() is None:
            raise ToolchainError("the Vulkan loader (libvulkan.so.1) is not installed here",
                                 why="ggml-vulkan links against it (it is never bundled: each machine has its own)",
                                 fix="install it (Debian/Ubuntu: apt-get install libvulkan1)")
        return Prepared(root=include, toolchain={"glslc": found.version, "vulkan_headers": h.version})

    def show_line(self, recipe: Recipe, host: HostFacts) -> str | None:
        assert recipe.vulkan is not None
        g = host.tools.get(self.name)
        if recipe.vulkan.glslc is not None:
            found = f"glslc pinned: {describe(pinned_glslc(recipe.vulkan.glslc))}"
        else:
            found = (f"glslc {g.version} at {g.path}; shader extensions: {', '.join(g.features) or 'none'}" if g
                     else "no glslc on PATH (the key needs one)")
        return f"headers {recipe.vulkan.headers.version} ({recipe.vulkan.headers.url}); {found}"

    def cmake_definitions(self, recipe: Recipe, host: HostFacts, *, platform: Platform,
                          toolkit_root: Path | None) -> dict[str, str]:
        found = host.tools.get(self.name)
        defs = {"Vulkan_GLSLC_EXECUTABLE": found.path if found else "glslc"}
        if toolkit_root is not None:
            defs["Vulkan_INCLUDE_DIR"] = str(toolkit_root)
        defs["Vulkan_LIBRARY"] = loader_path() or "libvulkan.so.1"
        return defs

    def after_configure(self, recipe: Recipe, host: HostFacts, configure_log: str) -> None:
        """The shader extensions CMake found are the ones the key holds (else the key would lie)."""
        found = host.tools.get(self.name)
        seen = configured_features(configure_log)
        if found is None or seen is None:
            return
        if seen != found.features:
            raise BuildError("ggml-vulkan's configure step found other shader extensions than the key holds",
                             why=f"CMake: {', '.join(seen) or 'none'}; probed before the build: "
                                 f"{', '.join(found.features) or 'none'}",
                             fix="check that CMake uses the glslc first on PATH (Vulkan_GLSLC_EXECUTABLE)")

    def manifest_section(self, recipe: Recipe, host: HostFacts, stage: Path, *, platform: Platform,
                         prepared: Prepared | None) -> dict[str, Any] | None:
        key = self.key_inputs(recipe, host)["vulkan"]
        return {"headers": key["headers"]["version"], "headers_sha256": key["headers"]["sha256"],
                "glslc": key["glslc"]["version"], "glslc_versions": key["glslc"]["versions"],
                "shader_extensions": key["glslc"]["features"]}

    def check(self, root: Path, manifest: Manifest, *, platform: Platform) -> dict[str, str]:
        """The module is there, bundle.json's section agrees with the key inputs, the loader is not bundled."""
        lib = platform.library_file("ggml-vulkan")
        if not (root / lib).is_file():
            raise VerifyError(f"bundle.json declares Vulkan but the bundle has no {lib}", fix="rebuild the bundle")
        loader = knowledge()["loader"].get(manifest.platform, "")
        if any(f.path.lower() == loader.lower() for f in manifest.files):
            raise VerifyError(f"the bundle carries {loader}", why="the Vulkan loader belongs to the machine's "
                              "graphics stack (its drivers register with it)", fix="rebuild the bundle")
        section = read_section(manifest)
        inputs = manifest.inputs.get("vulkan")
        recorded = (inputs or {}).get("glslc", {}).get("features") if isinstance(inputs, Mapping) else None
        exts = list(section.shader_extensions) if section is not None else []
        if recorded is not None and exts != list(recorded):
            raise VerifyError("bundle.json's Vulkan shader extensions differ from its key inputs",
                              fix="rebuild the bundle (the manifest was edited)")
        glslc = section.glslc if section is not None else "?"
        return {"vulkan": f"passed (glslc {glslc}; shader extensions: {', '.join(exts) or 'none'})"}

    def read_section(self, manifest: Manifest) -> VulkanInfo | None:
        return read_section(manifest)

    def section_schema(self) -> dict[str, Any] | None:
        return section_schema()

    def verdict(self, sight: Sight) -> Verdict:
        """The system loader, the backend loading from the bundle (a registered driver), a GPU listed (ggml-vulkan
        lists no CPU implementation)."""
        from .probing import device_name, device_of

        if loader_path() is None:
            return Reason.VULKAN_LOADER_MISSING, {"detail": "libvulkan.so.1 is not installed"}
        dev = device_of(sight, self.loader_name, failed=Reason.VULKAN_UNAVAILABLE,
                        not_loaded=(Reason.VULKAN_UNAVAILABLE, {"detail": "no Vulkan driver (ICD) could be loaded: the "
                                                                          "backend says nothing in a release build"}),
                        no_device=(Reason.VULKAN_NO_GPU, {"detail": "only a CPU implementation, or no device, is "
                                                                    "registered"}))
        if not isinstance(dev, str):
            return dev
        name, _, desc = dev.partition(": ")
        return Reason.VULKAN_OK, {"device": name, "device_name": device_name(desc)}

    def device_present(self) -> bool:
        """A Vulkan driver for a GPU is registered here (an ICD manifest other than a CPU implementation's)."""
        info = knowledge()
        cpu = info["cpu_drivers"]
        for d in info["icd_dirs"]:
            try:
                names = os.listdir(d)
            except OSError:
                continue
            if any(n.endswith(".json") and not any(fnmatch.fnmatch(n, p) for p in cpu) for n in names):
                return loader_path() is not None and _gpu_icd_usable()
        return False


def _gpu_icd_usable() -> bool:
    """An ICD manifest of a GPU driver is not proof of a GPU (Mesa installs radeon and intel manifests on any
    machine): a GPU Vulkan driver counts when the kernel exposes a render node."""
    return any(Path("/dev/dri").glob("renderD*")) or Path("/dev/nvidiactl").exists()


VULKAN = Vulkan()

