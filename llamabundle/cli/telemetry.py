"""`llamabundle telemetry`: live GPU telemetry (driver, utilisation, VRAM used/total per GPU) while a CUDA
llama-server of a bundle runs; a short-lived cache shared with concurrent callers (runtime.telemetry).

click only: parse, call llamabundle.runtime.telemetry, print. Always exit 0: no telemetry is a result."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from .context import Ctx, pass_ctx
from .options import DEST_OPT, JSON_OPT, SMI_OPT
from .output import emit

if TYPE_CHECKING:
    from ..runtime import telemetry as telemetry_mod
DEFAULT_MAX_AGE = 5.0  # runtime.telemetry.DEFAULT_MAX_AGE (a test checks they agree), spelled out for a fast start


def _print(t: telemetry_mod.Telemetry) -> None:
    if not t.active:
        click.echo(f"active   no: {t.reason} ({t.detail})")
        return
    assert t.sample is not None and t.server is not None
    click.echo(f"active   yes: llama-server {t.pid} ({t.server.exe})")
    click.echo(f"driver   {t.sample.driver}")
    for g in t.sample.gpus:
        util = f"{g.utilization_pct}%" if g.utilization_pct is not None else "?%"
        used = "?" if g.memory_used_mib is None else str(g.memory_used_mib)
        total = "?" if g.memory_total_mib is None else str(g.memory_total_mib)
        click.echo(f"gpu {g.index:<4} {g.name}: {util} busy, {used} / {total} MiB")
    if t.sample.warning:
        click.echo(f"warning  {t.sample.warning}")
    click.echo(f"sampled  {t.to_json()['sampled_at']}" + (f" (cached, {t.age_s:.0f}s old)" if t.cached else ""))


@click.command("telemetry")
@JSON_OPT
@click.option("--pid", type=click.IntRange(1, 2**31 - 1), metavar="PID",
              help="The llama-server's process id: telemetry is read only while it runs from a CUDA bundle.")
@click.option("--max-age", type=click.FloatRange(0), default=DEFAULT_MAX_AGE, show_default=True,
              help="Reuse a sample younger than this many seconds (0: run nvidia-smi now).")
@SMI_OPT
@DEST_OPT
@click.option("--bundle", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="The server must run from this unpacked bundle directory (default: an installed CUDA bundle).")
@pass_ctx
def telemetry_cmd(c: Ctx, as_json: bool, pid: int | None, max_age: float, nvidia_smi: str | None, dest: Path | None,
                  bundle: Path | None) -> None:
    """Live GPU telemetry of a running CUDA llama-server: the driver and, per GPU, utilisation and VRAM used/total.
    Without a running server of a bundle, or without a working nvidia-smi: active false and the reason."""
    from ..runtime import install as install_mod
    from ..runtime import telemetry as telemetry_mod

    t = telemetry_mod.read_telemetry(root=install_mod.data_root(c.settings, dest), env=c.env, pid=pid,
                                     cache_dir=c.runtime_cache, bundle=bundle, nvidia_smi=nvidia_smi, max_age=max_age)
    emit(t.to_json()) if as_json else _print(t)


COMMANDS: tuple[click.Command, ...] = (telemetry_cmd,)
