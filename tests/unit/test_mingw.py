"""Windows bundles cross-built with mingw (issue 5, parts 3 and 5): the recipe's cpu_variants field, the
toolchain file, compatibility header and project include in the plan (pure) and as the executor writes
them, collect_windows on real PE files compiled with mingw-w64, and the Wine load check against a fake
`wine` that prints a device list and never exits."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml

from llamabundle import data, keys
from llamabundle.build import (
    MEMORY_PROGRAM,
    PROBE_PROGRAM,
    PROJECT_INCLUDE,
    BuildPlan,
    BuildTools,
    plan_build,
    run_build,
)
from llamabundle.deps import pe
from llamabundle.errors import RecipeError, VerifyError
from llamabundle.log import Log
from llamabundle.package import copy_licenses
from llamabundle.platforms import RuntimeSources
from llamabundle.platforms.windows import WINDOWS, wine
from llamabundle.platforms.windows.mingw import COMPAT as MINGW_COMPAT
from llamabundle.platforms.windows.mingw import TOOLCHAIN as MINGW_TOOLCHAIN
from llamabundle.recipe import NO_HOST

ROOT = Path(__file__).resolve().parents[2]
MINGW_RECIPE = ROOT / "recipes" / "windows-x86_64-cpu-mingw.yaml"
LINUX_RECIPE = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
CC = "x86_64-w64-mingw32-gcc-posix"
CXX = "x86_64-w64-mingw32-g++-posix"
needs_mingw = pytest.mark.skipif(not (shutil.which(CC) and shutil.which(CXX)), reason=f"{CC} and {CXX} (mingw-w64) are needed")
needs_posix = pytest.mark.skipif(os.name == "nt", reason="the fake wine is a POSIX shell script")
TOOLS = BuildTools(cmake="cmake", ninja="ninja")


def mingw_text(*edits: tuple[str, str]) -> str:
    text = MINGW_RECIPE.read_text(encoding="utf-8")
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


# ------------------------------------------------------------------------------------- recipe field


def test_the_mingw_recipe_loads_and_pins_what_the_linux_one_does() -> None:
    r, linux = keys.load(MINGW_RECIPE), keys.load(LINUX_RECIPE)
    assert r.platform == "windows-x86_64" and r.toolchain.compiler == "mingw"
    assert r.llama_cpp == linux.llama_cpp
    assert r.targets == ("llama-server", "llama-cli", "llama-bench")
    assert r.cpu_variants.exclude == ("sapphirerapids",)
    assert r.cmake_options["GGML_BACKEND_DL"] == "ON" and r.cmake_options["GGML_CPU_ALL_VARIANTS"] == "ON"
    schema = json.loads((ROOT / "llamabundle" / "data" / "schemas" / "recipe.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(MINGW_RECIPE.read_text(encoding="utf-8")))


def test_excluded_variants_are_a_key_input_and_absent_ones_leave_old_keys_alone() -> None:
    r = keys.load(MINGW_RECIPE)
    assert keys.resolve(r).inputs["cpu_variants"] == {"exclude": ["sapphirerapids"]}
    without = keys.parse(mingw_text(("cpu_variants:\n  exclude: [sapphirerapids]", "")))
    assert "cpu_variants" not in keys.resolve(without).inputs and "cpu_variants" not in keys.resolve(keys.load(LINUX_RECIPE)).inputs
    assert keys.resolve(without).key != keys.resolve(r).key
    two = keys.parse(mingw_text(("[sapphirerapids]", "[zen4, sapphirerapids]")))
    assert keys.resolve(two).key not in (keys.resolve(r).key, keys.resolve(without).key)
    reordered = keys.parse(mingw_text(("[sapphirerapids]", "[sapphirerapids, zen4]")))
    assert keys.resolve(reordered).key == keys.resolve(two).key


@pytest.mark.parametrize(("edits", "where", "message", "fix"), [
    ((("[sapphirerapids]", "[saphirerapids]"),), "cpu_variants.exclude[0]", "'saphirerapids' is not a CPU variant",
     "did you mean 'sapphirerapids'?"),
    ((("[sapphirerapids]", "[sapphirerapids, sapphirerapids]"),), "cpu_variants.exclude", "listed twice", ""),
    ((("  GGML_CPU_ALL_VARIANTS: ON\n", ""),), "cpu_variants.exclude", "only of a GGML_CPU_ALL_VARIANTS build",
     "GGML_CPU_ALL_VARIANTS: ON"),
    ((("exclude: [sapphirerapids]", "exlude: [sapphirerapids]"),), "cpu_variants.exlude", "unknown key 'exlude'",
     "did you mean 'exclude'?"),
    ((("[sapphirerapids]", "[Sapphire]"),), "cpu_variants.exclude[0]", "is not valid", ""),
])
def test_bad_exclusions_name_the_key_and_suggest(edits: tuple[tuple[str, str], ...], where: str, message: str, fix: str) -> None:
    with pytest.raises(RecipeError) as e:
        keys.parse(mingw_text(*edits), file="w.yaml")
    assert f" {where}:" in e.value.what and message in e.value.what and e.value.what.startswith("w.yaml:")
    assert fix in (e.value.fix or "")


def test_exclusions_are_checked_against_the_compilers_own_variant_list() -> None:
    everything = ", ".join(data.build_knowledge()["cpu_variants"]["x86_64"])
    with pytest.raises(RecipeError, match="every CPU variant is excluded"):
        keys.parse(mingw_text(("[sapphirerapids]", f"[{everything}]")))
    msvc = mingw_text(('toolchain: {compiler: mingw, version: "=12.0.0"}', "toolchain: {compiler: msvc}"), ("[sapphirerapids]", "[ivybridge]"))
    with pytest.raises(RecipeError, match="'ivybridge' is not a CPU variant ggml builds with msvc"):
        keys.parse(msvc)  # MSVC builds no ivybridge variant (ggml/src/CMakeLists.txt)


def test_a_recipe_cannot_set_the_project_include() -> None:
    with pytest.raises(RecipeError, match="CMAKE_PROJECT_INCLUDE is set by llamabundle"):
        keys.parse(mingw_text(("  GGML_NATIVE: OFF\n", "  GGML_NATIVE: OFF\n  CMAKE_PROJECT_INCLUDE: /x.cmake\n")))


# -------------------------------------------------------------------------------------------- plan


def test_the_mingw_plan_cross_compiles_and_leaves_the_variant_out(tmp_path: Path) -> None:
    bd = tmp_path / "build"
    plan = plan_build(keys.load(MINGW_RECIPE), NO_HOST, source_dir=tmp_path / "src", build_dir=bd, tools=TOOLS)
    assert not bd.exists()  # pure: the files are data for the executor
    files = dict(plan.files)
    assert set(files) == {str(bd / MINGW_TOOLCHAIN), str(bd / MINGW_COMPAT), str(bd / PROJECT_INCLUDE),
                          str(bd / f"{MEMORY_PROGRAM}.cpp"), str(bd / f"{PROBE_PROGRAM}.cpp")}
    assert f"-DCMAKE_TOOLCHAIN_FILE={bd / MINGW_TOOLCHAIN}" in plan.configure
    assert f"-DCMAKE_PROJECT_INCLUDE={bd / PROJECT_INCLUDE}" in plan.configure
    toolchain = files[str(bd / MINGW_TOOLCHAIN)]
    for line in ("set(CMAKE_SYSTEM_NAME Windows)", "set(CMAKE_SYSTEM_PROCESSOR x86_64)", f"set(CMAKE_C_COMPILER {CC})",
                 f"set(CMAKE_CXX_COMPILER {CXX})", "set(CMAKE_RC_COMPILER x86_64-w64-mingw32-windres)",
                 "set(CMAKE_FIND_ROOT_PATH /usr/x86_64-w64-mingw32)"):
        assert line in toolchain.splitlines()
    include = files[str(bd / PROJECT_INCLUDE)]
    assert "add_compile_definitions(_WIN32_WINNT=0x0A00)" in include
    assert f"-include{(bd / MINGW_COMPAT).as_posix()}" in include
    assert "foreach(_dep ggml-cpu-sapphirerapids)" in include and "_add_dependencies(" in include
    assert "#ifndef THREAD_POWER_THROTTLING_CURRENT_VERSION" in files[str(bd / MINGW_COMPAT)]
    assert "ggml-cpu-sapphirerapids" not in plan.build and "ggml-cpu-zen4" in plan.build
    assert len(plan.backends) == 14 and plan.backends[-1] == "ggml-rpc.dll" and all(b.endswith(".dll") for b in plan.backends)
    assert plan.programs == ("llama-server.exe", "llama-cli.exe", "llama-bench.exe", "ggml-rpc-server.exe", f"{MEMORY_PROGRAM}.exe",
                             f"{PROBE_PROGRAM}.exe")
    shown = plan.to_json()
    assert shown["files"] == files and json.dumps(shown)  # what `llamabundle show --json` prints


def test_a_linux_plan_writes_only_the_own_programs_and_excludes_only_when_asked(tmp_path: Path) -> None:
    linux = keys.load(LINUX_RECIPE)
    plan = plan_build(linux, NO_HOST, source_dir=tmp_path, build_dir=tmp_path / "b", tools=TOOLS)
    assert [Path(p).name for p, _ in plan.files] == [f"{MEMORY_PROGRAM}.cpp", f"{PROBE_PROGRAM}.cpp", PROJECT_INCLUDE]
    assert not any("TOOLCHAIN_FILE" in a for a in plan.configure)
    include = dict(plan.files)[str(tmp_path / "b" / PROJECT_INCLUDE)]
    assert "_add_dependencies(" not in include and f"add_executable({MEMORY_PROGRAM} " in include
    assert "common_fit_print(" in dict(plan.files)[str(tmp_path / "b" / f"{MEMORY_PROGRAM}.cpp")]
    assert f"add_executable({PROBE_PROGRAM} " in include
    assert "target_link_libraries(llamabundle-probe PRIVATE ggml ${CMAKE_DL_LIBS} $<$<PLATFORM_ID:Windows>:ws2_32>)" in include
    assert "ggml_backend_load(" in dict(plan.files)[str(tmp_path / "b" / f"{PROBE_PROGRAM}.cpp")]
    assert "ggml-cpu-sapphirerapids" in plan.build and MEMORY_PROGRAM in plan.build and PROBE_PROGRAM in plan.build
    text = LINUX_RECIPE.read_text(encoding="utf-8").replace("targets:", "cpu_variants: {exclude: [zen4]}\ntargets:")
    plan = plan_build(keys.parse(text), NO_HOST, source_dir=tmp_path, build_dir=tmp_path / "b", tools=TOOLS)
    assert "foreach(_dep ggml-cpu-zen4)" in dict(plan.files)[str(tmp_path / "b" / PROJECT_INCLUDE)]
    assert "ggml-cpu-zen4" not in plan.build and "libggml-cpu-zen4.so" not in plan.backends


@needs_posix
def test_the_executor_writes_the_files_before_configure_and_keeps_unchanged_ones(tmp_path: Path) -> None:
    """A stand-in cmake (a shell script, not cmake) records what it found at configure time."""
    fake = tmp_path / "fake-cmake"
    fake.write_text(textwrap.dedent("""\
        #!/bin/sh
        if [ "$1" = "--build" ]; then
          mkdir -p "$2/bin"; for n in llama-server.exe llama-cli.exe llama-bench.exe ggml-rpc-server.exe llamabundle-memory.exe llamabundle-probe.exe ggml-rpc.dll; do : > "$2/bin/$n"; done
          for v in x64 sse42 sandybridge ivybridge piledriver haswell skylakex cannonlake cascadelake icelake \\
                   cooperlake zen4 alderlake; do : > "$2/bin/ggml-cpu-$v.dll"; done
          exit 0
        fi
        for a in "$@"; do case "$a" in -B) next=1;; *) [ -n "$next" ] && bd="$a"; next=;; esac; done
        ls "$bd" > "$bd/seen-at-configure"; : > "$bd/build.ninja"
        """))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    bd = tmp_path / "build"
    plan = plan_build(keys.load(MINGW_RECIPE), NO_HOST, source_dir=tmp_path, build_dir=bd,
                      tools=BuildTools(cmake=str(fake), ninja="ninja"))
    run_build(plan, log=Log(), env=dict(os.environ))
    seen = (bd / "seen-at-configure").read_text().split()
    assert {MINGW_TOOLCHAIN, MINGW_COMPAT, PROJECT_INCLUDE} <= set(seen)
    assert all(Path(p).read_text(encoding="utf-8") == t for p, t in plan.files)
    mtimes = {p: Path(p).stat().st_mtime_ns for p, _ in plan.files}
    (bd / "seen-at-configure").unlink()
    run_build(plan, log=Log(), env=dict(os.environ))  # same plan: no configure, files untouched
    assert not (bd / "seen-at-configure").exists()
    assert {p: Path(p).stat().st_mtime_ns for p, _ in plan.files} == mtimes
    run_build(plan, log=Log(), env=dict(os.environ), clean=True)  # --clean of that up-to-date tree: configured again
    assert set((bd / "seen-at-configure").read_text().split()) >= {MINGW_TOOLCHAIN, MINGW_COMPAT, PROJECT_INCLUDE}


@needs_mingw
def test_the_compat_header_supplies_what_the_mingw_headers_lack(tmp_path: Path) -> None:
    bd = tmp_path / "b"
    plan = plan_build(keys.load(MINGW_RECIPE), NO_HOST, source_dir=tmp_path, build_dir=bd, tools=TOOLS)
    header = tmp_path / "compat.h"
    header.write_text(dict(plan.files)[str(bd / MINGW_COMPAT)], encoding="utf-8")
    src = tmp_path / "t.c"  # what ggml-cpu.c does with it
    src.write_text(textwrap.dedent("""\
        #include <windows.h>
        int f(void) {
            THREAD_POWER_THROTTLING_STATE t;
            t.Version = THREAD_POWER_THROTTLING_CURRENT_VERSION;
            t.ControlMask = THREAD_POWER_THROTTLING_EXECUTION_SPEED;
            t.StateMask = 0;
            return SetThreadInformation(GetCurrentThread(), ThreadPowerThrottling, &t, sizeof(t));
        }
        """))
    argv = [CC, "-D_WIN32_WINNT=0x0A00", "-c", str(src), "-o", str(tmp_path / "t.o")]
    bare = subprocess.run(argv, capture_output=True, text=True)
    with_header = subprocess.run([*argv, f"-include{header}"], capture_output=True, text=True)
    assert with_header.returncode == 0, with_header.stderr
    if bare.returncode == 0:  # newer mingw-w64 headers: the guard must keep the header out of the way
        assert "__MINGW64_VERSION_MAJOR" in header.read_text()
    else:
        assert "THREAD_POWER_THROTTLING" in bare.stderr


# ------------------------------------------------------------------------------------------ collect


@pytest.fixture(scope="module")
def build_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build output of real PE files: an exe (C++, OpenMP, threads) importing llama.dll, and a backend."""
    if not (shutil.which(CC) and shutil.which(CXX)):
        pytest.skip(f"{CC} and {CXX} (mingw-w64) are needed")
    out = tmp_path_factory.mktemp("mingw") / "bin"
    out.mkdir()
    (out / "llama.c").write_text("__declspec(dllexport) int llama_answer(void) { return 42; }\n")
    (out / "backend.c").write_text("__declspec(dllexport) int ggml_backend_score(void) { return 1; }\n")
    (out / "main.cpp").write_text(textwrap.dedent("""\
        #include <string>
        #include <thread>
        extern "C" int llama_answer(void);
        int main() {
            std::string s = "x";
            int sum = 0;
            #pragma omp parallel for reduction(+:sum)
            for (int i = 0; i < 8; i++) sum += i;
            std::thread t([&] { s += "y"; });
            t.join();
            return llama_answer() + sum + (int)s.size();
        }
        """))
    def run(*argv: str) -> None:
        subprocess.run(argv, cwd=out, check=True, capture_output=True)
    run(CC, "-shared", "-o", "llama.dll", "llama.c", "-Wl,--out-implib,libllama.dll.a")
    run(CC, "-shared", "-o", "ggml-cpu-x64.dll", "backend.c")
    run(CXX, "-fopenmp", "-pthread", "-o", "llama-server.exe", "main.cpp", "-L.", "-lllama")
    for f in ("llama.c", "backend.c", "main.cpp", "libllama.dll.a"):
        (out / f).unlink()
    return out


def plan_of(out: Path) -> BuildPlan:
    return BuildPlan(source_dir=out.parent, build_dir=out.parent, configure=(), build=(), targets=(),
                     programs=("llama-server.exe",), backends=("ggml-cpu-x64.dll",), output_dir=out)


def test_collect_windows_bundles_the_mingw_runtime_and_never_system_dlls(build_tree: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "LICENSE").write_text("MIT\n")
    stage = tmp_path / "stage"
    stage.mkdir()
    labelled = WINDOWS.given_toolchain(keys.load(MINGW_RECIPE), redist=None).runtime_dirs
    dirs = [d for d, _ in labelled]
    assert dirs and all(d.is_dir() for d in dirs) and {o for _, o in labelled} == {"mingw"}
    plan = plan_of(build_tree)
    collected = WINDOWS.collect(plan, stage, log=Log(), sources=RuntimeSources(lib_dirs=labelled))
    licences = WINDOWS.licenses(collected, stage)
    assert licences and all(o == "mingw" for o, _ in licences.values())
    roles = dict(collected.roles) | copy_licenses(src, stage) | dict.fromkeys(licences, "license")
    closure = pe.resolve_closure([plan.output_dir / n for n in plan.programs + plan.backends],
                                 bundle_dir=plan.output_dir, extra_dirs=dirs)
    runtime = {"libgomp-1.dll", "libstdc++-6.dll", "libgcc_s_seh-1.dll", "libwinpthread-1.dll"}
    assert roles["llama-server.exe"] == "exe" and roles["ggml-cpu-x64.dll"] == "backend"
    assert roles["LICENSE"] == "license"
    assert {n for n, r in roles.items() if r == "runtime"} == runtime | {"llama.dll"}
    assert {p.name for p in stage.iterdir()} == set(roles)
    classes = {d.name: d.cls for d in closure.deps}
    assert all(classes[n] is pe.DllClass.MINGW_RUNTIME for n in runtime)
    assert classes["llama.dll"] is pe.DllClass.BUNDLED
    assert "KERNEL32.dll" in collected.system_deps and collected.glibc_floor is None
    assert not any(pe.pe_policy().classify(p.name) in pe.NOT_BUNDLED for p in stage.iterdir())
    for name in runtime:  # the very files of the toolchain, found from the compiler's own answer
        assert (stage / name).read_bytes() == collected.bundled[name].read_bytes()
        assert collected.bundled[name].parent in dirs
        assert collected.origins[name] == "mingw" and collected.why[name].startswith("imported by ")
    assert collected.origins["llama-server.exe"] == "build" and collected.why["llama-server.exe"].startswith("program")
    assert collected.why["ggml-cpu-x64.dll"].startswith("backend module")


def test_collect_windows_names_a_runtime_dll_it_cannot_find(build_tree: Path, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "LICENSE").write_text("MIT\n")
    with pytest.raises(VerifyError) as e:
        WINDOWS.collect(plan_of(build_tree), tmp_path, log=Log(), sources=RuntimeSources())
    assert "libstdc++-6.dll (imported by llama-server.exe)" in (e.value.why or "")


# --------------------------------------------------------------------------------------------- Wine


# `wine cmd /c LAUNCHER`: the exe the launcher runs (its quoted line), as a Unix path, becomes $1
LAUNCHED = r"""
if [ "$1" = cmd ]; then
  bat=$(printf '%s' "$3" | sed 's|^Z:||; s|\\|/|g')
  exe=$(grep '^"' "$bat" | head -1 | cut -d'"' -f2 | sed 's|^Z:||; s|\\|/|g')
  set -- "$exe"
fi
"""


def fake_wine(bin_dir: Path, body: str) -> Path:
    """`wine` and `wineserver` stand-ins: wine runs `body` (sh) with $1 the exe (what `cmd /c LAUNCHER` runs);
    wineserver records its calls."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "wine").write_text("#!/bin/sh\necho $$ > \"$WINEPREFIX/wine.pid\"\n" + LAUNCHED + textwrap.dedent(body))
    (bin_dir / "wineserver").write_text("#!/bin/sh\necho \"$@ $WINEPREFIX\" >> \"$WINEPREFIX/wineserver.calls\"\n")
    for f in ("wine", "wineserver"):
        (bin_dir / f).chmod(0o755)
    return bin_dir


def bundle_dir(tmp_path: Path) -> Path:
    root = tmp_path / "bundle"
    root.mkdir()
    (root / "llama-server.exe").write_bytes(b"MZ")
    return root


LIST = r"""
dir=$(dirname "$1" | sed 's|/|\\|g')
printf '%s\n' "load_backend: loaded CPU backend from Z:${dir}\\ggml-cpu-haswell.dll" >&2
echo "Available devices:"
echo "  CPU: Intel Xeon (64000 MiB, 60000 MiB free)"
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_posix
def test_wine_that_never_exits_is_stopped_after_the_device_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fake_wine(tmp_path / "bin", LIST + "exec sleep 3600\n")))
    root, prefix = bundle_dir(tmp_path), tmp_path / "prefix"
    r = wine.check_load(root, prefix=prefix)
    assert r.level == f"passed (under Wine; {wine.STOPPED})"
    assert r.backends == {"CPU": str(root / "ggml-cpu-haswell.dll")}
    assert r.devices == ["CPU: Intel Xeon (64000 MiB, 60000 MiB free)"]
    assert not alive(int((prefix / "wine.pid").read_text()))  # killed, not left behind
    assert (prefix / "wineserver.calls").read_text().split() == ["-k", str(prefix)]  # that prefix only


@needs_posix
def test_a_line_after_the_list_ends_it_without_waiting_for_quiet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fake_wine(tmp_path / "bin", LIST + "echo 'main: exiting'\nexec sleep 3600\n")))
    monkeypatch.setattr(wine, "QUIET", 3600.0)  # only the line can end the wait
    r = wine.check_load(bundle_dir(tmp_path), prefix=tmp_path / "prefix")
    assert wine.STOPPED in r.level and len(r.devices) == 1


@needs_posix
def test_wine_that_exits_by_itself_is_not_reported_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fake_wine(tmp_path / "bin", LIST + "exit 0\n")))
    r = wine.check_load(bundle_dir(tmp_path), prefix=tmp_path / "prefix")
    assert r.level == "passed (under Wine; it exited 0)"
    assert not (tmp_path / "prefix" / "wineserver.calls").exists()


@needs_posix
def test_a_backend_from_outside_the_bundle_fails_under_wine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = ("printf '%s\\n' 'load_backend: loaded CPU backend from Z:\\opt\\other\\ggml-cpu-x64.dll' >&2\n"
            'echo "Available devices:"\nexec sleep 3600\n')
    monkeypatch.setenv("PATH", str(fake_wine(tmp_path / "bin", body)))
    with pytest.raises(VerifyError, match=r"loaded from /opt/other/ggml-cpu-x64.dll, outside the bundle"):
        wine.check_load(bundle_dir(tmp_path), prefix=tmp_path / "prefix")


@needs_posix
def test_a_failing_exe_under_wine_fails_with_its_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = 'echo "err:module:import_dll Library libgomp-1.dll not found" >&2\nexit 53\n'
    monkeypatch.setenv("PATH", str(fake_wine(tmp_path / "bin", body)))
    with pytest.raises(VerifyError, match="exited with 53") as e:
        wine.check_load(bundle_dir(tmp_path), prefix=tmp_path / "prefix")
    assert "libgomp-1.dll not found" in (e.value.details or "")


def test_without_wine_the_load_level_is_skipped_with_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    r = wine.check_load(bundle_dir(tmp_path), prefix=tmp_path / "prefix")
    assert r.level.startswith("skipped: wine is not installed")


def test_wine_paths_map_z_to_the_root() -> None:
    assert wine.wine_to_unix(r"Z:\tmp\llamabundle-verify-1\bundle\ggml-cpu-icelake.dll") == \
        "/tmp/llamabundle-verify-1/bundle/ggml-cpu-icelake.dll"
    assert wine.wine_to_unix(r"C:\windows\system32\x.dll") == r"C:\windows\system32\x.dll"


# ------------------------------------------------------------------------------ the native Windows environment


def test_a_windows_bundle_runs_in_the_environment_windows_gives_a_program() -> None:
    """Not the POSIX one (PATH=/usr/bin:/bin, HOME, LANG, TMPDIR): SystemRoot and windir (Winsock, COM and the
    loader read them), the bundle then System32 on PATH, TEMP and TMP beside the bundle; nothing else of ours."""
    from llamabundle.platforms.load import windows_env

    env = windows_env(r"D:\a\_temp\v\bundle", r"D:\a\_temp\v", r"C:\Windows", {"GGML_VK_VISIBLE_DEVICES": "0"})
    assert env == {"GGML_VK_VISIBLE_DEVICES": "0", "SystemRoot": r"C:\Windows", "windir": r"C:\Windows",
                   "SystemDrive": "C:", "PATH": r"D:\a\_temp\v\bundle;C:\Windows\System32;C:\Windows",
                   "TEMP": r"D:\a\_temp\v", "TMP": r"D:\a\_temp\v"}


def test_the_wine_launcher_empties_the_environment_then_sets_the_native_one() -> None:
    script = wine.launcher_script({"TEMP": r"Z:\tmp\100%", "PATH": r"Z:\b;C:\windows\system32"}, r"Z:\b\llama-server.exe",
                                  ["--verbose", "--list-devices"])
    assert wine.launcher_script({}, "x.exe", ["-m", r"C:\my models\a.gguf", ""]).splitlines()[2] == \
        r'"x.exe" -m "C:\my models\a.gguf" ""'
    assert script.splitlines() == [
        "@echo off",
        """for /f "delims==" %%v in ('set') do set "%%v=\"""",
        r'set "TEMP=Z:\tmp\100%%"',  # a % in a value is doubled: it would start a variable
        r'set "PATH=Z:\b;C:\windows\system32"',
        r'"Z:\b\llama-server.exe" --verbose --list-devices',
        "exit /b %ERRORLEVEL%"]


@pytest.mark.skipif(shutil.which("wine") is None, reason="wine is not installed")
def test_under_wine_the_program_sees_the_native_environment(tmp_path: Path) -> None:
    """Real Wine: the launcher the load check runs gives the program exactly the native environment, besides
    what Wine itself adds to every process (its WINE* variables, SystemDrive) and what cmd.exe adds for itself
    (COMSPEC, PROMPT): Wine's registry TEMP, PATH and profile variables are gone."""
    from llamabundle.platforms.load import windows_env

    root = tmp_path / "bundle"
    root.mkdir()
    native = windows_env(wine.unix_to_wine(root), wine.unix_to_wine(tmp_path), wine.WINE_SYSTEM_ROOT)
    launcher = tmp_path / wine.LAUNCHER
    launcher.write_text(wine.launcher_script(native, r"C:\windows\system32\cmd.exe", ["/c", "set"]),
                        encoding="utf-8", newline="\r\n")
    prefix = tmp_path / "prefix"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WINEPREFIX": str(prefix), "WINEDEBUG": "-all",
           "WINEDLLOVERRIDES": "mscoree,mshtml=", "LANG": "C.UTF-8", "USERPROFILE": "from-unix", "TEMP": "from-unix"}
    try:
        out = subprocess.run(["wine", "cmd", "/c", wine.unix_to_wine(launcher)], env=env, capture_output=True,
                             timeout=300, cwd=tmp_path)
    finally:
        subprocess.run(["wineserver", "-k"], env=env, capture_output=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    seen = dict(line.split("=", 1) for line in out.stdout.decode().replace("\r", "").splitlines() if "=" in line)
    own = {k: v for k, v in seen.items() if not k.startswith("WINE") and k not in {"COMSPEC", "PROMPT"}}
    assert own == native, (own, native)
