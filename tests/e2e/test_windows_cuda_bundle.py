"""The Windows CUDA bundle of the shipped recipe (windows-x86_64-cuda12.8), made by `llamabundle bundle` on
Linux from real Windows artefacts: NVIDIA's own CUDA 12.8 DLLs (the PyPI win_amd64 wheels, sha256-pinned
and cached across test runs in the e2e cache), a Visual Studio redist tree whose CRT and OpenMP DLLs are
x64 stand-ins built with mingw under their redist names, and a build output of PE files compiled with mingw
that import what an MSVC build of llama.cpp imports. The bundle holds exactly the DLLs a clean Windows
needs, with the NVRTC companions and the recipe's extra libraries; `verify --level static` passes, and
removing any one of them fails naming it; nvcuda.dll is a system dependency, never bundled."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from llamabundle import keys
from llamabundle.build import BuildTools, plan_build
from llamabundle.recipe import NO_HOST
from tests.e2e.conftest import REPO, run_cli

RECIPE = REPO / "recipes" / "windows-x86_64-cuda12.8.yaml"
CC = "x86_64-w64-mingw32-gcc-posix"
DLLTOOL = "x86_64-w64-mingw32-dlltool"
pytestmark = pytest.mark.skipif(not all(shutil.which(t) for t in (CC, DLLTOOL)),
                                reason=f"{CC} and {DLLTOOL} (mingw-w64) are needed to build real PE files")

# NVIDIA's Windows DLLs of CUDA 12.8 (the versions of the 12.8.1 redist manifest), as PyPI serves them
WHEELS = {
    "nvidia_cuda_runtime_cu12-12.8.90-py3-none-win_amd64.whl": "c0c6027f01505bfed6c3b21ec546f69c687689aad5f1a377554bc6ca4aa993a8",
    "nvidia_cublas_cu12-12.8.4.1-py3-none-win_amd64.whl": "47e9b82132fa8d2b4944e708049229601448aaad7e6f296f630f2d1a32de35af",
    "nvidia_cuda_nvrtc_cu12-12.8.93-py3-none-win_amd64.whl": "7a4b6b2904850fe78e0bd179c4b655c404d4bb799ef03ddc60804247099ae909",
    "nvidia_nvjitlink_cu12-12.8.93-py3-none-win_amd64.whl": "bd93fbeeee850917903583587f4fc3a4eafa022e34572251368238ab5e6bd67f",
    "nvidia_nvfatbin_cu12-12.8.90-py3-none-win_amd64.whl": "79caf14669f67cae8391b0379654985b725ae0236aeb5d2875a1aadf2c12508d",
}
REDIST = "VC/Redist/MSVC/14.44.35112"
CRT = ("vcruntime140.dll", "vcruntime140_1.dll", "msvcp140.dll", "msvcp140_1.dll", "concrt140.dll")
# what the bundle must carry beyond the build's own files, and why
CUDA_DLLS = {"cudart64_12.dll": "imported by ggml-cuda.dll", "cublas64_12.dll": "imported by ggml-cuda.dll",
             "cublasLt64_12.dll": "imported by cublas64_12.dll",
             "nvrtc64_120_0.dll": "loaded by cublasLt64_12.dll at run time (latent companion)",
             "nvrtc-builtins64_128.dll": "loaded by nvrtc64_120_0.dll at run time (required companion)",
             "nvJitLink_120_0.dll": "asked for by the recipe (cuda.libraries)",
             "nvfatbin_120_0.dll": "asked for by the recipe (cuda.libraries)"}
MSVC_DLLS = {"vcruntime140.dll", "vcruntime140_1.dll", "msvcp140.dll", "vcomp140.dll"}


def fatbin_section(archs: list[str]) -> str:
    """C for a `.nv_fatb` section holding a fat binary container of the recipe's archs, laid out as nvcc
    writes it (llamabundle.backends.cuda.fatbin reads it; the Linux tests check that reader against
    cuobjdump on nvcc's own output). nvcc for Windows cannot run here: this stands in for its output."""
    entries = b""
    for arch in archs:
        num, kind = arch.split("-")
        sm = int(num.rstrip("af"))
        flags = (1 << 20) if num.endswith("a") else 0
        payload = f"code for sm_{num}".encode().ljust(32, b"\0")
        head = bytearray(64)
        struct.pack_into("<HHIQ", head, 0, 1 if kind == "virtual" else 2, 0x101, len(head), len(payload))
        struct.pack_into("<I", head, 28, sm)
        struct.pack_into("<Q", head, 40, flags)
        entries += bytes(head) + payload
    blob = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(entries)) + entries
    return ('__attribute__((section(".nv_fatb"), used)) const unsigned char fatbin[] = {'
            + ",".join(str(b) for b in blob) + "};\n")


def _run(*argv: str | Path, cwd: Path) -> None:
    subprocess.run([str(a) for a in argv], cwd=cwd, check=True, capture_output=True, env={**os.environ, "TMPDIR": str(cwd)})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="session")
def wheels(e2e_env: dict[str, str]) -> Path:
    """The wheels, downloaded once into the e2e cache (pip, from PyPI) and checked against their pins."""
    d = Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]) / "test-wheels"
    d.mkdir(parents=True, exist_ok=True)
    want = [n for n, sha in WHEELS.items() if not ((d / n).is_file() and _sha256(d / n) == sha)]
    if want:
        specs = ["==".join(n.split("-")[:2]).replace("_", "-") for n in want]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", "win_amd64", "--python-version", "3.11", "-d", str(d), *specs],
                       check=True, capture_output=True, timeout=1800)
    for name, sha in WHEELS.items():
        assert _sha256(d / name) == sha, f"{name}: not the pinned wheel"
    return d


@pytest.fixture(scope="session")
def windows_tree(wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The toolkit's bin/ (NVIDIA's DLLs), the VS redist (stand-ins), and a build directory of PE files."""
    root = tmp_path_factory.mktemp("win")
    tk = root / "cuda"
    (tk / "bin").mkdir(parents=True)
    for name in WHEELS:
        with zipfile.ZipFile(wheels / name) as z:
            for info in z.infolist():
                if info.filename.endswith(".dll") and "/bin/" in info.filename:
                    with z.open(info) as src, open(tk / "bin" / Path(info.filename).name, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                elif info.filename.endswith("dist-info/License.txt") and "cuda_runtime" in name:
                    (tk / "EULA.txt").write_bytes(z.read(info))  # NVIDIA's licence text, as the redist has it
    src = root / "src"
    src.mkdir()
    (src / "LICENSE").write_text("MIT License\n\nCopyright (c) 2023-2026 The ggml authors\n")
    # import libraries of DLLs that need not exist for the link: the import tables name them all the same
    defs = {"vcruntime140": ["__vc_x"], "vcruntime140_1": ["__vc1_x"], "msvcp140": ["__std_x"],
            "vcomp140": ["omp_get_max_threads"], "cudart64_12": ["cudaGetDeviceCount"], "cublas64_12": ["cublasCreate_v2"],
            "nvcuda": ["cuInit"]}
    for lib, exports in defs.items():
        (src / f"{lib}.def").write_text(f"LIBRARY {lib}.dll\nEXPORTS\n" + "".join(f"{e}\n" for e in exports))
        _run(DLLTOOL, "-d", f"{lib}.def", "-l", f"lib{lib}.a", cwd=src)
    # the VS redist: x64 stand-ins under the redist names; onecore\ copies that must never be taken
    redist = root / "vs" / REDIST
    for sub, names in {"x64/Microsoft.VC143.CRT": CRT, "x64/Microsoft.VC143.OpenMP": ("vcomp140.dll",),
                       "onecore/x64/Microsoft.VC143.CRT": CRT, "onecore/x64/Microsoft.VC143.OpenMP": ("vcomp140.dll",)}.items():
        (redist / sub).mkdir(parents=True)
        for n in names:
            (src / "stand_in.c").write_text(f'__declspec(dllexport) const char *which(void) {{ return "{sub}/{n}"; }}\n')
            _run(CC, "-shared", "-o", redist / sub / n, "stand_in.c", cwd=src)
    # the build output: what MSVC builds of llama.cpp import
    build = root / "build"
    out = build / "bin"
    out.mkdir(parents=True)
    crt = ["-lvcruntime140", "-lvcruntime140_1", "-lmsvcp140"]
    (src / "base.c").write_text("__declspec(dllexport) int ggml_base(void) { return 1; }\n")
    _run(CC, "-shared", "-o", out / "ggml-base.dll", "base.c", f"-Wl,--out-implib,{src / 'libggml-base.a'}", "-L.", *crt, cwd=src)
    (src / "ggml.c").write_text("int ggml_base(void);\n__declspec(dllexport) int ggml(void) { return ggml_base(); }\n")
    _run(CC, "-shared", "-o", out / "ggml.dll", "ggml.c", f"-Wl,--out-implib,{src / 'libggml.a'}", "-L.", "-lggml-base", *crt, cwd=src)
    (src / "llama.c").write_text("int ggml(void); int __std_x(void);\n__declspec(dllexport) int llama(void) { return ggml() + __std_x(); }\n")
    _run(CC, "-shared", "-o", out / "llama.dll", "llama.c", f"-Wl,--out-implib,{src / 'libllama.a'}", "-L.", "-lggml", *crt, cwd=src)
    (src / "server.c").write_text("int llama(void); int __vc_x(void); int __vc1_x(void);\n"
                                  "int main(void) { return llama() + __vc_x() + __vc1_x(); }\n")
    _run(CC, "-o", out / "llama-server.exe", "server.c", "-L.", "-lllama", "-lggml", "-lggml-base", *crt, cwd=src)
    (src / "cpu.c").write_text("int ggml_base(void); int omp_get_max_threads(void);\n"
                               "__declspec(dllexport) int cpu(void) { return ggml_base() + omp_get_max_threads(); }\n")
    (src / "cuda.c").write_text("int ggml_base(void); int cudaGetDeviceCount(int *n); int cublasCreate_v2(void *h); int cuInit(unsigned f);\n"
                                "__declspec(dllexport) int cuda(void) { int n; return ggml_base() + cudaGetDeviceCount(&n) "
                                "+ cublasCreate_v2(0) + cuInit(0); }\n")
    recipe = keys.load(RECIPE)
    assert recipe.cuda is not None
    (src / "cuda.c").write_text((src / "cuda.c").read_text() + fatbin_section(list(recipe.cuda.archs)))
    plan = plan_build(recipe, NO_HOST, source_dir=src, build_dir=build, tools=BuildTools(cmake="cmake", ninja="ninja"))
    (src / "rpc.c").write_text("#include <winsock2.h>\nint ggml_base(void);\n"
                               "__declspec(dllexport) int rpc(void) { WSADATA d; return ggml_base() + WSAStartup(0x202, &d); }\n")
    (src / "rpc-server.c").write_text("int ggml(void);\nint main(void) { return ggml(); }\n")
    _run(CC, "-o", out / "ggml-rpc-server.exe", "rpc-server.c", "-L.", "-lggml", "-lggml-base", *crt, cwd=src)
    for backend in plan.backends:
        if backend.startswith("ggml-cpu"):
            _run(CC, "-shared", "-o", out / backend, "cpu.c", "-L.", "-lggml-base", "-lvcomp140", *crt, cwd=src)
        elif backend == "ggml-rpc.dll":
            _run(CC, "-shared", "-o", out / backend, "rpc.c", "-L.", "-lggml-base", "-lws2_32", *crt, cwd=src)
        else:
            _run(CC, "-shared", "-o", out / backend, "cuda.c", "-L.", "-lggml-base", "-lcudart64_12", "-lcublas64_12",
                 "-lnvcuda", "-lvcruntime140", cwd=src)
    # what CMake and llama.cpp's build-info write, as an MSVC build of this commit has them
    (build / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={src}\nCMAKE_COMMAND:INTERNAL=C:/cmake/bin/cmake.exe\n")
    (build / "CMakeFiles" / "3.31.6").mkdir(parents=True)
    (build / "CMakeFiles" / "3.31.6" / "CMakeCXXCompiler.cmake").write_text(
        'set(CMAKE_CXX_COMPILER_ID "MSVC")\nset(CMAKE_CXX_COMPILER_VERSION "19.44.35207.1")\n')
    (build / "CMakeFiles" / "3.31.6" / "CMakeCUDACompiler.cmake").write_text('set(CMAKE_CUDA_COMPILER_VERSION "12.8.93")\n')
    (build / "common").mkdir()
    (build / "common" / "build-info.cpp").write_text('int LLAMA_BUILD_NUMBER = 0;\nchar const *LLAMA_COMMIT = "0c1e5709";\n')
    (build / "tools" / "ui").mkdir(parents=True)  # the recipe's ui: build, embedded as llama.cpp's ui-assets.cmake says
    (build / "tools" / "ui" / "ui.h").write_text("#pragma once\n#define LLAMA_UI_HAS_ASSETS 1\n")
    return {"toolkit": tk, "redist": redist, "build": build, "root": root}


def bundle(tree: dict[str, Path], out: Path, env: dict[str, str], *extra: str, recipe: Path = RECIPE) -> subprocess.CompletedProcess[str]:
    return run_cli("bundle", recipe, tree["build"], "--out", out, "--toolkit-root", tree["toolkit"],
                   "--msvc-redist", tree["redist"], *extra, env=env, timeout=1800)


@pytest.fixture(scope="session")
def made(windows_tree: dict[str, Path], e2e_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("winbundle") / "bundle"
    res = bundle(windows_tree, out, e2e_env, "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((out / "bundle.json").read_text())
    return {"out": out, "manifest": manifest, "files": {f["path"]: f for f in manifest["files"]}, "json": json.loads(res.stdout)}


def test_the_bundle_holds_exactly_the_dlls_a_clean_windows_needs(made: dict[str, Any]) -> None:
    files = made["files"]
    runtime = {n for n, f in files.items() if f["role"] == "runtime"}
    assert runtime == {"llama.dll", "ggml.dll", "ggml-base.dll"} | MSVC_DLLS | set(CUDA_DLLS)
    assert {n for n, f in files.items() if f["role"] == "exe"} == {"llama-server.exe", "ggml-rpc-server.exe"}
    assert "ggml-cuda.dll" in files and sum(n.startswith("ggml-cpu-") for n in files) == 9
    assert "nvcuda.dll" in made["manifest"]["system_deps"] and not any(n.lower() == "nvcuda.dll" for n in files)
    assert "nvrtc64_120_0.alt.dll" not in files and "nvblas64_12.dll" not in files  # in the toolkit, named by nothing
    for name, why in CUDA_DLLS.items():
        assert (files[name]["origin"], files[name]["why"]) == ("toolkit", why), name
    for name in MSVC_DLLS:
        assert files[name]["origin"] == "msvc-redist" and files[name]["why"].startswith("imported by "), name
    assert files["llama-server.exe"]["origin"] == "build" and files["llama-server.exe"]["why"].startswith("program")
    assert files["ggml-cuda.dll"]["why"] == "backend module: loaded by ggml at run time"
    licences = {n for n, f in files.items() if f["role"] == "license"}
    assert {"LICENSE", "LICENSE-CUDA.txt", "LICENSE-MSVC-REDIST.txt"} <= licences
    assert all(files[n]["origin"] and files[n]["why"] for n in licences)
    toolchain = made["manifest"]["toolchain"]  # what the build directory's CMake records say
    assert (toolchain["compiler"], toolchain["cmake"], toolchain["nvcc"]) == ("MSVC 19.44.35207.1", "3.31.6", "12.8.93")


def test_the_dlls_are_nvidias_and_the_redists_never_onecore(made: dict[str, Any], windows_tree: dict[str, Path]) -> None:
    out = made["out"]
    for name in CUDA_DLLS:
        assert (out / name).read_bytes() == (windows_tree["toolkit"] / "bin" / name).read_bytes(), name
    x64 = windows_tree["redist"] / "x64"
    assert (out / "vcruntime140.dll").read_bytes() == (x64 / "Microsoft.VC143.CRT" / "vcruntime140.dll").read_bytes()
    assert (out / "vcomp140.dll").read_bytes() == (x64 / "Microsoft.VC143.OpenMP" / "vcomp140.dll").read_bytes()
    onecore = windows_tree["redist"] / "onecore" / "x64" / "Microsoft.VC143.CRT" / "vcruntime140.dll"
    assert (out / "vcruntime140.dll").read_bytes() != onecore.read_bytes()


def test_verify_static_passes(made: dict[str, Any], e2e_env: dict[str, str]) -> None:
    res = run_cli("verify", made["out"], "--level", "static", "--json", env=e2e_env)
    assert res.returncode == 0, res.stderr
    levels = json.loads(res.stdout)["levels"]
    assert levels["companions"] == ("passed (cublasLt64_12.dll -> nvrtc64_120_0.dll; "
                                    "nvrtc64_120_0.dll -> nvrtc-builtins64_128.dll)")
    assert made["json"]["verify"]["levels"]["static"].startswith("passed")


@pytest.mark.parametrize("name", sorted(MSVC_DLLS | set(CUDA_DLLS) | {"ggml-base.dll"}))
def test_removing_any_one_fails_naming_it(made: dict[str, Any], e2e_env: dict[str, str], tmp_path: Path, name: str) -> None:
    copy = tmp_path / "b"
    shutil.copytree(made["out"], copy, copy_function=os.link)  # hard links: the DLLs are large
    (copy / name).unlink()
    manifest = json.loads((copy / "bundle.json").read_text())
    manifest["files"] = [f for f in manifest["files"] if f["path"] != name]  # as if it had never been collected
    for paths in (manifest.get("parts") or {}).values():  # out of its backend's part too: the import is what fails
        if name in paths:
            paths.remove(name)
    (copy / "bundle.json").unlink()
    (copy / "bundle.json").write_text(json.dumps(manifest))
    res = run_cli("verify", copy, "--level", "static", env=e2e_env)
    assert res.returncode == 5, res.stderr
    assert name in res.stderr.splitlines()[0] and "parts" not in res.stderr, res.stderr


def test_latent_companions_omitted_by_the_recipe(windows_tree: dict[str, Path], e2e_env: dict[str, str], tmp_path: Path) -> None:
    text = RECIPE.read_text().replace("  libraries: [", "  latent_companions: omit\n  libraries: [", 1)
    variant = tmp_path / "omit.yaml"
    variant.write_text(text)
    res = bundle(windows_tree, tmp_path / "out.zip", e2e_env, recipe=variant)
    assert res.returncode == 0, res.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "out.zip") as z:
        names = set(z.namelist())
    assert not any(n.startswith("nvrtc") for n in names)
    assert {"cublasLt64_12.dll", "nvJitLink_120_0.dll", "nvfatbin_120_0.dll"} <= names


def test_without_the_redist_or_the_toolkit_it_says_what_to_pass(windows_tree: dict[str, Path], e2e_env: dict[str, str],
                                                                tmp_path: Path) -> None:
    res = run_cli("bundle", RECIPE, windows_tree["build"], "--out", tmp_path / "o", "--toolkit-root",
                  windows_tree["toolkit"], env=e2e_env)
    assert res.returncode == 2 and "--msvc-redist is needed" in res.stderr and not (tmp_path / "o").exists()
    res = run_cli("bundle", RECIPE, windows_tree["build"], "--out", tmp_path / "o", "--msvc-redist",
                  windows_tree["redist"], env=e2e_env)
    assert res.returncode == 2 and "--toolkit-root is needed" in res.stderr and not (tmp_path / "o").exists()


def test_two_bundles_of_one_key_made_at_once_with_one_cache_each_hold_their_own_tree(
        windows_tree: dict[str, Path], e2e_env: dict[str, str], tmp_path: Path) -> None:
    """The zip of a key in the cache's out/ is the cache's: a second `bundle` of that key waits for the first
    rather than packing over the zip the first is still unpacking. The second tree's CRT stand-in differs,
    so each bundle must hold its own."""
    redists = [windows_tree["redist"], tmp_path / "vs" / REDIST]
    shutil.copytree(redists[0], redists[1])
    src = tmp_path / "src"
    src.mkdir()
    (src / "stand_in.c").write_text('__declspec(dllexport) const char *which(void) { return "the second tree"; }\n')
    _run(CC, "-shared", "-o", redists[1] / "x64" / "Microsoft.VC143.CRT" / "vcruntime140.dll", "stand_in.c", cwd=src)
    outs = [tmp_path / f"out{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "llamabundle", "bundle", str(RECIPE), str(windows_tree["build"]),
                               "--out", str(out), "--toolkit-root", str(windows_tree["toolkit"]), "--msvc-redist", str(r)],
                              env=e2e_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for out, r in zip(outs, redists, strict=True)]
    done = [p.communicate(timeout=1800) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], done
    for out, redist in zip(outs, redists, strict=True):
        crt = redist / "x64" / "Microsoft.VC143.CRT" / "vcruntime140.dll"
        assert (out / "vcruntime140.dll").read_bytes() == crt.read_bytes(), out
    assert sum("with this cache; waiting for it" in err for _, err in done) == 1, done  # they overlapped
