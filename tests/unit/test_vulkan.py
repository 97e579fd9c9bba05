"""The Vulkan backend without a build: the recipe section and its key (the glslc found here and the shader
extensions it supports), the probe run against a stand-in glslc, the check of what CMake found, the pinned
headers fetched from a loopback server (Debian .deb parsing, hostile packages, hash and version
mismatches), the bundle checks and the per-backend gpu level."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamabundle import keys, verify
from llamabundle import recipe as recipe_mod
from llamabundle.archive import UnsafeArchive
from llamabundle.backends import vulkan
from llamabundle.bundle.manifest import Manifest
from llamabundle.errors import BuildError, RecipeError, ToolchainError, VerifyError
from llamabundle.log import Log
from llamabundle.recipe import HostFacts, ToolFound
from tests.loopback import Loopback, static

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "recipes" / "linux-x86_64-vulkan.yaml"
CORE_H = """#define VK_HEADER_VERSION 309
#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION)
"""


def fake_glslc(bin_dir: Path, *, supported: tuple[str, ...], version: str = "shaderc 2023.2-1") -> Path:
    """A glslc that answers --version and fails 'extension not supported' for every extension not listed."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "glslc"
    ok = "|".join(supported) or "NONE"
    exe.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then printf '{version}\\nspirv-tools v2024.1\\nglslang 11.13.0-1\\n\\nTarget: SPIR-V 1.0\\n'; exit 0; fi
for a in "$@"; do f="$a"; done
ext=$(sed -n 's/^#extension \\([A-Za-z0-9_]*\\) : require$/\\1/p' "$f")
case "$ext" in {ok}) exit 0 ;; esac
echo "$f:2: error: '#extension' : extension not supported: $ext" >&2; exit 1
""")
    exe.chmod(0o755)
    return exe


def found(*features: str, version: str = "2023.2-1") -> ToolFound:
    return ToolFound(path="/x/glslc", version=version, versions=(("shaderc", version),), features=tuple(sorted(features)))


def host(glslc: ToolFound | None) -> HostFacts:
    return HostFacts(compiler="12.2.0", tools={"vulkan": glslc} if glslc is not None else {})


def shipped(**replace: object) -> recipe_mod.Recipe:
    r = keys.parse(SHIPPED.read_text(encoding="utf-8"), file=SHIPPED.name)
    return dataclasses.replace(r, **replace)  # type: ignore[arg-type]


def unpinned() -> recipe_mod.Recipe:
    """The shipped recipe without its glslc pin: the key holds the glslc found here."""
    r = shipped()
    assert r.vulkan is not None and r.vulkan.glslc is not None
    return dataclasses.replace(r, vulkan=dataclasses.replace(r.vulkan, glslc=None))


def key_with(r: recipe_mod.Recipe, glslc: ToolFound | None) -> str:
    return keys.resolve(r, host=host(glslc)).key


# ------------------------------------------------------------------------------------- recipe and key


def test_glslc_found_here_and_its_extensions_are_in_the_key(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_glslc(bin_dir, supported=("GL_EXT_integer_dot_product", "GL_KHR_cooperative_matrix"))
    vulkan._detect.cache_clear()
    keyed = keys.resolve(unpinned(), env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert keyed.host.tools["vulkan"].path == str(bin_dir / "glslc")
    key = keyed.inputs["vulkan"]
    assert key["glslc"] == {"version": "2023.2-1", "features": ["GL_EXT_integer_dot_product", "GL_KHR_cooperative_matrix"],
                            "versions": {"shaderc": "2023.2-1", "spirv-tools": "2024.1", "glslang": "11.13.0-1"}}
    assert key["headers"]["version"] == "1.4.309" and len(key["headers"]["sha256"]) == 64


def test_two_shader_sets_or_two_glslc_never_share_a_key() -> None:
    a = key_with(unpinned(), found())
    assert a != key_with(unpinned(), found("GL_KHR_cooperative_matrix"))
    assert a != key_with(unpinned(), found(version="2024.1"))
    assert a == key_with(unpinned(), dataclasses.replace(found(), path="/elsewhere/glslc"))
    cpu = keys.parse((ROOT / "recipes" / "linux-x86_64-cpu.yaml").read_text(encoding="utf-8"))
    assert "vulkan" not in keys.resolve(cpu).inputs, "a recipe without the backend keeps the key it had"


def test_no_glslc_for_an_unpinned_recipe_is_a_clear_error() -> None:
    with pytest.raises(ToolchainError) as e:
        key_with(unpinned(), None)
    assert "glslc" in e.value.what and "apt-get install glslc" in e.value.fix and "vulkan.glslc" in e.value.fix


def test_a_pinned_glslc_keys_without_glslc_and_as_the_same_glslc_found_would() -> None:
    r = shipped()
    assert r.vulkan is not None and r.vulkan.glslc is not None
    pin = vulkan.pinned_glslc(r.vulkan.glslc)
    assert keys.host_facts(r, env={"PATH": "/nonexistent"}).tools == {}  # nothing asked of this machine
    assert key_with(r, None) == key_with(unpinned(), dataclasses.replace(pin, path="/usr/bin/glslc"))
    assert keys.resolve(r, host=host(None)).inputs["vulkan"]["glslc"] == {
        "version": "2023.2-1", "features": [],
        "versions": {"shaderc": "2023.2-1", "spirv-tools": "2022.4+1.3.236.0-1", "glslang": "11.13.0-1"}}


@pytest.mark.parametrize("other", [
    found(version="2022.1"),  # another shaderc
    ToolFound(path="/x/glslc", version="2023.2-1", features=(),  # the same shaderc, another glslang
              versions=(("shaderc", "2023.2-1"), ("spirv-tools", "2022.4+1.3.236.0-1"), ("glslang", "14.0.0-2"))),
    ToolFound(path="/x/glslc", version="2023.2-1", features=("GL_KHR_cooperative_matrix",),  # another shader set
              versions=(("shaderc", "2023.2-1"), ("spirv-tools", "2022.4+1.3.236.0-1"), ("glslang", "11.13.0-1"))),
], ids=["shaderc", "glslang", "features"])
def test_a_build_refuses_a_glslc_other_than_the_pin(other: ToolFound) -> None:
    with pytest.raises(ToolchainError) as e:
        key_with(shipped(), other)
    assert e.value.exit_code == 3
    assert "pins glslc shaderc 2023.2-1 (spirv-tools 2022.4+1.3.236.0-1, glslang 11.13.0-1" in e.value.what
    assert "the glslc here is" in e.value.what and "vulkan.glslc" in e.value.fix


def test_for_build_finds_the_pinned_glslc_on_path_and_checks_it(tmp_path: Path) -> None:
    """`build` looks for the glslc it will run even where the key needed none: the same one keeps the key (and
    its path reaches CMake), another stops the build before anything starts."""
    r = shipped()
    keyed = keys.resolve(r, env={"PATH": "/nonexistent"})
    same, other = tmp_path / "same", tmp_path / "other"
    fake_glslc(same, supported=())
    (same / "glslc").write_text((same / "glslc").read_text().replace("spirv-tools v2024.1", "spirv-tools v2022.4+1.3.236.0-1"))
    fake_glslc(other, supported=())
    vulkan._detect.cache_clear()
    built = keys.for_build(keyed, env={"PATH": f"{same}:/usr/bin:/bin"})
    assert built.key == keyed.key and built.host.tools["vulkan"].path == str(same / "glslc")
    with pytest.raises(ToolchainError, match="the glslc here is shaderc 2023.2-1 \\(spirv-tools 2024.1"):
        keys.for_build(keyed, env={"PATH": f"{other}:/usr/bin:/bin"})
    with pytest.raises(ToolchainError, match="the cache key needs glslc"):
        keys.for_build(keys.resolve(unpinned(), host=host(found())), env={"PATH": str(tmp_path / "none")})


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("backends: [cpu, vulkan]", "backends: [cpu]"), "a vulkan: section without the vulkan backend"),
    (lambda t: t[:t.index("vulkan:\n")] + t[t.index("cmake:"):], "vulkan is listed but there is no vulkan: section"),
    (lambda t: t.replace("platform: linux-x86_64", "platform: windows-x86_64").replace("compiler: gcc", "compiler: mingw"),
     "linux-x86_64 only"),
    (lambda t: t.replace("sha256: 8d329d", "sha256: zz329d"), "sha256 of that archive"),
    (lambda t: t.replace("    version: 1.4.309\n", ""), "missing required key 'version'"),
])
def test_malformed_vulkan_sections_are_refused(edit, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RecipeError) as e:
        keys.parse(edit(SHIPPED.read_text(encoding="utf-8")), file="v.yaml")
    assert message in e.value.what


# --------------------------------------------------------------------------------- probe and configure


def test_probe_asks_glslc_as_ggml_does(tmp_path: Path) -> None:
    exe = fake_glslc(tmp_path, supported=("GL_EXT_bfloat16",))
    assert vulkan.probe_features(str(exe), env={"PATH": "/usr/bin:/bin"}) == ("GL_EXT_bfloat16",)
    every = tuple(vulkan.knowledge()["glslc_features"])
    exe = fake_glslc(tmp_path, supported=every)
    assert vulkan.probe_features(str(exe), env={"PATH": "/usr/bin:/bin"}) == tuple(sorted(every))


def test_the_real_glslc_here_agrees_with_the_table_if_there_is_one() -> None:
    vulkan._detect.cache_clear()
    got = vulkan.detect_glslc(env={"PATH": "/usr/bin:/bin"})
    if got is None:
        pytest.skip("no glslc on this machine")
    assert got.version and set(got.features) <= set(vulkan.knowledge()["glslc_features"])


CONFIGURE_LOG = """-- Vulkan found
-- GL_KHR_cooperative_matrix supported by glslc
-- GL_NV_cooperative_matrix2 not supported by glslc
-- GL_EXT_integer_dot_product supported by glslc
-- Including Vulkan backend
"""


def test_what_cmake_found_must_be_what_the_key_holds() -> None:
    assert vulkan.configured_features(CONFIGURE_LOG) == ("GL_EXT_integer_dot_product", "GL_KHR_cooperative_matrix")
    assert vulkan.configured_features("-- Configuring done\n") is None
    r, both = shipped(), host(found("GL_EXT_integer_dot_product", "GL_KHR_cooperative_matrix"))
    vulkan.VULKAN.after_configure(r, both, CONFIGURE_LOG)  # agrees
    vulkan.VULKAN.after_configure(r, both, "no probe lines: the tree was configured before\n")
    with pytest.raises(BuildError) as e:
        vulkan.VULKAN.after_configure(r, host(found()), CONFIGURE_LOG)
    assert "other shader extensions than the key holds" in e.value.what and "GL_KHR_cooperative_matrix" in e.value.why


# ------------------------------------------------------------------------------------------ headers


def tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tf:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def ar(members: dict[str, bytes]) -> bytes:
    out = bytearray(b"!<arch>\n")
    for name, body in members.items():
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode()
        out += body + (b"\n" if len(body) % 2 else b"")
    return bytes(out)


def deb(files: dict[str, bytes]) -> bytes:
    return ar({"debian-binary": b"2.0\n", "control.tar.xz": tar_xz({"control": b"Package: libvulkan-dev\n"}),
               "data.tar.xz": tar_xz(files)})


GOOD_DEB = deb({"./usr/include/vulkan/vulkan_core.h": CORE_H.encode(), "./usr/include/vulkan/vulkan.hpp": b"//\n"})


@pytest.fixture
def served(tmp_path: Path) -> Iterator[dict[str, bytes]]:
    """Paths served on loopback (tests/loopback.py), and the server's URL under `__base__`."""
    files: dict[str, bytes] = {}
    with Loopback(static(files)) as server:
        files["__base__"] = server.url.encode()
        yield files


def headers_for(served: dict[str, bytes], body: bytes, *, name: str = "libvulkan-dev_1.4.309.0-1_amd64.deb",
                version: str = "1.4.309", sha: str | None = None) -> recipe_mod.VulkanHeaders:
    served[f"/{name}"] = body
    return recipe_mod.VulkanHeaders(url=f"{served['__base__'].decode()}/{name}", version=version,
                                    sha256=sha or hashlib.sha256(body).hexdigest())


def test_headers_come_from_the_pinned_deb_once(tmp_path: Path, served: dict[str, bytes]) -> None:
    h = headers_for(served, GOOD_DEB)
    include = vulkan.fetch_headers(h, cache_dir=tmp_path, log=Log(quiet=True))
    assert (include / "vulkan" / "vulkan.hpp").is_file() and vulkan.header_version(include) == "1.4.309"
    del served[f"/{h.url.rsplit('/', 1)[1]}"]  # the second call needs no network
    assert vulkan.fetch_headers(h, cache_dir=tmp_path, log=Log(quiet=True)) == include


def test_a_hash_mismatch_leaves_nothing_behind(tmp_path: Path, served: dict[str, bytes]) -> None:
    h = headers_for(served, GOOD_DEB, sha="0" * 64)
    with pytest.raises(ToolchainError):
        vulkan.fetch_headers(h, cache_dir=tmp_path, log=Log(quiet=True))
    assert not vulkan.headers_root(tmp_path, h).exists()
    assert not any(p.is_file() for p in (tmp_path / "downloads").rglob("*.deb"))


def test_headers_of_another_version_are_refused(tmp_path: Path, served: dict[str, bytes]) -> None:
    h = headers_for(served, GOOD_DEB, version="1.4.310")
    with pytest.raises(ToolchainError) as e:
        vulkan.fetch_headers(h, cache_dir=tmp_path, log=Log(quiet=True))
    assert "1.4.309 headers, not 1.4.310" in e.value.what
    assert not vulkan.headers_root(tmp_path, h).exists()


@pytest.mark.parametrize("body, message", [
    (b"not an ar archive at all", "is not a Debian package"),
    (GOOD_DEB[:200], "truncated"),
    (ar({"debian-binary": b"2.0\n"}), "has no data.tar member"),
    (ar({"data.tar.xz": b"garbage that is not xz"}), "is not a tar archive"),
    (deb({"../../escape.h": b"x"}), "escapes the destination"),
    (deb({"/etc/absolute.h": b"x"}), "absolute path"),
])
def test_hostile_or_damaged_packages_are_refused(tmp_path: Path, served: dict[str, bytes], body: bytes,
                                                 message: str) -> None:
    h = headers_for(served, body)
    with pytest.raises((UnsafeArchive, ToolchainError, VerifyError)) as e:
        vulkan.fetch_headers(h, cache_dir=tmp_path, log=Log(quiet=True))
    assert message in e.value.what
    assert not vulkan.headers_root(tmp_path, h).exists()
    assert not (tmp_path / "escape.h").exists() and not tmp_path.parent.joinpath("escape.h").exists()


# --------------------------------------------------------------------------------- bundle checks, gpu


def test_a_bundle_that_carries_the_loader_fails_the_vulkan_check(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from llamabundle.platforms import get

    (tmp_path / "libggml-vulkan.so").write_bytes(b"\x7fELF")
    files = (SimpleNamespace(path="libggml-vulkan.so"), SimpleNamespace(path="libvulkan.so.1"))
    section = {"glslc": "2023.2-1", "shader_extensions": []}
    m = SimpleNamespace(platform="linux-x86_64", files=files, inputs={"vulkan": {"glslc": {"features": []}}},
                        sections={"vulkan": section})
    with pytest.raises(VerifyError) as e:
        vulkan.VULKAN.check(tmp_path, m, platform=get("linux-x86_64"))  # type: ignore[arg-type]
    assert "carries libvulkan.so.1" in e.value.what
    m.files = files[:1]
    assert vulkan.VULKAN.check(tmp_path, m, platform=get("linux-x86_64"))["vulkan"].startswith("passed (glslc 2023.2-1")  # type: ignore[arg-type]
    m.inputs = {"vulkan": {"glslc": {"features": ["GL_EXT_bfloat16"]}}}
    with pytest.raises(VerifyError, match="differ from its key inputs"):
        vulkan.VULKAN.check(tmp_path, m, platform=get("linux-x86_64"))  # type: ignore[arg-type]


def report(loaded: dict[str, str], devices: list[str]) -> verify.VerifyReport:
    r = verify.VerifyReport(path="b.zip", key="k", platform="linux-x86_64", files=1, bytes=1)
    r.levels["load"] = "passed"
    r.backends_loaded = {"CPU": "b.zip:libggml-cpu-x64.so", **loaded}
    r.devices = devices
    return r


def manifest_of(*backends: str) -> Manifest:
    from types import SimpleNamespace

    return SimpleNamespace(backends=backends, sections={})  # type: ignore[return-value]


def test_gpu_level_is_asked_of_every_gpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from llamabundle.backends import cuda

    monkeypatch.setattr(vulkan.Vulkan, "device_present", lambda self: False)
    monkeypatch.setattr(cuda.Cuda, "device_present", lambda self: False)
    # lavapipe: the backend loads, ggml lists no CPU implementation: skipped with the reason, not failed
    r = report({"Vulkan": "b.zip:libggml-vulkan.so"}, [])
    verify.check_gpu(manifest_of("cpu", "vulkan"), r, require_gpu=False)
    assert r.levels["gpu"].startswith("skipped: the Vulkan backend loaded but found no device")
    with pytest.raises(VerifyError) as e:
        verify.check_gpu(manifest_of("cpu", "vulkan"), report({"Vulkan": "x"}, []), require_gpu=True)
    assert "--require-gpu" in e.value.why and "lavapipe" in e.value.fix
    # CUDA and Vulkan, one GPU seen by both: each backend's result and the summary
    r = report({"CUDA": "b.zip:libggml-cuda.so", "Vulkan": "b.zip:libggml-vulkan.so"},
               ["CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)", "Vulkan0: NVIDIA H200 (143155 MiB, 143155 MiB free)"])
    verify.check_gpu(manifest_of("cpu", "cuda", "vulkan"), r, require_gpu=True)
    assert r.levels["gpu"] == "passed (CUDA, Vulkan)" and r.levels["gpu CUDA"] == r.levels["gpu Vulkan"] == "passed"
    # CUDA passes, no Vulkan loader on the machine: passed, with Vulkan's reason kept
    r = report({"CUDA": "b.zip:libggml-cuda.so"}, ["CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"])
    verify.check_gpu(manifest_of("cpu", "cuda", "vulkan"), r, require_gpu=True)
    assert r.levels["gpu"] == "passed (CUDA)" and r.levels["gpu Vulkan"].startswith("skipped: no Vulkan GPU driver")


def test_a_gpu_driver_without_its_backend_loading_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vulkan.Vulkan, "device_present", lambda self: True)
    with pytest.raises(VerifyError) as e:
        verify.check_gpu(manifest_of("cpu", "vulkan"), report({}, []), require_gpu=False)
    assert "Vulkan backend did not load" in e.value.what
    with pytest.raises(VerifyError, match="listed no Vulkan device"):
        verify.check_gpu(manifest_of("cpu", "vulkan"), report({"Vulkan": "x"}, []), require_gpu=False)


def test_the_shipped_recipes_with_vulkan_lint() -> None:
    for name in ("linux-x86_64-vulkan", "linux-x86_64-cuda13.0-vulkan"):
        r = keys.parse((ROOT / "recipes" / f"{name}.yaml").read_text(encoding="utf-8"), file=name)
        assert "vulkan" in r.backends and r.vulkan is not None
        inputs = keys.resolve(r, host=host(None)).inputs  # the key, whether or not this machine has a glslc
        assert json.dumps(inputs["backends"]) == json.dumps(sorted(r.backends))


def test_lint_passes_a_vulkan_recipe_on_a_machine_without_glslc(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from llamabundle.cli import cli

    vulkan._detect.cache_clear()
    res = CliRunner().invoke(cli, ["recipe", "lint", str(SHIPPED)], env={"PATH": str(tmp_path)})
    assert res.exit_code == 0, res.output
    assert f"key {keys.resolve(shipped(), host=host(None)).key[:12]}" in res.output  # pinned: keyed without glslc or g++
    text = SHIPPED.read_text(encoding="utf-8")
    bare = tmp_path / "unpinned.yaml"
    bare.write_text("\n".join(line for line in text.splitlines() if not line.startswith("  glslc:")) + "\n", encoding="utf-8")
    res = CliRunner().invoke(cli, ["recipe", "lint", str(bare)], env={"PATH": str(tmp_path)})
    assert res.exit_code == 0, res.output
    assert "no key here: the cache key needs glslc" in res.output


@pytest.mark.race
def test_two_runs_fetching_the_headers_at_once_end_with_one_tree(tmp_path: Path, served: dict[str, bytes]) -> None:
    h = headers_for(served, GOOD_DEB)
    got: list[Path | BaseException] = []

    def fetch() -> None:
        try:
            got.append(vulkan.fetch_headers(h, cache_dir=tmp_path, log=Log(quiet=True)))
        except BaseException as e:  # noqa: BLE001 - the test reports it
            got.append(e)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 4 and all(isinstance(g, Path) for g in got), got
    assert len(set(got)) == 1 and (got[0] / "vulkan" / "vulkan.hpp").is_file()  # type: ignore[operator]


def test_the_spirv_headers_are_found_where_cmake_looks(tmp_path: Path) -> None:
    """Under a prefix on CMAKE_PREFIX_PATH (as the GPU machine's unpacked Debian package), or SPIRV-Headers_ROOT,
    or the Vulkan SDK: not only under /usr."""
    config = tmp_path / "vk" / "usr" / "share" / "cmake" / "SPIRV-Headers" / "SPIRV-HeadersConfig.cmake"
    config.parent.mkdir(parents=True)
    config.write_text("# SPIR-V headers\n")
    prefix = str(tmp_path / "vk" / "usr")
    for var in ("CMAKE_PREFIX_PATH", "SPIRV-Headers_ROOT", "VULKAN_SDK"):
        assert vulkan.spirv_headers({var: f"/nonexistent{os.pathsep}{prefix}"}) == config, var
    elsewhere = vulkan.spirv_headers({"CMAKE_PREFIX_PATH": str(tmp_path / "none")})
    assert elsewhere is None or elsewhere.is_relative_to("/usr")  # only the system's own, if it has them


def test_spirv_headers_the_compiler_would_not_see_are_refused_before_the_build(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 image with the Debian package unpacked under a prefix: CMake finds the package, but ggml-vulkan
    includes spirv.hpp by __has_include without the package's include directory, and the build failed 7 minutes in
    ("'spv' has not been declared"). Refused at once, naming the directory to add; with it on CPLUS_INCLUDE_PATH
    (or CPATH) it passes."""
    usr = tmp_path / "vk" / "usr"
    (usr / "share" / "cmake" / "SPIRV-Headers").mkdir(parents=True)
    (usr / "share" / "cmake" / "SPIRV-Headers" / "SPIRV-HeadersConfig.cmake").write_text("# SPIR-V headers\n")
    (usr / "include" / "spirv" / "unified1").mkdir(parents=True)
    (usr / "include" / "spirv" / "unified1" / "spirv.hpp").write_text("namespace spv {}\n")
    monkeypatch.setattr(vulkan, "SYSTEM_INCLUDE", (str(tmp_path / "none"),))  # a machine without them under /usr
    with pytest.raises(ToolchainError) as e:
        vulkan.check_spirv({"CMAKE_PREFIX_PATH": str(usr)})
    assert "the compiler would not find spirv/unified1/spirv.hpp" in e.value.what
    assert e.value.fix is not None and e.value.fix.startswith(f"add {usr / 'include'} to CPLUS_INCLUDE_PATH")
    for var in ("CPLUS_INCLUDE_PATH", "CPATH"):
        vulkan.check_spirv({"CMAKE_PREFIX_PATH": str(usr), var: f"/nonexistent{os.pathsep}{usr / 'include'}"})
