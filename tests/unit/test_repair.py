"""`llamabundle bundle` refuses a build directory that is not the recipe's before it collects anything: not a
CMake build, another commit, another compiler family, a CUDA build of another nvcc (or none), a toolkit of
another version, missing targets, an --out that exists. Each is one clear error (exit 2 or 3) and leaves
nothing behind. (The bundles it makes are shown end to end in tests/e2e: test_cuda_bundle.py on Linux,
test_windows_cuda_bundle.py for Windows.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.clirun import run

REPO = Path(__file__).resolve().parents[2]
LINUX_CPU = REPO / "recipes" / "linux-x86_64-cpu.yaml"
LINUX_CUDA = REPO / "recipes" / "linux-x86_64-cuda13.0.yaml"
COMMIT = "0c1e5709"


def build_tree(tmp: Path, *, compiler: str = "GNU 12.2.0", commit: str = COMMIT, nvcc: str | None = None,
               programs: tuple[str, ...] = ("llama-server",), compiler_path: str = "") -> Path:
    """A build directory with the records CMake and llama.cpp's build-info write (its binaries are not read
    before the checks under test)."""
    src, build = tmp / "src", tmp / "build"
    src.mkdir(parents=True)
    (src / "LICENSE").write_text("MIT\n")
    (build / "CMakeFiles" / "3.25.1").mkdir(parents=True)
    (build / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={src}\nCMAKE_COMMAND:INTERNAL=/usr/bin/cmake\n")
    family, version = compiler.rsplit(" ", 1)
    (build / "CMakeFiles" / "3.25.1" / "CMakeCXXCompiler.cmake").write_text(
        f'set(CMAKE_CXX_COMPILER "{compiler_path}")\n' * bool(compiler_path) +
        f'set(CMAKE_CXX_COMPILER_ID "{family}")\nset(CMAKE_CXX_COMPILER_VERSION "{version}")\n')
    if nvcc:
        (build / "CMakeFiles" / "3.25.1" / "CMakeCUDACompiler.cmake").write_text(f'set(CMAKE_CUDA_COMPILER_VERSION "{nvcc}")\n')
    (build / "common").mkdir()
    (build / "common" / "build-info.cpp").write_text(f'char const *LLAMA_COMMIT = "{commit}";\n')
    (build / "bin").mkdir()
    for p in programs:
        (build / "bin" / p).write_bytes(b"\x7fELF")
    return build


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def refused(capsys: pytest.CaptureFixture[str], code: int, text: str, *argv: object) -> None:
    got, out, err = run(capsys, "bundle", *argv)
    assert got == code, err
    assert text in err and "Traceback" not in err, err


def test_another_commit_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build = build_tree(tmp_path, commit="deadbeef")
    refused(capsys, 2, "is a build of llama.cpp deadbeef, the recipe pins 0c1e57098bba", LINUX_CPU, build, "--out", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_another_compiler_family_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build = build_tree(tmp_path, compiler="Clang 18.1.3")
    refused(capsys, 3, "was built with Clang 18.1.3, not gcc", LINUX_CPU, build, "--out", tmp_path / "o")


WINDOWS_CUDA = REPO / "recipes" / "windows-x86_64-cuda12.8.yaml"
VC = "C:/Program Files/Microsoft Visual Studio/2022/Enterprise/VC/Tools/MSVC"


@pytest.mark.parametrize(("compiler", "path", "named"), [
    ("MSVC 19.50.35717.0", "", "MSVC 19.50.35717.0"),  # Visual Studio 2026, which CUDA 12.8 refuses
    ("MSVC 19.50.35717.0", f"{VC}/14.50.35717/bin/Hostx64/x64/cl.exe", "toolset 14.50.35717"),
    ("MSVC 19.44.35211.0", f"{VC}/14.44.35211/bin/Hostx64/x64/cl.exe", "toolset 14.44.35211"),  # same cl series, another toolset
], ids=["vs2026", "vs2026-path", "other-14.44"])
def test_an_msvc_build_outside_the_toolset_pin_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          compiler: str, path: str, named: str) -> None:
    build = build_tree(tmp_path, compiler=compiler, compiler_path=path, programs=("llama-server.exe",))
    refused(capsys, 3, f"was built with MSVC {named}", WINDOWS_CUDA, build, "--out", tmp_path / "o")
    refused(capsys, 3, "outside the recipe's toolchain.toolset 14.44.35207 (cl 19.44)", WINDOWS_CUDA, build, "--out", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_an_msvc_build_of_the_pinned_toolset_passes_the_pin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The record of the pinned toolset gets past the check (to the next one: this tree has no CUDA build)."""
    build = build_tree(tmp_path, compiler="MSVC 19.44.35207.1", compiler_path=f"{VC}/14.44.35207/bin/Hostx64/x64/cl.exe",
                       programs=("llama-server.exe",))
    got, _, err = run(capsys, "bundle", WINDOWS_CUDA, build, "--out", tmp_path / "o")
    assert got != 0 and "toolchain.toolset" not in err and "Traceback" not in err, err


def test_missing_targets_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build = build_tree(tmp_path, programs=())
    refused(capsys, 2, "lacks llama-server", LINUX_CPU, build, "--out", tmp_path / "o")


def test_an_out_zip_that_exists_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build = build_tree(tmp_path)
    (tmp_path / "x.zip").write_bytes(b"keep")
    refused(capsys, 2, "exists", LINUX_CPU, build, "--out", tmp_path / "x.zip")
    assert (tmp_path / "x.zip").read_bytes() == b"keep"


def test_a_cuda_recipe_needs_a_cuda_build_of_its_nvcc_and_its_toolkit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tk = tmp_path / "tk"
    (tk / "lib").mkdir(parents=True)
    refused(capsys, 2, "--toolkit-root is needed", LINUX_CUDA, build_tree(tmp_path / "a", nvcc="13.0.88"), "--out",
            tmp_path / "o")
    refused(capsys, 2, "did not compile CUDA", LINUX_CUDA, build_tree(tmp_path / "b"), "--out", tmp_path / "o",
            "--toolkit-root", tk)
    refused(capsys, 3, "was compiled by nvcc 12.8.93, the recipe pins CUDA 13.0.2 (nvcc 13.0.88)", LINUX_CUDA,
            build_tree(tmp_path / "c", nvcc="12.8.93"), "--out", tmp_path / "o", "--toolkit-root", tk)
    (tk / "version.json").write_text(json.dumps({"cuda": {"name": "CUDA SDK", "version": "12.8.1"}}))
    refused(capsys, 2, "is CUDA 12.8.1, the recipe pins 13.0.2", LINUX_CUDA, build_tree(tmp_path / "d", nvcc="13.0.88"),
            "--out", tmp_path / "o", "--toolkit-root", tk)
    assert not (tmp_path / "o").exists()


def test_the_web_ui_must_be_embedded_exactly_when_the_recipe_builds_it(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's generated tools/ui/ui.h says whether the build embedded the UI; the key holds ui:."""
    from llamabundle import keys
    from llamabundle.build import BuildTools, plan_build
    from llamabundle.recipe import NO_HOST

    build = build_tree(tmp_path)
    plan = plan_build(keys.load(LINUX_CPU), NO_HOST, source_dir=tmp_path / "src", build_dir=build,
                      tools=BuildTools(cmake="cmake", ninja="ninja"))
    for name in plan.programs + plan.backends:
        (plan.output_dir / name).write_bytes(b"\x7fELF")
    refused(capsys, 2, f"{build} embeds no web UI, the recipe says ui: build", LINUX_CPU, build, "--out", tmp_path / "o")
    (build / "tools" / "ui").mkdir(parents=True)
    (build / "tools" / "ui" / "ui.h").write_text("#pragma once\n#define LLAMA_UI_HAS_ASSETS 1\n")
    none = tmp_path / "none.yaml"
    none.write_text(LINUX_CPU.read_text(encoding="utf-8").replace("ui: build ", "ui: none "), encoding="utf-8")
    refused(capsys, 2, f"{build} embeds a web UI, the recipe says ui: none", none, build, "--out", tmp_path / "o")
    assert not (tmp_path / "o").exists()
