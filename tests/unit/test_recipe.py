"""Recipe loading (DESIGN §4): shipped recipes, strict errors with file:line:key, cmake values, JSON schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

import llamabundle.recipe as recipe_mod
from llamabundle import keys
from llamabundle.errors import RecipeError
from llamabundle.recipe import MAX_RECIPE_BYTES, GithubSource, PypiSource
from llamabundle.recipe.schema import json_schema
from tests.recipes import LINUX, LINUX_PATH, WINDOWS, WINDOWS_PATH, edit, line_of

BASES = {"L": (LINUX, "linux.yaml"), "W": (WINDOWS, "windows.yaml")}
SCHEMA_FILE = Path(recipe_mod.__file__).parents[1] / "data" / "schemas" / "recipe.schema.json"

COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
WHERE = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+):(?P<col>\d+): (?P<path>\S+): (?P<msg>.*)$", re.S)


def fails(text: str, file: str = "r.yaml") -> RecipeError:
    with pytest.raises(RecipeError) as info:
        keys.parse(text, file=file)
    err = info.value
    assert err.exit_code == 2
    assert err.what and err.fix
    return err


def where(err: RecipeError) -> dict[str, str]:
    m = WHERE.match(err.what)
    assert m, f"no file:line:col: path: in {err.what!r}"
    return m.groupdict()


# ------------------------------------------------------------------------------- shipped recipes


def test_linux_recipe_fields() -> None:
    r = keys.load(LINUX_PATH)
    assert r.recipe == 1
    assert r.name == "linux-x86_64-cpu"
    assert r.platform == "linux-x86_64"
    assert r.llama_cpp.commit == COMMIT
    assert r.llama_cpp.sources == (
        GithubSource(repo="ggml-org/llama.cpp"),
        PypiSource(package="llama-cpp-python", version="0.3.36",
                   sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"),
    )
    assert r.backends == ("cpu",)
    assert r.toolchain.compiler == "gcc" and r.toolchain.msvc_version is None
    assert r.cuda is None and r.driver_floor is None
    assert r.cmake_options == {
        "GGML_BACKEND_DL": "ON", "GGML_CPU_ALL_VARIANTS": "ON", "GGML_NATIVE": "OFF",
        "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF",
    }
    assert r.targets == ("llama-server",)
    assert r.runtime.openmp == "auto"
    assert r.publish.tag == "{name}-{key12}"
    assert r.origin == str(LINUX_PATH)
    assert keys.resolve(r).tag == f"linux-x86_64-cpu-{keys.resolve(r).key[:12]}"


def test_windows_recipe_fields() -> None:
    r = keys.load(WINDOWS_PATH)
    assert r.recipe == 1
    assert r.name == "windows-x86_64-cuda12.8"
    assert r.platform == "windows-x86_64"
    assert r.llama_cpp.commit == COMMIT
    assert [s.kind for s in r.llama_cpp.sources] == ["github", "pypi"]
    assert r.backends == ("cpu", "cuda", "rpc")
    assert r.toolchain.compiler == "msvc" and r.toolchain.msvc_version == "[17.0,18.0)"
    assert r.cuda is not None
    assert r.cuda.toolkit == "12.8.1"
    assert r.cuda.source == "redist"
    assert r.cuda.components == ("cuda_nvcc", "cuda_cudart", "libcublas", "libnvjitlink", "cuda_nvrtc", "libnvfatbin", "cuda_cccl")
    assert r.cuda.archs == ("50-virtual", "61-virtual", "70-virtual", "75-virtual", "80-virtual", "86-real", "89-real", "120a-real")
    assert r.cuda.driver_floor is not None
    assert (r.cuda.driver_floor.windows, r.cuda.driver_floor.linux) == ("572.61", "570.124.06")
    assert r.driver_floor == "572.61"  # the windows one: the recipe is for windows
    assert r.cmake_options == {"GGML_BACKEND_DL": "ON", "GGML_CPU_ALL_VARIANTS": "ON", "GGML_NATIVE": "OFF",
                               "LLAMA_USE_PREBUILT_UI": "OFF"}
    assert r.targets == ("llama-server",)
    assert r.runtime.openmp == "auto"
    assert r.publish.tag == "{name}-{key12}"


def test_parse_and_load_agree() -> None:
    assert keys.parse(LINUX, file="elsewhere.yaml") == keys.load(LINUX_PATH)
    assert keys.parse(WINDOWS) == keys.load(WINDOWS_PATH)


def test_driver_floor_defaults_to_the_toolkit() -> None:
    no_floor = edit(WINDOWS, '  driver_floor: {windows: "572.61", linux: "570.124.06"}   # optional: derived from toolkit + archs\n', "")
    r = keys.parse(no_floor)
    assert r.cuda is not None and r.cuda.driver_floor is None
    assert r.driver_floor == "572.61"
    on_linux = edit(edit(no_floor, "platform: windows-x86_64", "platform: linux-x86_64"),
                    'toolchain: {compiler: msvc, msvc_version: "[17.0,18.0)", toolset: "14.44.35207"}', "toolchain: {compiler: gcc}")
    assert keys.parse(on_linux).driver_floor == "570.124.06"
    only_linux = edit(WINDOWS, 'driver_floor: {windows: "572.61", linux: "570.124.06"}', 'driver_floor: {linux: "999.1"}')
    assert keys.parse(only_linux).driver_floor == "572.61"  # no windows floor given: the toolkit's


def test_source_long_and_short_forms() -> None:
    text = edit(LINUX, "- github: ggml-org/llama.cpp", "- github: {repo: ggml-org/llama.cpp}\n    - git: https://example.invalid/llama.cpp.git\n    - path: ../llama.cpp")
    r = keys.parse(text)
    kinds = [(s.kind, getattr(s, {"github": "repo", "git": "url", "path": "path", "pypi": "package"}[s.kind])) for s in r.llama_cpp.sources]
    assert kinds == [("github", "ggml-org/llama.cpp"), ("git", "https://example.invalid/llama.cpp.git"),
                     ("path", "../llama.cpp"), ("pypi", "llama-cpp-python")]


# ------------------------------------------------------------------------------ broken recipes

SOURCES_BLOCK = """  sources:                          # tried in order; every source must prove the same commit
    - github: ggml-org/llama.cpp    # archive tarball; commit read from its pax header
    - pypi: {package: llama-cpp-python, version: 0.3.36,
             sha256: 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e}"""
W_ARCHS = "archs: [50-virtual, 61-virtual, 70-virtual, 75-virtual, 80-virtual, 86-real, 89-real, 120a-real]"

# (id, base, old, new, line needle in the edited text, key path, in .what, in .fix)
BROKEN = [
    ("unknown-top-key", "L", "backends: [cpu]", "backend: [cpu]", "backend:", "backend", "unknown key 'backend'", "did you mean 'backends'?"),
    ("unknown-top-key-no-hint", "L", "targets: [llama-server]", "targets: [llama-server]\nzzzzzz: 1", "zzzzzz", "zzzzzz", "unknown key 'zzzzzz'", "allowed keys: recipe, name, platform"),
    ("unknown-nested-key", "L", "  commit: ", "  comit: ", "comit:", "llama_cpp.comit", "unknown key 'comit'", "did you mean 'commit'?"),
    ("unknown-cuda-key", "W", "  source: redist", "  sourse: redist", "sourse:", "cuda.sourse", "unknown key 'sourse'", "did you mean 'source'?"),
    ("unknown-flow-key", "L", "runtime: {openmp: auto}", "runtime: {opnemp: auto}", "opnemp", "runtime.opnemp", "unknown key 'opnemp'", "did you mean 'openmp'?"),
    ("duplicate-top-key", "L", "targets: [llama-server]", "targets: [llama-server]\ntargets: [llama-cli]", "llama-cli", "targets",
     "duplicate key 'targets' (first set on line 21)", "keep one"),
    ("duplicate-nested-key", "L", "  GGML_NATIVE: OFF", "  GGML_NATIVE: OFF\n  GGML_NATIVE: ON", "GGML_NATIVE: ON", "cmake.GGML_NATIVE",
     "duplicate key 'GGML_NATIVE' (first set on line 17)", "keep one"),
    ("duplicate-flow-key", "L", "toolchain: {compiler: gcc,", "toolchain: {compiler: gcc, compiler: clang,", "toolchain:", "toolchain.compiler",
     "duplicate key 'compiler'", "keep one"),
    ("string-for-list", "L", "backends: [cpu]", "backends: cpu", "backends:", "backends", "expected a list, got 'cpu'", ""),
    ("string-for-targets", "L", "targets: [llama-server]", "targets: llama-server", "targets:", "targets", "expected a list, got 'llama-server'", ""),
    ("list-for-mapping", "L", 'toolchain: {compiler: gcc, version: "=12.2.0"}', "toolchain: [gcc]", "toolchain:", "toolchain", "expected a mapping, got a list", ""),
    ("list-for-string", "L", "name: linux-x86_64-cpu", "name: [linux-x86_64-cpu]", "name:", "name", "expected a string, got a list", ""),
    ("list-for-cmake", "L", "  GGML_NATIVE: OFF", "  GGML_NATIVE: [OFF]", "GGML_NATIVE", "cmake.GGML_NATIVE", "expected ON/OFF or a string, got a list", ""),
    ("cmake-not-mapping", "W", "cmake: {GGML_BACKEND_DL: ON, GGML_CPU_ALL_VARIANTS: ON, GGML_NATIVE: OFF, LLAMA_USE_PREBUILT_UI: OFF}", "cmake: [GGML_NATIVE=OFF]",
     "cmake:", "cmake", "expected a mapping of CMake options, got a list", ""),
    ("unquoted-float-toolkit", "W", "toolkit: 12.8.1", "toolkit: 12.8", "toolkit:", "cuda.toolkit", "expected a string, got 12.8 (float)", "quote the value: '12.8'"),
    ("unquoted-float-floor", "W", 'windows: "572.61"', "windows: 572.61", "driver_floor:", "cuda.driver_floor.windows", "expected a string, got 572.61", "quote the value"),
    ("string-for-int", "L", "recipe: 1", "recipe: 1.0", "recipe:", "recipe", "expected an integer, got 1.0", ""),
    ("commit-short", "L", COMMIT, COMMIT[:7], "commit:", "llama_cpp.commit", f"'{COMMIT[:7]}' is not valid", "[0-9a-f]{40}"),
    ("commit-upper", "L", COMMIT, COMMIT.upper(), "commit:", "llama_cpp.commit", f"'{COMMIT.upper()}' is not valid", "[0-9a-f]{40}"),
    ("commit-non-hex", "L", COMMIT, "g" + COMMIT[1:], "commit:", "llama_cpp.commit", "is not valid: the llama.cpp commit, 40 lowercase hex digits", "[0-9a-f]{40}"),
    ("commit-41", "L", COMMIT, COMMIT + "0", "commit:", "llama_cpp.commit", "is not valid", "[0-9a-f]{40}"),
    ("commit-trailing-newline", "L", COMMIT, f'"{COMMIT}\\n"', "commit:", "llama_cpp.commit", "is not valid", "[0-9a-f]{40}"),
    ("commit-int", "L", COMMIT, "1234567", "commit:", "llama_cpp.commit", "expected a string, got 1234567 (int)", "quote the value"),
    ("arch-realish", "W", "86-real,", "86-realish,", "86-realish", "cuda.archs[5]", "'86-realish' is not valid", "real|virtual"),
    ("arch-native", "W", "86-real,", "native,", "native", "cuda.archs[5]", "'native' is not valid", "real|virtual"),
    ("arch-sm", "W", "86-real,", "sm_86,", "sm_86", "cuda.archs[5]", "'sm_86' is not valid", "real|virtual"),
    ("arch-all", "W", "50-virtual,", "all,", "all,", "cuda.archs[0]", "'all' is not valid", "real|virtual"),
    ("arch-unknown-to-toolkit", "W", "120a-real]", "121-real]", "121-real", "cuda.archs[7]", "'121-real': CUDA 12.8.1 does not know sm_121", "supported: 50, 52"),
    ("arch-dropped", "W", "toolkit: 12.8.1", "toolkit: 13.0.2", "archs:", "cuda.archs[0]",
     "'50-virtual': CUDA 13.0.2 dropped sm_50 (it supports nothing below sm_75)", "supported: 75, 80"),
    ("arch-duplicate", "W", "89-real,", "86-real,", "archs:", "cuda.archs[6]", "'86-real' is listed twice", "remove one"),
    ("arch-empty", "W", W_ARCHS, "archs: []", "archs:", "cuda.archs", "the arch list is empty", "86-real"),
    ("platform-unknown", "L", "platform: linux-x86_64", "platform: linux-x86-64", "platform:", "platform",
     "'linux-x86-64' is not one of linux-x86_64, linux-aarch64, windows-x86_64", "did you mean 'linux-x86_64'?"),
    ("platform-far-off", "L", "platform: linux-x86_64", "platform: macos", "platform:", "platform", "'macos' is not one of", "use one of: linux-x86_64, linux-aarch64, windows-x86_64"),
    ("version-2", "L", "recipe: 1", "recipe: 2", "recipe:", "recipe", "unknown recipe schema version 2", "reads schema 1"),
    ("version-string", "L", "recipe: 1", 'recipe: "1"', "recipe:", "recipe", "unknown recipe schema version '1'", "reads schema 1"),
    ("version-bool", "L", "recipe: 1", "recipe: true", "recipe:", "recipe", "unknown recipe schema version True", "reads schema 1"),
    ("version-list", "L", "recipe: 1", "recipe: [1]", "recipe:", "recipe", "unknown recipe schema version a list", "reads schema 1"),
    ("version-missing", "L", "recipe: 1\n", "", "name:", "recipe", "missing required key 'recipe'", "recipe: 1"),
    ("name-missing", "L", "name: linux-x86_64-cpu\n", "", "recipe:", "name", "missing required key 'name'", ""),
    ("commit-missing", "L", "  commit: " + COMMIT + "\n", "", "  sources:", "llama_cpp.commit", "missing required key 'commit'", ""),
    ("name-bad", "L", "name: linux-x86_64-cpu", "name: -linux", "name:", "name", "'-linux' is not valid: bundle name", ""),
    ("sources-empty", "L", SOURCES_BLOCK, "  sources: []", "sources:", "llama_cpp.sources", "the source list is empty", "github: ggml-org/llama.cpp"),
    ("source-kind-typo", "L", "- github:", "- gihub:", "gihub", "llama_cpp.sources[0].gihub", "unknown source kind 'gihub'", "did you mean 'github'?"),
    ("source-kind-unknown", "L", "- github:", "- svn:", "svn:", "llama_cpp.sources[0].svn", "unknown source kind 'svn'", "use github, git, path or pypi"),
    ("source-two-keys", "L", "- github: ggml-org/llama.cpp", "- {github: ggml-org/llama.cpp, git: x}", "git: x", "llama_cpp.sources[0]",
     "a source is a one-key mapping", "github: ggml-org/llama.cpp"),
    ("source-scalar", "L", "- github: ggml-org/llama.cpp", "- ggml-org/llama.cpp", "- ggml-org", "llama_cpp.sources[0]", "a source is a one-key mapping", ""),
    ("pypi-sha-short", "L", "sha256: 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e", "sha256: 832db069",
     "sha256:", "llama_cpp.sources[1].pypi.sha256", "'832db069' is not valid", "[0-9a-f]{64}"),
    ("github-repo-bad", "L", "- github: ggml-org/llama.cpp", "- github: llama.cpp", "github:", "llama_cpp.sources[0].github.repo", "'llama.cpp' is not valid", ""),
    ("template-unknown", "L", 'publish: {tag: "{name}-{key12}"}', 'publish: {tag: "{name}-{sha}"}', "publish:", "publish.tag",
     "template field '{sha}' does not exist", "fields: name, key, key12, commit, commit12, platform"),
    ("template-typo", "L", 'publish: {tag: "{name}-{key12}"}', 'publish: {tag: "{name}-{key13}"}', "publish:", "publish.tag",
     "template field '{key13}' does not exist", "did you mean '{key12}'?"),
    ("template-positional", "L", 'publish: {tag: "{name}-{key12}"}', 'publish: {tag: "{name}-{}"}', "publish:", "publish.tag", "template field '{}' does not exist", ""),
    ("template-unbalanced", "L", 'publish: {tag: "{name}-{key12}"}', 'publish: {tag: "{name-{key12}"}', "publish:", "publish.tag", "bad template", "{field}"),
    ("template-bad-chars", "L", 'publish: {tag: "{name}-{key12}"}', 'publish: {tag: "{name} {key12}"}', "publish:", "publish.tag", "characters a git tag cannot hold", ""),
    ("template-trailing-newline", "L", 'publish: {tag: "{name}-{key12}"}', 'publish: {tag: "{name}-{key12}\\n"}', "publish:", "publish.tag",
     "characters a git tag cannot hold", ""),
    ("template-without-key", "L", 'publish: {tag: "{name}-{key12}"}', 'publish: {tag: "{name}-{commit12}"}', "publish:", "publish.tag",
     "template '{name}-{commit12}' does not end with {key} or {key12}", "one release per cache key"),
    ("cmake-build-type", "L", "  GGML_NATIVE: OFF", "  CMAKE_BUILD_TYPE: Debug", "CMAKE_BUILD_TYPE", "cmake.CMAKE_BUILD_TYPE",
     "CMAKE_BUILD_TYPE is set by llamabundle and cannot be set in cmake:", "remove it"),
    ("cmake-ggml-cuda", "L", "  GGML_NATIVE: OFF", "  GGML_CUDA: ON", "GGML_CUDA", "cmake.GGML_CUDA", "GGML_CUDA is set by llamabundle", "remove it"),
    ("cmake-cuda-archs", "W", "LLAMA_USE_PREBUILT_UI: OFF}", 'LLAMA_USE_PREBUILT_UI: OFF, CMAKE_CUDA_ARCHITECTURES: "86"}', "CMAKE_CUDA_ARCHITECTURES", "cmake.CMAKE_CUDA_ARCHITECTURES",
     "CMAKE_CUDA_ARCHITECTURES is set by llamabundle", "remove it"),
    ("cmake-toolkit-root", "W", "LLAMA_USE_PREBUILT_UI: OFF}", "LLAMA_USE_PREBUILT_UI: OFF, CUDAToolkit_ROOT: /opt/cuda}", "CUDAToolkit_ROOT", "cmake.CUDAToolkit_ROOT",
     "CUDAToolkit_ROOT is set by llamabundle", "remove it"),
    ("cmake-bad-name", "L", "  GGML_NATIVE: OFF", "  GGML-NATIVE: OFF", "GGML-NATIVE", "cmake.GGML-NATIVE", "'GGML-NATIVE' is not a CMake variable name", ""),
    ("cmake-float", "L", "  GGML_NATIVE: OFF", "  GGML_NATIVE: 1.5", "GGML_NATIVE", "cmake.GGML_NATIVE", "expected ON/OFF or a string, got 1.5", ""),
    ("cmake-null", "L", "  GGML_NATIVE: OFF", "  GGML_NATIVE:", "GGML_NATIVE", "cmake.GGML_NATIVE", "expected ON/OFF or a string, got None", ""),
    ("cuda-backend-no-section", "L", "backends: [cpu]", "backends: [cpu, cuda]", "backends:", "backends", "no cuda: section", "add cuda:"),
    ("cuda-section-no-backend", "W", "backends: [cpu, cuda, rpc]", "backends: [cpu, rpc]", "cuda:", "cuda", "a cuda: section without the cuda backend", "add cuda to backends"),
    ("cpu-missing", "W", "backends: [cpu, cuda, rpc]", "backends: [cuda, rpc]", "backends:", "backends", "'cpu' is required", "add cpu"),
    ("backend-twice", "L", "backends: [cpu]", "backends: [cpu, cpu]", "backends:", "backends", "a backend is listed twice", ""),
    ("backend-typo", "W", "backends: [cpu, cuda, rpc]", "backends: [cpu, cudaa, rpc]", "backends:", "backends[1]", "'cudaa' is not one of cpu, cuda", "did you mean 'cuda'?"),
    ("compiler-msvc-on-linux", "L", 'compiler: gcc, version: "=12.2.0"', "compiler: msvc", "toolchain:", "toolchain.compiler", "compiler 'msvc' cannot target linux-x86_64", "use one of: gcc, clang"),
    ("compiler-gcc-on-windows", "W", "compiler: msvc, msvc_version: \"[17.0,18.0)\", toolset: \"14.44.35207\"", "compiler: gcc", "toolchain:", "toolchain.compiler",
     "compiler 'gcc' cannot target windows-x86_64", "use one of: msvc, clang, mingw"),
    ("compiler-typo", "L", "compiler: gcc", "compiler: gccc", "toolchain:", "toolchain.compiler", "'gccc' is not one of gcc, clang, msvc, mingw", "did you mean 'gcc'?"),
    ("msvc-version-on-gcc", "L", "compiler: gcc", 'compiler: clang, msvc_version: "17"', "toolchain:", "toolchain.msvc_version", "msvc_version is only for compiler: msvc", ""),
    ("msvc-version-bad", "W", '"[17.0,18.0)"', '"17.0-18.0"', "toolchain:", "toolchain.msvc_version", "'17.0-18.0' is not valid", ""),
    ("cuda-component-unknown", "W", "cuda_nvcc,", "cuda_nvccc,", "components:", "cuda.components[0]", "'cuda_nvccc' is not a component of CUDA 12.8.1", "did you mean 'cuda_nvcc'?"),
    ("cuda-component-twice", "W", "cuda_cccl]", "cuda_cccl, cuda_nvcc]", "components:", "cuda.components", "a component is listed twice", ""),
    ("cuda-components-empty", "W", "components: [cuda_nvcc, cuda_cudart, libcublas, libnvjitlink, cuda_nvrtc, libnvfatbin, cuda_cccl]", "components: []",
     "components:", "cuda.components", "the component list is empty", ""),
    ("cuda-toolkit-unknown", "W", "toolkit: 12.8.1", "toolkit: 12.9.0", "toolkit:", "cuda.toolkit", "CUDA toolkit 12.9.0 is not known", "use one of: 12.8.1, 13.0.1, 13.0.2"),
    ("cuda-toolkit-pattern", "W", "toolkit: 12.8.1", 'toolkit: "12.8"', "toolkit:", "cuda.toolkit", "'12.8' is not valid", ""),
    ("cuda-source-unknown", "W", "source: redist ", "source: conda ", "source:", "cuda.source", "'conda' is not one of redist, installer, pypi, system", ""),
    ("openmp-typo", "L", "runtime: {openmp: auto}", "runtime: {openmp: libgomp}", "runtime:", "runtime.openmp", "'libgomp' is not one of auto, vcomp, libomp, none", ""),
    ("targets-empty", "L", "targets: [llama-server]", "targets: []", "targets:", "targets", "no targets", "llama-server"),
    ("target-bad", "L", "targets: [llama-server]", 'targets: ["llama server"]', "targets:", "targets[0]", "'llama server' is not valid", ""),
    ("key-not-string", "L", "targets: [llama-server]", "targets: [llama-server]\n1: x", "1: x", "", "keys must be strings, got 1", ""),
    ("explicit-tag", "L", "name: linux-x86_64-cpu", "name: !foo linux-x86_64-cpu", "name:", "name", "could not determine a constructor for the tag '!foo'", "without YAML tags"),
    ("explicit-int-tag", "L", "recipe: 1", "recipe: !!int one", "recipe:", "recipe", "cannot read the value 'one'", "without YAML tags"),
    ("impossible-date", "L", "name: linux-x86_64-cpu", "name: 2024-13-45", "name:", "name", "cannot read the value '2024-13-45'", ""),
    ("alias", "L", "backends: [cpu]", "backends: &b [cpu]\ntargets_: *b", "targets_", "", "YAML aliases (*b) are not allowed in recipes", "write the values out in full"),
    ("merge-key", "L", "runtime: {openmp: auto}", "x: &x {openmp: auto}\nruntime: {<<: *x}", "runtime:", "", "YAML aliases (*x) are not allowed", ""),
    ("unclosed-bracket", "L", "backends: [cpu]", "backends: [cpu", "toolchain:", "", "malformed YAML: expected ',' or ']'", "fix the YAML syntax"),
    ("bad-indent", "L", "  commit: ", "    commit: ", "  sources:", "", "malformed YAML", "fix the YAML syntax"),
]


@pytest.mark.parametrize(("base", "old", "new", "needle", "path", "what", "fix"),
                         [pytest.param(*c[1:], id=c[0]) for c in BROKEN])
def test_broken_recipe(base: str, old: str, new: str, needle: str, path: str, what: str, fix: str) -> None:
    text, file = BASES[base]
    broken = edit(text, old, new)
    err = fails(broken, file=file)
    line = line_of(broken, needle)
    if path:
        got = where(err)
        assert (got["file"], int(got["line"]), got["path"]) == (file, line, path), err.what
    else:  # YAML-level problems: no key path, but file and line
        assert err.what.startswith(f"{file}:{line}:"), err.what
    assert what in err.what
    assert fix in err.fix


def test_duplicate_key_names_both_lines() -> None:
    text = edit(LINUX, "runtime: {openmp: auto}", "runtime: {openmp: auto}\nruntime: {openmp: none}")
    err = fails(text, file="dup.yaml")
    assert where(err)["line"] == str(line_of(text, "openmp: none"))
    assert f"first set on line {line_of(text, 'openmp: auto')}" in err.what


def test_arch_error_points_at_the_item_in_a_block_list() -> None:
    text = edit(WINDOWS, W_ARCHS, "archs:\n    - 75-virtual\n    - 86-real\n    - 86-realish\n    - 89-real")
    err = fails(text)
    got = where(err)
    assert (int(got["line"]), got["path"]) == (line_of(text, "86-realish"), "cuda.archs[2]"), err.what
    text = edit(WINDOWS, W_ARCHS, "archs:\n    - 75-virtual\n    - 86-real\n    - 89-real\n    - 86-real")
    err = fails(text)
    got = where(err)
    assert (int(got["line"]), got["path"]) == (line_of(text, "89-real") + 1, "cuda.archs[3]"), err.what
    assert "listed twice" in err.what


def test_malformed_yaml_why_says_what_was_open() -> None:
    err = fails(edit(LINUX, "backends: [cpu]", "backends: [cpu"))
    assert "flow sequence" in err.why


def test_top_level_not_a_mapping() -> None:
    err = fails("- recipe: 1\n- name: x\n", file="list.yaml")
    assert err.what.startswith("list.yaml:1:1:") and "must be a mapping" in err.what
    err = fails("just a string\n", file="s.yaml")
    assert "must be a mapping" in err.what


def test_multiple_documents() -> None:
    err = fails(LINUX + "---\n" + LINUX, file="two.yaml")
    assert err.what == "two.yaml: expected exactly one YAML document, found 2"
    assert "single YAML mapping" in err.fix


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"], ids=["empty", "newline", "comment"])
def test_empty_file(text: str) -> None:
    err = fails(text, file="empty.yaml")
    assert err.what.startswith("empty.yaml: expected exactly one YAML document")


def test_billion_laughs_is_refused() -> None:
    lines = ['l0: &l0 "lol"']
    for i in range(1, 10):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    bomb = "\n".join(lines) + "\n"
    err = fails(bomb, file="bomb.yaml")
    assert err.what.startswith("bomb.yaml:2:")  # the first alias
    assert "aliases" in err.what and "not allowed" in err.what


def test_billion_laughs_in_a_recipe_value() -> None:
    bomb = "".join(f"  - &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 10))
    text = edit(LINUX, "targets: [llama-server]", 'targets:\n  - &a0 "llama-server"\n' + bomb.rstrip("\n"))
    err = fails(text)
    assert "aliases" in err.what


# --------------------------------------------------------------------------------- load_recipe


def test_load_nonexistent_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError) as info:
        keys.load(missing)
    assert info.value.what == f"{missing}: no such recipe file"
    assert info.value.exit_code == 2 and info.value.fix


def test_load_directory(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as info:
        keys.load(tmp_path)
    assert info.value.what == f"{tmp_path}: not a regular file"


def test_load_non_utf8(tmp_path: Path) -> None:
    p = tmp_path / "latin1.yaml"
    p.write_bytes(LINUX.encode().replace(b"# llama.cpp for Linux", b"# llama.cpp f\xfcr Linux", 1))
    with pytest.raises(RecipeError) as info:
        keys.load(p)
    assert info.value.what == f"{p}: recipe is not UTF-8 text"
    assert "utf-8" in info.value.why.lower()


def test_load_too_large(tmp_path: Path) -> None:
    p = tmp_path / "big.yaml"
    p.write_text(LINUX + ("# padding\n" * (MAX_RECIPE_BYTES // 10 + 1)), encoding="utf-8")
    size = p.stat().st_size
    assert size > MAX_RECIPE_BYTES
    with pytest.raises(RecipeError) as info:
        keys.load(p)
    assert info.value.what == f"{p}: recipe is {size} bytes; the limit is {MAX_RECIPE_BYTES}"


def test_load_at_the_size_limit(tmp_path: Path) -> None:
    p = tmp_path / "limit.yaml"
    pad = MAX_RECIPE_BYTES - len(LINUX.encode())
    p.write_text(LINUX + "#" * (pad - 1) + "\n", encoding="utf-8")
    assert p.stat().st_size == MAX_RECIPE_BYTES
    assert keys.load(p).name == "linux-x86_64-cpu"


def test_load_error_names_the_path(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(edit(LINUX, "backends: [cpu]", "backend: [cpu]"), encoding="utf-8")
    with pytest.raises(RecipeError) as info:
        keys.load(p)
    assert info.value.what.startswith(f"{p}:12:1: backend: unknown key")


def test_load_utf8_bom(tmp_path: Path) -> None:
    p = tmp_path / "bom.yaml"
    p.write_bytes(b"\xef\xbb\xbf" + LINUX.encode())
    assert keys.load(p) == keys.load(LINUX_PATH)


# ------------------------------------------------------------------------------- cmake values


@pytest.mark.parametrize(("yaml_value", "expected"), [
    ("ON", "ON"), ("OFF", "OFF"), ("on", "ON"), ("off", "OFF"), ("On", "ON"), ("Off", "OFF"),
    ("true", "ON"), ("false", "OFF"), ("True", "ON"), ("FALSE", "OFF"), ("yes", "ON"), ("no", "OFF"),
    ('"ON"', "ON"), ("'OFF'", "OFF"), ('"true"', "true"),
    ("0", "0"), ("1", "1"), ("42", "42"), ("-3", "-3"), ("0x10", "16"),
    ("Release", "Release"), ('"86;89"', "86;89"), ("/opt/some/path", "/opt/some/path"),
])
def test_cmake_values_normalise(yaml_value: str, expected: str) -> None:
    r = keys.parse(edit(LINUX, "  GGML_NATIVE: OFF", f"  GGML_NATIVE: {yaml_value}"))
    value = r.cmake_options["GGML_NATIVE"]
    assert value == expected and type(value) is str


def test_cmake_options_are_sorted_and_typed() -> None:
    r = keys.parse(edit(edit(WINDOWS, "cmake: {GGML_BACKEND_DL: ON, GGML_CPU_ALL_VARIANTS: ON, GGML_NATIVE: OFF, LLAMA_USE_PREBUILT_UI: OFF}",
                               "cmake: {GGML_NATIVE: false, LLAMA_X: 3, GGML_BACKEND_DL: true, GGML_CPU_ALL_VARIANTS: yes}"),
                          "ui: build ", "ui: none "))  # (ui: build needs LLAMA_USE_PREBUILT_UI: OFF)
    assert r.cmake == (("GGML_BACKEND_DL", "ON"), ("GGML_CPU_ALL_VARIANTS", "ON"), ("GGML_NATIVE", "OFF"), ("LLAMA_X", "3"))


def test_cmake_may_be_absent_or_empty() -> None:
    text = edit(LINUX, "ui: build ", "ui: none ")  # (ui: build needs LLAMA_USE_PREBUILT_UI: OFF)
    start = text.index("cmake:\n")
    end = text.index("targets:")
    assert keys.parse(text[:start] + text[end:]).cmake == ()
    assert keys.parse(text[:start] + "cmake: {}\n" + text[end:]).cmake == ()


def test_defaults() -> None:
    text = edit(edit(LINUX, "runtime: {openmp: auto}\n", ""), 'publish: {tag: "{name}-{key12}"}\n', "")
    r = keys.parse(text)
    assert r.runtime.openmp == "auto" and r.publish.tag == "{name}-{key12}"
    w = keys.parse(edit(WINDOWS, "  source: redist                    # redist | installer | pypi | system\n", ""))
    assert w.cuda is not None and w.cuda.source == "redist"


# -------------------------------------------------------------------------------- JSON schema

REGENERATE = ("llamabundle/data/schemas/recipe.schema.json is out of date; regenerate it with:\n"
              "  python3 -c 'import json, llamabundle.recipe.schema as r; "
              "open(\"llamabundle/data/schemas/recipe.schema.json\", \"w\").write(json.dumps(r.json_schema(), indent=2, sort_keys=True) + \"\\n\")'")


def test_schema_file_is_current() -> None:
    committed = SCHEMA_FILE.read_text(encoding="utf-8")
    assert json.loads(committed) == json_schema(), REGENERATE
    assert committed == json.dumps(json_schema(), indent=2, sort_keys=True) + "\n", REGENERATE


def test_schema_is_valid_draft_2020_12() -> None:
    jsonschema.Draft202012Validator.check_schema(json_schema())


@pytest.mark.parametrize("path", [LINUX_PATH, WINDOWS_PATH], ids=["linux", "windows"])
def test_shipped_recipes_validate_against_schema(path: Path) -> None:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(path.read_text(encoding="utf-8")))


@pytest.mark.parametrize(("base", "old", "new"), [
    ("L", "backends: [cpu]", "backend: [cpu]"),
    ("L", "  commit: ", "  comit: "),
    ("W", "  source: redist", "  sourse: redist"),
    ("L", "recipe: 1", "recipe: 2"),
    ("L", COMMIT, COMMIT.upper()),
    ("W", "86-real,", "86-realish,"),
    ("L", "- github:", "- gihub:"),
    ("L", "platform: linux-x86_64", "platform: linux-x86-64"),
], ids=["unknown-key", "unknown-nested-key", "unknown-cuda-key", "version", "commit", "arch", "source-kind", "platform"])
def test_schema_rejects_broken_recipe(base: str, old: str, new: str) -> None:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(edit(BASES[base][0], old, new)))
