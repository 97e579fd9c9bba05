"""`llamabundle probe | install | list | uninstall | doctor`: the app side of the bundle contract (DESIGN §5, §8):
which backend will run and why, installing and removing bundles, and what to do when CUDA is not used.

click only: parse, call llamabundle.runtime, print, exit code."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import UsageError
from .context import Ctx, pass_ctx
from .options import DEST_OPT, JSON_OPT, SMI_OPT, InputFile
from .output import emit

if TYPE_CHECKING:
    from ..runtime import probe as probe_mod
DEFAULT_TTL = 30.0  # runtime.probe.DEFAULT_TTL (a test checks they agree), spelled out for a fast start

_BUNDLE = click.option("--bundle", type=click.Path(file_okay=False, exists=True, path_type=Path),
                       help="Probe this unpacked bundle directory instead of the installed CUDA bundle.")


def _print_probe(r: probe_mod.ProbeResult) -> None:
    click.echo(f"backend  {r.backend}")
    click.echo(f"reason   {r.reason}")
    click.echo(f"why      {r.sentence}" + (" (cached)" if r.cached else ""))
    click.echo(f"fix      {r.fix}")
    for gpu in r.facts.get("gpu_devices") or []:
        click.echo(f"gpu      {gpu['name']}: {', '.join(gpu['devices'])}")
    for server in r.facts.get("rpc_servers") or []:
        click.echo(f"rpc      {server['reason']}: {server['sentence']}" + ("" if server["reason"] == "rpc_ok" else f" (fix: {server['fix']})"))
    if r.facts.get("server_args"):
        env = " ".join(f"{k}={v!r}" if v == "" else f"{k}={v}" for k, v in (r.facts.get("server_env") or {}).items())
        click.echo(f"run      {env + ' ' if env else ''}llama-server {' '.join(r.facts['server_args'])} …")


@click.command("probe")
@JSON_OPT
@_BUNDLE
@DEST_OPT
@SMI_OPT
@click.option("--ngl", type=click.IntRange(0), metavar="N", help="The planned -ngl: 0 means cuda_gpu_layers_zero.")
@click.option("--max-age", type=click.FloatRange(0), default=DEFAULT_TTL, show_default=True,
              help="Reuse a cached result younger than this many seconds (0: probe now).")
@click.option("--prefer", type=click.Choice(["cuda", "vulkan", "cpu"]),
              help="Use this backend when it works here (default: CUDA on NVIDIA when its checks pass, else Vulkan, else CPU).")
@click.option("--rpc", "rpc", metavar="HOST:PORT[,...]",
              help="RPC servers the app will give llama-server: each is checked now (rpc_ok, rpc_unreachable, …); "
                   "those that answer join the run flags (--rpc, and their devices in --device).")
@pass_ctx
def probe_cmd(c: Ctx, as_json: bool, bundle: Path | None, dest: Path | None, nvidia_smi: str | None, ngl: int | None,
              max_age: float, prefer: str | None, rpc: str | None) -> None:
    """Which backend will run (cuda, vulkan or cpu) and why: one reason code with a sentence and a fix, the
    GPUs the bundle sees (one physical GPU once) and the llama-server flags that select the backend."""
    from ..runtime import install as install_mod
    from ..runtime import probe as probe_mod

    r = probe_mod.with_gpu_layers(probe_mod.probe(root=install_mod.data_root(c.settings, dest), env=c.env, cache_dir=c.runtime_cache, max_age=max_age,
                              bundle=bundle, nvidia_smi=nvidia_smi, prefer=prefer), ngl)
    r = probe_mod.with_rpc(r, [e for e in (rpc or "").split(",") if e.strip()])
    emit(r.to_json()) if as_json else _print_probe(r)


@click.command("install")
@click.option("--store", "store_url", metavar="URL", help="Bundle store: a directory, file://DIR, github:OWNER/REPO or oci://HOST[:PORT]/REPO.")
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False, path_type=Path), help="Install the bundle of this recipe.")
@click.option("--key", "key_", metavar="KEY", help="Install the bundle with this key (64 hex digits).")
@DEST_OPT
@click.option("--expect-commit", metavar="C", help="Refuse a bundle of another llama.cpp commit (default with --recipe: its commit).")
@click.option("--expect-toolkit", metavar="V", help="Refuse a bundle of another CUDA toolkit (default with --recipe: its toolkit).")
@click.option("--expect-sha256", "expect_sha256", metavar="HEX",
              help="Refuse a bundle whose zip has another sha256 (checked on the downloaded bytes, before anything is unpacked).")
@click.option("--digests", "digests_path", metavar="FILE", type=InputFile(exists=True),
              help="Refuse a bundle whose zip is not in this digest list (SHA256SUMS lines: `<sha256>  <zip name or key>`).")
@click.option("--if-needed", is_flag=True, help="Probe first; install only on binary_missing_nvidia_detected (pinned as without it), then probe again.")
@click.option("--backends", "backends_wanted", metavar="auto|LIST",
              help="Install only the CPU part and these backends (comma-separated), or those the GPU drivers here can "
                   "run (auto: the bundle's llamabundle-probe --drivers, from its CPU part fetched first).")
@JSON_OPT
@pass_ctx
def install_cmd(c: Ctx, store_url: str | None, recipe_path: Path | None, key_: str | None, dest: Path | None,
                expect_commit: str | None, expect_toolkit: str | None, expect_sha256: str | None,
                digests_path: Path | None, if_needed: bool, backends_wanted: str | None, as_json: bool) -> None:
    """Download a bundle, check everything in it, and install it atomically (the previous one stays until then).
    With --expect-sha256 or --digests, only the pinned zip is installed. With --backends, only the files the
    CPU part and the chosen backends need (bundle.json then says which, and what it was cut from)."""
    from ..runtime import install as install_mod
    from ..runtime import probe as probe_mod

    if (recipe_path is None) == (key_ is None):
        raise UsageError("pass exactly one of --recipe and --key", fix="llamabundle install --store S --recipe R")
    if key_ is not None and not re.fullmatch(r"[0-9a-f]{64}", key_):
        raise UsageError(f"'{key_}' is not a key", fix="a key is 64 hex digits (llamabundle key RECIPE)")
    if expect_sha256 is not None and digests_path is not None:
        raise UsageError("pass at most one of --expect-sha256 and --digests", fix="pin the zip by one of them")
    sha = install_mod.parse_sha256(expect_sha256) if expect_sha256 is not None else None
    digests = install_mod.load_digests(digests_path) if digests_path is not None else None
    if recipe_path is not None:
        from .. import keys  # here: an install by key (an app's) loads no recipe, YAML or key rules

        keyed = keys.resolve(keys.load(recipe_path), env=c.env)
        r, key_ = keyed.recipe, keyed.key
        expect_commit = expect_commit or r.llama_cpp.commit
        expect_toolkit = expect_toolkit or (r.cuda.toolkit if r.cuda else None)
    assert key_ is not None
    root, store = install_mod.data_root(c.settings, dest), c.store(store_url)
    if if_needed:
        res = probe_mod.ensure_backend(store=store, key=key_, root=root, env=c.env, log=c.log, cache_dir=c.runtime_cache,
                                       commit=expect_commit, toolkit=expect_toolkit, expect_sha256=sha, digests=digests,
                                       backends_wanted=backends_wanted)
        emit(res.to_json()) if as_json else _print_probe(res)
        return
    out = install_mod.install_bundle(store, key_, root=root, log=c.log, commit=expect_commit, toolkit=expect_toolkit,
                                     expect_sha256=sha, digests=digests, backends_wanted=backends_wanted)
    if as_json:
        emit(out.to_json())
    elif out.reused:
        click.echo(f"already installed and intact: {out.installed.name} ({out.installed.key[:12]}) {out.installed.path}")
    else:
        cut = out.installed.manifest.cut
        click.echo(f"installed {out.installed.name} ({out.installed.key[:12]}): {out.installed.path}"
                   + (f" (backends {', '.join(out.installed.backends)} of {', '.join(cut['from_backends'])})" if cut else "")
                   + (f" (replaced {out.replaced[:12]})" if out.replaced else "")
                   + (f" (zip sha256 pinned by {out.pinned.where})" if out.pinned else ""))


@click.command("list")
@DEST_OPT
@JSON_OPT
@pass_ctx
def list_cmd(c: Ctx, dest: Path | None, as_json: bool) -> None:
    """The installed bundles."""
    from ..runtime import install as install_mod

    root = install_mod.data_root(c.settings, dest)
    found = install_mod.list_installed(root)
    if as_json:
        emit({"schema": 1, "root": str(root), "bundles": [i.to_json() for i in found]})
        return
    if not found:
        click.echo(f"no bundles installed in {root}")
    for i in found:
        j = i.to_json()
        click.echo(f"{i.name:<28} {i.key[:12]}  {'+'.join(i.backends) or '?':<9} "
                   f"{('CUDA ' + str(j['toolkit']) + (' driver>=' + str(j['driver_floor']) if j['driver_floor'] else '')) if j['toolkit'] else '-':<28} {i.path}")


@click.command("uninstall")
@click.argument("what", metavar="KEY|NAME")
@DEST_OPT
@JSON_OPT
@pass_ctx
def uninstall_cmd(c: Ctx, what: str, dest: Path | None, as_json: bool) -> None:
    """Remove an installed bundle (by key, unique key prefix or name)."""
    from ..runtime import install as install_mod

    gone = install_mod.uninstall(install_mod.data_root(c.settings, dest), what)
    emit({"schema": 1, "removed": gone.to_json()}) if as_json else click.echo(f"removed {gone.name} ({gone.key[:12]})")


@click.command("doctor")
@_BUNDLE
@DEST_OPT
@SMI_OPT
@JSON_OPT
@pass_ctx
def doctor_cmd(c: Ctx, bundle: Path | None, dest: Path | None, nvidia_smi: str | None, as_json: bool) -> None:
    """What was found (GPUs, driver, installed bundles, the last probe), the reason, and what to do."""
    from ..runtime import doctor as doctor_mod
    from ..runtime import install as install_mod

    d = doctor_mod.diagnose(root=install_mod.data_root(c.settings, dest), env=c.env, cache_dir=c.runtime_cache, bundle=bundle, nvidia_smi=nvidia_smi)
    if as_json:
        emit(d.to_json())
        return
    console = c.log.console
    if console.is_terminal:
        from rich.table import Table
        from rich.text import Text

        table = Table(title="llamabundle doctor", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        for what, found in d.rows():
            table.add_row(Text(what), Text(found))  # facts are text, never rich markup
        console.print(table)
        console.print(d.advice, markup=False)
    else:
        width = max(len(what) for what, _ in d.rows())
        for what, found in d.rows():
            click.echo(f"{what:<{width}}  {found}")
        click.echo(d.advice)


COMMANDS: tuple[click.Command, ...] = (probe_cmd, install_cmd, list_cmd, uninstall_cmd, doctor_cmd)
