"""A GGUF model's shapes for the offload planner: hyperparameters and per-block tensor bytes, read from the
file's header (memory-mapped: no weight is read), and data/offload.json, the planner's knowledge of llama.cpp
(checked against gguf's own type table when it is first used)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from .. import data
from ..errors import UsageError

MiB = 1 << 20


@cache
def constants() -> dict[str, Any]:
    info: dict[str, Any] = data.load("offload.json")
    assert info["default_kv_type"] in info["kv_types"]
    return info


@cache
def knowledge() -> dict[str, Any]:
    """data/offload.json, checked: every KV type's block and byte size agree with gguf's table."""
    import gguf  # 0.2 s of numpy: imported when a plan is made, not when the CLI starts

    info = constants()
    for name, (blck, size) in info["kv_types"].items():
        assert tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]) == (blck, size), name
    return info


def kv_types() -> list[str]:
    """The KV cache types llama.cpp accepts for -ctk/-ctv."""
    return list(constants()["kv_types"])


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] first
    type: str
    n_bytes: int


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    path: Path
    architecture: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: tuple[int, ...]  # per block
    n_head_kv: tuple[int, ...]  # per block
    head_dim_k: int
    head_dim_v: int
    n_ff: int  # feed-forward width active per token (MoE: experts used x expert width)
    n_vocab: int
    n_expert: int
    n_expert_used: int
    tensors: tuple[TensorInfo, ...]
    layer_bytes: tuple[int, ...]  # every tensor of blk.i
    expert_bytes: tuple[int, ...]  # the expert tensors of blk.i (included in layer_bytes)
    output_bytes: int  # the output layer (slot N)
    input_bytes: int  # token_embd and the rest: always on the CPU

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0 and any(self.expert_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @cached_property
    def largest_weights(self) -> tuple[tuple[int, int], ...]:
        """Per block: (its largest tensor of 2+ dimensions that is not an expert tensor, its largest expert
        tensor): what op offload copies into the GPU compute buffer when that tensor is on the CPU."""
        k = knowledge()
        layer_re, expert_re = re.compile(k["layer_tensor_regex"]), re.compile(k["expert_tensor_regex"])
        out = [[0, 0] for _ in range(self.n_layer)]
        for t in self.tensors:
            m = layer_re.match(t.name)
            if m and int(m[1]) < self.n_layer and len(t.shape) >= 2:
                slot = out[int(m[1])]
                e = 1 if expert_re.match(t.name) else 0
                slot[e] = max(slot[e], t.n_bytes)
        return tuple((a, b) for a, b in out)

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "architecture": self.architecture, "n_layer": self.n_layer,
                "n_ctx_train": self.n_ctx_train, "n_embd": self.n_embd, "n_head": list(self.n_head),
                "n_head_kv": list(self.n_head_kv), "head_dim_k": self.head_dim_k, "head_dim_v": self.head_dim_v,
                "n_vocab": self.n_vocab, "expert_count": self.n_expert, "expert_used_count": self.n_expert_used,
                "tensor_bytes": self.total_bytes, "output_bytes": self.output_bytes, "input_bytes": self.input_bytes}


def read_model(path: Path) -> ModelInfo:
    """Hyperparameters and per-layer tensor bytes of a GGUF file (memory-mapped: only the header is read)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - gguf raises assorted errors on a missing, truncated or foreign file
        raise UsageError(f"cannot read {path} as a GGUF model", why=f"{type(e).__name__}: {e}",
                         fix="pass the path of a .gguf model file") from None

    def field(key: str, default: Any = None) -> Any:
        f = reader.get_field(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if not isinstance(arch, str):
        raise UsageError(f"{path} has no general.architecture", fix="pass a llama.cpp GGUF model")
    n_layer, n_embd, head = field(f"{arch}.block_count"), field(f"{arch}.embedding_length"), field(f"{arch}.attention.head_count")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int) or head is None:
        raise UsageError(f"{path} lacks {arch}.block_count, .embedding_length or .attention.head_count",
                         fix="pass a transformer model converted by llama.cpp")

    def per_layer(key: str, value: Any) -> tuple[int, ...]:
        if isinstance(value, list):
            if len(value) != n_layer:
                raise UsageError(f"{path}: {key} has {len(value)} entries for {n_layer} blocks")
            return tuple(int(v) for v in value)
        return (int(value),) * n_layer

    n_head = per_layer(f"{arch}.attention.head_count", head)
    n_head_kv = per_layer(f"{arch}.attention.head_count_kv", field(f"{arch}.attention.head_count_kv", head))
    head_dim_k = int(field(f"{arch}.attention.key_length", n_embd // max(max(n_head), 1)))
    ff = field(f"{arch}.feed_forward_length", 0)
    n_ff = max(ff) if isinstance(ff, list) else int(ff)
    n_expert, n_expert_used = int(field(f"{arch}.expert_count", 0)), int(field(f"{arch}.expert_used_count", 0))
    if n_expert:
        n_ff = n_expert_used * int(field(f"{arch}.expert_feed_forward_length", n_ff))

    k = knowledge()
    layer_re, expert_re, output_re = (re.compile(k[f"{key}_tensor_regex"]) for key in ("layer", "expert", "output"))
    tensors = tuple(TensorInfo(name=t.name, shape=tuple(int(x) for x in t.shape), type=t.tensor_type.name,
                               n_bytes=int(t.n_bytes)) for t in reader.tensors)
    layers, experts, output, rest = [0] * n_layer, [0] * n_layer, 0, 0
    by_name = {t.name: t for t in tensors}
    for t in tensors:
        m = layer_re.match(t.name)
        if m and int(m[1]) < n_layer:
            layers[int(m[1])] += t.n_bytes
            if expert_re.match(t.name):
                experts[int(m[1])] += t.n_bytes
        elif output_re.match(t.name):
            output += t.n_bytes
        else:
            rest += t.n_bytes
    embd = by_name.get("token_embd.weight")
    if "output.weight" not in by_name and embd is not None:  # tied embeddings: llama.cpp duplicates token_embd
        output += embd.n_bytes
    tokens = reader.get_field("tokenizer.ggml.tokens")
    n_vocab = (embd.shape[1] if embd is not None and len(embd.shape) > 1
               else len(tokens.data) if tokens is not None else int(field(f"{arch}.vocab_size", 0)))
    return ModelInfo(path=path, architecture=arch, n_layer=n_layer, n_ctx_train=int(field(f"{arch}.context_length", 0)),
                     n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_dim_k,
                     head_dim_v=int(field(f"{arch}.attention.value_length", head_dim_k)), n_ff=n_ff, n_vocab=n_vocab,
                     n_expert=n_expert, n_expert_used=n_expert_used, tensors=tensors, layer_bytes=tuple(layers),
                     expert_bytes=tuple(experts), output_bytes=output, input_bytes=rest)
