"""llama-server's command line and log, as the offload planner reads them: the flags an app launches it with
(llama.cpp 0c1e570's common/arg.cpp spellings: -ngl, -c, -np, -ctk/-ctv, --n-cpu-moe, -fa, -kvu, -ub/-b …)
and the buffer sizes it logs when it loads a model."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from .gguf_model import MiB, constants, kv_types

# flag spellings of llama.cpp 0c1e570 (common/arg.cpp) that the plan reads; option -> key
_VALUE_FLAGS = {"-ngl": "ngl", "--gpu-layers": "ngl", "--n-gpu-layers": "ngl", "-c": "ctx", "--ctx-size": "ctx",
                "-np": "np", "--parallel": "np", "-ctk": "ctk", "--cache-type-k": "ctk", "-ctv": "ctv",
                "--cache-type-v": "ctv", "-ncmoe": "ncmoe", "--n-cpu-moe": "ncmoe", "-ub": "ub",
                "--ubatch-size": "ub", "-b": "b", "--batch-size": "b"}
_BOOL_FLAGS = {"-cmoe": ("cmoe", True), "--cpu-moe": ("cmoe", True), "-kvu": ("kvu", True),
               "--kv-unified": ("kvu", True), "-no-kvu": ("kvu", False), "--no-kv-unified": ("kvu", False),
               "--op-offload": ("opo", True), "--no-op-offload": ("opo", False)}
_FA_FLAGS = ("-fa", "--flash-attn")
_FA_VALUES = {"on": True, "enabled": True, "true": True, "1": True, "off": False, "disabled": False,
              "false": False, "0": False, "auto": None, "-1": None}
# placement flags passed through as they are, but not modelled by the plan
_UNMODELLED = ("-ot", "--override-tensor", "-ts", "--tensor-split", "-sm", "--split-mode", "-dev", "--device",
               "-mg", "--main-gpu", "-ncffn", "--n-cpu-ffn")
ALL_LAYERS = -2  # -ngl all (llama.cpp: <= -2)


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    """The flags an app launches llama-server with, and what the plan reads from them (None: not given).
    `at` maps each read key to its argv index (to replace its value). llama.cpp has no --flag=value form."""

    argv: tuple[str, ...]
    ngl: int | None = None  # -1 (auto) is None; 'all' is ALL_LAYERS
    n_cpu_moe: int | None = None
    cpu_moe: bool = False  # -cmoe: every expert tensor on the CPU
    ctx: int | None = None
    n_parallel: int | None = None  # -1 (auto) is None
    kv_type_k: str | None = None
    kv_type_v: str | None = None
    flash_attn: bool | None = None  # None: auto
    kv_unified: bool | None = None
    n_ubatch: int | None = None
    n_batch: int | None = None
    op_offload: bool = True
    unmodelled: tuple[str, ...] = ()
    at: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"args": list(self.argv), "ngl": self.ngl, "n_cpu_moe": self.n_cpu_moe, "cpu_moe": self.cpu_moe,
                "ctx": self.ctx, "n_parallel": self.n_parallel, "kv_type_k": self.kv_type_k,
                "kv_type_v": self.kv_type_v, "flash_attn": self.flash_attn}


def parse_server_args(argv: Sequence[str] | str) -> ServerArgs:
    """Read -ngl, -c, -np, -ctk/-ctv, --n-cpu-moe/-cmoe, -fa, -kvu, -ub/-b and --no-op-offload from llama-server
    flags (a list, or one string split as a shell would); every other flag is kept as it is."""
    args = tuple(shlex.split(argv) if isinstance(argv, str) else argv)
    got: dict[str, Any] = {}
    at: dict[str, int] = {}
    unmodelled: list[str] = []
    kv = set(kv_types())
    i = 0
    while i < len(args):
        flag = args[i]
        key = _VALUE_FLAGS.get(flag)
        if key is None and flag in _FA_FLAGS:
            if i + 1 < len(args) and args[i + 1].lower() in _FA_VALUES:
                value, used = args[i + 1], 1
            else:  # a bare -fa (llama.cpp before -fa took a value): on
                value, used = "on", 0
            got["fa"], at["fa"] = _FA_VALUES[value.lower()], i
            i += 1 + used
            continue
        if key is None:
            if flag in _BOOL_FLAGS:
                name, on = _BOOL_FLAGS[flag]
                got[name], at[name] = on, i
            elif flag in _UNMODELLED:
                unmodelled.append(flag)
            i += 1
            continue
        if i + 1 < len(args):
            value = args[i + 1]
        else:
            raise UsageError(f"server argument {flag} has no value", fix=f"write {flag} VALUE")
        if key in ("ctk", "ctv"):
            if value not in kv:
                raise UsageError(f"server argument {flag} {value}: unknown KV cache type", fix=f"use one of {', '.join(sorted(kv))}")
            got[key] = value
        elif key == "ngl" and value in ("auto", "all"):
            got[key] = None if value == "auto" else ALL_LAYERS
        else:
            try:
                number = int(value)
            except ValueError:
                raise UsageError(f"server argument {flag} {value!r} is not a whole number",
                                 fix=f"write {flag} N" + (" (or auto, all)" if key == "ngl" else "")) from None
            if number < 0 and not (key in ("ngl", "np") and number <= -1):
                raise UsageError(f"server argument {flag} {value} is negative", fix=f"write {flag} N with N >= 0")
            got[key] = (ALL_LAYERS if number <= -2 else None if number == -1 else number) if key == "ngl" \
                else (None if number < 0 else number) if key == "np" else number
        at[key] = i
        i += 2
    if got.get("np") == 0:
        raise UsageError("server argument -np 0: llama-server needs at least one slot", fix="write -np N with N >= 1")
    return ServerArgs(argv=args, ngl=got.get("ngl"), n_cpu_moe=got.get("ncmoe"), cpu_moe=got.get("cmoe", False),
                      ctx=got.get("ctx"), n_parallel=got.get("np"), kv_type_k=got.get("ctk"), kv_type_v=got.get("ctv"),
                      flash_attn=got.get("fa"), kv_unified=got.get("kvu"), n_ubatch=got.get("ub"),
                      n_batch=got.get("b"), op_offload=got.get("opo", True), unmodelled=tuple(dict.fromkeys(unmodelled)),
                      at=at)



_BUFFER_RE = re.compile(r"(\w+):\s+(\S+)\s+(model|KV|RS|compute|output) buffer size =\s*([\d.]+) MiB")
_OFFLOADED_RE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


@dataclass(frozen=True, kw_only=True)
class ReportedBuffers:
    """Buffer sizes llama.cpp logged for one model load, in bytes per kind ('model', 'kv', 'rs', 'compute',
    'output') and buffer name ('CUDA0', 'CUDA_Host', 'CPU_Mapped', ...)."""

    sizes: Mapping[str, Mapping[str, int]]
    offloaded: tuple[int, int] | None

    def gpu(self, kind: str) -> int:
        """Bytes of `kind` in device memory (CUDA0, Vulkan1, ...; not CPU, AMX or CUDA_Host buffers)."""
        gpu = re.compile(constants()["gpu_buffer_regex"])
        return sum(v for dev, v in self.sizes.get(kind, {}).items() if gpu.match(dev))


def parse_buffer_log(text: str) -> ReportedBuffers:
    """The buffer sizes in a llama.cpp log (`load_tensors:  CUDA0 model buffer size = 4168.09 MiB`,
    `llama_kv_cache[_unified]: CUDA0 KV buffer size = ...`, `llama_context: CUDA0 compute buffer size = ...`).
    Lines of one kind and buffer add up (an iSWA cache logs two KV buffers); a model buffer after a
    KV or compute line starts a new load, and the last load is returned."""
    sizes: dict[str, dict[str, int]] = {}
    offloaded: tuple[int, int] | None = None
    for line in text.splitlines():
        if m := _OFFLOADED_RE.search(line):
            offloaded = (int(m[1]), int(m[2]))
        if (m := _BUFFER_RE.search(line)) is None:
            continue
        kind = m[3].lower()
        if kind == "model" and any(kk != "model" for kk in sizes):
            sizes = {}
        per = sizes.setdefault(kind, {})
        per[m[2]] = per.get(m[2], 0) + round(float(m[4]) * MiB)
    return ReportedBuffers(sizes=sizes, offloaded=offloaded)
