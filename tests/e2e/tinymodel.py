"""Write a tiny Qwen2-architecture GGUF with random F16 weights, tokenizer copied from a vocab-only
GGUF of the llama.cpp tree (models/ggml-vocab-qwen2.gguf), using llama.cpp's own gguf-py."""

from __future__ import annotations

import sys
from pathlib import Path


def write_tiny_qwen2(source_dir: Path, out: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, ffn: int = 128) -> Path:
    sys.path.insert(0, str(source_dir / "gguf-py"))
    try:
        import gguf
        import numpy as np
    finally:
        sys.path.pop(0)
    reader = gguf.GGUFReader(str(source_dir / "models" / "ggml-vocab-qwen2.gguf"))
    w = gguf.GGUFWriter(str(out), "qwen2")
    n_vocab = 0
    for name, f in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            if f.types[1] == gguf.GGUFValueType.STRING:
                val = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
            else:
                val = [f.parts[i].tolist()[0] for i in f.data]
            w.add_array(name, val)
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(val)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(name, bytes(f.parts[f.data[0]]).decode("utf-8", "replace"))
        else:
            w.add_key_value(name, f.parts[f.data[0]].tolist()[0], vtype)
    assert n_vocab, "the vocab file has no tokens"
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    kv = hidden // heads * kv_heads
    w.add_tensor("token_embd.weight", rand(n_vocab, hidden))
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(b + "attn_q.weight", rand(hidden, hidden))
        w.add_tensor(b + "attn_q.bias", np.zeros(hidden, np.float32))
        w.add_tensor(b + "attn_k.weight", rand(kv, hidden))
        w.add_tensor(b + "attn_k.bias", np.zeros(kv, np.float32))
        w.add_tensor(b + "attn_v.weight", rand(kv, hidden))
        w.add_tensor(b + "attn_v.bias", np.zeros(kv, np.float32))
        w.add_tensor(b + "attn_output.weight", rand(hidden, hidden))
        w.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(b + "ffn_gate.weight", rand(ffn, hidden))
        w.add_tensor(b + "ffn_up.weight", rand(ffn, hidden))
        w.add_tensor(b + "ffn_down.weight", rand(hidden, ffn))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rand(n_vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
