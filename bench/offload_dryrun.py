#!/usr/bin/env python3
"""The offload plan's sizes against llama.cpp's, in one run: for each point, the GPU buffers llama-server
logs when it loads the model (the truth), llama.cpp's own dry run (the bundle's llamabundle-memory,
what `plan` asks), and llamabundle's closed-form estimate; the ratios of both to the truth.
Then `plan` itself for a few free-VRAM sizes: the rung it picks with the dry run is launched, and what
llama-server allocates must fit in the free VRAM less the headroom.

    python bench/offload_dryrun.py BUNDLE MODEL.gguf [NGL:CTX[:NP[:u]] ...] [--plan FREE_MIB:CTX ...] [--json OUT]

BUNDLE is an unpacked bundle with llamabundle-memory whose GPU backend runs here (CUDA on an NVIDIA GPU;
Vulkan on lavapipe with GGML_VK_VISIBLE_DEVICES=0). NGL may be ALL (every layer) or HALF. The servers run
with --fit off --no-warmup on 127.0.0.1; each is killed once its buffers are logged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.offload_compare import free_port, server_log  # noqa: E402
from llamabundle.errors import UsageError  # noqa: E402
from llamabundle.runtime.dryrun import Launch, open_dry_run  # noqa: E402
from llamabundle.runtime.gguf_model import MiB, read_model  # noqa: E402
from llamabundle.runtime.offload import estimate, plan_offload  # noqa: E402
from llamabundle.runtime.server_args import parse_buffer_log  # noqa: E402


def server_buffers(bundle: Path, model: Path, args: list[str], env: dict[str, str], timeout: float = 180) -> dict[str, Any]:
    """The GPU model / KV / compute buffers llama-server logs at load (MiB), and its offloaded-layer count."""
    argv = [str(bundle / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(free_port()),
            "--fit", "off", "--no-warmup", "--verbose", *args]
    rep = parse_buffer_log(server_log(argv, timeout=timeout, env=env, cwd=bundle.parent))
    return {"model": rep.gpu("model") / MiB, "kv": rep.gpu("kv") / MiB, "compute": rep.gpu("compute") / MiB,
            "offloaded": list(rep.offloaded) if rep.offloaded else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("model", type=Path)
    ap.add_argument("points", nargs="*")
    ap.add_argument("--plan", action="append", default=[], metavar="FREE_MIB:CTX")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    model = read_model(a.model)
    dry = open_dry_run(a.bundle)
    if isinstance(dry, str):
        print(f"error: {dry}", file=sys.stderr)
        return 2
    env = dry.env
    n = model.n_layer
    rows = []
    print(f"{a.model.name}: {n} blocks, {model.total_bytes / MiB:,.0f} MiB, bundle {dry.bundle}")
    print(f"{'point':>14} | {'llama-server model/KV/compute MiB':>34} | {'dry run':>16} | {'closed form':>20} | "
          f"{'compute dry/real':>16} | {'closed/real':>11}")
    for spec in a.points:
        parts = spec.split(":")
        ngl = n + 1 if parts[0] == "ALL" else (n + 1) // 2 if parts[0] == "HALF" else int(parts[0])
        ctx, np_ = int(parts[1]), int(parts[2]) if len(parts) > 2 else 1
        unified = len(parts) > 3 and parts[3] == "u"
        launch = Launch(ngl=ngl, ctx=ctx, n_parallel=np_, kv_unified=unified)
        got = dry.measure(a.model, launch)
        sargs = ["-ngl", str(ngl), "-c", str(ctx), "-fa", "on", "-np", str(np_)] + (["-kvu"] if unified else [])
        real = server_buffers(a.bundle, a.model, sargs, env)
        est = estimate(model, ngl=ngl, ctx=ctx, n_parallel=np_, kv_unified=unified)
        row = {"point": spec, "ngl": ngl, "ctx": ctx, "np": np_, "unified": unified, "server": real,
               "dry_run": {k: v / MiB for k, v in got.to_json().items() if k != "device"} if got else None,
               "device": got.device if got else None,
               "closed_form": {"model": est.weights / MiB, "kv": est.kv / MiB, "compute": est.compute / MiB}}
        row["compute_dry_over_real"] = (got.compute / MiB / real["compute"]) if got and real["compute"] else None
        row["compute_closed_over_real"] = (est.compute / MiB / real["compute"]) if real["compute"] else None
        rows.append(row)
        d = row["dry_run"] or {"model": 0, "context": 0, "compute": 0}
        print(f"{f'-ngl {ngl} -c {ctx}' + (f' -np {np_}' if np_ > 1 else '') + (' u' if unified else ''):>14} | "
              f"{real['model']:>10.1f} {real['kv']:>10.1f} {real['compute']:>10.1f}   | "
              f"{d['model']:>5.0f} {d['context']:>5.0f} {d['compute']:>5.0f} | "
              f"{est.weights / MiB:>6.0f} {est.kv / MiB:>6.0f} {est.compute / MiB:>6.0f} | "
              f"{row['compute_dry_over_real'] or 0:>16.3f} | {row['compute_closed_over_real'] or 0:>11.3f}", flush=True)
    plans = []
    for spec in a.plan:
        free_mib, ctx = (int(x) for x in spec.split(":"))
        runs0 = dry.runs
        t0 = time.monotonic()
        try:
            p = plan_offload(model, free_vram=free_mib * MiB, ctx=ctx, min_ctx=ctx, dry_run=dry)
        except UsageError as e:
            plans.append({"free_mib": free_mib, "ctx": ctx, "error": e.what, "fits": False})
            print(f"plan --free-vram {free_mib}MiB -c {ctx}: {e.what}", flush=True)
            continue
        took = time.monotonic() - t0
        closed = plan_offload(model, free_vram=free_mib * MiB, ctx=ctx, min_ctx=ctx)
        real = server_buffers(a.bundle, a.model, p.flags(), env)
        used = real["model"] + real["kv"] + real["compute"]
        row = {"free_mib": free_mib, "ctx": ctx, "ngl": p.ngl, "closed_form_ngl": closed.ngl, "estimate_by": p.estimate_by,
               "dry_runs": dry.runs - runs0, "seconds": took, "planned_mib": p.estimate.total / MiB,
               "headroom_mib": p.estimate.headroom / MiB, "server_used_mib": used,
               "fits": used + p.estimate.headroom / MiB <= free_mib, "server": real}
        plans.append(row)
        print(f"plan --free-vram {free_mib}MiB -c {ctx}: -ngl {p.ngl} ({p.estimate_by}, {row['dry_runs']} dry runs, "
              f"{took:.1f} s; closed form alone: -ngl {closed.ngl}); llama-server uses {used:,.1f} MiB + headroom "
              f"{row['headroom_mib']:,.0f} = {used + row['headroom_mib']:,.1f} of {free_mib:,} MiB: "
              f"{'fits' if row['fits'] else 'DOES NOT FIT'}", flush=True)
    dr = [r["compute_dry_over_real"] for r in rows if r["compute_dry_over_real"]]
    cf = [r["compute_closed_over_real"] for r in rows if r["compute_closed_over_real"] and r["ngl"] <= n]
    if dr:
        print(f"compute buffer, dry run / llama-server: {min(dr):.3f}-{max(dr):.3f} (median {statistics.median(dr):.3f}, "
              f"{len(dr)} points); closed form at partial offload: "
              + (f"{min(cf):.3f}-{max(cf):.3f} (median {statistics.median(cf):.3f})" if cf else "no points"))
    if a.json:
        a.json.write_text(json.dumps({"model": a.model.name, "bundle": dry.bundle, "points": rows, "plans": plans,
                                      "dry_run": dry.to_json()}, indent=1))
    return 0 if all(r["fits"] for r in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
