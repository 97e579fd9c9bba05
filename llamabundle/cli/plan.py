"""`llamabundle plan MODEL.gguf [--free-vram SIZE] [--server-args "..." | -- ARGS…]`: the -ngl / --n-cpu-moe /
context that fits in the free VRAM (read from nvidia-smi unless --free-vram is given); with an app's
llama-server flags, the same flags with an -ngl / --n-cpu-moe that only ever offloads more. The rungs are
sized by the bundle's llamabundle-memory (runtime.dryrun) where one runs here, else by the closed form.

click only (DESIGN §8): parse, call llamabundle.runtime.offload and .dryrun, print.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import UsageError

if TYPE_CHECKING:
    from ..runtime.dryrun import DeviceMemory, Launch
from ..runtime.gguf_model import MiB, kv_types
from .context import Ctx, pass_ctx
from .options import JSON_OPT, InputFile, owned
from .output import emit


@click.command("plan")
@click.argument("model_path", metavar="MODEL.gguf", type=InputFile())
@click.argument("app_argv", metavar="[-- LLAMA_SERVER_ARGS…]", nargs=-1, type=click.UNPROCESSED)
@click.option("--free-vram", metavar="SIZE",
              help="Free GPU memory: 24GiB, 8000MiB, 12G (binary) or bytes (default: nvidia-smi's memory.free).")
@click.option("--nvidia-smi", "nvidia_smi", metavar="PATH", help="The nvidia-smi to run (default: the one on PATH).")
@click.option("--gpu", type=click.IntRange(0), default=0, show_default=True, help="The GPU (nvidia-smi's index).")
@click.option("--server-args", metavar="ARGS",
              help="The app's llama-server flags, one string (or after --): plan with them, only ever offloading more.")
@click.option("--ctx", type=click.IntRange(1), help="Context (-c), total over all slots (default: the model's trained context).")
@click.option("--min-ctx", type=click.IntRange(1), help="Never shrink the context below this (default 4096).")
@click.option("--parallel", "n_parallel", type=click.IntRange(1), help="Server slots (-np); they share --ctx (default 1).")
@click.option("--kv-type", type=click.Choice(kv_types()), help="KV cache type (-ctk/-ctv; default f16).")
@click.option("--flash-attn/--no-flash-attn", default=None, help="Plan for flash attention (-fa on|off; default on).")
@click.option("--headroom", metavar="SPEC", help="VRAM kept free: share of the free VRAM plus bytes (default 5%+256MiB).")
@click.option("--bundle", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Size each rung with this unpacked bundle's llamabundle-memory (llama.cpp's own dry run; "
                   "default: the installed GPU bundle probe would pick).")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), callback=owned("the install root, --dest"),
              help="Install root to find that bundle in (default: $LLAMABUNDLE_DATA_DIR or the user data directory).")
@click.option("--closed-form", is_flag=True, help="Use llamabundle's closed-form estimate only: run no dry run.")
@JSON_OPT
@pass_ctx
def plan_command(c: Ctx, model_path: Path, app_argv: tuple[str, ...], free_vram: str | None, nvidia_smi: str | None,
                 gpu: int, server_args: str | None, ctx: int | None, min_ctx: int | None, n_parallel: int | None,
                 kv_type: str | None, flash_attn: bool | None, headroom: str | None, bundle: Path | None,
                 dest: Path | None, closed_form: bool, as_json: bool) -> None:
    """Plan GPU offload for a GGUF model: the llama-server flags that fit in the free VRAM. Each rung it weighs
    is sized by llama.cpp's own dry run where a bundle (--bundle, or the installed one) runs here."""
    from ..runtime.dryrun import find_dry_run, passthrough_args
    from ..runtime.gguf_model import read_model
    from ..runtime.offload import (
        FreeVram,
        launch_args,
        parse_headroom,
        parse_size,
        plan_for_app,
        plan_offload,
        query_free_vram,
    )
    from ..runtime.server_args import parse_server_args

    if server_args is not None and app_argv:
        raise UsageError("the app's llama-server flags are given twice (--server-args and after --)",
                         fix="give them one way")
    app = parse_server_args(server_args if server_args is not None else list(app_argv)) \
        if server_args is not None or app_argv else None
    if app is not None:
        given = [name for name, v in (("--ctx", ctx), ("--min-ctx", min_ctx), ("--parallel", n_parallel),
                                      ("--kv-type", kv_type), ("--flash-attn", flash_attn)) if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} cannot be combined with the app's llama-server flags",
                             why="the plan uses the context, slots, cache types and flash attention llama-server "
                                 "will run with, which are the app's",
                             fix="put them in the server flags instead (-c, -np, -ctk/-ctv, -fa)")
    vram = (FreeVram(free=parse_size(free_vram), source="--free-vram") if free_vram is not None
            else query_free_vram(env=c.env, nvidia_smi=nvidia_smi, gpu=gpu))
    if bundle is not None and closed_form:
        raise UsageError("--bundle and --closed-form cannot be combined", fix="give one of them")
    model = read_model(model_path)
    room = parse_headroom(headroom)
    from ..runtime.install import data_root

    dry, skipped = (None, "--closed-form") if closed_form else \
        find_dry_run(bundle, root=data_root(c.settings, dest), extra=passthrough_args(app.argv) if app else (),
                     on_run=lambda launch, row, took: c.log.info(_dry_run_line(launch, row, took)))
    if dry is not None:
        c.log.info(f"sizing the rungs with llama.cpp's dry run: {dry.program} ({dry.bundle})")
    if app is None:
        plan = plan_offload(model, free_vram=vram.free, ctx=ctx, min_ctx=min_ctx, n_parallel=n_parallel or 1,
                            kv_type=kv_type, flash_attn=flash_attn is not False, headroom=room, dry_run=dry)
        argv = plan.flags()
    else:
        plan = plan_for_app(model, app, free_vram=vram.free, headroom=room, dry_run=dry)
        argv = launch_args(plan, app)
    plan = replace(plan, dry_run_skipped=skipped)
    if as_json:
        emit({**plan.to_json(), "free_vram_source": vram.source, "gpu": vram.to_json(),
              "app": app.to_json() if app else None, "server_args": argv})
        return
    m, e = plan.model, plan.estimate

    def mib(n: int) -> str:
        return f"{n / MiB:>12,.1f} MiB"

    experts = f", {m.n_expert} experts ({m.n_expert_used} used)" if m.is_moe else ""
    click.echo(f"model     {model_path} ({m.architecture}, {m.n_layer} blocks{experts}, {m.total_bytes / 1e9:.2f} GB, "
               f"trained context {m.n_ctx_train})")
    where = (f"nvidia-smi, GPU {vram.gpu}: {vram.free / MiB:,.0f} of {(vram.total or 0) / MiB:,.0f} MiB free"
             if vram.source == "nvidia-smi" else "--free-vram")
    click.echo(f"vram      {vram.free / MiB:,.1f} MiB free ({where})")
    moe = f"  --n-cpu-moe {plan.n_cpu_moe}" if m.is_moe else ""
    ctx_note = "" if plan.ctx == plan.ctx_requested else f" (asked {plan.ctx_requested})"
    kv = plan.kv_type if plan.v_type == plan.kv_type else f"{plan.kv_type}/{plan.v_type}"
    click.echo(f"plan      -ngl {plan.ngl}{moe}  ({plan.blocks_on_gpu}/{m.n_layer} blocks"
               f"{' + output' if plan.output_on_gpu else ''} on the GPU)  context {plan.ctx}{ctx_note}, "
               f"{plan.n_parallel} slot(s){' (unified KV)' if plan.kv_unified else ''}, KV {kv}, "
               f"flash attention {'on' if plan.flash_attn else 'off'}")
    rows: list[tuple[str, int]] = [("weights", e.weights), ("KV cache", e.kv), ("compute", e.compute),
                                   (f"headroom ({plan.headroom})", e.headroom)]
    click.echo(f"sized by  {plan.estimate_by}" + (f" ({plan.dry_run['runs']} runs of {plan.dry_run['program']}, "
                                                  f"{plan.dry_run['device']}, {plan.dry_run['seconds']:.1f} s)"
                                                  if plan.dry_run and plan.dry_run["runs"] else "")
               + (f": {skipped}" if skipped else ""))
    for label, value in rows:
        click.echo(f"  {label:<24}{mib(value)}")
    click.echo(f"  {'total':<24}{mib(e.total)}  of {plan.free_vram / MiB:,.1f} MiB free")
    for reason in plan.reasons:
        click.echo(f"why       {reason}")
    for warning in plan.warnings:
        click.echo(f"warning   {warning}")
    click.echo(f"flags     {shlex.join(plan.flags())}")
    if app is not None:
        click.echo(f"launch    llama-server {shlex.join(argv)}")


def _dry_run_line(launch: Launch, row: DeviceMemory | None, took: float) -> str:
    sizes = (f"{row.device}: model {row.model / MiB:,.0f}, KV {row.context / MiB:,.0f}, compute {row.compute / MiB:,.0f} MiB"
             if row is not None else "no GPU device listed")
    return f"    dry run -ngl {launch.ngl}" + (f" --n-cpu-moe {launch.n_cpu_moe}" if launch.n_cpu_moe else "") + \
        f" -c {launch.ctx}: {sizes} ({took:.1f} s)"


COMMANDS: tuple[click.Command, ...] = (plan_command,)
