"""`llamabundle toolkit plan|install`: the CUDA toolkit a recipe (or --version/--components) needs, from
NVIDIA's redist archives, PyPI wheels or the Windows local installer.

click only (DESIGN §8): read which toolkit the command line names, let backends.cuda.toolkit.resolve plan
and install it from its source, print, exit code.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ..errors import ToolchainError, UsageError
from .context import Ctx, pass_ctx
from .options import InputFile, owned
from .output import emit

if TYPE_CHECKING:
    from ..backends.cuda.toolkit import installer as installer_src
    from ..backends.cuda.toolkit import resolve
    from ..backends.cuda.toolkit.manifest import Manifest
    from ..backends.cuda.toolkit.plan import ToolkitPlan

# backends.cuda.toolkit's manifest.PLATFORMS and plan.SOURCES (a test checks they agree), spelled out so that the
# CLI starts without importing the backends
PLATFORMS = ("linux-x86_64", "windows-x86_64")
SOURCES = ("redist",)

F = TypeVar("F", bound=Callable[..., Any])


def _options(f: F) -> F:
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


def _toolkit_plan(recipe_path: Path | None, version: str | None, components: str | None, platform: str | None,
                  source: str | None, manifest_path: Path | None, installer_path: Path | None,
                  installer_sha256: str | None) -> ToolkitPlan | installer_src.InstallerPlan | resolve.WheelPlan:
    """The plan of the toolkit the command line names: RECIPE's (its cuda: section, --source overriding its
    source), or --version/--components/--platform/--source's. A usage error when they are missing, mixed,
    or name what this llamabundle does not pin."""
    from .. import data, keys
    from ..backends.cuda.toolkit import resolve
    from ..backends.cuda.toolkit.manifest import load_manifest
    from ..backends.cuda.toolkit.plan import plan_for_recipe
    from ..platforms import host_name

    r = keys.load(recipe_path) if recipe_path is not None else None  # its cuda: section (the key is not asked)
    names = [c.strip() for c in components.split(",") if c.strip()] if components else []
    if r is not None:  # the installer and PyPI sources take RECIPE's toolkit whatever the other options say
        cuda = r.cuda
        wanted = (source or cuda.source) if cuda is not None else None
        if cuda is not None and wanted in ("installer", "pypi"):
            if wanted == "pypi" and (installer_path is not None or installer_sha256 is not None):
                raise _installer_options_error()
            return resolve.plan_source(wanted, version=cuda.toolkit, platform=r.platform,
                                       components=list(cuda.components), sha256=installer_sha256)
    elif source == "installer":
        if version is None or not components:
            raise UsageError("which toolkit? pass a RECIPE, or --version and --components",
                             fix="e.g. llamabundle toolkit plan --source installer --version 12.8.1 --components cuda_nvcc,cuda_cudart")
        return resolve.plan_source("installer", version=version, platform=platform or "windows-x86_64",
                                   components=names, sha256=installer_sha256)
    if installer_path is not None or installer_sha256 is not None:
        raise _installer_options_error()
    if r is None and source == "pypi" and version and components:
        return resolve.plan_source("pypi", version=version, platform=platform or host_name(), components=names)
    if r is not None and (version is not None or components is not None or platform is not None):
        raise UsageError("pass either RECIPE or --version/--components/--platform, not both",
                         fix="llamabundle toolkit plan RECIPE  |  llamabundle toolkit plan --version 12.8.1 --components cuda_nvcc,cuda_cudart")
    manifest: Manifest | None = load_manifest(manifest_path) if manifest_path is not None else None
    if r is not None:
        return plan_for_recipe(r, source=source, manifest=manifest)
    if version is None or not components:
        raise UsageError("which toolkit? pass a RECIPE, or --version and --components",
                         fix="e.g. llamabundle toolkit install --version 12.8.1 --components cuda_nvcc,cuda_cudart")
    if manifest is None:
        if version not in data.cuda_toolkits():
            raise UsageError(f"CUDA {version} is not pinned in this llamabundle",
                             fix="use one of: " + ", ".join(data.cuda_toolkits()) + " (or --manifest FILE)")
        manifest = load_manifest(version=version)
    for name in names:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name not in manifest.components:
            raise UsageError(f"'{name}' is not a component of CUDA {manifest.release}",
                             fix="components are names from the redist manifest, e.g. cuda_nvcc,cuda_cudart,libcublas")
    return resolve.plan_source(source or "redist", version=version, platform=platform or host_name(),
                               components=names, manifest=manifest)


def _installer_options_error() -> UsageError:
    return UsageError("--installer and --installer-sha256 are for the Windows local installer",
                      fix="add --source installer (or use a recipe with cuda.source: installer)")


@click.group("toolkit")
def toolkit_group() -> None:
    """CUDA toolkit: plan and install it from NVIDIA's redist archives (no admin rights)."""


@toolkit_group.command("plan")
@_options
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (schema 1) on stdout.")
@pass_ctx
def plan_cmd(c: Ctx, recipe_path: Path | None, version: str | None, components: str | None, platform: str | None,
             source: str | None, manifest_path: Path | None, installer_path: Path | None, installer_sha256: str | None,
             as_json: bool) -> None:
    """Show the archives a toolkit install needs: versions, sizes, sha256, cached or not, total bytes."""
    from ..backends.cuda.toolkit import resolve
    from ..backends.cuda.toolkit.plan import ToolkitPlan

    plan = _toolkit_plan(recipe_path, version, components, platform, source, manifest_path, installer_path,
                         installer_sha256)
    if isinstance(plan, ToolkitPlan):
        _print_redist_plan(c, plan, as_json)
    elif isinstance(plan, resolve.WheelPlan):
        _print_wheel_plan(plan, as_json)
    else:
        _print_installer_plan(c, plan, installer_path, as_json)


@toolkit_group.command("install")
@_options
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), callback=owned("--dest"),
              help="Install here (a new or empty directory) instead of the cache's content-addressed root.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (schema 1) on stdout.")
@pass_ctx
def install_cmd(c: Ctx, recipe_path: Path | None, version: str | None, components: str | None, platform: str | None,
                source: str | None, manifest_path: Path | None, installer_path: Path | None, installer_sha256: str | None,
                dest: Path | None, as_json: bool) -> None:
    """Install the toolkit (reused when already installed and intact); print its root."""
    from .. import cache
    from ..backends.cuda.toolkit import installer as installer_src
    from ..backends.cuda.toolkit import redist, resolve
    from ..backends.cuda.toolkit.layout import Toolkit
    from ..backends.cuda.toolkit.plan import ToolkitPlan

    plan = _toolkit_plan(recipe_path, version, components, platform, source, manifest_path, installer_path,
                         installer_sha256)
    start = time.monotonic()
    with cache.in_use(c.settings.cache_dir):  # its downloads and toolkit root are not pruned under it
        result = resolve.install_planned(plan, settings=c.settings, log=c.log, dest=dest, installer=installer_path)
    took = time.monotonic() - start
    if isinstance(plan, ToolkitPlan):
        assert isinstance(result, redist.InstallResult)
        tk = result.toolkit
        if as_json:
            emit({"schema": 1, "root": str(tk.root), "nvcc": str(tk.nvcc), "toolkit": tk.version, "platform": tk.platform,
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
    elif isinstance(plan, resolve.WheelPlan):
        assert isinstance(result, Toolkit)
        if as_json:
            emit({"schema": 1, "root": str(result.root), "nvcc": str(result.nvcc), "toolkit": result.version,
                  "platform": result.platform, "source": result.source, "seconds": round(took, 3)})
            return
        click.echo(f"CUDA {result.version} ({result.platform}) from PyPI wheels: {result.root}")
        click.echo(f"nvcc  {result.nvcc}")
    else:
        assert isinstance(result, installer_src.InstallResult)
        tk = result.toolkit
        if as_json:
            emit({"schema": 1, "root": str(tk.root), "nvcc": str(tk.nvcc), "toolkit": tk.version, "platform": tk.platform,
                  "source": tk.source, "components": plan.components, "reused": result.reused,
                  "installer": str(result.installer) if result.installer else None, "downloaded": result.downloaded,
                  "extractor": result.extractor, "seconds": round(took, 3)})
            return
        if result.reused:
            click.echo(f"already installed and intact: {tk.root}")
        else:
            click.echo(f"installed CUDA {tk.version} ({tk.platform}, {len(plan.components)} components) from "
                       f"{result.installer} (extracted by {result.extractor}): {tk.root}")
        click.echo(f"nvcc  {tk.nvcc}")


def _print_redist_plan(c: Ctx, plan: ToolkitPlan, as_json: bool) -> None:
    from ..backends.cuda.toolkit import redist

    cache_dir = c.settings.cache_dir
    cached = redist.cached_map(plan, cache_dir)
    root = plan.root(cache_dir)
    try:
        installed = redist.installed(plan, root) is not None
    except ToolchainError:  # changed or foreign: not usable as is (install says why)
        installed = False
    info = plan.to_json(base_url=c.settings.cuda_redist_url, cached=cached, root=root, installed=installed)
    if as_json:
        emit(info)
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


def _print_wheel_plan(plan: resolve.WheelPlan, as_json: bool) -> None:
    records = plan.wheels
    if as_json:
        emit({"schema": 1, "toolkit": plan.version, "platform": plan.platform, "source": "pypi",
              "wheels": [{"component": r.component, "project": r.project, "version": r.version, "file": r.filename,
                          "sha256": r.sha256, "size": r.size} for r in records],
              "total_bytes": sum(r.size for r in records)})
        return
    click.echo(f"CUDA {plan.version}  {plan.platform}  source pypi")
    for r in records:
        click.echo(f"  {r.component:<14} {r.project + '==' + r.version:<34} {r.size:>13,} B  {r.filename}")
    click.echo(f"  total {sum(r.size for r in records):,} bytes")


def _print_installer_plan(c: Ctx, plan: installer_src.InstallerPlan, local: Path | None, as_json: bool) -> None:
    from ..backends.cuda.toolkit import installer as installer_src

    cache_dir = c.settings.cache_dir
    root = plan.root(cache_dir)
    try:
        installed = installer_src.installed(plan, root) is not None
    except ToolchainError:
        installed = False
    from ..sevenzip import seven_zip_program

    program = seven_zip_program()
    extractor = program or "py7zr"
    info = plan.to_json(root=root, installed=installed, local=local, cached=installer_src.is_cached(cache_dir, plan),
                        extractor=extractor)
    if as_json:
        emit(info)
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


COMMANDS: tuple[click.Command, ...] = (toolkit_group,)
