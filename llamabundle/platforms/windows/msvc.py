"""MSVC on Windows: Visual Studio found through vswhere, the vcvars64.bat environment, the toolset and
its _MSC_VER (checked against what the recipe's CUDA accepts, before the build), and the redist DLLs
(CRT and OpenMP) a bundle carries. Every function takes its paths and environment as parameters, and
programs run through a `runner`, so all of it is testable on any OS."""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from ... import data, proc, untrusted
from ...compilers import cl_version
from ...deps.pe import DllClass, pe_policy
from ...errors import RecipeError, ToolchainError
from ...log import Log
from ...recipe import OpenMP, Recipe
from ..base import HostToolchain

Runner = Callable[[Sequence[str], Mapping[str, str]], str]  # (argv, env) -> output; raises on failure
INSTALL_FIX = ("install Visual Studio 2022 or its Build Tools with the \"Desktop development with C++\" workload "
               "(component Microsoft.VisualStudio.Component.VC.Tools.x86.x64)")


@cache
def knowledge() -> dict[str, Any]:
    info: dict[str, Any] = data.load("msvc.json")
    for cuda, (lo, hi) in info["cuda_host_msc_ver"].items():
        assert 1900 <= lo < hi, cuda
    return info


def process_runner(log: Log) -> Runner:
    """The real runner: proc.run (echoes `+ cmd`, raises ToolchainError with the output's tail)."""
    def run(argv: Sequence[str], env: Mapping[str, str]) -> str:
        return proc.run(argv, log=log, error=ToolchainError, what=f"{Path(argv[0]).name} failed", env=env,
                        fix=INSTALL_FIX)
    return run


def env_get(env: Mapping[str, str], name: str) -> str | None:
    """Windows variable names are case-insensitive."""
    return next((v for k, v in env.items() if k.upper() == name.upper()), None)


# ------------------------------------------------------------------------------------------------ vswhere


@dataclass(frozen=True, kw_only=True)
class VsInstance:
    instance_id: str
    path: Path  # installationPath
    version: str  # installationVersion, e.g. 17.14.36127.28
    display_version: str  # catalog.productDisplayVersion, e.g. 17.14.4
    name: str  # displayName
    complete: bool
    prerelease: bool


def find_vswhere(env: Mapping[str, str]) -> Path:
    """vswhere.exe where the Visual Studio Installer puts it, else on PATH."""
    tried = []
    base = env_get(env, "ProgramFiles(x86)")
    if base:
        exe = Path(base).joinpath(*knowledge()["vswhere"]["path"])
        if exe.is_file():
            return exe
        tried.append(str(exe))
    on_path = shutil.which("vswhere", path=env_get(env, "PATH"))
    if on_path:
        return Path(on_path)
    raise ToolchainError("vswhere.exe was not found", why=f"looked at {', '.join(tried) or '%ProgramFiles(x86)% (unset)'} "
                         "and on PATH", fix=INSTALL_FIX)


def vswhere_argv(vswhere: Path, version_range: str | None) -> list[str]:
    argv = [str(vswhere), "-products", "*", "-requires", knowledge()["vswhere"]["component"]]
    if version_range:
        argv += ["-version", version_range]
    return argv + ["-format", "json", "-utf8"]


def parse_vswhere(text: str) -> tuple[VsInstance, ...]:
    try:
        raw = untrusted.loads(text)
        return tuple(VsInstance(instance_id=i["instanceId"], path=Path(i["installationPath"]),
                                version=i["installationVersion"],
                                display_version=i.get("catalog", {}).get("productDisplayVersion", i["installationVersion"]),
                                name=i.get("displayName", i["installationPath"]), complete=i.get("isComplete", True),
                                prerelease=i.get("isPrerelease", False)) for i in raw)
    except (ValueError, TypeError, KeyError) as e:
        raise ToolchainError("vswhere's output is not the JSON list it should be", why=f"{type(e).__name__}: {e}",
                             details=text[:2000]) from None


def version_in_range(version: str, spec: str) -> bool:
    """vswhere's range syntax: "[17.0,18.0)", "(17.0,]", or "17.0" (at least)."""
    try:
        v = Version(version)
        s = spec.strip()
        if s[:1] in "[(" and s[-1:] in ")]":
            lo, sep, hi = s[1:-1].partition(",")
            if not sep:
                raise InvalidVersion(spec)
            if lo.strip() and (v < Version(lo) or (s[0] == "(" and v == Version(lo))):
                return False
            return not (hi.strip() and (v > Version(hi) or (s[-1] == ")" and v == Version(hi))))
        return v >= Version(s)
    except (InvalidVersion, IndexError):
        raise RecipeError(f"toolchain.msvc_version {spec!r} is not a version range",
                          fix='write a vswhere range such as "[17.0,18.0)"') from None


def pick_instance(instances: Iterable[VsInstance], *, version_range: str | None) -> VsInstance:
    """The newest complete instance in the range."""
    seen = list(instances)
    fit = [i for i in seen if i.complete and (not version_range or version_in_range(i.version, version_range))]
    if not fit:
        found = "; ".join(f"{i.name} {i.version}{'' if i.complete else ' (incomplete)'} at {i.path}" for i in seen)
        raise ToolchainError(f"no Visual Studio with the C++ x64 tools{' in ' + version_range if version_range else ''}",
                             why=f"vswhere found: {found}" if found else "vswhere found no Visual Studio with the C++ x64 tools",
                             fix=INSTALL_FIX + (", or widen toolchain.msvc_version" if found else ""))
    return max(fit, key=lambda i: Version(i.version))


def find_instance(*, env: Mapping[str, str], version_range: str | None, runner: Runner) -> VsInstance:
    return pick_instance(parse_vswhere(runner(vswhere_argv(find_vswhere(env), version_range), env)),
                         version_range=version_range)


# ------------------------------------------------------------------------------------------------ toolset


@dataclass(frozen=True, kw_only=True)
class Toolset:
    instance: VsInstance
    vcvars: Path
    version: str  # VC\Tools\MSVC\<version>, e.g. 14.44.35207
    pinned: str  # what vcvars64.bat is given as -vcvars_ver: the toolset found, so vcvars cannot pick another
    msc_ver: int  # e.g. 1944
    installed: tuple[str, ...]  # every toolset version under VC\Tools\MSVC
    redist_version: str
    redist_dir: Path  # VC\Redist\MSVC\<redist_version>


def msc_ver(toolset_version: str) -> int:
    """_MSC_VER of an MSVC toolset: 14.44.35207 -> 1944 (cl.exe 19.44), 14.50 -> 1950."""
    m = re.match(r"^14\.(\d+)", toolset_version.strip())
    if not m:
        raise ToolchainError(f"MSVC toolset version {toolset_version!r} is not 14.x", fix="report this to llamabundle")
    return 1900 + int(m.group(1))


def msc_ver_from_banner(text: str) -> int:
    """_MSC_VER from cl.exe's banner, "... Compiler Version 19.44.35207.1 for x64" -> 1944."""
    version = cl_version(text)
    if version is None:
        raise ToolchainError("cl.exe printed no version banner", details=text[:500])
    major, minor = version.split(".")[:2]
    return int(major) * 100 + int(minor)


def _read_version(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except OSError:
        raise ToolchainError(f"{path} is missing", why="every MSVC install writes it",
                             fix="repair Visual Studio, or " + INSTALL_FIX) from None


def locate_toolset(instance: VsInstance, *, toolset: str | None = None) -> Toolset:
    """vcvars64.bat, the toolset (the default one, or the newest 14.xx.* matching `toolset`) and the redist."""
    build = instance.path / "VC" / "Auxiliary" / "Build"
    vcvars = build / "vcvars64.bat"
    if not vcvars.is_file():
        raise ToolchainError(f"{instance.name} has no {vcvars}", why="the C++ x64 tools are not installed there",
                             fix=INSTALL_FIX)
    tools = instance.path / "VC" / "Tools" / "MSVC"
    installed = tuple(sorted((d.name for d in tools.iterdir() if d.is_dir() and re.match(r"^\d+\.\d+\.\d+$", d.name)),
                             key=Version)) if tools.is_dir() else ()
    if toolset:
        matches = [v for v in installed if v == toolset or v.startswith(toolset + ".")]
        if not matches:
            raise ToolchainError(f"MSVC toolset {toolset} is not installed in {instance.name}",
                                 why=f"installed: {', '.join(installed) or 'none'}",
                                 fix=f"add the MSVC v{toolset} build tools in the Visual Studio Installer (Individual components)")
        version = matches[-1]
    else:
        version = _read_version(build / "Microsoft.VCToolsVersion.default.txt")
        if version not in installed:
            raise ToolchainError(f"the default MSVC toolset {version} is not under {tools}", fix="repair Visual Studio")
    redist_version = _read_version(build / "Microsoft.VCRedistVersion.default.txt")
    redist_dir = instance.path / "VC" / "Redist" / "MSVC" / redist_version
    if not redist_dir.is_dir():
        raise ToolchainError(f"the MSVC redist directory {redist_dir} is missing", fix="repair Visual Studio")
    return Toolset(instance=instance, vcvars=vcvars, version=version, pinned=version, msc_ver=msc_ver(version),
                   installed=installed, redist_version=redist_version, redist_dir=redist_dir)


def cuda_msc_range(cuda: str) -> tuple[int, int] | None:
    """[lowest, highest exclusive) _MSC_VER that CUDA `cuda` (major.minor[.patch]) accepts as host compiler."""
    table = knowledge()["cuda_host_msc_ver"]
    want = Version(".".join(cuda.split(".")[:2]))
    known = [k for k in table if Version(k) <= want and Version(k).major == want.major]
    if not known:
        return None
    lo, hi = table[max(known, key=Version)]
    return lo, hi


def check_cuda_host(msc: int, cuda: str, *, toolset: Toolset | None = None) -> None:
    """Before the build: nvcc's crt/host_config.h must accept this _MSC_VER, else fail now with the fix."""
    limits = cuda_msc_range(cuda)
    if limits is None or limits[0] <= msc < limits[1]:
        return
    lo, hi = limits
    cuda_mm = ".".join(cuda.split(".")[:2])
    what = f"MSVC toolset {toolset.version} (_MSC_VER {msc})" if toolset else f"MSVC with _MSC_VER {msc}"
    ok = [v for v in (toolset.installed if toolset else ()) if lo <= msc_ver(v) < hi]
    if ok:
        fix = f"build with the installed toolset {ok[-1]} (vcvars64.bat -vcvars_ver={'.'.join(ok[-1].split('.')[:2])})"
    elif msc >= hi:
        series = f"14.{(hi - 1 - 1900) // 10}x"
        fix = (f"install an MSVC v{series} toolset (Visual Studio Installer, Individual components: \"MSVC v143 - VS 2022 "
               f"C++ x64/x86 build tools (v{series})\") and build with it (-vcvars_ver=14.{hi - 1 - 1900 - 5}, say), or use a CUDA toolkit "
               f"that accepts _MSC_VER {msc}")
    else:
        fix = f"install a newer Visual Studio (toolset 14.{lo - 1900} or later)"
    raise ToolchainError(f"{what} is {'too new' if msc >= hi else 'too old'} for CUDA {cuda}",
                         why=f"CUDA {cuda_mm}'s crt/host_config.h rejects _MSC_VER {'>= ' + str(hi) if msc >= hi else '< ' + str(lo)} "
                             "(\"unsupported Microsoft Visual Studio version\")", fix=fix)


def pin_summary(recipe: Recipe) -> str:
    """What the recipe pins of MSVC and how a build selects it, said without Windows (for `show`)."""
    t = recipe.toolchain
    where = f"a Visual Studio in {t.msvc_version}" if t.msvc_version else "the newest Visual Studio"
    if t.toolset:
        return f"MSVC toolset {t.toolset} (cl {cl_of_toolset(t.toolset)}), pinned: vcvars64.bat -vcvars_ver={t.toolset} of {where}"
    return f"MSVC: the default toolset of {where} (toolchain.toolset pins none: any such toolset builds under one key)"


def cl_of_toolset(toolset: str) -> str:
    """cl.exe's version series of a toolset: 14.44.35207 -> 19.44 (its _MSC_VER is 1944)."""
    return f"19.{msc_ver(toolset) - 1900}"


# ------------------------------------------------------------------------------------------------ vcvars


def vcvars_argv(toolset: Toolset) -> list[str]:
    """cmd runs vcvars64.bat, then `set` prints the resulting environment. No argument carries a quote
    character (subprocess would escape it as \\", which cmd does not understand); the path is quoted by
    subprocess as one argument, and cmd, with the line not starting with a quote, leaves it as is."""
    return ["cmd.exe", "/d", "/c", "call", str(toolset.vcvars), f"-vcvars_ver={toolset.pinned}", ">nul", "&&", "set"]


def parse_set_output(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key and not key.startswith((" ", "*", "[")):
            out[key] = value.rstrip("\r")
    return out


def env_diff(base: Mapping[str, str], new: Mapping[str, str]) -> dict[str, str]:
    """What vcvars added or changed (names compared case-insensitively, as Windows does), each spelled as
    `base` spells it, so that laying the result over `base` replaces a variable instead of doubling it."""
    spelled = {k.upper(): k for k in base}
    upper = {k.upper(): v for k, v in base.items()}
    return {spelled.get(k.upper(), k): v for k, v in sorted(new.items()) if upper.get(k.upper()) != v}


def capture_vcvars(toolset: Toolset, *, base_env: Mapping[str, str], runner: Runner) -> dict[str, str]:
    """The variables vcvars64.bat sets (PATH, INCLUDE, LIB, VCToolsVersion, ...) on top of base_env."""
    diff = env_diff(base_env, parse_set_output(runner(vcvars_argv(toolset), base_env)))
    got = env_get(diff, "VCToolsVersion")
    if not got:
        raise ToolchainError(f"{toolset.vcvars.name} did not set up the MSVC environment",
                             why="its environment has no VCToolsVersion", fix="run it by hand to see why; repair Visual Studio")
    if got.strip().rstrip("\\") != toolset.version:
        raise ToolchainError(f"{toolset.vcvars.name} set up MSVC {got.strip()}, not {toolset.version}",
                             fix="pass the toolset explicitly (-vcvars_ver)")
    return diff


@dataclass(frozen=True, kw_only=True)
class MsvcSetup:
    toolset: Toolset
    env: dict[str, str]  # the vcvars variables to lay over the build's environment


def setup(*, env: Mapping[str, str], version_range: str | None, runner: Runner, cuda: str | None = None,
          toolset: str | None = None) -> MsvcSetup:
    """vswhere -> newest instance in range -> toolset -> _MSC_VER check against CUDA -> vcvars environment."""
    ts = locate_toolset(find_instance(env=env, version_range=version_range, runner=runner), toolset=toolset)
    if cuda:
        check_cuda_host(ts.msc_ver, cuda, toolset=ts)
    return MsvcSetup(toolset=ts, env=capture_vcvars(ts, base_env=env, runner=runner))


# ------------------------------------------------------------------------------------------------ redist


def _dirs(base: Path, globs: Iterable[str]) -> list[Path]:
    out = [d for g in globs for d in sorted(base.glob(g)) if d.is_dir()]
    return [d for d in out if "onecore" not in (p.lower() for p in d.relative_to(base).parts)]


def redist_dirs(redist: Path, *, openmp: OpenMP, instance: Path | None = None) -> tuple[Path, ...]:
    """Where the CRT and the chosen OpenMP runtime live under VC\\Redist\\MSVC\\<version> (and, for libomp,
    the instance's LLVM tools): the extra dirs of the PE closure; never onecore. Raises when the CRT is not
    there (not a redist directory)."""
    r = knowledge()["redist"]
    out = _dirs(redist, r["crt"])
    if not out:
        raise ToolchainError(f"{redist} holds no MSVC CRT", why=f"no {' or '.join(r['crt'])} under it",
                             fix="pass the VC\\Redist\\MSVC\\<version> directory of a Visual Studio with the C++ x64 tools")
    if openmp in ("vcomp", "auto"):
        out += _dirs(redist, r["vcomp"])
    if openmp in ("libomp", "auto"):
        out += _dirs(redist, r["libomp"]) + (_dirs(instance, r["libomp_tools"]) if instance else [])
    return tuple(out)


def runtime_dirs(toolset: Toolset, *, openmp: OpenMP) -> tuple[Path, ...]:
    """The redist directories of a located toolset."""
    return redist_dirs(toolset.redist_dir, openmp=openmp, instance=toolset.instance.path)


def check_openmp(imports: Iterable[str], *, openmp: str) -> None:
    """The OpenMP runtime the binaries import is the one runtime.openmp ships: a mismatch (vcomp asked,
    libomp imported; none asked, one imported) is an error before anything is packed."""
    policy = pe_policy()
    names = {n.lower(): n for n in imports}
    omp = sorted(n for n in names if policy.classify(n) is DllClass.OPENMP)
    wanted = knowledge()["openmp_dll"].get(openmp)
    stray = [names[n] for n in omp if openmp == "none" or (wanted and n != wanted)]
    if stray:
        raise ToolchainError(f"the binaries import {', '.join(stray)} but runtime.openmp is {openmp}",
                             why="the OpenMP runtime shipped must be the one the compiler linked",
                             fix="set runtime.openmp to auto (or to match the compiler's /openmp flag), or build with GGML_OPENMP=OFF")


NOTICE = "LICENSE-MSVC-REDIST.txt"


def copy_notice(stage: Path) -> list[str]:
    """The terms under which the MSVC CRT and OpenMP DLLs are redistributed (the redist directory carries
    no licence file of its own)."""
    from importlib import resources

    text = resources.files(data.__name__).joinpath("MSVC-REDIST-NOTICE.txt").read_text(encoding="utf-8")
    (stage / NOTICE).write_text(text, encoding="utf-8")
    return [NOTICE]


# ------------------------------------------------------------------------------------------------ the build's


def host_toolchain(recipe: Recipe, *, env: Mapping[str, str], log: Log, runner: Runner | None = None) -> HostToolchain:
    """Visual Studio in the recipe's msvc_version range, its toolset pinned and checked against the CUDA
    host range (before the build), and the vcvars64.bat environment the configure and build run in."""
    run = runner or process_runner(log)
    cuda = recipe.cuda.toolkit if recipe.cuda else None
    with log.step("MSVC (vswhere, vcvars64.bat)"):
        got = setup(env=env, version_range=recipe.toolchain.msvc_version, runner=run, cuda=cuda,
                    toolset=recipe.toolchain.toolset)
    ts = got.toolset
    dirs = runtime_dirs(ts, openmp=recipe.runtime.openmp)
    summary = (f"Visual Studio: {ts.instance.name} {ts.instance.display_version} at {ts.instance.path} "
               f"(msvc_version {recipe.toolchain.msvc_version or 'any'})",
               f"toolset: MSVC {ts.version} ({'pinned by toolchain.toolset' if recipe.toolchain.toolset else 'the default: the recipe pins none'}; "
               f"_MSC_VER {ts.msc_ver}{', accepted by CUDA ' + cuda if cuda else ''})",
               "environment: " + shlex.join(vcvars_argv(ts)),
               f"redist: {ts.redist_dir}")
    for line in summary:
        log.info(f"    {line}")
    return HostToolchain(env=got.env, runtime_dirs=tuple((d, "msvc-redist") for d in dirs), summary=summary)
