"""`llamabundle toolkit plan|install`: the CUDA toolkit a recipe needs, from NVIDIA's redist archives.

click commands only (DESIGN §8): parse, call the toolkit package, print, exit code. The group is
registered on the main `cli` group by cli.py; ctx.obj is cli.Ctx (settings, log).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import click

from .. import data
from ..backends.cuda.toolkit.manifest import PLATFORMS, Manifest, load_manifest
from ..backends.cuda.toolkit.plan import (
    SOURCES,
    ToolkitPlan,
    plan_for_recipe,
    plan_toolkit,
)
from ..errors import ToolchainError, UsageError
from ..lazy import lazy_import
from ..recipe import load_recipe
from . import output as cli_json
from .paths import InputFile

installer_src = lazy_import("llamabundle.backends.cuda.toolkit.installer")
pypi = lazy_import("llamabundle.backends.cuda.toolkit.pypi")
redist = lazy_import("llamabundle.backends.cuda.toolkit.redist")


def _emit(value: Any) -> None:
    cli_json.emit(value)


def _host_platform() -> str:
    return "windows-x86_64" if sys.platform == "win32" else "linux-x86_64"


def _options(f: Any) -> Any:
    for opt in reversed([
        click.argument("recipe_path", metavar="[RECIPE]", required=False, type=click.Path(dir_okay=False, path_type=Path)),
        click.option("--version", "version", metavar="V", help="CUDA toolkit version, e.g. 12.8.1 (instead of RECIPE)."),
        click.option("--components", metavar="a,b,c", help="Comma-separated redist components (with --version)."),
        click.option("--platform", type=click.Choice(PLATFORMS), help="Target platform (with --version; default: this host)."),
        click.option("--source", type=click.Choice((*SOURCES, "pypi", "installer")), help="Where the toolkit comes from (default: the recipe's, or redist)."),
        click.option("--manifest", "manifest_path", metavar="FILE", type=InputFile(),
                     help="A redistrib_*.json to use instead of the pinned one (mirrors, tests)."),
        click.option("--installer", "installer_path", metavar="PATH", type=InputFile(),
                     help="With --source installer: a local copy of NVIDIA's .exe instead of downloading it."),
        click.option("--installer-sha256", metavar="HEX",
                     help="With --source installer: the sha256 of an installer llamabundle has no pin for."),
    ]):
        f = opt(f)
    return f


def _plan(recipe_path: Path | None, version: str | None, components: str | None, platform: str | None,
          source: str | None, manifest_path: Path | None) -> ToolkitPlan:
    explicit = version is not None or components is not None or platform is not None
    if recipe_path is not None and explicit:
        raise UsageError("pass either RECIPE or --version/--components/--platform, not both",
                         fix="llamabundle toolkit plan RECIPE  |  llamabundle toolkit plan --version 12.8.1 --components cuda_nvcc,cuda_cudart")
    manifest: Manifest | None = load_manifest(manifest_path) if manifest_path is not None else None
    if recipe_path is not None:
        return plan_for_recipe(load_recipe(recipe_path), source=source, manifest=manifest)
    if version is None or not components:
        raise UsageError("which toolkit? pass a RECIPE, or --version and --components",
                         fix="e.g. llamabundle toolkit install --version 12.8.1 --components cuda_nvcc,cuda_cudart")
    if manifest is None:
        if version not in data.cuda_toolkits():
            raise UsageError(f"CUDA {version} is not pinned in this llamabundle",
                             fix="use one of: " + ", ".join(data.cuda_toolkits()) + " (or --manifest FILE)")
        manifest = load_manifest(version=version)
    names = [c.strip() for c in components.split(",") if c.strip()]
    for name in names:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name not in manifest.components:
            raise UsageError(f"'{name}' is not a component of CUDA {manifest.release}",
                             fix="components are names from the redist manifest, e.g. cuda_nvcc,cuda_cudart,libcublas")
    return plan_toolkit(version=version, components=names, platform=platform or _host_platform(),
                        source=source or "redist", manifest=manifest)


def _pypi_request(recipe_path: Path | None, version: str | None, components: str | None, platform: str | None,
                  source: str | None) -> tuple[str, str, list[str]] | None:
    """(version, platform, components) when the toolkit comes from PyPI wheels, else None."""
    if recipe_path is not None:
        r = load_recipe(recipe_path)
        if r.cuda is not None and (source or r.cuda.source) == "pypi":
            return r.cuda.toolkit, r.platform, list(r.cuda.components)
        return None
    if source == "pypi" and version and components:
        return version, platform or _host_platform(), [c.strip() for c in components.split(",") if c.strip()]
    return None


def _installer_request(recipe_path: Path | None, version: str | None, components: str | None, platform: str | None,
                       source: str | None, installer_path: Path | None, installer_sha256: str | None,
                       ) -> installer_src.InstallerPlan | None:
    """The installer plan when the toolkit comes from the Windows local installer, else None."""
    plan = None
    if recipe_path is not None:
        r = load_recipe(recipe_path)
        if r.cuda is not None and (source or r.cuda.source) == "installer":
            plan = installer_src.plan_installer(version=r.cuda.toolkit, components=list(r.cuda.components),
                                                platform=r.platform, sha256=installer_sha256)
    elif source == "installer":
        if version is None or not components:
            raise UsageError("which toolkit? pass a RECIPE, or --version and --components",
                             fix="e.g. llamabundle toolkit plan --source installer --version 12.8.1 --components cuda_nvcc,cuda_cudart")
        plan = installer_src.plan_installer(version=version, components=[c.strip() for c in components.split(",") if c.strip()],
                                            platform=platform or "windows-x86_64", sha256=installer_sha256)
    if plan is None and (installer_path is not None or installer_sha256 is not None):
        raise UsageError("--installer and --installer-sha256 are for the Windows local installer",
                         fix="add --source installer (or use a recipe with cuda.source: installer)")
    return plan


def _installed_state(plan: ToolkitPlan, root: Path) -> bool:
    try:
        return redist.installed(plan, root) is not None
    except ToolchainError:  # changed or foreign: not usable as is (install says why)
        return False


@click.group("toolkit")
def toolkit_group() -> None:
    """CUDA toolkit: plan and install it from NVIDIA's redist archives (no admin rights)."""


@toolkit_group.command("plan")
@_options
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (schema 1) on stdout.")
@click.pass_obj
def plan_cmd(c: Any, recipe_path: Path | None, version: str | None, components: str | None, platform: str | None,
             source: str | None, manifest_path: Path | None, installer_path: Path | None, installer_sha256: str | None,
             as_json: bool) -> None:
    """Show the archives a toolkit install needs: versions, sizes, sha256, cached or not, total bytes."""
    iplan = _installer_request(recipe_path, version, components, platform, source, installer_path, installer_sha256)
    if iplan is not None:
        _print_installer_plan(c, iplan, installer_path, as_json)
        return
    wheels = _pypi_request(recipe_path, version, components, platform, source)
    if wheels is not None:
        records = pypi.plan_pypi(*wheels)
        if as_json:
            _emit({"schema": 1, "toolkit": wheels[0], "platform": wheels[1], "source": "pypi",
                   "wheels": [{"component": r.component, "project": r.project, "version": r.version, "file": r.filename,
                               "sha256": r.sha256, "size": r.size} for r in records],
                   "total_bytes": sum(r.size for r in records)})
            return
        click.echo(f"CUDA {wheels[0]}  {wheels[1]}  source pypi")
        for r in records:
            click.echo(f"  {r.component:<14} {r.project + '==' + r.version:<34} {r.size:>13,} B  {r.filename}")
        click.echo(f"  total {sum(r.size for r in records):,} bytes")
        return
    plan = _plan(recipe_path, version, components, platform, source, manifest_path)
    cache_dir = c.settings.cache_dir
    cached = redist.cached_map(plan, cache_dir)
    root = plan.root(cache_dir)
    installed = _installed_state(plan, root)
    info = plan.to_json(base_url=c.settings.cuda_redist_url, cached=cached, root=root, installed=installed)
    if as_json:
        _emit(info)
        return
    click.echo(f"CUDA {plan.version}  {plan.platform}  source {plan.source}  manifest {plan.manifest_origin}")
    click.echo(f"{'component':<16} {'version':<12} {'bytes':>15}  {'cached':<6}  {'sha256':<64}  archive")
    for comp in info["components"]:
        note = f"  ({comp['note']})" if comp["note"] else ""
        click.echo(f"{comp['name']:<16} {comp['version']:<12} {comp['size']:>15,}  {'yes' if comp['cached'] else 'no':<6}  "
                   f"{comp['sha256']}  {comp['archive']}{note}")
    click.echo(f"{'total':<16} {len(plan.archives):<12} {plan.total_bytes:>15,}  bytes ({plan.total_bytes / 1e9:.2f} GB); "
               f"to download {info['download_bytes']:,} bytes")
    click.echo(f"root  {root} ({'installed' if installed else 'not installed'})")


@toolkit_group.command("install")
@_options
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path),
              help="Install here (a new or empty directory) instead of the cache's content-addressed root.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (schema 1) on stdout.")
@click.pass_obj
def install_cmd(c: Any, recipe_path: Path | None, version: str | None, components: str | None, platform: str | None,
                source: str | None, manifest_path: Path | None, installer_path: Path | None, installer_sha256: str | None,
                dest: Path | None, as_json: bool) -> None:
    """Install the toolkit (reused when already installed and intact); print its root."""
    iplan = _installer_request(recipe_path, version, components, platform, source, installer_path, installer_sha256)
    if iplan is not None:
        start = time.monotonic()
        with c.log.step(f"CUDA {iplan.version} toolkit from the local installer ({len(iplan.components)} components)"):
            res = installer_src.install(iplan, cache_dir=c.settings.cache_dir, log=c.log, installer=installer_path,
                                        dest=dest, connect_timeout=c.settings.connect_timeout)
        tk = res.toolkit
        if as_json:
            _emit({"schema": 1, "root": str(tk.root), "nvcc": str(tk.nvcc), "toolkit": tk.version, "platform": tk.platform,
                   "source": tk.source, "components": iplan.components, "reused": res.reused,
                   "installer": str(res.installer) if res.installer else None, "downloaded": res.downloaded,
                   "extractor": res.extractor, "seconds": round(time.monotonic() - start, 3)})
            return
        if res.reused:
            click.echo(f"already installed and intact: {tk.root}")
        else:
            click.echo(f"installed CUDA {tk.version} ({tk.platform}, {len(iplan.components)} components) from "
                       f"{res.installer} (extracted by {res.extractor}): {tk.root}")
        click.echo(f"nvcc  {tk.nvcc}")
        return
    wheels = _pypi_request(recipe_path, version, components, platform, source)
    if wheels is not None:
        start = time.monotonic()
        tk = pypi.install_from_pypi(version=wheels[0], platform=wheels[1], components=wheels[2], settings=c.settings,
                                    log=c.log, dest=dest)
        if as_json:
            _emit({"schema": 1, "root": str(tk.root), "nvcc": str(tk.nvcc), "toolkit": tk.version, "platform": tk.platform,
                   "source": tk.source, "seconds": round(time.monotonic() - start, 3)})
        else:
            click.echo(f"CUDA {tk.version} ({tk.platform}) from PyPI wheels: {tk.root}")
            click.echo(f"nvcc  {tk.nvcc}")
        return
    plan = _plan(recipe_path, version, components, platform, source, manifest_path)
    start = time.monotonic()
    with c.log.step(f"CUDA {plan.version} toolkit ({plan.platform}, {len(plan.archives)} components)"):
        result = redist.install(plan, cache_dir=c.settings.cache_dir, base_url=c.settings.cuda_redist_url, log=c.log,
                                dest=dest, connect_timeout=c.settings.connect_timeout)
    took = time.monotonic() - start
    tk = result.toolkit
    if as_json:
        _emit({"schema": 1, "root": str(tk.root), "nvcc": str(tk.nvcc), "toolkit": tk.version, "platform": tk.platform,
               "source": tk.source, "components": plan.components, "reused": result.reused,
               "downloaded_bytes": result.downloaded_bytes, "downloaded": result.downloaded,
               "from_cache": result.from_cache, "seconds": round(took, 3)})
        return
    if result.reused:
        click.echo(f"already installed and intact: {tk.root}")
    else:
        click.echo(f"installed CUDA {tk.version} ({tk.platform}, {len(plan.archives)} components): {tk.root}")
    click.echo(f"downloaded {result.downloaded_bytes:,} bytes ({len(result.downloaded)} archives); "
               f"{len(result.from_cache)} from the download cache; {took:.2f}s")
    click.echo(f"nvcc  {tk.nvcc}")


def _print_installer_plan(c: Any, plan: installer_src.InstallerPlan, local: Path | None, as_json: bool) -> None:
    cache_dir = c.settings.cache_dir
    root = plan.root(cache_dir)
    try:
        installed = installer_src.installed(plan, root) is not None
    except ToolchainError:
        installed = False
    program = installer_src.seven_zip_program()
    extractor = program or "py7zr"
    info = plan.to_json(root=root, installed=installed, local=local, cached=installer_src.is_cached(cache_dir, plan),
                        extractor=extractor)
    if as_json:
        _emit(info)
        return
    ins = plan.installer
    click.echo(f"CUDA {plan.version}  {plan.platform}  source installer  (component versions: {plan.manifest_origin})")
    click.echo(f"installer  {ins.file}")
    click.echo(f"  from     {local if local is not None else ins.url}"
               f"{'' if local is not None else ' (cached)' if info['installer']['cached'] else ''}")
    click.echo(f"  size     {f'{ins.size:,} bytes' if ins.size is not None else 'not pinned (the sha256 is checked)'}")
    if plan.sha256 is None:
        click.echo("  sha256   NOT PINNED: install refuses this installer unless --installer-sha256 gives the sha256 of the file")
    else:
        origin = f"pinned; {ins.sha256_source}" if plan.sha256_origin == "pinned" and ins.sha256_source else plan.sha256_origin
        click.echo(f"  sha256   {plan.sha256} ({origin})")
    click.echo(f"{'component':<16} {'version':<12} folders extracted")
    for comp, version in plan.components.items():
        note = f"  (added: needed by {plan.added_by[comp]})" if comp in plan.added_by else ""
        click.echo(f"{comp:<16} {version:<12} {', '.join(f + '/' for f in plan.folders[comp])}{note}")
    if plan.shared_licenses:
        click.echo(f"also             {', '.join(plan.shared_licenses)} (installer-wide license)")
    click.echo(f"extractor  {extractor if program else 'py7zr (no 7zz, 7z or 7zr on PATH)'}")
    click.echo(f"root  {root} ({'installed' if installed else 'not installed'})")
