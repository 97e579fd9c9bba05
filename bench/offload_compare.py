"""The offload planner's estimate against llama.cpp's own buffer sizes, for a few -ngl / -c points.

For each point it starts llama-server (`-ngl N -c C -np P --fit off --verbose`), waits until the model is
loaded (or the server exits), stops it, reads the `model / KV / compute buffer size` lines of its log
(llamabundle.runtime.server_args.parse_buffer_log) and prints a markdown table: estimate, reported GPU bytes and
their ratio per kind. Without --model it writes a synthetic llama model (zero weights, a small SPM
vocabulary) with gguf first, dense or mixture-of-experts.

    python bench/offload_compare.py --server BUNDLE/llama-server [--model M.gguf | --synthetic dense|moe]
        [--points 17:4096,17:16384,9:8192,1:4096,0:4096] [--out bench/results/offload-h200.md]

Run it on a machine with an NVIDIA GPU and the CUDA bundle; on a CPU-only build every GPU column is 0.
Use --no-fit-flag for a llama.cpp older than `--fit` (then its fitting is off anyway).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llamabundle.runtime.gguf_model import MiB, read_model  # noqa: E402
from llamabundle.runtime.offload import estimate  # noqa: E402
from llamabundle.runtime.server_args import parse_buffer_log  # noqa: E402

READY = ("model loaded", "listening on", "server is listening")


def write_synthetic(path: Path, *, arch: str = "llama", n_layer: int = 16, n_embd: int = 2048, n_head: int = 16,
                    n_head_kv: int | list[int] = 4, n_ff: int = 5632, n_vocab: int = 32000, n_ctx_train: int = 32768,
                    n_expert: int = 0, n_expert_used: int = 0, tied: bool = False) -> Path:
    """A GGUF llama.cpp can load: f16 zero weights, f32 norms, an SPM vocabulary with byte fallback.
    n_head_kv may be a list (one per block); with n_expert > 0 the FFN is 3-D expert tensors."""
    import gguf
    import numpy as np

    assert n_vocab >= 3 + 256 + 1, "the vocabulary holds <unk> <s> </s>, 256 byte tokens and one more"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_vocab_size(n_vocab)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def f16(*shape: int) -> Any:  # numpy order: the ggml shape reversed (ne[0] = the input width last)
        return np.zeros(shape, dtype=np.float16)

    def norm() -> Any:
        return np.ones(n_embd, dtype=np.float32)

    hd = n_embd // n_head
    kv = n_head_kv if isinstance(n_head_kv, list) else [n_head_kv] * n_layer
    w.add_tensor("token_embd.weight", f16(n_vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm())
        w.add_tensor(p + "attn_q.weight", f16(n_embd, n_embd))
        w.add_tensor(p + "attn_k.weight", f16(kv[i] * hd, n_embd))
        w.add_tensor(p + "attn_v.weight", f16(kv[i] * hd, n_embd))
        w.add_tensor(p + "attn_output.weight", f16(n_embd, n_embd))
        w.add_tensor(p + "ffn_norm.weight", norm())
        if n_expert:
            w.add_tensor(p + "ffn_gate_inp.weight", np.zeros((n_expert, n_embd), dtype=np.float32))
            w.add_tensor(p + "ffn_gate_exps.weight", f16(n_expert, n_ff, n_embd))
            w.add_tensor(p + "ffn_up_exps.weight", f16(n_expert, n_ff, n_embd))
            w.add_tensor(p + "ffn_down_exps.weight", f16(n_expert, n_embd, n_ff))
        else:
            w.add_tensor(p + "ffn_gate.weight", f16(n_ff, n_embd))
            w.add_tensor(p + "ffn_up.weight", f16(n_ff, n_embd))
            w.add_tensor(p + "ffn_down.weight", f16(n_embd, n_ff))
    w.add_tensor("output_norm.weight", norm())
    if not tied:
        w.add_tensor("output.weight", f16(n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_server(server: Path, model: Path, *, ngl: int, ctx: int, n_parallel: int, flash_attn: bool, fit_flag: bool,
               verbose: bool, timeout: float, n_cpu_moe: int = 0) -> str:
    """llama-server's log from start until the model is loaded (then it is stopped)."""
    argv = [str(server), "-m", str(model), "-ngl", str(ngl), "-c", str(ctx), "-np", str(n_parallel),
            "-fa", "on" if flash_attn else "off", "--host", "127.0.0.1", "--port", str(free_port())]
    argv += ["--n-cpu-moe", str(n_cpu_moe)] if n_cpu_moe else []
    argv += ["--fit", "off"] if fit_flag else []
    argv += ["--verbose"] if verbose else []
    print("+ " + " ".join(argv), file=sys.stderr)
    return server_log(argv, timeout=timeout)


def server_log(argv: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """The log of the llama-server `argv` from start until the model is loaded (then it is stopped)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            errors="replace", env=env, cwd=cwd)
    assert proc.stdout is not None
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if any(r in line for r in READY):
                ready.set()
        ready.set()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    ready.wait(timeout)
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    t.join(5)
    return "".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True, type=Path, help="llama-server of the bundle")
    ap.add_argument("--model", type=Path, help="a GGUF model (default: write a synthetic one)")
    ap.add_argument("--synthetic", choices=["dense", "moe"], default="dense")
    ap.add_argument("--points", help="ngl:ctx[:n_cpu_moe],... (default: full, full at 4x ctx, half, output only, none)")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--no-flash-attn", action="store_true")
    ap.add_argument("--no-fit-flag", action="store_true", help="do not pass --fit off (llama.cpp without --fit)")
    ap.add_argument("--quiet-server", action="store_true",
                    help="do not pass --verbose (llama-server then logs no buffer sizes)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, help="also write the table (and the logs beside it) here")
    ap.add_argument("--keep-logs", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lb-offload-"))
    model_path = a.model
    if model_path is None:
        model_path = work / f"synthetic-{a.synthetic}.gguf"
        moe = a.synthetic == "moe"
        write_synthetic(model_path, n_layer=16, n_ff=1408 if moe else 5632, n_expert=8 if moe else 0,
                        n_expert_used=2 if moe else 0)
    model = read_model(model_path)
    n = model.n_layer
    points = ([(*(int(x) for x in p.split(":")), 0)[:3] for p in a.points.split(",")] if a.points
              else [(n + 1, 4096, 0), (n + 1, 16384, 0), (n // 2, 8192, 0), (1, 4096, 0), (0, 4096, 0)])
    if model.is_moe and not a.points:
        points.insert(1, (n + 1, 4096, n // 2))
    fa = not a.no_flash_attn
    rows = ["| -ngl | --n-cpu-moe | -c | kind | estimate MiB | llama.cpp GPU MiB | ratio |",
            "|---:|---:|---:|---|---:|---:|---:|"]
    logs: list[str] = []
    for ngl, ctx, ncmoe in points:
        t0 = time.monotonic()
        log = run_server(a.server, model_path, ngl=ngl, ctx=ctx, n_parallel=a.parallel, flash_attn=fa,
                         fit_flag=not a.no_fit_flag, verbose=not a.quiet_server, timeout=a.timeout, n_cpu_moe=ncmoe)
        logs.append(f"===== -ngl {ngl} --n-cpu-moe {ncmoe} -c {ctx} ({time.monotonic() - t0:.1f}s)\n{log}")
        rep = parse_buffer_log(log)
        est = estimate(model, ngl=ngl, n_cpu_moe=ncmoe, ctx=ctx, n_parallel=a.parallel, flash_attn=fa)
        if rep.offloaded is not None:
            print(f"-ngl {ngl}: llama.cpp offloaded {rep.offloaded[0]}/{rep.offloaded[1]} layers", file=sys.stderr)
        for kind, mine in (("model", est.weights), ("kv", est.kv), ("compute", est.compute)):
            theirs = rep.gpu(kind)
            ratio = f"{mine / theirs:.3f}" if theirs else ("-" if not mine else "inf")
            rows.append(f"| {ngl} | {ncmoe} | {ctx} | {kind} | {mine / MiB:,.2f} | {theirs / MiB:,.2f} | {ratio} |")
    head = (f"model `{model_path.name}`: {model.architecture}, {n} blocks, {model.n_expert} experts, "
            f"{model.total_bytes / MiB:,.1f} MiB of tensors; -np {a.parallel}, flash attention {'on' if fa else 'off'}\n\n")
    table = head + "\n".join(rows) + "\n"
    print(table)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(table)
        if a.keep_logs:
            a.out.with_suffix(".log").write_text("\n".join(logs))


if __name__ == "__main__":
    main()
