"""The VRAM offload planner (`llamabundle plan`): what llama.cpp puts in GPU memory for an -ngl / --n-cpu-moe /
context choice, and the most-offloaded choice that fits the free VRAM less a headroom. Each rung of the
ladder (everything on the GPU down to nothing) is sized by the bundle's own dry run where there is one
(runtime/dryrun.py), else by a closed form of the model's shapes (gguf_model.py); a live plan keeps an app's
llama-server flags (server_args.py) and only ever offloads more. docs/offload.md derives the closed form and
says how close it comes on the H200."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from ..errors import UsageError
from .dryrun import DeviceMemory, DryRun, Launch
from .gguf_model import MiB, ModelInfo, knowledge
from .server_args import ALL_LAYERS, ServerArgs

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": MiB, "mi": MiB, "mib": MiB,
          "mb": 10**6, "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "ti": 1 << 40,
          "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes in '24GiB', '8000MiB', '12G', '1.5T', '12GB' or '25769803776'. K, M, G, T alone are binary
    (as GiB); KB, MB, GB, TB are decimal."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text, re.I)
    unit = _UNITS.get(m[2].lower()) if m else None
    if m is None or unit is None:
        raise UsageError(f"'{text}' is not a size", fix="write it like 24GiB, 8000MiB, 12G or a plain number of bytes")
    return int(Decimal(m[1]) * unit)


@dataclass(frozen=True, kw_only=True)
class Headroom:
    """VRAM kept free: `percent` of the free VRAM plus `fixed` bytes."""

    percent: float
    fixed: int

    def of(self, free: int) -> int:
        return int(free * self.percent / 100) + self.fixed

    def __str__(self) -> str:
        return f"{self.percent:g}%+{self.fixed / MiB:g}MiB"


def parse_headroom(text: str | None = None) -> Headroom:
    """'5%+256MiB', '10%', '1GiB' (default: data/offload.json)."""
    text = knowledge()["default_headroom"] if text is None else text
    percent, fixed = 0.0, 0
    for part in (p.strip() for p in text.split("+")):
        if part.endswith("%") and re.fullmatch(r"\d+(\.\d+)?", part[:-1].strip()):
            percent += float(part[:-1])
        elif part.endswith("%"):
            raise UsageError(f"'{text}' is not a headroom", fix="write it like 5%+256MiB, 10% or 1GiB")
        else:
            fixed += parse_size(part)
    if percent >= 100:
        raise UsageError(f"headroom '{text}' keeps all the VRAM free", fix="use a share below 100%, e.g. 5%+256MiB")
    return Headroom(percent=percent, fixed=fixed)


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def kv_cells(ctx: int, n_parallel: int = 1, *, unified: bool = False) -> tuple[int, int]:
    """(cells in all, cells per slot) that llama.cpp allocates for -c ctx -np n_parallel [-kvu]."""
    pad = knowledge()["ctx_pad"]
    if unified:
        return _pad(ctx, pad), _pad(ctx, pad)
    per_slot = _pad(_pad(ctx, pad) // n_parallel, pad)
    return per_slot * n_parallel, per_slot


def gpu_blocks(n_layer: int, ngl: int) -> range:
    """The blocks -ngl puts on the GPU (the output layer goes first: it is there whenever ngl >= 1)."""
    return range(min(max(n_layer + 1 - ngl, 0), n_layer), n_layer)


def _row_bytes(n: int, kv_type: str) -> int:
    blck: int
    size: int
    blck, size = knowledge()["kv_types"][kv_type]
    return -(-n // blck) * size


def _kv_cell_bytes(model: ModelInfo, block: int, kv_type: str, kv_type_v: str | None = None) -> int:
    """Bytes of one KV cell of one block: its K row and its V row."""
    return (_row_bytes(model.n_head_kv[block] * model.head_dim_k, kv_type)
            + _row_bytes(model.n_head_kv[block] * model.head_dim_v, kv_type_v or kv_type))


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Bytes of GPU memory one choice needs."""

    weights: int
    kv: int
    compute: int
    headroom: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.headroom

    def to_json(self) -> dict[str, int]:
        return {"weights": self.weights, "kv": self.kv, "compute": self.compute, "headroom": self.headroom,
                "total": self.total}


def offload_copy(model: ModelInfo, *, ngl: int, n_cpu_moe: int = 0) -> int:
    """Bytes of the largest block tensor in host memory at -ngl ngl --n-cpu-moe n_cpu_moe: op offload copies
    it into the GPU compute buffer (0 when every block tensor is on the GPU)."""
    on_gpu = gpu_blocks(model.n_layer, ngl)
    return max((max(w, e) if i not in on_gpu else e if i < n_cpu_moe else 0
                for i, (w, e) in enumerate(model.largest_weights)), default=0)


def kv_view_copy(model: ModelInfo, *, ngl: int, cells: int, kv_type: str = "f16", kv_type_v: str | None = None) -> int:
    """Bytes of the largest K view plus V view of a block whose KV cache is in host memory at -ngl ngl (0 when
    every block's cache is on the GPU): the attention op of such a block is pulled onto the GPU beside its
    offloaded weight ops, and its split copies the block's whole K and V views into the compute buffer."""
    on_gpu = gpu_blocks(model.n_layer, ngl)
    return max((cells * _kv_cell_bytes(model, i, kv_type, kv_type_v) for i in range(model.n_layer) if i not in on_gpu),
               default=0)


def estimate(model: ModelInfo, *, ngl: int, n_cpu_moe: int = 0, ctx: int, n_parallel: int = 1, kv_type: str = "f16",
             kv_type_v: str | None = None, kv_unified: bool = False, n_ubatch: int | None = None,
             op_offload: bool = True, flash_attn: bool = True, free_vram: int = 0,
             headroom: Headroom | None = None) -> Estimate:
    """GPU bytes for llama-server -ngl ngl --n-cpu-moe n_cpu_moe -c ctx -np n_parallel (see the module doc);
    kv_type_v defaults to kv_type, n_ubatch to data/offload.json's (llama.cpp's) 512."""
    k = knowledge()
    blocks = gpu_blocks(model.n_layer, ngl)
    weights = sum(model.layer_bytes[i] - (model.expert_bytes[i] if i < n_cpu_moe else 0) for i in blocks)
    weights += model.output_bytes if ngl >= 1 else 0
    cells, per_slot = kv_cells(ctx, n_parallel, unified=kv_unified)
    kv = sum(cells * _kv_cell_bytes(model, i, kv_type, kv_type_v) for i in blocks)
    c = k["compute"]
    per_token = (c["fa_mask_bytes"] if flash_attn else c["mask_bytes"]) * per_slot + c["float_bytes"] * max(
        c["attn_embd"] * model.n_embd + (0 if flash_attn else max(model.n_head, default=0) * per_slot),
        c["ffn_ff"] * model.n_ff + c["ffn_embd"] * model.n_embd)
    tokens = min(n_ubatch or k["n_ubatch"], cells)
    compute = tokens * per_token + n_parallel * model.n_vocab * c["float_bytes"]
    if op_offload and tokens >= k["op_offload_min_batch"]:
        compute += max(offload_copy(model, ngl=ngl, n_cpu_moe=n_cpu_moe),
                       kv_view_copy(model, ngl=ngl, cells=cells, kv_type=kv_type, kv_type_v=kv_type_v))
    return Estimate(weights=weights, kv=kv, compute=compute, headroom=(headroom or parse_headroom()).of(free_vram))


CLOSED_FORM = "closed form"
LLAMA_CPP = "llama.cpp dry run"


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelInfo
    free_vram: int
    ngl: int
    n_cpu_moe: int
    ctx: int  # the -c to pass: total over all slots
    ctx_requested: int
    n_parallel: int
    kv_type: str
    flash_attn: bool
    headroom: Headroom
    estimate: Estimate
    reasons: tuple[str, ...]
    kv_type_v: str | None = None  # None: as kv_type
    kv_unified: bool = False
    warnings: tuple[str, ...] = ()
    estimate_by: str = CLOSED_FORM  # or LLAMA_CPP: the chosen rung sized by llama.cpp's dry run
    dry_run: Mapping[str, Any] | None = None  # DryRun.to_json() of the dry runs asked, or None
    dry_run_skipped: str | None = None  # why a bundle's dry run was not used (a sentence), or None

    @property
    def blocks_on_gpu(self) -> int:
        return len(gpu_blocks(self.model.n_layer, self.ngl))

    @property
    def output_on_gpu(self) -> bool:
        return self.ngl >= 1

    def flags(self) -> list[str]:
        out = ["-ngl", str(self.ngl), "-c", str(self.ctx), "-np", str(self.n_parallel)]
        if self.model.is_moe:
            out += ["--n-cpu-moe", str(self.n_cpu_moe)]
        if self.kv_type != "f16" or self.v_type != "f16":
            out += ["-ctk", self.kv_type, "-ctv", self.v_type]
        if self.kv_unified:
            out.append("-kvu")
        return out + ["-fa", "on" if self.flash_attn else "off"]

    @property
    def v_type(self) -> str:
        return self.kv_type_v or self.kv_type

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, "model": self.model.to_json(), "free_vram": self.free_vram, "ngl": self.ngl,
                "n_cpu_moe": self.n_cpu_moe, "moe": self.model.is_moe, "ctx": self.ctx,
                "ctx_requested": self.ctx_requested,
                "kv_cells": kv_cells(self.ctx, self.n_parallel, unified=self.kv_unified)[0],
                "n_parallel": self.n_parallel, "kv_type": self.kv_type, "kv_type_v": self.v_type,
                "kv_unified": self.kv_unified, "flash_attn": self.flash_attn, "warnings": list(self.warnings),
                "blocks_on_gpu": self.blocks_on_gpu, "output_on_gpu": self.output_on_gpu, "headroom": str(self.headroom),
                "bytes": self.estimate.to_json(), "reasons": list(self.reasons), "flags": self.flags(),
                "estimate_by": self.estimate_by, "dry_run": dict(self.dry_run) if self.dry_run is not None else None,
                "dry_run_skipped": self.dry_run_skipped}


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


def _rungs(model: ModelInfo, *, min_ngl: int = 0, max_n_cpu_moe: int | None = None) -> list[tuple[int, int]]:
    """(ngl, n_cpu_moe) from everything on the GPU to nothing on it; with an app's floor, every rung is
    raised to at least its -ngl and at most its --n-cpu-moe (the last rung is then the app's own choice)."""
    n = model.n_layer
    if not model.is_moe:
        ladder = [(ngl, 0) for ngl in range(n + 1, -1, -1)]
    else:
        ladder = [(n + 1, m) for m in range(n + 1)] + [(ngl, n) for ngl in range(n, -1, -1)]
    lo, cap = min(max(min_ngl, 0), n + 1), n if max_n_cpu_moe is None else min(max(max_n_cpu_moe, 0), n)
    return list(dict.fromkeys((max(g, lo), min(m, cap)) for g, m in ladder))


def plan_offload(model: ModelInfo, *, free_vram: int, ctx: int | None = None, min_ctx: int | None = None,
                 n_parallel: int = 1, kv_type: str | None = None, kv_type_v: str | None = None,
                 kv_unified: bool = False, n_ubatch: int | None = None, n_batch: int | None = None,
                 op_offload: bool = True, flash_attn: bool = True, headroom: Headroom | None = None,
                 min_ngl: int | None = None,
                 max_n_cpu_moe: int | None = None, dry_run: DryRun | None = None) -> Plan:
    """The most-offloaded -ngl (and --n-cpu-moe) that fits in free_vram, shrinking the context first
    when that keeps more on the GPU (see the module doc). Raises UsageError when nothing fits.
    min_ngl / max_n_cpu_moe (an app's own flags) bound the ladder: the plan never offloads less than they
    do, and when even they do not fit they are kept, with a warning, instead of an error.
    dry_run: a bundle's llamabundle-memory; each rung the plan weighs is then sized by llama.cpp's own dry run
    (runtime.dryrun): the first rung that fits by llama.cpp's figures is bisected for between the closed-form
    choice and the end of the ladder it lies towards (one dry run each when the closed form was right)."""
    k = knowledge()
    kv_type = kv_type or k["default_kv_type"]
    for t in {kv_type, kv_type_v or kv_type}:
        if t not in k["kv_types"]:
            raise UsageError(f"unknown KV cache type '{t}'", fix=f"use one of {', '.join(k['kv_types'])}")
    v_type = kv_type_v or kv_type
    if v_type not in ("f32", "f16", "bf16") and not flash_attn:
        raise UsageError(f"a {v_type} V cache needs flash attention", why="llama.cpp refuses a quantized V cache without it",
                         fix="drop --no-flash-attn (or -fa off), or use an f16 V cache")
    headroom = headroom or parse_headroom()
    ctx = ctx or model.n_ctx_train or k["min_ctx"]
    min_ctx = min(min_ctx or k["min_ctx"], ctx)
    if n_parallel < 1 or n_parallel > ctx:
        raise UsageError(f"--parallel {n_parallel} does not fit a context of {ctx}", fix="use 1 <= --parallel <= --ctx")
    ctxs = [ctx]
    while ctxs[-1] // 2 >= min_ctx:
        ctxs.append(ctxs[-1] // 2)
    if ctxs[-1] > min_ctx:
        ctxs.append(min_ctx)
    floored = min_ngl is not None or (max_n_cpu_moe is not None and model.is_moe)
    rungs = _rungs(model, min_ngl=min_ngl or 0, max_n_cpu_moe=max_n_cpu_moe if model.is_moe else None)

    def closed_form(rung: tuple[int, int], c: int) -> Estimate:
        return estimate(model, ngl=rung[0], n_cpu_moe=rung[1], ctx=c, n_parallel=n_parallel, kv_type=kv_type,
                        kv_type_v=v_type, kv_unified=kv_unified, n_ubatch=n_ubatch, op_offload=op_offload,
                        flash_attn=flash_attn, free_vram=free_vram, headroom=headroom)

    measured: dict[tuple[tuple[int, int], int], DeviceMemory | None] = {}

    def cost(rung: tuple[int, int], c: int) -> Estimate:
        est = closed_form(rung, c)
        if dry_run is None:
            return est
        if (rung, c) not in measured:
            measured[rung, c] = dry_run.measure(model.path, Launch(
                ngl=rung[0], n_cpu_moe=rung[1], ctx=c, n_parallel=n_parallel, kv_unified=kv_unified, kv_type=kv_type,
                kv_type_v=v_type, flash_attn=flash_attn, n_ubatch=n_ubatch, n_batch=n_batch, op_offload=op_offload))
        got = measured[rung, c]
        return est if got is None else replace(est, weights=got.model, kv=got.context, compute=got.compute)

    def first_fit(c: int) -> int | None:
        guess = next((i for i, r in enumerate(rungs) if closed_form(r, c).total <= free_vram), None)
        if dry_run is None:
            return guess
        # The rungs need less and less memory down the ladder: bisect for the first that fits by llama.cpp's
        # figures, between the closed-form choice and the rung next to it (one dry run each when it was right).
        def fits(i: int) -> bool:
            return cost(rungs[i], c).total <= free_vram

        g = len(rungs) - 1 if guess is None else guess
        if fits(g):
            if g == 0 or not fits(g - 1):
                return g
            lo, hi = 0, g - 1  # the first fit is in [lo, hi], and hi fits
        else:
            if g + 1 >= len(rungs) or not fits(len(rungs) - 1):
                return None
            lo, hi = g + 1, len(rungs) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        return hi

    def name(i: int) -> str:
        return f"-ngl {rungs[i][0]}" + (f" --n-cpu-moe {rungs[i][1]}" if model.is_moe else "")

    reasons: list[str] = []
    at, best = 0, first_fit(ctx)
    while best != 0 and at + 1 < len(ctxs):
        a, b = ctxs[at], ctxs[at + 1]
        nxt = first_fit(b)
        if best is not None and (nxt is None or nxt >= best):
            reasons.append(f"context kept at {a}: halving it to {b} would not move more of the model to the GPU")
            break
        if best is None or nxt is None:
            reasons.append(f"context {a} -> {b}: nothing fits at {a}, not even -ngl 0")
        else:
            saved = cost(rungs[nxt], a).total - cost(rungs[nxt], b).total
            reasons.append(f"context {a} -> {b}: {name(nxt)} fits instead of {name(best)}; the shorter context "
                           f"needs {_mib(saved)} less KV cache and compute buffer")
        at, best = at + 1, nxt
    else:
        if best not in (0, None):
            reasons.append(f"context not shrunk below {ctxs[at]} (--min-ctx {min_ctx})")
    warnings: list[str] = []
    if best is None and floored:  # the app's own -ngl / --n-cpu-moe: kept, the plan never offloads less
        best, app = len(rungs) - 1, cost(rungs[-1], ctxs[at])
        warnings.append(f"the app's {name(best)} does not fit: at context {ctxs[at]} it needs {_mib(app.total)} "
                        f"({_mib(app.total - free_vram)} more than the {_mib(free_vram)} free); kept, since the plan "
                        f"only ever offloads more; llama.cpp may fail to allocate its buffers")
    if best is None:
        need = cost(rungs[-1], ctxs[at])
        raise UsageError(f"{model.path.name} cannot run with {_mib(free_vram)} of free VRAM, even with every layer on the CPU",
                         why=f"at -ngl 0 and context {ctxs[at]} llama.cpp still needs a {_mib(need.compute)} compute buffer "
                             f"on the GPU, plus {_mib(need.headroom)} of headroom ({headroom}): {_mib(need.total)} in all",
                         fix="free GPU memory, lower --min-ctx or --headroom, or run the CPU bundle")
    ngl, ncmoe = rungs[best]
    chosen = cost(rungs[best], ctxs[at])
    n = model.n_layer
    if warnings:
        reasons.insert(0, f"{name(best)}: the app's own choice, kept although it does not fit")
    elif best == 0:
        reasons.insert(0, f"everything fits: {n} blocks and the output layer on the GPU at context {ctxs[at]}")
    else:
        over = cost(rungs[best - 1], ctxs[at]).total - free_vram
        reasons.insert(0, f"{name(best)}: one step more ({name(best - 1)}) would need {_mib(over)} more than the free VRAM")
    if floored and best < len(rungs) - 1:
        reasons.append(f"{name(best)} instead of the app's {name(len(rungs) - 1)}: more of the model fits on the GPU")
    if model.is_moe and ncmoe and ngl == n + 1:
        reasons.append(f"--n-cpu-moe {ncmoe}: the expert tensors of block{'s 0-' if ncmoe > 1 else ' '}{ncmoe - 1} "
                       f"({_mib(sum(model.expert_bytes[:ncmoe]))}) stay in system RAM")
    if ngl == 0:
        reasons.append("-ngl 0: no layer fits on the GPU; llama.cpp computes on the CPU (probe reason cuda_gpu_layers_zero)")
    by = CLOSED_FORM
    if dry_run is not None:
        warnings += dry_run.warnings
        if measured.get((rungs[best], ctxs[at])) is not None:
            by = LLAMA_CPP
        else:
            warnings.append(f"{dry_run.bundle}'s {dry_run.program.name} lists no GPU device here (its GPU backend does "
                            f"not load: see probe): the figures are llamabundle's closed-form estimate")
    return Plan(model=model, free_vram=free_vram, ngl=ngl, n_cpu_moe=ncmoe, ctx=ctxs[at], ctx_requested=ctx,
                n_parallel=n_parallel, kv_type=kv_type, flash_attn=flash_attn, headroom=headroom, estimate=chosen,
                reasons=tuple(reasons), kv_type_v=kv_type_v, kv_unified=kv_unified, warnings=tuple(warnings),
                estimate_by=by, dry_run=dry_run.to_json() if dry_run is not None else None)


# ---------------------------------------------------------------------------- free VRAM from the driver



@dataclass(frozen=True, kw_only=True)
class FreeVram:
    """Free GPU memory and where it came from: nvidia-smi (with the GPU it names) or --free-vram."""

    free: int
    source: str  # "nvidia-smi" | "--free-vram"
    gpu: int | None = None
    total: int | None = None
    nvidia_smi: str | None = None

    def to_json(self) -> dict[str, Any] | None:
        if self.source != "nvidia-smi":
            return None
        return {"index": self.gpu, "memory_free_mib": self.free // MiB, "memory_total_mib": (self.total or 0) // MiB,
                "nvidia_smi": self.nvidia_smi}


def query_free_vram(*, env: Mapping[str, str], nvidia_smi: str | None = None, gpu: int = 0,
                    timeout: float | None = None) -> FreeVram:
    """GPU `gpu`'s free memory as the driver reports it, through nvidia-smi (given, or found on env's PATH),
    run by proc.capture with probe's timeout. Raises UsageError (exit 2) with a fix when it cannot be read."""
    from .. import gpus

    timeout = gpus.SMI_TIMEOUT if timeout is None else timeout
    fix = "pass --free-vram SIZE (e.g. --free-vram 22GiB), or --nvidia-smi PATH for the driver's nvidia-smi"
    what = f"cannot read the free VRAM of GPU {gpu} from nvidia-smi, and no --free-vram was given"
    exe = gpus.find(env, nvidia_smi)
    if exe is None:
        raise UsageError(what, why="nvidia-smi is not on PATH (no NVIDIA driver here?)", fix=fix)
    answer = gpus.run(exe, gpus.MEMORY_ARGS, env=env, timeout=timeout)
    if answer.stdout is None:
        raise UsageError(what, why=f"{exe}: {answer.failure}", fix=fix)
    try:
        free, total = gpus.read_memory(answer.stdout, gpu)
    except ValueError as e:
        raise UsageError(what, why=f"{exe}: {e}", fix=fix + "; --gpu N picks another GPU") from None
    return FreeVram(free=free, total=total, gpu=gpu, source="nvidia-smi", nvidia_smi=exe)


def app_floor(model: ModelInfo, app: ServerArgs) -> tuple[int | None, int | None]:
    """(the least -ngl, the most --n-cpu-moe) a plan may choose for this app: it never offloads less. An
    app without --n-cpu-moe keeps on the CPU only the experts of its CPU blocks (those below N + 1 - ngl)."""
    n = model.n_layer
    ngl = None if app.ngl is None else n + 1 if app.ngl == ALL_LAYERS else min(app.ngl, n + 1)
    if not model.is_moe:
        return ngl, None
    if app.cpu_moe:
        return ngl, n
    if app.n_cpu_moe is not None:
        return ngl, min(app.n_cpu_moe, n)
    return ngl, None if ngl is None else max(n + 1 - ngl, 0)


def plan_for_app(model: ModelInfo, app: ServerArgs, *, free_vram: int, headroom: Headroom | None = None,
                 dry_run: DryRun | None = None) -> Plan:
    """The plan for an app's llama-server flags: their context, slots, cache types, flash attention and batch,
    and at least their offload (see app_floor); llama-server's defaults where they give none (-c 0: the
    trained context; no -np: 4 slots sharing one unified KV cache; -fa auto: on)."""
    k = knowledge()
    ctx = app.ctx or model.n_ctx_train or k["min_ctx"]
    auto_np = app.n_parallel is None
    n_parallel: int = k["server_auto_parallel"] if app.n_parallel is None else app.n_parallel
    unified = True if auto_np else bool(app.kv_unified)
    n_ubatch = min(app.n_ubatch or k["n_ubatch"], app.n_batch or 1 << 30)
    min_ngl, max_ncmoe = app_floor(model, app)
    plan = plan_offload(model, free_vram=free_vram, ctx=ctx, min_ctx=ctx, n_parallel=n_parallel,
                        kv_type=app.kv_type_k or k["default_kv_type"],
                        kv_type_v=app.kv_type_v or k["default_kv_type"], kv_unified=unified,
                        n_ubatch=n_ubatch, op_offload=app.op_offload, flash_attn=app.flash_attn is not False,
                        headroom=headroom, min_ngl=min_ngl, max_n_cpu_moe=max_ncmoe, n_batch=app.n_batch,
                        dry_run=dry_run)
    notes = list(plan.warnings)
    if app.unmodelled and plan.estimate_by == CLOSED_FORM:
        notes.append(f"{', '.join(app.unmodelled)}: passed to llama-server as given, but not part of this estimate")
    reasons = list(plan.reasons)
    if auto_np:
        reasons.append(f"no -np: llama-server runs {n_parallel} slots sharing one unified KV cache of -c cells")
    return replace(plan, warnings=tuple(notes), reasons=tuple(reasons))


def launch_args(plan: Plan, app: ServerArgs) -> list[str]:
    """The app's llama-server flags with the plan's -ngl (and, for a MoE model, --n-cpu-moe) in place of
    theirs, or added at the end. A value that already says what the plan chose is left as written (-ngl 99)."""
    out = list(app.argv)
    n = plan.model.n_layer
    drop: set[int] = set()
    add: list[str] = []

    def put(key: str, flag: str, value: str) -> None:
        if key in app.at:
            out[app.at[key] + 1] = value
        else:
            add.extend([flag, value])

    min_ngl, _ = app_floor(plan.model, app)
    if min_ngl is None or plan.ngl > min_ngl:
        put("ngl", "-ngl", str(plan.ngl))
    if plan.model.is_moe:
        if app.cpu_moe and plan.n_cpu_moe < n:
            drop.add(app.at["cmoe"])
            put("ncmoe", "--n-cpu-moe", str(plan.n_cpu_moe))
        elif not app.cpu_moe and (app.n_cpu_moe is not None or plan.n_cpu_moe > 0):
            if app.n_cpu_moe is None or min(app.n_cpu_moe, n) != plan.n_cpu_moe:
                put("ncmoe", "--n-cpu-moe", str(plan.n_cpu_moe))
    return [a for i, a in enumerate(out) if i not in drop] + add


