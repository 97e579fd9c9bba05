"""A CMake build directory of the shipped Linux CPU recipe as `llamabundle bundle` reads it, made without
building llama.cpp: CMake's records (cache, compiler), llama.cpp's build-info and web UI header, and bin/ with
real ELF files compiled by gcc in a moment. Each program is a small C launcher that runs an embedded shell
script answering as the real program does (llama-server's --list-devices lines, llamabundle-probe's JSON for
the CPU backend); each backend module is a tiny shared object. So `bundle` collects, packs and verifies it
(static and load) for real, and its --json output is the command's real output."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from llamabundle import keys
from llamabundle.build import BuildTools, plan_build

ROOT = Path(__file__).resolve().parents[1]
LINUX_CPU = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
GCC = shutil.which("gcc")
LOADED = "libggml-cpu-x64.so"  # the CPU variant the stand-ins say ggml chose

SERVER = f"""d=$(dirname "$0")
echo "load_backend: loaded CPU backend from $d/{LOADED}" >&2
echo "Available devices:"
"""
PROBE_ANSWER = {
    "schema": 1, "program": "llamabundle-probe", "dir": "DIR",
    "modules": [{"file": LOADED, "backend": "cpu", "variant": "x64", "opened": True, "error": None, "score": 1,
                 "chosen": True, "loaded": True, "outcome": "loaded", "registered": "CPU",
                 "log": [f"load_backend: loaded CPU backend from DIR/{LOADED}"]}],
    "devices": [{"name": "CPU", "description": "a CPU", "backend": "CPU", "type": "cpu", "memory_total": 1 << 30,
                 "memory_free": 1 << 30, "device_id": None, "compute_capability": None}],
    "log": [{"level": "info", "text": f"load_backend: loaded CPU backend from DIR/{LOADED}"}],
}
PROBE = f"""d=$(cd "$(dirname "$0")" && pwd)
sed "s|DIR|$d|g" <<'EOF'
{json.dumps(PROBE_ANSWER)}
EOF
"""
LAUNCHER = """#include <unistd.h>
static char script[] = %s;
int main(int argc, char **argv) {
    char *args[64];
    int n = 0;
    args[n++] = "/bin/sh";
    args[n++] = "-c";
    args[n++] = script;
    for (int i = 0; i < argc && n < 63; i++)
        args[n++] = argv[i];
    args[n] = 0;
    execv("/bin/sh", args);
    return 127;
}
"""


def _compile(source: str, out: Path, *flags: str) -> None:
    assert GCC is not None, "gcc is needed"
    c = out.with_name(out.name + ".c")
    c.write_text(source)
    subprocess.run([GCC, "-O1", *flags, "-o", str(out), str(c)], check=True, capture_output=True, timeout=120)
    c.unlink()


def cpu_build_tree(tmp: Path, *, probe: bool = True) -> Path:
    """The build directory (tmp/build; its source tree tmp/src) of linux-x86_64-cpu, made with gcc."""
    recipe = keys.load(LINUX_CPU)
    src, build = tmp / "src", tmp / "build"
    src.mkdir(parents=True)
    (src / "LICENSE").write_text("MIT License\n")
    (build / "CMakeFiles" / "3.25.1").mkdir(parents=True)
    (build / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={src}\nCMAKE_COMMAND:INTERNAL=/usr/bin/cmake\n")
    (build / "CMakeFiles" / "3.25.1" / "CMakeCXXCompiler.cmake").write_text(
        'set(CMAKE_CXX_COMPILER_ID "GNU")\nset(CMAKE_CXX_COMPILER_VERSION "12.2.0")\n')  # the recipe's pin
    (build / "common").mkdir()
    (build / "common" / "build-info.cpp").write_text(
        f'char const *LLAMA_COMMIT = "{recipe.llama_cpp.commit[:8]}";\nint LLAMA_BUILD_NUMBER = 6000;\n')
    (build / "tools" / "ui").mkdir(parents=True)
    (build / "tools" / "ui" / "ui.h").write_text("#define LLAMA_UI_HAS_ASSETS 1\n")  # ui: build
    bin_dir = build / "bin"
    bin_dir.mkdir()
    plan = plan_build(recipe, keys.resolve(recipe).host, source_dir=src, build_dir=build,
                      tools=BuildTools(cmake="cmake", ninja="", cmake_version="3.25.1"), toolkit_roots={})
    scripts = {"llama-server": SERVER, "llamabundle-memory": "exit 1\n", **({"llamabundle-probe": PROBE} if probe else {})}
    for name, script in scripts.items():
        _compile(LAUNCHER % json.dumps(script), bin_dir / name)
    module = tmp / "module.so"
    _compile("int ggml_backend_score(void) { return 1; }\n", module, "-shared", "-fPIC")
    for name in plan.backends:
        shutil.copyfile(module, bin_dir / name)
    return build
