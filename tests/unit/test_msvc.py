"""MSVC discovery (llamabundle.platforms.windows.msvc) on Linux: recorded vswhere output (tests/data/vswhere), a Visual
Studio directory tree made in a temp dir, a fake runner in place of vswhere.exe and cmd.exe, and the
_MSC_VER check against what each CUDA's host_config.h accepts."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from llamabundle.deps.pe import DllClass, resolve_closure
from llamabundle.errors import RecipeError, ToolchainError
from llamabundle.log import Log
from llamabundle.platforms.windows import msvc
from llamabundle.platforms.windows.msvc import Toolset, VsInstance
from tests.pefiles import CC, Built
from tests.vstrees import PLACEHOLDER, make_vs, recorded

BANNER = "Microsoft (R) C/C++ Optimizing Compiler Version 19.44.35207.1 for x64\nCopyright (C) Microsoft Corporation.  All rights reserved.\n"


class FakeRunner:
    """Stands in for vswhere.exe and cmd.exe: answers by program name and records each call."""

    def __init__(self, **replies: str) -> None:
        self.replies = replies
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, argv: Sequence[str], env: Mapping[str, str]) -> str:
        self.calls.append((list(argv), dict(env)))
        return self.replies[Path(argv[0]).stem.replace(".", "_")]


def installer(tmp: Path) -> dict[str, str]:
    """An environment whose %ProgramFiles(x86)% holds vswhere.exe where the installer puts it."""
    exe = tmp / "pf86" / "Microsoft Visual Studio" / "Installer" / "vswhere.exe"
    exe.parent.mkdir(parents=True)
    exe.write_bytes(PLACEHOLDER)
    return {"ProgramFiles(x86)": str(tmp / "pf86"), "SystemRoot": r"C:\Windows", "PATH": r"C:\Windows\system32"}


def set_output(base: Mapping[str, str], changes: Mapping[str, str]) -> str:
    """What `set` prints after vcvars64.bat: every variable, sorted, as cmd spells it."""
    merged = {**{("Path" if k == "PATH" else k): v for k, v in base.items()}, **changes}
    return "".join(f"{k}={v}\r\n" for k, v in sorted(merged.items(), key=lambda kv: kv[0].upper()))


def _toolset(tmp: Path, **kw: object) -> Toolset:
    inst = VsInstance(instance_id="8f3e5ef8", path=make_vs(tmp / "vs", **kw), version="17.14.36212.18",  # type: ignore[arg-type]
                      display_version="17.14.5", name="Visual Studio Enterprise 2022", complete=True, prerelease=False)
    return msvc.locate_toolset(inst)


# ------------------------------------------------------------------------------------------------ vswhere


def test_find_vswhere_under_program_files_x86_in_any_case(tmp_path: Path) -> None:
    env = installer(tmp_path)
    want = tmp_path / "pf86" / "Microsoft Visual Studio" / "Installer" / "vswhere.exe"
    assert msvc.find_vswhere(env) == want
    assert msvc.find_vswhere({"PROGRAMFILES(X86)": env["ProgramFiles(x86)"]}) == want  # os.environ on Windows


def test_find_vswhere_falls_back_to_path_then_fails_clearly(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vswhere").write_bytes(PLACEHOLDER)
    (bindir / "vswhere").chmod(0o755)
    assert msvc.find_vswhere({"ProgramFiles(x86)": str(tmp_path / "nowhere"), "PATH": str(bindir)}) == bindir / "vswhere"
    with pytest.raises(ToolchainError) as e:
        msvc.find_vswhere({"PATH": str(tmp_path / "empty")})
    assert e.value.exit_code == 3 and e.value.what == "vswhere.exe was not found"
    assert "Desktop development with C++" in e.value.fix


def test_vswhere_argv() -> None:
    assert msvc.vswhere_argv(Path("vswhere.exe"), "[17.0,18.0)") == [
        "vswhere.exe", "-products", "*", "-requires", "Microsoft.VisualStudio.Component.VC.Tools.x86.x64",
        "-version", "[17.0,18.0)", "-format", "json", "-utf8"]
    assert "-version" not in msvc.vswhere_argv(Path("vswhere.exe"), None)


def test_parse_a_github_runner_recording() -> None:
    (inst,) = msvc.parse_vswhere(recorded("windows-2022-runner.json"))
    assert inst == VsInstance(instance_id="8f3e5ef8", path=Path(r"C:\Program Files\Microsoft Visual Studio\2022\Enterprise"),
                              version="17.14.36212.18", display_version="17.14.5", name="Visual Studio Enterprise 2022",
                              complete=True, prerelease=False)


def test_parse_rejects_output_that_is_not_vswhere_json() -> None:
    with pytest.raises(ToolchainError, match="not the JSON list"):
        msvc.parse_vswhere("Visual Studio Locator version 3.1.7\n")
    with pytest.raises(ToolchainError, match="not the JSON list"):
        msvc.parse_vswhere('[{"instanceId": "x"}]')


@pytest.mark.parametrize(("version", "spec", "inside"), [
    ("17.14.36212.18", "[17.0,18.0)", True), ("18.0.11205.157", "[17.0,18.0)", False), ("18.0", "[17.0,18.0]", True),
    ("17.0", "(17.0,18.0)", False), ("16.11.5", "17.0", False), ("18.0.1", "17.0", True), ("17.9", "[,17.10)", True),
])
def test_version_ranges_as_vswhere_reads_them(version: str, spec: str, inside: bool) -> None:
    assert msvc.version_in_range(version, spec) is inside


def test_a_malformed_range_is_a_recipe_error() -> None:
    with pytest.raises(RecipeError) as e:
        msvc.version_in_range("17.14", "[17.0;18.0)")
    assert e.value.exit_code == 2 and "toolchain.msvc_version" in e.value.what


def test_pick_the_newest_complete_instance_in_range() -> None:
    instances = msvc.parse_vswhere(recorded("buildtools-and-vs2026.json"))
    # Community 2022 17.14 is newer than Build Tools 17.12 but incomplete: never picked.
    assert msvc.pick_instance(instances, version_range="[17.0,18.0)").name == "Visual Studio Build Tools 2022"
    assert msvc.pick_instance(instances, version_range=None).name == "Visual Studio Community 2026"
    with pytest.raises(ToolchainError) as e:
        msvc.pick_instance(instances, version_range="[19.0,20.0)")
    assert e.value.what == "no Visual Studio with the C++ x64 tools in [19.0,20.0)"
    assert "Visual Studio Community 2022 17.14.36301.6 (incomplete)" in e.value.why
    assert "widen toolchain.msvc_version" in e.value.fix


def test_no_visual_studio_at_all() -> None:
    with pytest.raises(ToolchainError) as e:
        msvc.pick_instance(msvc.parse_vswhere(recorded("none.json")), version_range="[17.0,18.0)")
    assert e.value.why == "vswhere found no Visual Studio with the C++ x64 tools"


def test_find_instance_runs_vswhere_with_the_range(tmp_path: Path) -> None:
    env = installer(tmp_path)
    runner = FakeRunner(vswhere=recorded("windows-2022-runner.json", {"8f3e5ef8": tmp_path / "vs"}))
    inst = msvc.find_instance(env=env, version_range="[17.0,18.0)", runner=runner)
    assert inst.path == tmp_path / "vs"
    (argv, got_env), = runner.calls
    assert argv == msvc.vswhere_argv(tmp_path / "pf86" / "Microsoft Visual Studio" / "Installer" / "vswhere.exe",
                                     "[17.0,18.0)")
    assert got_env == env


# ------------------------------------------------------------------------------------------------ toolset


def test_locate_the_default_toolset_and_redist(tmp_path: Path) -> None:
    ts = _toolset(tmp_path, tools=("14.38.33130", "14.44.35207"), default="14.44.35207")
    vs = tmp_path / "vs"
    assert (ts.version, ts.msc_ver, ts.pinned) == ("14.44.35207", 1944, "14.44.35207")  # vcvars gets it, never its own pick
    assert ts.installed == ("14.38.33130", "14.44.35207")
    assert ts.vcvars == vs / "VC" / "Auxiliary" / "Build" / "vcvars64.bat"
    assert (ts.redist_version, ts.redist_dir) == ("14.44.35112", vs / "VC" / "Redist" / "MSVC" / "14.44.35112")


def test_locate_a_pinned_toolset(tmp_path: Path) -> None:
    make_vs(tmp_path / "vs", tools=("14.38.33130", "14.44.35207", "14.50.35717"))
    inst = msvc.parse_vswhere(recorded("windows-2022-runner.json", {"8f3e5ef8": tmp_path / "vs"}))[0]
    ts = msvc.locate_toolset(inst, toolset="14.44")
    assert (ts.version, ts.msc_ver, ts.pinned) == ("14.44.35207", 1944, "14.44.35207")
    assert msvc.locate_toolset(inst).version == "14.50.35717"
    with pytest.raises(ToolchainError) as e:
        msvc.locate_toolset(inst, toolset="14.29")
    assert e.value.what == "MSVC toolset 14.29 is not installed in Visual Studio Enterprise 2022"
    assert e.value.why == "installed: 14.38.33130, 14.44.35207, 14.50.35717"


def test_a_broken_install_is_reported(tmp_path: Path) -> None:
    make_vs(tmp_path / "vs")
    inst = msvc.parse_vswhere(recorded("windows-2022-runner.json", {"8f3e5ef8": tmp_path / "vs"}))[0]
    build = tmp_path / "vs" / "VC" / "Auxiliary" / "Build"
    (build / "Microsoft.VCRedistVersion.default.txt").unlink()
    with pytest.raises(ToolchainError, match="Microsoft.VCRedistVersion.default.txt is missing"):
        msvc.locate_toolset(inst)
    (build / "vcvars64.bat").unlink()
    with pytest.raises(ToolchainError, match="vcvars64.bat"):
        msvc.locate_toolset(inst)


@pytest.mark.parametrize(("toolset", "want"), [("14.44.35207", 1944), ("14.50.35717", 1950), ("14.29.30133", 1929),
                                                ("14.0.24215", 1900)])
def test_msc_ver_of_a_toolset(toolset: str, want: int) -> None:
    assert msvc.msc_ver(toolset) == want


def test_msc_ver_from_the_cl_banner() -> None:
    assert msvc.msc_ver_from_banner(BANNER) == 1944
    with pytest.raises(ToolchainError):
        msvc.msc_ver_from_banner("cl : Command line warning D9002\n")


# ------------------------------------------------------------------------------------------------ _MSC_VER vs CUDA


@pytest.mark.parametrize(("msc", "cuda"), [(1944, "12.8.1"), (1910, "12.8"), (1949, "13.0.2"), (1939, "12.2.0")])
def test_accepted_host_compilers(msc: int, cuda: str) -> None:
    msvc.check_cuda_host(msc, cuda)


def test_msvc_14_50_is_refused_for_cuda_12_8_before_the_build(tmp_path: Path) -> None:
    ts = _toolset(tmp_path, tools=("14.50.35717",))
    with pytest.raises(ToolchainError) as e:
        msvc.check_cuda_host(ts.msc_ver, "12.8.1", toolset=ts)
    assert e.value.exit_code == 3
    assert e.value.what == "MSVC toolset 14.50.35717 (_MSC_VER 1950) is too new for CUDA 12.8.1"
    assert e.value.why.startswith("CUDA 12.8's crt/host_config.h rejects _MSC_VER >= 1950")
    assert "v14.4x toolset" in e.value.fix and "-vcvars_ver=14.44" in e.value.fix


def test_the_fix_names_an_installed_toolset_that_fits(tmp_path: Path) -> None:
    ts = _toolset(tmp_path, tools=("14.38.33130", "14.44.35207", "14.50.35717"))
    with pytest.raises(ToolchainError) as e:
        msvc.check_cuda_host(ts.msc_ver, "13.0.1", toolset=ts)
    assert e.value.fix == "build with the installed toolset 14.44.35207 (vcvars64.bat -vcvars_ver=14.44)"


@pytest.mark.parametrize(("msc", "cuda", "what"), [
    (1940, "12.2", "MSVC with _MSC_VER 1940 is too new for CUDA 12.2"),
    (1916, "13.0.2", "MSVC with _MSC_VER 1916 is too old for CUDA 13.0.2"),
])
def test_limits_come_from_each_toolkits_host_config(msc: int, cuda: str, what: str) -> None:
    with pytest.raises(ToolchainError) as e:
        msvc.check_cuda_host(msc, cuda)
    assert e.value.what == what


def test_a_newer_minor_uses_the_nearest_known_limits_and_unknown_majors_are_not_checked() -> None:
    assert msvc.cuda_msc_range("12.10.0") == (1910, 1950)
    assert msvc.cuda_msc_range("11.8") is None
    msvc.check_cuda_host(1960, "11.8")


# ------------------------------------------------------------------------------------------------ vcvars


def test_vcvars_argv_needs_no_quotes_inside_arguments(tmp_path: Path) -> None:
    ts = dataclasses.replace(_toolset(tmp_path), vcvars=Path(r"C:\Program Files\Microsoft Visual Studio\2022"
                                                              r"\Enterprise\VC\Auxiliary\Build\vcvars64.bat"))
    argv = msvc.vcvars_argv(ts)
    assert not any('"' in a for a in argv)
    # What CreateProcess gets: cmd runs `call "<path>" >nul && set`, the path quoted once.
    assert subprocess.list2cmdline(argv) == ('cmd.exe /d /c call "C:\\Program Files\\Microsoft Visual Studio\\2022\\'
                                             'Enterprise\\VC\\Auxiliary\\Build\\vcvars64.bat" -vcvars_ver=14.44.35207 >nul && set')
    assert msvc.vcvars_argv(dataclasses.replace(ts, pinned="14.44"))[5] == "-vcvars_ver=14.44"


def test_capture_vcvars_returns_what_it_changed(tmp_path: Path) -> None:
    ts = _toolset(tmp_path)
    base = {"PATH": r"C:\Windows\system32", "SYSTEMROOT": r"C:\Windows", "TEMP": r"C:\Temp"}
    changes = {"Path": r"C:\VS\VC\Tools\MSVC\14.44.35207\bin\HostX64\x64;C:\Windows\system32",
               "INCLUDE": r"C:\VS\VC\Tools\MSVC\14.44.35207\include", "LIB": r"C:\VS\VC\Tools\MSVC\14.44.35207\lib\x64",
               "VCToolsVersion": "14.44.35207", "VCINSTALLDIR": "C:\\VS\\VC\\", "VSCMD_ARG_TGT_ARCH": "x64"}
    runner = FakeRunner(cmd=set_output({**base, "SystemRoot": base.pop("SYSTEMROOT")}, changes) + "\r\n")
    got = msvc.capture_vcvars(ts, base_env={**base, "SYSTEMROOT": r"C:\Windows"}, runner=runner)
    # SystemRoot and TEMP did not change, whatever their case; Path is spelled as the base spells it, so that
    # laying it over the base replaces PATH instead of adding a second one
    want = {("PATH" if k == "Path" else k): v for k, v in changes.items()}
    assert got == dict(sorted(want.items()))
    assert runner.calls[0][0] == msvc.vcvars_argv(ts)


def test_capture_vcvars_notices_a_vcvars_that_did_nothing(tmp_path: Path) -> None:
    ts = _toolset(tmp_path)
    with pytest.raises(ToolchainError, match="did not set up the MSVC environment"):
        msvc.capture_vcvars(ts, base_env={"PATH": "x"}, runner=FakeRunner(cmd="PATH=x\r\n"))
    with pytest.raises(ToolchainError, match="set up MSVC 14.38.33130, not 14.44.35207"):
        msvc.capture_vcvars(ts, base_env={}, runner=FakeRunner(cmd="VCToolsVersion=14.38.33130\r\n"))


def test_setup_checks_msc_ver_before_running_vcvars(tmp_path: Path) -> None:
    trees = {"e07a93d2": make_vs(tmp_path / "vs2026", tools=("14.44.35207", "14.50.35717")),
             "2b9c1f4e": make_vs(tmp_path / "bt2022", tools=("14.42.34433",))}
    env = installer(tmp_path)
    runner = FakeRunner(vswhere=recorded("buildtools-and-vs2026.json", trees),
                        cmd=set_output(env, {"VCToolsVersion": "14.44.35207", "INCLUDE": "x"}))
    with pytest.raises(ToolchainError, match="too new for CUDA 12.8.1"):
        msvc.setup(env=env, version_range=None, runner=runner, cuda="12.8.1")
    assert [Path(a[0]).name for a, _ in runner.calls] == ["vswhere.exe"]  # vcvars never ran
    done = msvc.setup(env=env, version_range=None, runner=runner, cuda="12.8.1", toolset="14.44")
    assert done.toolset.instance.name == "Visual Studio Community 2026"
    assert done.env == {"INCLUDE": "x", "VCToolsVersion": "14.44.35207"}
    assert runner.calls[-1][0][5] == "-vcvars_ver=14.44.35207"
    ok = msvc.setup(env=env, version_range="[17.0,18.0)", runner=FakeRunner(
        vswhere=recorded("buildtools-and-vs2026.json", trees), cmd="VCToolsVersion=14.42.34433\r\n"), cuda="12.8.1")
    assert (ok.toolset.version, ok.toolset.msc_ver) == ("14.42.34433", 1942)


def test_the_process_runner_runs_real_programs() -> None:
    run = msvc.process_runner(Log(quiet=True))
    assert run([sys.executable, "-c", "print('VCToolsVersion=14.44.35207')"], dict(os.environ)) == "VCToolsVersion=14.44.35207\n"
    with pytest.raises(ToolchainError) as e:
        run([sys.executable, "-c", "import sys; print('[ERROR:vcvars.bat] Toolset not found'); sys.exit(1)"], dict(os.environ))
    assert e.value.exit_code == 3 and "[ERROR:vcvars.bat] Toolset not found" in e.value.details


# ------------------------------------------------------------------------------------------------ redist


def test_runtime_dirs_per_openmp_choice_never_onecore(tmp_path: Path) -> None:
    ts = _toolset(tmp_path)
    r = ts.redist_dir
    crt, vcomp, llvm = (r / "x64" / "Microsoft.VC143.CRT", r / "x64" / "Microsoft.VC143.OpenMP",
                        r / "debug_nonredist" / "x64" / "Microsoft.VC143.OpenMP.LLVM")
    assert msvc.runtime_dirs(ts, openmp="vcomp") == (crt, vcomp)
    assert msvc.runtime_dirs(ts, openmp="libomp") == (crt, llvm)
    assert msvc.runtime_dirs(ts, openmp="auto") == (crt, vcomp, llvm)
    assert msvc.runtime_dirs(ts, openmp="none") == (crt,)


@pytest.mark.parametrize(("imports", "openmp", "what"), [
    (["vcomp140.dll"], "libomp", "the binaries import vcomp140.dll but runtime.openmp is libomp"),
    (["libomp140.x86_64.dll"], "vcomp", "the binaries import libomp140.x86_64.dll but runtime.openmp is vcomp"),
    (["VCOMP140.DLL"], "none", "the binaries import VCOMP140.DLL but runtime.openmp is none"),
])
def test_an_openmp_mismatch_is_an_error(imports: list[str], openmp: str, what: str) -> None:
    with pytest.raises(ToolchainError) as e:
        msvc.check_openmp(imports, openmp=openmp)
    assert e.value.what == what
    for fine in ("auto", {"vcomp140.dll": "vcomp"}.get(imports[0].lower(), "libomp")):
        if not (openmp == fine):
            msvc.check_openmp(imports, openmp=fine)  # what was imported is what is shipped: no error


def test_a_directory_without_the_crt_is_not_a_redist(tmp_path: Path) -> None:
    with pytest.raises(ToolchainError, match="holds no MSVC CRT"):
        msvc.redist_dirs(tmp_path, openmp="auto")


def test_vs2026_redist_folders_are_found_too(tmp_path: Path) -> None:
    ts = _toolset(tmp_path, tools=("14.50.35717",), redist="14.50.35710", crt_dir="Microsoft.VC145.CRT")
    assert msvc.runtime_dirs(ts, openmp="vcomp") == (ts.redist_dir / "x64" / "Microsoft.VC145.CRT",
                                                     ts.redist_dir / "x64" / "Microsoft.VC145.OpenMP")


@pytest.mark.skipif(shutil.which(CC) is None, reason=f"{CC} (mingw-w64) is needed to build real PE files")
def test_the_pe_closure_finds_the_msvc_runtime_in_the_redist(built: Built, tmp_path: Path) -> None:
    dll = (built / "cudart64_12.dll").read_bytes()  # a real x64 DLL stands in for each redist file
    ts = _toolset(tmp_path, dll=dll)
    onecore = ts.redist_dir / "onecore" / "x64" / "Microsoft.VC143.CRT" / "msvcp140.dll"
    assert onecore.is_file()
    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    shutil.copy(built / "msvcapp.exe", bundle_dir / "llama-server.exe")
    c = resolve_closure([bundle_dir / "llama-server.exe"], bundle_dir=bundle_dir,
                        extra_dirs=msvc.runtime_dirs(ts, openmp="auto"))
    got = {d.name: (d.cls, d.path) for d in c.deps if d.cls not in (DllClass.SYSTEM, DllClass.DRIVER)}
    crt, omp = ts.redist_dir / "x64" / "Microsoft.VC143.CRT", ts.redist_dir / "x64" / "Microsoft.VC143.OpenMP"
    assert got == {"msvcp140.dll": (DllClass.MSVC_RUNTIME, crt / "msvcp140.dll"),
                   "vcomp140.dll": (DllClass.OPENMP, omp / "vcomp140.dll"),
                   "vcruntime140.dll": (DllClass.MSVC_RUNTIME, crt / "vcruntime140.dll")}
    assert c.missing == {}
    msvc.check_openmp([d.name for d in c.deps], openmp="vcomp")
