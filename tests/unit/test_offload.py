"""The VRAM offload planner on real GGUF files written with gguf (dense, MoE, per-layer KV heads): what
it reads, what it estimates, what it chooses at several VRAM sizes, the context-for-layers trade, the
refusal, size parsing, llama.cpp log parsing, the bench's server runner and `llamabundle plan`."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from llamabundle.errors import UsageError
from llamabundle.runtime.gguf_model import MiB, read_model
from llamabundle.runtime.offload import (
    Headroom,
    estimate,
    gpu_blocks,
    kv_cells,
    parse_headroom,
    parse_size,
    plan_offload,
)
from llamabundle.runtime.server_args import parse_buffer_log
from tests.clirun import run  # noqa: E402
from tests.ggufs import NONE, bench, write

ROOT = Path(__file__).resolve().parents[2]


# The small dense model: 4 blocks, n_embd 64, 4 heads of 16, 2 KV heads, n_ff 128, 300 tokens, all f16
# but the f32 norms. Bytes by hand: q, o 64*64*2; k, v 32*64*2; gate, up, down 128*64*2; 2 norms 64*4.
LAYER = 2 * 8192 + 2 * 4096 + 3 * 16384 + 2 * 256
EMBD = 300 * 64 * 2
OUTPUT = EMBD + 256  # output.weight + output_norm
KV_CELL = 2 * 16 * 2 * 2  # per block and KV cell: 2 heads x 16 dims x (K + V) x f16


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("gguf") / "dense.gguf")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("gguf") / "moe.gguf", n_expert=4, n_expert_used=2)


def test_read_model_groups_tensors_per_layer(dense: Path) -> None:
    m = read_model(dense)
    assert (m.architecture, m.n_layer, m.n_ctx_train, m.n_embd, m.n_vocab) == ("llama", 4, 32768, 64, 300)
    assert m.n_head == (4,) * 4 and m.n_head_kv == (2,) * 4 and (m.head_dim_k, m.head_dim_v) == (16, 16)
    assert m.layer_bytes == (LAYER,) * 4 and m.expert_bytes == (0,) * 4 and not m.is_moe
    assert (m.output_bytes, m.input_bytes) == (OUTPUT, EMBD)
    assert m.total_bytes == 4 * LAYER + OUTPUT + EMBD
    k = next(t for t in m.tensors if t.name == "blk.0.attn_k.weight")
    assert (k.shape, k.type, k.n_bytes) == ((64, 32), "F16", 4096)


def test_tied_embeddings_put_a_copy_of_token_embd_in_the_output_layer(tmp_path: Path) -> None:
    m = read_model(write(tmp_path / "tied.gguf", tied=True))
    assert (m.output_bytes, m.input_bytes) == (EMBD + 256, EMBD)


def test_moe_expert_tensors_and_active_ffn(moe: Path) -> None:
    m = read_model(moe)
    experts = 3 * 4 * 128 * 64 * 2
    assert m.is_moe and (m.n_expert, m.n_expert_used, m.n_ff) == (4, 2, 256)
    assert m.expert_bytes == (experts,) * 4
    assert m.layer_bytes == (LAYER - 3 * 16384 + experts + 4 * 64 * 4,) * 4  # + the f32 router ffn_gate_inp


def test_not_a_gguf_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_text("not a model\n")
    with pytest.raises(UsageError, match="cannot read .* as a GGUF model"):
        read_model(bad)
    with pytest.raises(UsageError):
        read_model(tmp_path / "missing.gguf")


def test_ngl_follows_llama_cpp_output_layer_first() -> None:
    # llama-model.cpp: slots >= n_layer + 1 - ngl on the GPU; slot n_layer is the output layer
    assert list(gpu_blocks(4, 0)) == [] and list(gpu_blocks(4, 1)) == []
    assert list(gpu_blocks(4, 2)) == [3] and list(gpu_blocks(4, 4)) == [1, 2, 3]
    assert list(gpu_blocks(4, 5)) == [0, 1, 2, 3] == list(gpu_blocks(4, 99))


def test_estimate_weights_and_kv_per_ngl(dense: Path) -> None:
    m = read_model(dense)
    e = {ngl: estimate(m, ngl=ngl, ctx=4096, headroom=NONE) for ngl in range(6)}
    assert [e[n].weights for n in range(6)] == [0, OUTPUT] + [OUTPUT + k * LAYER for k in range(1, 5)]
    assert [e[n].kv for n in range(6)] == [0, 0] + [k * 4096 * KV_CELL for k in range(1, 5)]
    # the compute buffer is there at -ngl 0; with a block on the CPU it also holds a copy of its largest weight
    # (op offload: ffn_gate, up or down, 128 x 64 f16) or, larger here, of that block's K and V views
    assert 4096 * KV_CELL > 128 * 64 * 2
    assert {e[n].compute - e[5].compute for n in range(5)} == {4096 * KV_CELL} and e[0].compute > 0
    assert estimate(m, ngl=2, ctx=64, headroom=NONE).compute - estimate(m, ngl=5, ctx=64, headroom=NONE).compute \
        == max(128 * 64 * 2, 256 * KV_CELL)  # the cache is padded to 256 cells
    assert estimate(m, ngl=0, ctx=4096, op_offload=False).compute == e[5].compute
    assert e[5].total == e[5].weights + e[5].kv + e[5].compute
    assert estimate(m, ngl=5, ctx=4096, free_vram=1000 * MiB).headroom == 50 * MiB + 256 * MiB  # default 5%+256MiB
    # quantized cache: 32 values per row of K and of V -> one q8_0 block of 34 bytes each
    assert estimate(m, ngl=2, ctx=4096, kv_type="q8_0").kv == 4096 * 2 * 34
    # without flash attention the KQ matrix (n_head floats per cell and token) dominates the compute buffer
    assert estimate(m, ngl=5, ctx=8192, flash_attn=False).compute > 4 * 512 * 8192 * 4


def test_kv_cells_pad_and_split_like_llama_context() -> None:
    assert kv_cells(4096) == (4096, 4096)
    assert kv_cells(4000) == (4096, 4096)
    assert kv_cells(10000, 3) == (10752, 3584)  # pad(10000) = 10240; pad(10240 / 3) = 3584 per slot


def test_per_layer_head_count_kv_array(tmp_path: Path) -> None:
    m = read_model(write(tmp_path / "var.gguf", n_head_kv=[1, 2, 4, 2]))
    assert m.n_head_kv == (1, 2, 4, 2)
    per_head = 16 * 2 * 2  # 16 dims, K + V, f16
    assert estimate(m, ngl=2, ctx=1024).kv == 1024 * 2 * per_head  # block 3
    assert estimate(m, ngl=3, ctx=1024).kv == 1024 * (4 + 2) * per_head  # blocks 2, 3
    assert estimate(m, ngl=5, ctx=1024).kv == 1024 * 9 * per_head


@pytest.mark.parametrize("ngl", [5, 4, 3, 1, 0])
def test_plan_takes_the_largest_ngl_that_fits(dense: Path, ngl: int) -> None:
    m = read_model(dense)
    free = estimate(m, ngl=ngl, ctx=4096, headroom=NONE).total
    plan = plan_offload(m, free_vram=free, ctx=4096, min_ctx=4096, headroom=NONE)
    assert plan.ngl == ngl and plan.ctx == 4096 and plan.estimate.total <= free
    if ngl < 5:  # one byte less than the next rung needs
        assert plan_offload(m, free_vram=estimate(m, ngl=ngl + 1, ctx=4096, headroom=NONE).total - 1, ctx=4096,
                            min_ctx=4096, headroom=NONE).ngl == ngl
    assert plan.flags()[:6] == ["-ngl", str(ngl), "-c", "4096", "-np", "1"] and "--n-cpu-moe" not in plan.flags()
    assert ("cuda_gpu_layers_zero" in " ".join(plan.reasons)) == (ngl == 0)


def test_headroom_is_taken_from_the_free_vram(dense: Path) -> None:
    m = read_model(dense)
    free = estimate(m, ngl=5, ctx=4096, headroom=NONE).total
    room = Headroom(percent=10, fixed=MiB)
    plan = plan_offload(m, free_vram=int((free + MiB) / 0.9) + 64, ctx=4096, min_ctx=4096, headroom=room)
    assert plan.ngl == 5 and plan.estimate.headroom > MiB
    assert plan_offload(m, free_vram=free, ctx=4096, min_ctx=4096, headroom=room).ngl < 5


def test_shrinks_the_context_when_that_keeps_layers_on_the_gpu(tmp_path: Path) -> None:
    m = read_model(write(tmp_path / "kv.gguf", n_embd=256, n_head=4, n_head_kv=4))  # 4 KiB of KV cache per cell
    free = estimate(m, ngl=5, ctx=8192, headroom=NONE).total  # all layers fit at 8192, not at 32768
    plan = plan_offload(m, free_vram=free, ctx=32768, min_ctx=2048, headroom=NONE)
    assert (plan.ngl, plan.ctx, plan.ctx_requested) == (5, 8192, 32768)
    assert any("32768 -> 16384" in r for r in plan.reasons) and any("16384 -> 8192" in r for r in plan.reasons)
    assert plan.flags()[2:4] == ["-c", "8192"]
    # with the floor at the requested context it keeps the context and drops layers instead (here even -ngl 0
    # does not fit at 32768 in `free`: a CPU block's K and V views, 2 x 64 MiB, are copied into the compute
    # buffer; with room for two blocks it keeps two)
    with pytest.raises(UsageError, match="even with every layer on the CPU"):
        plan_offload(m, free_vram=free, ctx=32768, min_ctx=32768, headroom=NONE)
    two = estimate(m, ngl=3, ctx=32768, headroom=NONE).total
    kept = plan_offload(m, free_vram=two, ctx=32768, min_ctx=32768, headroom=NONE)
    assert kept.ctx == 32768 and kept.ngl == 3 and any("not shrunk below 32768" in r for r in kept.reasons)
    # never below the floor: at 16384 the best is still short of everything
    floor = plan_offload(m, free_vram=free, ctx=32768, min_ctx=16384, headroom=NONE)
    assert floor.ctx == 16384 and floor.ngl < 5


def test_keeps_the_context_when_halving_gains_no_layer(tmp_path: Path) -> None:
    # fat blocks (n_ff 4096: 6 MiB each), a thin cache: halving 8192 -> 4096 saves far less than a block
    m = read_model(write(tmp_path / "fat.gguf", n_embd=256, n_head=4, n_head_kv=1, n_ff=4096))
    free = estimate(m, ngl=3, ctx=8192, headroom=NONE).total
    assert estimate(m, ngl=4, ctx=4096, headroom=NONE).total > free
    plan = plan_offload(m, free_vram=free, ctx=8192, min_ctx=1024, headroom=NONE)
    assert (plan.ngl, plan.ctx) == (3, 8192)
    assert any("context kept at 8192" in r for r in plan.reasons)


def test_moe_moves_experts_to_the_cpu_before_dropping_layers(moe: Path) -> None:
    m = read_model(moe)
    free = estimate(m, ngl=5, n_cpu_moe=2, ctx=4096, headroom=NONE).total
    plan = plan_offload(m, free_vram=free, ctx=4096, min_ctx=4096, headroom=NONE)
    assert (plan.ngl, plan.n_cpu_moe) == (5, 2)
    assert plan.flags()[6:8] == ["--n-cpu-moe", "2"] and any("blocks 0-1" in r for r in plan.reasons)
    assert plan.estimate.weights == OUTPUT + 4 * m.layer_bytes[0] - 2 * m.expert_bytes[0]
    everything = estimate(m, ngl=5, ctx=4096, headroom=NONE).total
    top = plan_offload(m, free_vram=everything, ctx=4096, min_ctx=4096, headroom=NONE)
    assert (top.ngl, top.n_cpu_moe) == (5, 0) and top.flags()[6:8] == ["--n-cpu-moe", "0"]
    # all experts on the CPU is not enough: then whole layers go, the experts stay on the CPU
    tight = estimate(m, ngl=3, n_cpu_moe=4, ctx=4096, headroom=NONE).total
    low = plan_offload(m, free_vram=tight, ctx=4096, min_ctx=4096, headroom=NONE)
    assert (low.ngl, low.n_cpu_moe) == (3, 4)


def test_refuses_when_even_ngl_0_at_the_minimum_context_does_not_fit(dense: Path) -> None:
    m = read_model(dense)
    need = estimate(m, ngl=0, ctx=4096, headroom=NONE).total
    assert plan_offload(m, free_vram=need, ctx=32768, min_ctx=4096, headroom=NONE).ngl == 0
    with pytest.raises(UsageError) as e:
        plan_offload(m, free_vram=need - 1, ctx=32768, min_ctx=4096, headroom=NONE)
    assert e.value.exit_code == 2 and "even with every layer on the CPU" in e.value.what
    assert "compute buffer" in e.value.why and e.value.fix
    with pytest.raises(UsageError, match="needs flash attention"):
        plan_offload(m, free_vram=1 << 40, kv_type="q4_0", flash_attn=False)


@pytest.mark.parametrize(("text", "value"), [("24GiB", 24 << 30), ("8000MiB", 8000 << 20), ("12G", 12 << 30),
                                             ("12GB", 12 * 10**9), ("1.5GiB", 3 << 29), ("123", 123), ("64 KiB", 65536),
                                             ("2t", 2 << 40), ("512mb", 512 * 10**6)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1", "1e9", "12GiBs"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="is not a size"):
        parse_size(text)


def test_parse_headroom() -> None:
    assert parse_headroom("5%+256MiB") == Headroom(percent=5, fixed=256 * MiB) == parse_headroom()
    assert parse_headroom("10%") == Headroom(percent=10, fixed=0)
    assert parse_headroom("1GiB").of(10 << 30) == 1 << 30
    assert parse_headroom("10%+1MiB").of(100 * MiB) == 11 * MiB
    for bad in ("x%", "100%", "5%+lots"):
        with pytest.raises(UsageError):
            parse_headroom(bad)


# Recorded from llama-server 0c1e570 (CPU build, --verbose) and in the format the same source prints for
# CUDA (load_tensors, llama_kv_cache, sched_reserve); older names (llama_kv_cache_unified, llama_context).
CPU_LOG = """\
0.00.091.804 I load_tensors:          AMX model buffer size =  1501.00 MiB
0.00.091.856 I load_tensors:   CPU_Mapped model buffer size =  1501.26 MiB
0.04.500.170 I llama_context:        CPU  output buffer size =     0.12 MiB
0.04.500.620 I llama_kv_cache:        CPU KV buffer size =   128.00 MiB
0.04.878.867 I sched_reserve:        CPU compute buffer size =   158.01 MiB
0.05.889.133 D ~llama_context:        CPU compute buffer size is 158.0078 MiB, matches expectation of 158.0078 MiB
"""
CUDA_LOG = """\
load_tensors: offloading output layer to GPU
load_tensors: offloading 27 repeating layers to GPU
load_tensors: offloaded 28/29 layers to GPU
load_tensors:        CUDA0 model buffer size =  4168.09 MiB
load_tensors:   CPU_Mapped model buffer size =   292.36 MiB
llama_context:  CUDA_Host  output buffer size =     0.58 MiB
llama_kv_cache_unified:      CUDA0 KV buffer size =   448.00 MiB
llama_kv_cache_unified:        CPU KV buffer size =    16.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =    64.00 MiB
llama_context:      CUDA0 compute buffer size =   304.00 MiB
llama_context:  CUDA_Host compute buffer size =    24.01 MiB
"""


def test_parse_buffer_log() -> None:
    cpu = parse_buffer_log(CPU_LOG)
    assert cpu.sizes["model"] == {"AMX": round(1501.00 * MiB), "CPU_Mapped": round(1501.26 * MiB)}
    assert cpu.sizes["compute"] == {"CPU": round(158.01 * MiB)}  # the "size is ... matches" line is not counted
    assert cpu.sizes["kv"] == {"CPU": 128 * MiB} and cpu.sizes["output"] == {"CPU": round(0.12 * MiB)}
    assert (cpu.gpu("model"), cpu.gpu("kv"), cpu.gpu("compute"), cpu.offloaded) == (0, 0, 0, None)
    cuda = parse_buffer_log(CUDA_LOG)
    assert cuda.offloaded == (28, 29)
    assert cuda.gpu("model") == round(4168.09 * MiB)
    assert cuda.gpu("kv") == 512 * MiB  # two caches (iSWA) add up; the CPU part does not count
    assert cuda.gpu("compute") == 304 * MiB and cuda.gpu("output") == 0
    # a trial load (llama.cpp's --fit) before the real one: only the last load counts
    assert parse_buffer_log(CPU_LOG + CUDA_LOG).sizes["model"].keys() == {"CUDA0", "CPU_Mapped"}


def test_bench_runner_stops_the_server_once_the_model_is_loaded(tmp_path: Path) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n"
                    "echo \"args: $*\"\n"
                    "echo 'load_tensors:        CUDA0 model buffer size =    10.00 MiB'\n"
                    "echo 'srv  llama_server: model loaded'\n"
                    "exec sleep 600\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    log = bench.run_server(fake, tmp_path / "m.gguf", ngl=3, ctx=1024, n_parallel=2, flash_attn=False, fit_flag=True,
                           verbose=True, timeout=120)
    assert "-ngl 3 -c 1024 -np 2 -fa off" in log
    assert "--fit off" in log and "--verbose" in log
    assert parse_buffer_log(log).gpu("model") == 10 * MiB


def test_cli_plan_json_and_text(capsys: pytest.CaptureFixture[str], moe: Path) -> None:
    m = read_model(moe)
    free = estimate(m, ngl=5, n_cpu_moe=1, ctx=8192, free_vram=0, headroom=NONE).total
    code, out, _ = run(capsys, "plan", moe, "--free-vram", str(free), "--ctx", 8192, "--min-ctx", 8192,
                       "--headroom", "0", "--json")
    data = json.loads(out)
    assert code == 0 and (data["ngl"], data["n_cpu_moe"], data["ctx"], data["moe"]) == (5, 1, 8192, True)
    assert data["bytes"]["total"] <= free == data["free_vram"]
    assert data["flags"] == ["-ngl", "5", "-c", "8192", "-np", "1", "--n-cpu-moe", "1", "-fa", "on"]
    assert data["model"]["n_layer"] == 4 and data["schema"] == 1
    code, out, _ = run(capsys, "plan", moe, "--free-vram", f"{free}", "--ctx", 8192, "--min-ctx", 8192,
                       "--headroom", "0", "--kv-type", "q8_0", "--parallel", 2)
    assert code == 0 and "flags     -ngl 5 -c 8192 -np 2 --n-cpu-moe" in out and "-ctk q8_0 -ctv q8_0" in out
    assert "weights" in out and "KV cache" in out and "compute" in out and "of " in out


def test_cli_plan_failures_exit_2(capsys: pytest.CaptureFixture[str], dense: Path, tmp_path: Path) -> None:
    code, out, err = run(capsys, "plan", dense, "--free-vram", "1MiB")
    assert code == 2 and out == "" and "cannot run with 1.0 MiB of free VRAM" in err and "Traceback" not in err
    code, _, err = run(capsys, "plan", dense, "--free-vram", "lots")
    assert code == 2 and "'lots' is not a size" in err
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\0" * 64)
    code, _, err = run(capsys, "plan", junk, "--free-vram", "8GiB")
    assert code == 2 and "as a GGUF model" in err
    code, _, err = run(capsys, "plan", dense, "--free-vram", "8GiB", "--kv-type", "q3_k")
    assert code == 2 and "q3_k" in err


def test_cli_plan_everything_fits(capsys: pytest.CaptureFixture[str], dense: Path) -> None:
    code, out, _ = run(capsys, "plan", dense, "--free-vram", "24GiB")
    assert code == 0 and "everything fits" in out and "-ngl 5 -c 32768 -np 1 -fa on" in out
