"""BuildPlan is pure: the same recipe and paths give the same commands, for any target platform."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llamabundle import keys, proc
from llamabundle.build import _NINJA_PROGRESS, MEMORY_PROGRAM, PROBE_PROGRAM, BuildTools, backend_targets, plan_build
from llamabundle.errors import BuildError
from llamabundle.log import Log
from llamabundle.recipe import NO_HOST, HostFacts, ToolFound

REPO = Path(__file__).resolve().parents[2]
LINUX = keys.load(REPO / "recipes" / "linux-x86_64-cpu.yaml")
WINDOWS = keys.load(REPO / "recipes" / "windows-x86_64-cuda12.8.yaml")
TOOLS = BuildTools(cmake="/opt/cmake", ninja="/opt/ninja")
X86_VARIANTS = ["x64", "sse42", "sandybridge", "ivybridge", "piledriver", "haswell", "skylakex", "cannonlake",
                "cascadelake", "icelake", "cooperlake", "zen4", "alderlake", "sapphirerapids"]


def _plan(recipe, tools=TOOLS, jobs=None):  # type: ignore[no-untyped-def]
    return plan_build(recipe, NO_HOST, source_dir=Path("/src"), build_dir=Path("/b"), tools=tools, jobs=jobs)


def _defs(plan) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return dict(a[2:].split("=", 1) for a in plan.configure if a.startswith("-D"))


def test_linux_cpu_plan() -> None:
    plan = _plan(LINUX)
    assert plan.configure[:7] == ("/opt/cmake", "-S", "/src", "-B", "/b", "-G", "Ninja")
    defs = _defs(plan)
    assert defs["CMAKE_MAKE_PROGRAM"] == "/opt/ninja"
    assert defs["CMAKE_BUILD_TYPE"] == "Release"
    assert defs["GGML_BACKEND_DL"] == "ON" and defs["GGML_CPU_ALL_VARIANTS"] == "ON" and defs["GGML_NATIVE"] == "OFF"
    assert defs["GGML_CUDA"] == "OFF"
    assert defs["LLAMA_BUILD_COMMIT"] == LINUX.llama_cpp.commit[:8]
    assert defs["LLAMA_BUILD_NUMBER"] == "11312"  # data/llama_builds.json: --version prints the real build
    # where the source and the build tree lie is mapped out of the binaries (reproducible builds)
    assert defs["CMAKE_C_FLAGS"] == defs["CMAKE_CXX_FLAGS"] == "-ffile-prefix-map=/src=/llama.cpp -ffile-prefix-map=/b=/build"
    assert defs["CMAKE_BUILD_RPATH_USE_ORIGIN"] == "ON"
    assert (defs["CMAKE_C_COMPILER"], defs["CMAKE_CXX_COMPILER"]) == ("gcc", "g++")
    assert "CMAKE_CUDA_ARCHITECTURES" not in defs and "CMAKE_C_COMPILER_LAUNCHER" not in defs
    assert plan.targets == ("llama-server", MEMORY_PROGRAM, PROBE_PROGRAM, *(f"ggml-cpu-{v}" for v in X86_VARIANTS))
    assert plan.build == ("/opt/cmake", "--build", "/b", "--target", *plan.targets)
    assert plan.programs == ("llama-server", MEMORY_PROGRAM, PROBE_PROGRAM)
    assert plan.backends == tuple(f"libggml-cpu-{v}.so" for v in X86_VARIANTS)
    assert plan.output_dir == Path("/b/bin")


def test_windows_cuda_plan_is_made_on_linux() -> None:
    plan = _plan(WINDOWS, jobs=8)
    defs = _defs(plan)
    assert defs["GGML_CUDA"] == "ON"
    assert defs["CMAKE_CUDA_ARCHITECTURES"] == "50-virtual;61-virtual;70-virtual;75-virtual;80-virtual;86-real;89-real;120a-real"
    assert (defs["CMAKE_C_COMPILER"], defs["CMAKE_CXX_COMPILER"]) == ("cl", "cl")
    # MSVC builds 9 of the 14 x86 variants (no F16C-only, BF16 or AMX variants).
    assert backend_targets(WINDOWS) == (*(f"ggml-cpu-{v}" for v in
                                          ["x64", "sse42", "sandybridge", "haswell", "skylakex", "cannonlake",
                                           "cascadelake", "icelake", "alderlake"]), "ggml-cuda", "ggml-rpc")
    assert plan.programs == ("llama-server.exe", "ggml-rpc-server.exe", f"{MEMORY_PROGRAM}.exe", f"{PROBE_PROGRAM}.exe")
    assert plan.backends[-2:] == ("ggml-cuda.dll", "ggml-rpc.dll") and all(b.endswith(".dll") for b in plan.backends)
    assert plan.build[-2:] == ("--parallel", "8")
    assert defs["GGML_CUDA_COMPRESSION_MODE"] == "size"
    assert "GGML_CUDA_COMPRESSION_MODE" not in _defs(_plan(LINUX))
    assert "CMAKE_C_FLAGS" not in defs and "CMAKE_CUDA_FLAGS" not in defs  # MSVC: no prefix maps claimed


def test_cuda_host_compiler_gets_the_prefix_maps_too() -> None:
    cuda = keys.load(REPO / "recipes" / "linux-x86_64-cuda13.0.yaml")
    defs = _defs(_plan(cuda))
    # and nvcc's own path- and pid-dependent names fixed (backends/cuda: measured with nvcc 13.0.88), and gcc,
    # preprocessing for nvcc, keeps the toolkit's header paths as given (not resolved through the fixed links)
    assert defs["CMAKE_CUDA_FLAGS"] == ("-Xcompiler=-ffile-prefix-map=/src=/llama.cpp -Xcompiler=-ffile-prefix-map=/b=/build "
                                        "-objtemp -Xcudafe=--orig_src_path_name=/llama.cpp "
                                        "-Xcompiler=-fno-canonical-system-headers")


def test_the_toolkit_location_is_mapped_out_too() -> None:
    """CUB's asserts name its headers under the toolkit root: a toolkit in another cache directory must not
    change the bytes."""
    cuda = keys.load(REPO / "recipes" / "linux-x86_64-cuda13.0.yaml")
    defs = _defs(plan_build(cuda, NO_HOST, source_dir=Path("/src"), build_dir=Path("/b"), tools=TOOLS,
                            toolkit_roots={"cuda": Path("/cache/toolkits/cuda-13.0.2")}))
    assert "-Xcompiler=-ffile-prefix-map=/cache/toolkits/cuda-13.0.2=/cuda" in defs["CMAKE_CUDA_FLAGS"].split()
    assert "-objtemp" in defs["CMAKE_CUDA_FLAGS"].split()


def test_a_toolkits_map_goes_only_to_its_backends_targets() -> None:
    """The C and C++ compiles outside a backend's targets are those of a recipe without that backend (the same
    flags as the CPU recipe's, so that one compiler cache serves both); its own targets get the toolkit's map
    through the project include, which stops the configure where such a target is missing."""
    cpu = _defs(_plan(LINUX))
    for name, recipe, target in (("cuda", "linux-x86_64-cuda13.0", "ggml-cuda"), ("vulkan", "linux-x86_64-vulkan", "ggml-vulkan")):
        r = keys.load(REPO / "recipes" / f"{recipe}.yaml")
        host = HostFacts(tools={"vulkan": ToolFound(path="/G/glslc", version="2023.2-1",
                                                    versions=(("shaderc", "2023.2-1"), ("spirv_tools", "2022.4+1.3.236.0-1"),
                                                              ("glslang", "11.13.0-1")), features=())})
        plan = plan_build(r, host, source_dir=Path("/src"), build_dir=Path("/b"), tools=TOOLS,
                          toolkit_roots={name: Path(f"/cache/toolkits/{name}")})
        defs = _defs(plan)
        for lang in ("C", "CXX"):
            assert defs[f"CMAKE_{lang}_FLAGS"] == cpu[f"CMAKE_{lang}_FLAGS"], (name, lang)
            assert "/cache/toolkits" not in defs[f"CMAKE_{lang}_FLAGS"]
        include = dict(plan.files)["/b/llamabundle-project.cmake"]
        flag = f"-ffile-prefix-map=/cache/toolkits/{name}=/{name}"
        assert f'foreach(_target {target})' in include
        assert f'target_compile_options(${{_target}} PRIVATE "$<$<COMPILE_LANGUAGE:C,CXX>:{flag}>")' in include
        assert "message(FATAL_ERROR" in include and "cmake_language(DEFER CALL" in include


def test_ccache_is_used_when_present() -> None:
    defs = _defs(_plan(LINUX, tools=BuildTools(cmake="c", ninja="n", compiler_cache="/usr/bin/ccache")))
    assert defs["CMAKE_C_COMPILER_LAUNCHER"] == defs["CMAKE_CXX_COMPILER_LAUNCHER"] == "/usr/bin/ccache"
    assert "CMAKE_CUDA_COMPILER_LAUNCHER" not in defs
    wdefs = _defs(_plan(WINDOWS, tools=BuildTools(cmake="c", ninja="n", compiler_cache="/usr/bin/ccache")))
    assert wdefs["CMAKE_CUDA_COMPILER_LAUNCHER"] == "/usr/bin/ccache"


def test_plan_is_pure_and_serialisable() -> None:
    assert _plan(LINUX) == _plan(LINUX)
    js = _plan(LINUX).to_json()
    assert js["build_dir"] == "/b" and js["targets"][0] == "llama-server"


def test_variants_off_builds_the_single_cpu_backend(tmp_path: Path) -> None:
    text = (REPO / "recipes" / "linux-x86_64-cpu.yaml").read_text().replace("GGML_CPU_ALL_VARIANTS: ON", "GGML_CPU_ALL_VARIANTS: OFF")
    (tmp_path / "r.yaml").write_text(text)
    plan = _plan(keys.load(tmp_path / "r.yaml"))
    assert plan.targets == ("llama-server", MEMORY_PROGRAM, PROBE_PROGRAM, "ggml-cpu")
    assert plan.backends == ("libggml-cpu.so",)


def test_ninja_progress_lines() -> None:
    m = _NINJA_PROGRESS.match("[12/459] Building CXX object src/x.o")
    assert m and (m.group(1), m.group(2)) == ("12", "459")
    assert _NINJA_PROGRESS.match("FAILED: src/x.o") is None


def test_failed_command_reports_the_last_50_lines_and_the_log(tmp_path: Path) -> None:
    log_path = tmp_path / "build.log"
    script = "import sys\nfor i in range(120): print(f'line {i}')\nsys.exit(3)"
    with pytest.raises(BuildError) as e:
        proc.run([sys.executable, "-c", script], log=Log(quiet=True), error=BuildError, what="the build failed",
                 log_path=log_path, fix="read the log")
    err = e.value
    assert err.exit_code == 4
    assert "exit code 3" in err.what
    shown = [ln for ln in err.details.splitlines() if ln.startswith("line ")]
    assert shown == [f"line {i}" for i in range(70, 120)]
    assert str(log_path) in err.details
    assert log_path.read_text().count("\n") == 120  # the full output is in the log
