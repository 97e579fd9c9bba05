"""`llamabundle show` of the MSVC CUDA recipe, run as a real process on Linux: vswhere.exe (where the Visual
Studio Installer puts it, under %ProgramFiles(x86)%) is a script that prints the recorded vswhere output
(tests/data/vswhere) pointed at a Visual Studio tree made in a temp dir, and cmd.exe (first on PATH) is a
script that checks it is asked to run exactly vcvars64.bat and `set`, then prints the environment with the
vcvars variables (tests/data/vcvars, a stand-in) laid over it. So the toolchain lines, the environment
and the configure line `show` prints come from the real code path: find_vswhere, proc.run, vcvars_argv,
parse_set_output and env_diff, with only the two Windows programs stood in for."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.vstrees import make_vs, recorded

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/windows-x86_64-cuda12.8.yaml"
LISTING = ROOT / "tests" / "data" / "vcvars" / "set-windows-2022-14.44.txt"
VSWHERE_ARGS = ("-products * -requires Microsoft.VisualStudio.Component.VC.Tools.x86.x64 -version [17.0,18.0) "
                "-format json -utf8")

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="stands in for the Windows programs with scripts")

# cmd.exe, as `call <vcvars64.bat> -vcvars_ver=<toolset> >nul && set` runs it: a Python script (a shell would
# drop ProgramFiles(x86), which is not a shell variable name, and add PWD to the listing `set` prints).
CMD = '''#!{python}
"""Stands in for cmd.exe running vcvars64.bat (tests/unit/test_show_msvc.py)."""
import os, pathlib, sys
pathlib.Path({marker!r}).touch()
want = ["/d", "/c", "call", {vcvars!r}, "-vcvars_ver=14.44.35207", ">nul", "&&", "set"]
if sys.argv[1:] != want:
    print("cmd.exe stand-in: not the vcvars command line:", sys.argv[1:], file=sys.stderr)
    sys.exit(1)
vcvars = dict(line.split("=", 1) for line in pathlib.Path({listing!r}).read_text(encoding="utf-8").splitlines() if line)
env = {{("Path" if k == "PATH" else k): v for k, v in os.environ.items()}}
env.update(vcvars)
sys.stdout.write("".join(f"{{k}}={{v}}\\r\\n" for k, v in sorted(env.items(), key=lambda kv: kv[0].upper())))
'''

VSWHERE = '''#!/bin/sh
# Stands in for vswhere.exe (tests/unit/test_show_msvc.py): the recorded output, for the arguments show passes.
if [ "$*" != {args} ]; then
    echo "vswhere stand-in: unexpected arguments: $*" >&2
    exit 1
fi
cat {json}
'''


def listing() -> dict[str, str]:
    lines = LISTING.read_text(encoding="utf-8").splitlines()
    return dict(line.split("=", 1) for line in lines if line)


def script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
    return path


class Machine:
    """A Visual Studio tree, vswhere.exe where the installer puts it, and cmd.exe first on PATH."""

    def __init__(self, tmp: Path, *, tools: Sequence[str] = ("14.44.35207",), vswhere: bool = True,
                 vcvars_listing: Path = LISTING) -> None:
        self.vs = make_vs(tmp / "vs", tools=tools)
        self.vcvars = self.vs / "VC" / "Auxiliary" / "Build" / "vcvars64.bat"
        self.marker = tmp / "cmd-was-run"
        bin_dir = tmp / "bin"
        script(bin_dir / "cmd.exe", CMD.format(python=sys.executable, marker=str(self.marker),
                                               vcvars=str(self.vcvars), listing=str(vcvars_listing)))
        home = tmp / "home"
        home.mkdir()
        self.env = {"PATH": os.pathsep.join([str(bin_dir), os.defpath]), "HOME": str(home), "LANG": "C.UTF-8",
                    "LLAMABUNDLE_CACHE_DIR": str(tmp / "cache")}
        if vswhere:
            pf86 = tmp / "Program Files (x86)"
            answer = pf86 / "vswhere-answer.json"
            answer.parent.mkdir(parents=True)
            answer.write_text(recorded("windows-2022-runner.json", {"8f3e5ef8": self.vs}), encoding="utf-8")
            script(pf86 / "Microsoft Visual Studio" / "Installer" / "vswhere.exe",
                   VSWHERE.format(args=shlex.quote(VSWHERE_ARGS), json=shlex.quote(str(answer))))
            self.env["ProgramFiles(x86)"] = str(pf86)

    def show(self, *extra: str, recipe: str | Path = RECIPE) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "llamabundle", "show", str(recipe), *extra], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return done


def lines_of(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


def show_schema() -> dict[str, Any]:
    text = (resources.files("llamabundle.data") / "schemas" / "cli-show.schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def test_show_sets_up_msvc_through_vswhere_and_vcvars(tmp_path: Path) -> None:
    m = Machine(tmp_path)
    out = m.show().stdout
    assert m.marker.exists()
    vcvars_line = shlex.join(["cmd.exe", "/d", "/c", "call", str(m.vcvars), "-vcvars_ver=14.44.35207", ">nul", "&&",
                              "set"])
    assert vcvars_line.endswith(" -vcvars_ver=14.44.35207 '>nul' '&&' set")  # what shlex.join makes of cmd's syntax
    redist = m.vs / "VC" / "Redist" / "MSVC" / "14.44.35112"
    assert lines_of(out, "toolchain ") == [
        f"toolchain Visual Studio: Visual Studio Enterprise 2022 17.14.5 at {m.vs} (msvc_version [17.0,18.0))",
        "toolchain toolset: MSVC 14.44.35207 (pinned by toolchain.toolset; _MSC_VER 1944, accepted by CUDA 12.8.1)",
        f"toolchain environment: {vcvars_line}",
        f"toolchain redist: {redist}",
    ]
    assert lines_of(out, "pinned    ") == ["pinned    MSVC toolset 14.44.35207 (cl 19.44), pinned: vcvars64.bat "
                                        "-vcvars_ver=14.44.35207 of a Visual Studio in [17.0,18.0)"]
    vc = listing()
    env_lines = lines_of(out, "env       ")
    assert "env       VCToolsVersion=14.44.35207" in env_lines
    assert f"env       INCLUDE={vc['INCLUDE']}" in env_lines
    assert f"env       PATH={vc['Path']}" in env_lines  # spelled as the environment spells it: it replaces PATH
    assert len(env_lines) == len(vc)  # what vcvars set, nothing of the environment it did not change
    (configure,) = lines_of(out, "configure ")
    argv = shlex.split(configure.removeprefix("configure "))
    assert Path(argv[0]).name == "cmake" and argv[1] == "-S"
    assert {"-DCMAKE_C_COMPILER=cl", "-DCMAKE_CXX_COMPILER=cl", "-DGGML_CUDA=ON"} <= set(argv)


def test_show_json_has_the_toolchain_and_the_vcvars_environment(tmp_path: Path) -> None:
    m = Machine(tmp_path)
    data = json.loads(m.show("--json").stdout)
    jsonschema.Draft202012Validator(show_schema()).validate(data)
    tc = data["toolchain"]
    assert tc["summary"] and tc["summary"][1] == "toolset: MSVC 14.44.35207 (pinned by toolchain.toolset; _MSC_VER 1944, accepted by CUDA 12.8.1)"
    assert tc["unavailable"] is None
    vc = listing()
    assert data["plan"]["env"] == {("PATH" if k == "Path" else k): v for k, v in vc.items()}
    assert data["plan"]["env"]["VCToolsVersion"] == "14.44.35207" and data["plan"]["env"]["INCLUDE"] == vc["INCLUDE"]
    # the bundle's own programs are built by MSVC too, beside llama-server (targets of the same cmake --build)
    assert {"llama-server.exe", "llamabundle-probe.exe", "llamabundle-memory.exe"} <= set(data["plan"]["programs"])
    assert {"llamabundle-probe", "llamabundle-memory"} <= set(data["plan"]["build"])
    redist = m.vs / "VC" / "Redist" / "MSVC" / "14.44.35112"
    assert tc["runtime_dirs"] == {str(redist / "x64" / "Microsoft.VC143.CRT"): "msvc-redist",
                                  str(redist / "x64" / "Microsoft.VC143.OpenMP"): "msvc-redist",  # runtime.openmp auto
                                  str(redist / "debug_nonredist" / "x64" / "Microsoft.VC143.OpenMP.LLVM"): "msvc-redist"}


def test_show_names_a_pinned_toolset_that_is_not_installed(tmp_path: Path) -> None:
    m = Machine(tmp_path, tools=("14.50.35717",))
    (line,) = lines_of(m.show().stdout, "toolchain ")
    assert line == ("toolchain not set up here: MSVC toolset 14.44.35207 is not installed in Visual Studio Enterprise "
                    "2022 (installed: 14.50.35717)")
    assert not m.marker.exists()


def test_show_a_toolset_cuda_refuses_is_reported_before_vcvars_runs(tmp_path: Path) -> None:
    m = Machine(tmp_path, tools=("14.50.35717",))
    unpinned = tmp_path / "unpinned.yaml"  # the default toolset of the Visual Studio found
    unpinned.write_text((ROOT / RECIPE).read_text(encoding="utf-8").replace(', toolset: "14.44.35207"', ""), encoding="utf-8")
    out = m.show(recipe=unpinned).stdout
    (line,) = lines_of(out, "toolchain ")
    assert line.startswith("toolchain not set up here: MSVC toolset 14.50.35717 (_MSC_VER 1950) is too new for "
                           "CUDA 12.8.1 (CUDA 12.8's crt/host_config.h rejects _MSC_VER >= 1950")
    assert not m.marker.exists()  # the _MSC_VER check comes before vcvars64.bat
    assert lines_of(out, "env ") == [] and lines_of(out, "configure ")
    data = json.loads(m.show("--json", recipe=unpinned).stdout)
    jsonschema.Draft202012Validator(show_schema()).validate(data)
    assert data["toolchain"]["pin"].startswith("MSVC: the default toolset of a Visual Studio in [17.0,18.0)")
    assert data["toolchain"]["summary"] == [] and data["toolchain"]["runtime_dirs"] == {}
    assert data["toolchain"]["unavailable"].startswith("MSVC toolset 14.50.35717 (_MSC_VER 1950) is too new")
    assert "env" not in data["plan"] or data["plan"]["env"] == {}


def test_show_without_vswhere_says_so(tmp_path: Path) -> None:
    m = Machine(tmp_path, vswhere=False)
    assert shutil.which("vswhere", path=m.env["PATH"]) is None
    out = m.show().stdout
    assert ("toolchain not set up here: vswhere.exe was not found (looked at %ProgramFiles(x86)% (unset) and on PATH)"
            in out.splitlines())
    assert not m.marker.exists() and lines_of(out, "configure ")


def test_show_finds_cmake_where_the_build_does_on_the_vcvars_path(tmp_path: Path) -> None:
    vs_tools = tmp_path / "vs-cmake"  # Visual Studio's own CMake and Ninja, on the Path vcvars64.bat sets
    for tool in ("cmake", "ninja"):
        script(vs_tools / tool, "#!/bin/sh\nexit 0\n")
    caller_path = os.pathsep.join([str(tmp_path / "m" / "bin"), os.defpath])  # the PATH Machine gives show
    vc = {**listing(), "Path": os.pathsep.join([str(vs_tools), caller_path])}
    variant = tmp_path / "set.txt"
    variant.write_text("".join(f"{k}={v}\n" for k, v in vc.items()), encoding="utf-8")
    m = Machine(tmp_path / "m", vcvars_listing=variant)
    assert m.env["PATH"] == caller_path
    out = m.show().stdout
    assert f"env       PATH={vc['Path']}" in out.splitlines()
    (configure,) = lines_of(out, "configure ")
    argv = shlex.split(configure.removeprefix("configure "))
    assert argv[0] == str(vs_tools / "cmake") and f"-DCMAKE_MAKE_PROGRAM={vs_tools / 'ninja'}" in argv
