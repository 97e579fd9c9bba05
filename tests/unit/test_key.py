"""The cache key (DESIGN §4): sha256 of the canonical JSON of every input that changes the bundle's files."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import pytest

from llamabundle import keys
from llamabundle.compilers import detect_version
from llamabundle.digest import canonical_json
from llamabundle.errors import ToolchainError
from llamabundle.recipe import BUNDLE_FORMAT, NO_HOST, Recipe

ROOT = Path(__file__).resolve().parents[2]
LINUX_PATH = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
WINDOWS_PATH = ROOT / "recipes" / "windows-x86_64-cuda12.8.yaml"
LINUX = LINUX_PATH.read_text(encoding="utf-8")
WINDOWS = WINDOWS_PATH.read_text(encoding="utf-8")
BASES = {"L": LINUX, "W": WINDOWS}

COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
W_COMPONENTS = "components: [cuda_nvcc, cuda_cudart, libcublas, libnvjitlink, cuda_nvrtc, libnvfatbin, cuda_cccl]"
W_ARCHS = "archs: [50-virtual, 61-virtual, 70-virtual, 75-virtual, 80-virtual, 86-real, 89-real, 120a-real]"
W_FLOOR = 'driver_floor: {windows: "572.61", linux: "570.124.06"}'
W_CMAKE = "cmake: {GGML_BACKEND_DL: ON, GGML_CPU_ALL_VARIANTS: ON, GGML_NATIVE: OFF, LLAMA_USE_PREBUILT_UI: OFF}"
W_TOOLCHAIN = 'toolchain: {compiler: msvc, msvc_version: "[17.0,18.0)", toolset: "14.44.35207"}'
L_TOOLCHAIN = 'toolchain: {compiler: gcc, version: "=12.2.0"}'
UNPINNED = (L_TOOLCHAIN, "toolchain: {compiler: gcc}")
L_SOURCES = """    - github: ggml-org/llama.cpp    # archive tarball; commit read from its pax header
    - pypi: {package: llama-cpp-python, version: 0.3.36,
             sha256: 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e}"""

Edits = tuple[tuple[str, str], ...]


def edit(text: str, *edits: tuple[str, str]) -> str:
    for old, new in edits:
        assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
        text = text.replace(old, new)
    return text


def load(base: str, *edits: tuple[str, str], file: str = "r.yaml") -> Recipe:
    return keys.parse(edit(BASES[base], *edits), file=file)


def key(base: str, *edits: tuple[str, str]) -> str:
    return keys.resolve(load(base, *edits)).key


# ---------------------------------------------------------------------------------- basics


@pytest.mark.parametrize("path", [LINUX_PATH, WINDOWS_PATH], ids=["linux", "windows"])
def test_key_is_64_hex_and_stable(path: Path) -> None:
    k = keys.resolve(keys.load(path)).key
    assert re.fullmatch(r"[0-9a-f]{64}", k)
    assert keys.resolve(keys.load(path)).key == k
    assert keys.resolve(keys.parse(path.read_text(encoding="utf-8"), file="other/place.yaml")).key == k


def test_key_is_sha256_of_canonical_key_inputs() -> None:
    r = keys.load(WINDOWS_PATH)
    text = canonical_json(keys.resolve(r).inputs)
    assert keys.resolve(r).key == hashlib.sha256(text.encode()).hexdigest()
    assert json.loads(text) == keys.resolve(r).inputs
    assert text == json.dumps(keys.resolve(r).inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def test_linux_and_windows_keys_differ() -> None:
    assert keys.resolve(keys.load(LINUX_PATH)).key != keys.resolve(keys.load(WINDOWS_PATH)).key


def test_key_inputs_are_exactly_design_4() -> None:
    for path in (LINUX_PATH, WINDOWS_PATH):
        inputs = keys.resolve(keys.load(path)).inputs
        assert set(inputs) == {"recipe", "platform", "commit", "backends", "toolchain", "cuda", "cmake",
                               "targets", "runtime", "bundle_format", "derivation", "ui"}  # ui: the shipped recipes build the web UI
        assert inputs["recipe"] == 1 and inputs["bundle_format"] == BUNDLE_FORMAT
        assert inputs["commit"] == COMMIT
        assert not {"sources", "publish", "name", "origin", "llama_cpp"} & set(inputs)
        blob = canonical_json(inputs)
        for not_in_key in ("ggml-org", "llama-cpp-python", "832db0699007", "{key12}", keys.load(path).name, str(path)):
            assert not_in_key not in blob, not_in_key


def test_key_inputs_windows_values() -> None:
    inputs = keys.resolve(keys.load(WINDOWS_PATH)).inputs
    assert inputs["platform"] == "windows-x86_64"
    assert inputs["backends"] == ["cpu", "cuda", "rpc"]
    assert inputs["toolchain"] == {"compiler": "msvc", "msvc_version": "[17.0,18.0)", "toolset": "14.44.35207"}
    cuda = inputs["cuda"]
    assert {"toolkit", "components", "archs", "driver_floor"} <= set(cuda)
    assert cuda["toolkit"] == "12.8.1"
    assert cuda["components"] == sorted(["cuda_nvcc", "cuda_cudart", "libcublas", "libnvjitlink", "cuda_nvrtc", "libnvfatbin", "cuda_cccl"])
    assert sorted(cuda["archs"]) == sorted(["50-virtual", "61-virtual", "70-virtual", "75-virtual", "80-virtual", "86-real", "89-real", "120a-real"])
    assert cuda["driver_floor"] == "572.61"
    assert inputs["cmake"] == {"GGML_BACKEND_DL": "ON", "GGML_CPU_ALL_VARIANTS": "ON", "GGML_NATIVE": "OFF",
                               "LLAMA_USE_PREBUILT_UI": "OFF"}
    assert inputs["targets"] == ["llama-server"]
    assert inputs["runtime"] == {"openmp": "auto"}


def test_key_inputs_linux_values() -> None:
    inputs = keys.resolve(keys.load(LINUX_PATH)).inputs
    assert inputs["platform"] == "linux-x86_64"
    assert inputs["backends"] == ["cpu"]
    assert inputs["toolchain"] == {"compiler": "gcc", "version": "=" + detect_version("gcc")}  # unpinned: the host's
    assert inputs["cuda"] is None
    assert inputs["cmake"]["LLAMA_USE_PREBUILT_UI"] == "OFF"


# ------------------------------------------------------------------- order and style don't matter

TWO_TARGETS = ("targets: [llama-server]", "targets: [llama-server, llama-cli]")


@pytest.mark.parametrize(("base", "setup", "reordered"), [
    ("W", (), (("backends: [cpu, cuda, rpc]", "backends: [rpc, cuda, cpu]"),)),
    ("W", (TWO_TARGETS,), (("targets: [llama-server, llama-cli]", "targets: [llama-cli, llama-server]"),)),
    ("W", (), ((W_CMAKE, "cmake: {LLAMA_USE_PREBUILT_UI: OFF, GGML_NATIVE: OFF, GGML_CPU_ALL_VARIANTS: ON, GGML_BACKEND_DL: ON}"),)),
    ("W", (), ((W_COMPONENTS, "components: [cuda_cccl, libnvfatbin, cuda_nvrtc, libnvjitlink, libcublas, cuda_cudart, cuda_nvcc]"),)),
    ("W", (), ((W_ARCHS, "archs: [120a-real, 89-real, 86-real, 80-virtual, 75-virtual, 70-virtual, 61-virtual, 50-virtual]"),)),
    ("W", (), ((W_FLOOR, 'driver_floor: {linux: "570.124.06", windows: "572.61"}'),)),
    ("W", (), ((W_TOOLCHAIN, 'toolchain: {toolset: "14.44.35207", msvc_version: "[17.0,18.0)", compiler: msvc}'),)),
    ("L", (), (("  GGML_BACKEND_DL: ON\n", ""), ("  LLAMA_USE_PREBUILT_UI: OFF", "  LLAMA_USE_PREBUILT_UI: OFF\n  GGML_BACKEND_DL: ON"))),
    ("L", (), (("recipe: 1\n", ""), ('publish: {tag: "{name}-{key12}"}', 'publish: {tag: "{name}-{key12}"}\nrecipe: 1'))),
    ("L", (), (("targets: [llama-server]\n", ""), ("backends: [cpu]", "targets: [llama-server]\nbackends: [cpu]"))),
], ids=["backends", "targets", "cmake-keys", "components", "archs", "floor-keys", "toolchain-keys", "cmake-block", "top-level-keys", "targets-first"])
def test_key_ignores_order(base: str, setup: Edits, reordered: Edits) -> None:
    before = load(base, *setup)
    after = load(base, *setup, *reordered)
    assert keys.resolve(after).key == keys.resolve(before).key


@pytest.mark.parametrize(("base", "restyled"), [
    ("L", (("cmake:\n  GGML_BACKEND_DL: ON\n  GGML_CPU_ALL_VARIANTS: ON\n  GGML_NATIVE: OFF\n  LLAMA_BUILD_TESTS: OFF\n"
            "  LLAMA_BUILD_EXAMPLES: OFF\n  LLAMA_USE_PREBUILT_UI: OFF        # no download of web UI assets at build time\n",
            "cmake: {GGML_BACKEND_DL: true, GGML_CPU_ALL_VARIANTS: on, GGML_NATIVE: false, LLAMA_BUILD_TESTS: \"OFF\",\n"
            "        LLAMA_BUILD_EXAMPLES: no, LLAMA_USE_PREBUILT_UI: 'OFF'}\n"),)),
    ("L", (("backends: [cpu]", "backends:\n  - cpu"), (L_TOOLCHAIN, "toolchain:\n  compiler: \"gcc\"\n  version: =12.2.0"))),
    ("L", ((f"commit: {COMMIT}", f"commit: '{COMMIT}'"),)),
    ("W", (("toolkit: 12.8.1", 'toolkit: "12.8.1"'),)),
    ("W", ((W_FLOOR, "driver_floor:\n    windows: '572.61'\n    linux: '570.124.06'"),)),
], ids=["cmake-bool-spellings", "block-vs-flow", "quoted-commit", "quoted-toolkit", "block-floor"])
def test_key_ignores_yaml_style(base: str, restyled: Edits) -> None:
    assert key(base, *restyled) == key(base)


# ----------------------------------------------------------------------- every input changes it

CLANG = (L_TOOLCHAIN, 'toolchain: {compiler: clang, version: "16"}')
W_CLANG = (W_TOOLCHAIN, 'toolchain: {compiler: clang, version: "16"}')
W_SM75_UP = (W_ARCHS, "archs: [75-virtual, 86-real, 89-real, 120a-real]")
L_CUDA = (("backends: [cpu]", "backends: [cpu, cuda]"),
          ("targets: [llama-server]", "cuda:\n  toolkit: 12.8.1\n  components: [cuda_nvcc, cuda_cudart]\n  archs: [86-real]\n"
                                      "targets: [llama-server]"))


@pytest.mark.parametrize(("base", "setup", "change"), [
    ("L", (), ((COMMIT, "a" * 40),)),
    ("L", (), ((COMMIT, COMMIT[:-1] + "e"),)),
    ("L", (CLANG,), (("platform: linux-x86_64", "platform: windows-x86_64"),)),
    ("W", (W_CLANG,), (("platform: windows-x86_64", "platform: linux-x86_64"),)),
    ("L", (), L_CUDA),
    ("L", (), (CLANG,)),
    ("W", (), ((W_TOOLCHAIN, 'toolchain: {compiler: clang, version: "16"}'),)),
    ("W", (), ((W_TOOLCHAIN, 'toolchain: {compiler: mingw, version: "12"}'),)),
    ("W", (), ((W_TOOLCHAIN, 'toolchain: {compiler: msvc, msvc_version: "[17.0,19.0)", toolset: "14.44.35207"}'),)),
    ("W", (), (('toolset: "14.44.35207"', 'toolset: "14.43.34808"'),)),
    ("L", (), ((L_TOOLCHAIN, 'toolchain: {compiler: gcc, version: "[12,13)"}'),)),
    ("L", ((L_TOOLCHAIN, 'toolchain: {compiler: gcc, version: "12"}'),),
     (('version: "12"', 'version: "12.2"'),)),
    ("L", (), (('version: "=12.2.0"', 'version: "=12.3.0"'),)),
    ("W", (W_SM75_UP,), (("toolkit: 12.8.1", "toolkit: 13.0.1"),)),
    ("W", (W_SM75_UP,), (("toolkit: 12.8.1", "toolkit: 13.0.2"),)),
    ("W", (), (("cuda_nvrtc, libnvfatbin,", "cuda_nvrtc,"),)),
    ("W", (), (("cuda_cccl]", "cuda_cccl, cuda_nvml_dev]"),)),
    ("W", (), (("120a-real]", "120-real]"),)),
    ("W", (), (("86-real,", "86-virtual,"),)),
    ("W", (), (("50-virtual, ", ""),)),
    ("W", (), (("89-real,", "89-real, 90-real,"),)),
    ("W", (), (('windows: "572.61"', 'windows: "580.00"'),)),
    ("W", (), ((W_FLOOR, 'driver_floor: {windows: "590.1"}'),)),
    ("L", (), (("  GGML_NATIVE: OFF", "  GGML_NATIVE: ON"),)),
    ("L", (), (("  GGML_NATIVE: OFF\n", ""),)),
    ("L", (), (("  GGML_NATIVE: OFF", "  GGML_NATIVE: OFF\n  GGML_AVX512: OFF"),)),
    ("W", (), (("GGML_BACKEND_DL: ON", "GGML_BACKEND_DL: OFF"),)),
    ("L", (), (("targets: [llama-server]", "targets: [llama-cli]"),)),
    ("L", (), ((TWO_TARGETS),)),
    ("L", (), (("runtime: {openmp: auto}", "runtime: {openmp: none}"),)),
    ("W", (), (("runtime: {openmp: auto}", "runtime: {openmp: vcomp}"),)),
], ids=["commit", "commit-last-digit", "platform-to-windows", "platform-to-linux", "backends", "compiler", "compiler-win-clang",
        "compiler-mingw", "msvc-version", "msvc-toolset", "gcc-pinned", "gcc-pin-narrowed", "gcc-exact", "toolkit-13.0.1", "toolkit-13.0.2",
        "component-removed", "component-added", "arch-changed", "arch-real-to-virtual", "arch-removed", "arch-added",
        "driver-floor", "driver-floor-only-windows", "cmake-value", "cmake-removed", "cmake-added", "cmake-value-windows",
        "target-changed", "target-added", "openmp", "openmp-windows"])
def test_key_changes_with_every_input(base: str, setup: Edits, change: Edits) -> None:
    before = load(base, *setup)
    after = load(base, *setup, *change)
    assert keys.resolve(after).key != keys.resolve(before).key
    changed = {k for k in keys.resolve(before).inputs if keys.resolve(before).inputs[k] != keys.resolve(after).inputs[k]}
    assert changed and changed <= {"platform", "commit", "backends", "toolchain", "cuda", "cmake", "targets", "runtime"}


def test_platform_alone_changes_key_inputs_only_in_platform() -> None:
    before = load("L", CLANG)
    after = load("L", CLANG, ("platform: linux-x86_64", "platform: windows-x86_64"))
    diff = {k for k in keys.resolve(before).inputs if keys.resolve(before).inputs[k] != keys.resolve(after).inputs[k]}
    assert diff == {"platform"}


def test_toolkit_alone_changes_key_inputs_only_in_cuda_toolkit() -> None:
    before = keys.resolve(load("W", W_SM75_UP)).inputs
    after = keys.resolve(load("W", W_SM75_UP, ("toolkit: 12.8.1", "toolkit: 13.0.1"))).inputs
    assert {k for k in before if before[k] != after[k]} == {"cuda"}
    assert {k for k in before["cuda"] if before["cuda"][k] != after["cuda"][k]} == {"toolkit"}


def test_bundle_format_and_schema_version_are_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    import llamabundle.recipe.model as recipe_model

    r = keys.load(LINUX_PATH)
    k = keys.resolve(r).key
    monkeypatch.setattr(recipe_model, "BUNDLE_FORMAT", BUNDLE_FORMAT + 1)
    assert keys.resolve(r).inputs["bundle_format"] == BUNDLE_FORMAT + 1
    assert keys.resolve(r).key != k


# --------------------------------------------------------------------- what is not in the key


@pytest.mark.parametrize(("base", "change"), [
    ("L", (("- github: ggml-org/llama.cpp", "- github: someone/llama.cpp-mirror"),)),
    ("L", ((L_SOURCES, "    - git: https://example.invalid/llama.cpp.git"),)),
    ("L", ((L_SOURCES, "    - path: ../llama.cpp"),)),
    ("L", (("- github: ggml-org/llama.cpp    # archive tarball; commit read from its pax header\n", ""),)),
    ("W", (("version: 0.3.36", "version: 0.3.37"),)),
    ("L", (('publish: {tag: "{name}-{key12}"}', 'publish: {tag: "llama-{commit12}-{platform}-{key12}"}'),)),
    ("L", (('publish: {tag: "{name}-{key12}"}\n', ""),)),
    ("L", (("name: linux-x86_64-cpu", "name: something-else"),)),
    ("W", (("name: windows-x86_64-cuda12.8", "name: w"),)),
    ("L", (("# llama.cpp for Linux x86-64, CPU backend only", "# a different comment"),)),
    ("W", (("# windows-x86_64 | linux-x86_64", ""), ("# windows-2022's VS 2022 17.14 (cl 19.44)", "# a new comment"))),
    ("L", (("recipe: 1", "# leading comment\nrecipe: 1   # trailing comment"),)),
    ("W", ((W_FLOOR, 'driver_floor: {windows: "572.61", linux: "999.99"}'),)),
    ("W", (("  " + W_FLOOR + "   # optional: derived from toolkit + archs\n", ""),)),
    ("W", ((W_FLOOR, 'driver_floor: {windows: "572.61"}'),)),
    ("L", (("runtime: {openmp: auto}\n", ""),)),
    ("W", (("  source: redist                    # redist | installer | pypi | system\n", ""),)),
    ("W", (("source: redist ", "source: system "),)),
], ids=["github-repo", "git-source", "path-source", "fewer-sources", "pypi-version", "publish-tag", "publish-default",
        "name", "name-windows", "comment", "comments-windows", "more-comments", "other-os-floor", "floor-equals-default",
        "floor-only-own-os", "openmp-default", "cuda-source-default",
        "cuda-source-system"])
def test_key_ignores_non_inputs(base: str, change: Edits) -> None:
    assert key(base, *change) == key(base)


def test_key_ignores_file_path(tmp_path: Path) -> None:
    a = tmp_path / "a" / "one.yaml"
    b = tmp_path / "b" / "two.yml"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text(WINDOWS, encoding="utf-8")
    ra, rb = keys.load(a), keys.load(b)
    assert ra.origin != rb.origin
    assert ra == rb  # origin is not compared
    assert keys.resolve(ra).key == keys.resolve(rb).key == keys.resolve(keys.load(WINDOWS_PATH)).key


def test_tag_uses_the_key() -> None:
    r = load("L", ('publish: {tag: "{name}-{key12}"}', 'publish: {tag: "{name}-{commit12}-{platform}-{key}"}'))
    assert keys.resolve(r).tag == f"linux-x86_64-cpu-{COMMIT[:12]}-linux-x86_64-{keys.resolve(r).key}"


# ------------------------------------------------------------------ honest keys: compiler, derivation


def test_an_unpinned_compiler_keys_the_exact_version_found(monkeypatch: pytest.MonkeyPatch) -> None:
    import llamabundle.compilers as compilers

    monkeypatch.setattr(compilers, "detect_version", lambda compiler, env=None, program=None: "12.2.0")
    a = keys.resolve(load("L", UNPINNED))
    monkeypatch.setattr(compilers, "detect_version", lambda compiler, env=None, program=None: "12.3.0")
    b = keys.resolve(load("L", UNPINNED))
    assert a.inputs["toolchain"] == {"compiler": "gcc", "version": "=12.2.0"}
    assert a.key != b.key  # another gcc makes other bytes: another key
    # the exact pin of a version keys as that version found here does: pinning a recipe keeps its key
    assert keys.resolve(load("L")).key == a.key


def test_an_exact_pin_needs_that_compiler_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from llamabundle.compilers import check_host, version_matches

    assert version_matches("=12.2.0", "12.2.0") and not version_matches("=12.2.0", "12.2.1")
    assert not version_matches("=12.2.0", "12.2") and version_matches("12.2", "12.2.1")
    import llamabundle.compilers as compilers

    monkeypatch.setattr(compilers, "detect_version", lambda compiler, env=None, program=None: "13.3.0")
    with pytest.raises(ToolchainError, match=r"g\+\+ 13.3.0 is outside the recipe's toolchain.version =12.2.0") as e:
        check_host("gcc", pin="=12.2.0", keyed=None, env={})
    assert e.value.exit_code == 3


def test_a_pinned_compiler_keys_the_pin_whatever_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import llamabundle.compilers as compilers

    pinned = (L_TOOLCHAIN, 'toolchain: {compiler: gcc, version: "12.2"}')
    seen = set()
    for found in ("12.2.0", None):
        monkeypatch.setattr(compilers, "detect_version", lambda compiler, env=None, program=None, v=found: v)
        seen.add(keys.resolve(load("L", pinned)).key)
    assert len(seen) == 1 and keys.resolve(load("L", pinned)).inputs["toolchain"] == {"compiler": "gcc", "version": "12.2"}


def test_an_unpinned_recipe_without_its_compiler_cannot_be_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    import llamabundle.compilers as compilers

    monkeypatch.setattr(compilers, "detect_version", lambda compiler, env=None, program=None: None)
    r = load("W", (W_TOOLCHAIN, "toolchain: {compiler: mingw}"))
    with pytest.raises(ToolchainError) as e:
        keys.resolve(r)
    assert e.value.exit_code == 3 and "x86_64-w64-mingw32-g++-posix" in e.value.what
    assert "toolchain.version" in e.value.why and "version:" in e.value.fix
    with pytest.raises(ToolchainError):
        keys.resolve(load("W", (W_TOOLCHAIN, "toolchain: {compiler: msvc}")))  # msvc without msvc_version, no cl here


def test_msvc_is_pinned_by_msvc_version_not_version() -> None:
    from llamabundle.errors import RecipeError

    with pytest.raises(RecipeError, match="pinned by toolset"):
        load("W", (W_TOOLCHAIN, 'toolchain: {compiler: msvc, version: "19.44"}'))


def test_derivation_version_and_knowledge_are_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    from llamabundle import data

    r = keys.load(LINUX_PATH)
    k = keys.resolve(r).key
    assert keys.resolve(r).inputs["derivation"]["version"] == keys.DERIVATION
    monkeypatch.setattr(keys, "DERIVATION", keys.DERIVATION + 1)
    assert keys.resolve(r).key != k
    monkeypatch.undo()
    real = data.load

    def more_variants(name: str):  # type: ignore[no-untyped-def]
        value = real(name)
        if name == "build.json":
            value = {**value, "cpu_variants": {**value["cpu_variants"], "x86_64": [*value["cpu_variants"]["x86_64"], "zen5"]}}
        return value

    monkeypatch.setattr(data, "load", more_variants)
    assert keys.resolve(r).key != k  # a new default CPU-variant set: a new key, though the recipe did not change


# The flags, files and variant set the tool derives for the shipped recipes, per DERIVATION. When this
# test fails, the tool now builds differently: bump keys.DERIVATION and record the new digest here.
# 7 was recomputed (from 8bbe1f71…) when windows-x86_64-cuda12.8.yaml gained LLAMA_USE_PREBUILT_UI: OFF: a shipped
# recipe's own cmake option (in its key by itself), not a change of what the tool derives
DERIVED = {6: "58138558cd102942cf8722466ec0708deb02c36933f6f718ddc7b7e580bf27b8",
           7: "870ce3807aa3f6e0afa046fc1a0e47f5656ec10b4f31aa31f62e2b6a089d3ab9",
           8: "f2a275c0e0a6916e9f64bcd98f4a9247f65ccc3d123115d122d6a334eb25703b",
           9: "b1ef64758a3ebab53a03be93974b0ebfb214f0427f91ce07b512eb4173153bec",
           10: "602f0e3875bc9d04e41365ea278787f8daac1b9a511d6af9fcd2804cc557fb3a",
           11: "d52af70853670092b4c9ca5761b1adf7be57ad391198244b7fb0dd1acef1a06e",
           12: "33aee5565b630305d3cb8bf3891addfc2e580bb306bfeb5319ea132d77ecbfa7"}


# The recipes the digest is of: the shipped ones as they were when derivation 10 was recorded, kept in tests/data/derived
# (a shipped recipe that changes changes its own key; this digest is of what the tool derives from fixed inputs)
DERIVED_RECIPES = ("linux-x86_64-cpu", "linux-x86_64-cuda13.0", "linux-x86_64-cuda13.0-vulkan", "linux-x86_64-vulkan",
                   "windows-x86_64-cpu", "windows-x86_64-cpu-mingw", "windows-x86_64-cuda12.8")
DERIVED_DIR = ROOT / "tests" / "data" / "derived"


def test_what_the_tool_derives_is_recorded_for_this_derivation_version(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from llamabundle.backends import vulkan
    from llamabundle.build import COMPILER_CACHE_SWITCH, BuildTools, plan_build
    from llamabundle.recipe import HostFacts, ToolFound

    # What this machine has (glslc, the Vulkan loader) is fixed: the digest is of what the tool derives.
    monkeypatch.setattr(vulkan, "loader_path", lambda: "/L/libvulkan.so.1")
    glslc = ToolFound(path="/G/glslc", version="2023.2-1", versions=(("shaderc", "2023.2-1"),), features=())
    tools = BuildTools(cmake="cmake", ninja="ninja")
    parts = []
    for path in sorted(DERIVED_DIR / f"{name}.yaml" for name in DERIVED_RECIPES):
        r = keys.parse(path.read_text(encoding="utf-8"), file=path.name)
        host = HostFacts(tools={"vulkan": glslc} if r.vulkan else {})
        roots = {**({"cuda": Path("/C")} if r.cuda else {}), **({"vulkan": Path("/V")} if r.vulkan else {})}
        plan = plan_build(r, host, source_dir=Path("/S"), build_dir=Path("/B"), tools=tools, toolkit_roots=roots or None,
                          fixed_root=Path("/F"))
        # GGML_CCACHE=OFF (build.COMPILER_CACHE_SWITCH) leaves every byte the same (tests/e2e/test_compiler_cache.py):
        # which compiler cache runs is no part of what the tool derives
        configure = [a for a in plan.configure if a != f"-D{COMPILER_CACHE_SWITCH}=OFF"]
        assert len(configure) == len(plan.configure) - 1
        parts.append({"recipe": path.name, "configure": configure, "build": list(plan.build),
                      "files": dict(plan.files), "links": dict(plan.links), "commands": [list(c) for c in plan.commands]})
    # The Python that runs the CUDA launcher is this machine's: not part of what the tool derives.
    digest = hashlib.sha256(canonical_json(parts).replace(sys.executable, "PYTHON").encode()).hexdigest()
    assert DERIVED.get(keys.DERIVATION) == digest, (
        f"the derived build changed (digest {digest}): bump keys.DERIVATION and record it in DERIVED")


# ------------------------------------------------------------- computable anywhere: no build tools needed


SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))


def test_every_shipped_recipe_is_keyed_and_checked_with_only_the_venv_on_path(tmp_path: Path) -> None:
    """The cheap job ("is it published?") runs on a bare runner: with PATH holding only this Python's directory
    (no compiler, no glslc, no MSVC), `key` and `check` of every shipped recipe exit as they do here, with the
    key the build machine computes (in this process, with the system's PATH)."""
    import shutil
    import subprocess

    venv_bin = str(Path(sys.executable).parent)
    for tool in ("g++", "gcc", "glslc", "x86_64-w64-mingw32-g++-posix", "cl", "cl.exe"):
        assert shutil.which(tool, path=venv_bin) is None, f"{tool} is in {venv_bin}: the test would prove nothing"
    env = {"PATH": venv_bin, "HOME": str(tmp_path), "LANG": "C.UTF-8", "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")}
    store = tmp_path / "store"
    store.mkdir()
    assert len(SHIPPED) >= 9
    for path in SHIPPED:
        want = keys.resolve(keys.load(path)).key
        done = subprocess.run([sys.executable, "-m", "llamabundle", "key", str(path)], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert (done.returncode, done.stdout.strip()) == (0, want), f"{path.name}: {done.stderr}"
        done = subprocess.run([sys.executable, "-m", "llamabundle", "check", str(path), "--store", str(store)], env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert (done.returncode, done.stdout.split()[:2]) == (1, ["miss", want]), f"{path.name}: {done.stderr}"


def test_every_shipped_recipe_pins_its_compiler_exactly() -> None:
    """No shipped recipe leaves its key to the machine: gcc, clang and mingw by an exact version, MSVC by its
    toolset, glslc by its versions and shader extensions."""
    for path in SHIPPED:
        r = keys.load(path)
        t = r.toolchain
        if t.compiler == "msvc":
            assert t.toolset and re.fullmatch(r"14\.\d+\.\d+", t.toolset), path.name
        else:
            assert t.version and re.fullmatch(r"=\d+\.\d+\.\d+", t.version), path.name
        if r.vulkan is not None:
            assert r.vulkan.glslc is not None, path.name
        assert keys.host_facts(r, env={"PATH": "/nonexistent"}) == NO_HOST, path.name
