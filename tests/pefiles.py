"""Real PE files for the Windows dependency tests, compiled on Linux with mingw-w64: `build` makes them all once
(an exe importing a DLL and the driver, a delay-loading exe, an OpenMP DLL and its runtime closure, an
nvrtc-style pair, an exe importing the MSVC runtimes); the `built` fixture of tests/unit/conftest.py is its
result. `make_dir` copies some of them side by side, `as_i386` makes a 32-bit copy of one."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pefile

CC = "x86_64-w64-mingw32-gcc-posix"
DLLTOOL = "x86_64-w64-mingw32-dlltool"
NM = "x86_64-w64-mingw32-nm"
SOURCES = {
    "cudart.c": "__declspec(dllexport) int cudaGetDeviceCount(int *n) { *n = 0; return 0; }\n",
    "app.c": "int cudaGetDeviceCount(int *n);\nint cuInit(unsigned flags);\n"
             "int main(void) { int n; cudaGetDeviceCount(&n); return cuInit(0) + n; }\n",
    "lazy.c": "int lazy_fn(void);\nint main(int argc, char **argv) { (void)argv; return argc > 5 ? lazy_fn() : 0; }\n",
    "omp.c": "#include <omp.h>\n__declspec(dllexport) int threads(void) { int n = 0;\n#pragma omp parallel\n"
             "{ n = omp_get_num_threads(); }\nreturn n; }\n",
    "nvrtc.c": "__declspec(dllexport) int nvrtcVersion(int *a, int *b) { *a = 12; *b = 8; return 0; }\n",
    "kernels.c": "int nvrtcVersion(int *a, int *b);\n__declspec(dllexport) int jit(void) { int a, b; return nvrtcVersion(&a, &b); }\n",
    "msvcapp.c": "int __std_x(void);\nint __vc_x(void);\nint omp_get_max_threads(void);\n"
                 "int main(void) { return __std_x() + __vc_x() + omp_get_max_threads(); }\n",
}
MINGW_OMP = ("libgomp-1.dll", "libgcc_s_seh-1.dll", "libwinpthread-1.dll")  # -fopenmp's runtime closure
DEFS = {  # import libraries for DLLs that need not exist: the linker records the import all the same
    "nvcuda": ("nvcuda.dll", ["cuInit"]),
    "msvcp140": ("msvcp140.dll", ["__std_x"]),
    "vcruntime140": ("vcruntime140.dll", ["__vc_x"]),
    "vcomp140": ("vcomp140.dll", ["omp_get_max_threads"]),
}


@dataclass(frozen=True)
class Built:
    out: Path  # every product, side by side
    mingw: tuple[Path, ...]  # where the mingw runtime DLLs live (sysroot)

    def __truediv__(self, name: str) -> Path:
        return self.out / name


def _run(*argv: str | Path, cwd: Path) -> None:
    # dlltool leaves empty temporary files behind: keep them in the test's directory, not in /tmp
    subprocess.run([str(a) for a in argv], cwd=cwd, check=True, capture_output=True, env={**os.environ, "TMPDIR": str(cwd)})


def _set_delay_directory(exe: Path, *, image_base: int) -> None:
    """Point the Delay Import data directory at the descriptor the delay library linked in. Newer binutils
    fill it in themselves (MSVC's link always does); Debian's ld 2.40 leaves it empty."""
    symbols = subprocess.run([NM, str(exe)], check=True, capture_output=True, text=True).stdout
    addr = next(int(line.split()[0], 16) for line in symbols.splitlines() if "__DELAY_IMPORT_DESCRIPTOR_" in line)
    with pefile.PE(str(exe), fast_load=True) as p:
        offset = p.OPTIONAL_HEADER.DATA_DIRECTORY[13].get_file_offset()
    raw = bytearray(exe.read_bytes())
    raw[offset:offset + 8] = struct.pack("<II", addr - image_base, 32)
    exe.write_bytes(bytes(raw))


def as_i386(src: Path, dest: Path) -> Path:
    """A copy with the COFF Machine field set to I386 (0x14c)."""
    raw = bytearray(src.read_bytes())
    at = struct.unpack_from("<I", raw, 0x3C)[0] + 4
    raw[at:at + 2] = struct.pack("<H", 0x14C)
    dest.write_bytes(bytes(raw))
    return dest


def build(root: Path) -> Built:
    """Every PE file, made under `root` (sources and import libraries in root/src, products in root/out)."""
    src, out = root / "src", root / "out"
    src.mkdir()
    out.mkdir()
    for name, text in SOURCES.items():
        (src / name).write_text(text)
    for lib, (dll, exports) in DEFS.items():
        (src / f"{lib}.def").write_text(f"LIBRARY {dll}\nEXPORTS\n" + "".join(f"{e}\n" for e in exports))
        _run(DLLTOOL, "-d", f"{lib}.def", "-l", f"lib{lib}.a", cwd=src)
    (src / "lazy.def").write_text("LIBRARY lazy.dll\nEXPORTS\nlazy_fn\n")
    _run(DLLTOOL, "-d", "lazy.def", "-y", "liblazy_delay.a", cwd=src)
    _run(CC, "-shared", "-o", out / "cudart64_12.dll", "cudart.c", f"-Wl,--out-implib,{src / 'libcudart.a'}", cwd=src)
    _run(CC, "-o", out / "app.exe", "app.c", "-L.", "-lcudart", "-lnvcuda", cwd=src)
    _run(CC, "-o", out / "lazy.exe", "lazy.c", "-L.", "-llazy_delay", cwd=src)
    with pefile.PE(str(out / "lazy.exe"), fast_load=True) as p:
        base = p.OPTIONAL_HEADER.ImageBase
    _set_delay_directory(out / "lazy.exe", image_base=base)
    _run(CC, "-shared", "-fopenmp", "-o", out / "ggml-cpu-haswell.dll", "omp.c", cwd=src)
    _run(CC, "-shared", "-o", out / "nvrtc64_120_0.dll", "nvrtc.c", f"-Wl,--out-implib,{src / 'libnvrtc.a'}", cwd=src)
    _run(CC, "-shared", "-o", out / "kernels.dll", "kernels.c", "-L.", "-lnvrtc", cwd=src)
    shutil.copy(out / "cudart64_12.dll", out / "nvrtc-builtins64_128.dll")
    _run(CC, "-o", out / "msvcapp.exe", "msvcapp.c", "-L.", "-lmsvcp140", "-lvcruntime140", "-lvcomp140", cwd=src)
    mingw = tuple(dict.fromkeys(Path(subprocess.run([CC, f"-print-file-name={n}"], check=True, capture_output=True,
                                                    text=True).stdout.strip()).resolve().parent
                                for n in MINGW_OMP))
    return Built(out=out, mingw=mingw)


def make_dir(tmp: Path, built: Built, *names: str) -> Path:
    d = tmp / "dir"
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copy(built / n, d / n)
    return d
