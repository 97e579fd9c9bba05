"""`llamabundle plan MODEL.gguf --free-vram SIZE`: the -ngl / --n-cpu-moe / context that fits in the free VRAM.

click only (DESIGN §8): parse, call llamabundle.runtime.offload, print.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from ..runtime.offload import (
    MiB,
    kv_types,
    parse_headroom,
    parse_size,
    plan_offload,
    read_model,
)
from .options import JSON_OPT, InputFile
from .output import emit


@click.command("plan")
@click.argument("model_path", metavar="MODEL.gguf", type=InputFile())
@click.option("--free-vram", required=True, metavar="SIZE", help="Free GPU memory: 24GiB, 8000MiB, 12G (binary) or bytes.")
@click.option("--ctx", type=click.IntRange(1), help="Context (-c), total over all slots (default: the model's trained context).")
@click.option("--min-ctx", type=click.IntRange(1), help="Never shrink the context below this (default 4096).")
@click.option("--parallel", "n_parallel", type=click.IntRange(1), default=1, show_default=True,
              help="Server slots (-np); they share --ctx.")
@click.option("--kv-type", type=click.Choice(kv_types()), help="KV cache type (-ctk/-ctv; default f16).")
@click.option("--flash-attn/--no-flash-attn", default=True, show_default=True, help="Plan for flash attention (-fa on|off).")
@click.option("--headroom", metavar="SPEC", help="VRAM kept free: share of the free VRAM plus bytes (default 5%+256MiB).")
@JSON_OPT
def plan_command(model_path: Path, free_vram: str, ctx: int | None, min_ctx: int | None, n_parallel: int, kv_type: str | None,
                 flash_attn: bool, headroom: str | None, as_json: bool) -> None:
    """Plan GPU offload for a GGUF model: the llama-server flags that fit in the free VRAM."""
    free = parse_size(free_vram)
    plan = plan_offload(read_model(model_path), free_vram=free, ctx=ctx, min_ctx=min_ctx, n_parallel=n_parallel,
                        kv_type=kv_type, flash_attn=flash_attn, headroom=parse_headroom(headroom))
    if as_json:
        emit(plan.to_json())
        return
    m, e = plan.model, plan.estimate

    def mib(n: int) -> str:
        return f"{n / MiB:>12,.1f} MiB"

    experts = f", {m.n_expert} experts ({m.n_expert_used} used)" if m.is_moe else ""
    click.echo(f"model     {model_path} ({m.architecture}, {m.n_layer} blocks{experts}, {m.total_bytes / 1e9:.2f} GB, "
               f"trained context {m.n_ctx_train})")
    moe = f"  --n-cpu-moe {plan.n_cpu_moe}" if m.is_moe else ""
    ctx_note = "" if plan.ctx == plan.ctx_requested else f" (asked {plan.ctx_requested})"
    click.echo(f"plan      -ngl {plan.ngl}{moe}  ({plan.blocks_on_gpu}/{m.n_layer} blocks"
               f"{' + output' if plan.output_on_gpu else ''} on the GPU)  context {plan.ctx}{ctx_note}, "
               f"{plan.n_parallel} slot(s), KV {plan.kv_type}, flash attention {'on' if plan.flash_attn else 'off'}")
    rows: list[tuple[str, int]] = [("weights", e.weights), ("KV cache", e.kv), ("compute", e.compute),
                                   (f"headroom ({plan.headroom})", e.headroom)]
    for label, value in rows:
        click.echo(f"  {label:<24}{mib(value)}")
    click.echo(f"  {'total':<24}{mib(e.total)}  of {plan.free_vram / MiB:,.1f} MiB free")
    for reason in plan.reasons:
        click.echo(f"why       {reason}")
    click.echo(f"flags     {shlex.join(plan.flags())}")


COMMANDS: tuple[click.Command, ...] = (plan_command,)
