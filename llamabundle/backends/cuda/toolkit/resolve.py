"""Pick the toolkit a CUDA recipe builds with, and check it before a long build starts; plan and install a
toolkit from a given source (`llamabundle toolkit plan|install`)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .... import data, proc
from ....errors import ToolchainError
from ....log import Log
from ....recipe import Recipe
from ....settings import Settings
from .layout import Toolkit
from .manifest import Manifest
from .plan import ToolkitPlan, plan_toolkit
from .system import DEFAULT_ROOTS, find_system_toolkit

if TYPE_CHECKING:
    from .installer import InstallerPlan
    from .installer import InstallResult as InstallerResult
    from .pypi import WheelRecord
    from .redist import InstallResult as RedistResult


def resolve_toolkit(recipe: Recipe, *, settings: Settings, log: Log, env: Mapping[str, str],
                    source: str | None = None, system_roots: Sequence[Path] = DEFAULT_ROOTS) -> Toolkit:
    """The toolkit for this recipe: an installed one of the same version (`system`), or one installed
    into the user cache from `redist`, `pypi` or `installer` (reused when already there)."""
    assert recipe.cuda is not None
    version = recipe.cuda.toolkit
    source = source or recipe.cuda.source
    if source == "system":
        tk, notes = find_system_toolkit(version, recipe.platform, env, system_roots)
        if tk is not None:
            log.info(f"    CUDA {version}: system toolkit at {tk.root}")
            return tk
        log.warn(f"no installed CUDA {version} ({'; '.join(notes) or 'none found'}); bootstrapping from redist")
        source = "redist"
    components = list(recipe.cuda.components)
    if source == "pypi":
        from .pypi import install_from_pypi

        return install_from_pypi(version=version, platform=recipe.platform, components=components, settings=settings, log=log)
    if source == "installer":
        from .installer import install_from_installer

        # settings.cuda_installer: a local copy of the .exe instead of the pinned URL
        return install_from_installer(version=version, platform=recipe.platform, components=components, settings=settings,
                                      log=log, installer=settings.cuda_installer, sha256=settings.cuda_installer_sha256)
    if source == "redist":
        from .redist import install_redist

        return install_redist(version=version, platform=recipe.platform, components=components, settings=settings, log=log)
    raise ToolchainError(f"the CUDA toolkit source '{source}' is not available in this version",
                         fix="use cuda.source: redist, pypi or system")


@dataclass(frozen=True, kw_only=True)
class WheelPlan:
    """A toolkit from PyPI wheels: the CUDA version, platform and components asked for, and their pinned wheels."""

    version: str
    platform: str
    components: list[str]
    wheels: list[WheelRecord]


def plan_source(source: str, *, version: str, platform: str, components: Sequence[str],
                manifest: Manifest | None = None, sha256: str | None = None) -> ToolkitPlan | InstallerPlan | WheelPlan:
    """What installing `components` of CUDA `version` for `platform` from `source` takes: the local installer's
    folders (`installer`; `sha256` for a version without a pinned one), the PyPI wheels (`pypi`), or the redist
    archives (`redist`, from `manifest` or the pinned one; plan_toolkit refuses any other source)."""
    if source == "installer":
        from .installer import plan_installer

        return plan_installer(version=version, components=components, platform=platform, sha256=sha256)
    if source == "pypi":
        from .plan import check_components
        from .pypi import plan_pypi

        check_components(components)  # as every other source: a toolkit is a compiler
        return WheelPlan(version=version, platform=platform, components=list(components),
                         wheels=plan_pypi(version, platform, components))
    return plan_toolkit(version=version, components=components, platform=platform, source=source, manifest=manifest)


def install_planned(plan: ToolkitPlan | InstallerPlan | WheelPlan, *, settings: Settings, log: Log,
                    dest: Path | None = None, installer: Path | None = None,
                    ) -> RedistResult | InstallerResult | Toolkit:
    """Install a plan_source plan into its content-addressed root under settings.cache_dir (or `dest`), reusing
    a complete install; the local installer's .exe from `installer` instead of the pinned URL. The result of
    redist.install or installer.install, or the Toolkit of PyPI wheels."""
    if isinstance(plan, WheelPlan):
        from .pypi import install_from_pypi

        return install_from_pypi(version=plan.version, platform=plan.platform, components=plan.components,
                                 settings=settings, log=log, dest=dest)
    if isinstance(plan, ToolkitPlan):
        from . import redist

        with log.step(f"CUDA {plan.version} toolkit ({plan.platform}, {len(plan.archives)} components)"):
            return redist.install(plan, cache_dir=settings.cache_dir, base_url=settings.cuda_redist_url, log=log,
                                  dest=dest, connect_timeout=settings.connect_timeout)
    from . import installer as installer_src

    with log.step(f"CUDA {plan.version} toolkit from the local installer ({len(plan.components)} components)"):
        return installer_src.install(plan, cache_dir=settings.cache_dir, log=log, installer=installer, dest=dest,
                                     connect_timeout=settings.connect_timeout)


def check_toolkit(tk: Toolkit, recipe: Recipe, *, env: Mapping[str, str]) -> dict[str, str]:
    """Before the build: nvcc's version equals the pinned one, and the host compiler is one this CUDA accepts.
    Returns {"nvcc": "13.0.88", "host": "gcc 12"}."""
    assert recipe.cuda is not None
    want = str(data.cuda_manifest(recipe.cuda.toolkit)["cuda_nvcc"]["version"])
    if not tk.nvcc.is_file():
        raise ToolchainError(f"the toolkit at {tk.root} has no nvcc", fix="add cuda_nvcc to cuda.components")
    out = proc.capture([str(tk.nvcc), "--version"], env=env).stdout
    m = re.search(r"release (\d+\.\d+), V(\d+\.\d+\.\d+)", out)
    got = m.group(2) if m else "unknown"
    if got != want:
        raise ToolchainError(f"nvcc at {tk.nvcc} is version {got}, the recipe pins CUDA {recipe.cuda.toolkit} (nvcc {want})",
                             fix="use a toolkit of the pinned version (llamabundle toolkit install RECIPE)")
    host = check_host_compiler(recipe, env=env)
    return {"nvcc": got, "host": host}


def check_host_compiler(recipe: Recipe, *, env: Mapping[str, str]) -> str:
    assert recipe.cuda is not None
    if recipe.toolchain.compiler == "msvc":
        return _check_msvc(recipe.cuda.toolkit, env=env)
    lo, hi = data.cuda_toolkits()[recipe.cuda.toolkit]["host_compilers"]["gcc"]
    if recipe.toolchain.compiler != "gcc":
        return recipe.toolchain.compiler
    res = proc.capture(["gcc", "-dumpversion"], env=env)
    major = int(res.stdout.strip().split(".")[0]) if res.returncode == 0 and res.stdout.strip() else -1
    if not lo <= major <= hi:
        raise ToolchainError(f"gcc {major} is not a host compiler CUDA {recipe.cuda.toolkit} accepts",
                             why=f"nvcc of CUDA {recipe.cuda.toolkit} supports gcc {lo} to {hi}",
                             fix=f"install a gcc between {lo} and {hi} and put it first on PATH")
    return f"gcc {major}"


def _check_msvc(toolkit: str, *, env: Mapping[str, str]) -> str:
    """The cl.exe the build's environment (vcvars64.bat's) puts first on PATH: its _MSC_VER in the range
    this CUDA accepts (msvc.check_cuda_host: the one table)."""
    from ....platforms.windows import msvc

    exe = shutil.which("cl", path=msvc.env_get(env, "PATH"))
    if exe is None:
        raise ToolchainError("cl.exe (MSVC) was not found on the build's PATH",
                             why="the CUDA host compiler on Windows is MSVC, and vcvars64.bat did not put it on PATH",
                             fix="install Visual Studio 2022 or its Build Tools with the C++ x64 tools")
    res = proc.capture([exe], env=env)
    msc = msvc.msc_ver_from_banner(res.stderr + res.stdout)
    msvc.check_cuda_host(msc, toolkit)
    return f"msvc {msc}"
