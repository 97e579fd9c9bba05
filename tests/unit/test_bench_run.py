"""The benchmark runner (python3 -m bench): parsers of the scripts' JSON and of the recorded GPU results,
the rows and the table, and "not run" rows for skipped and failing benchmarks. No benchmark is run: the
scripts here are small Python programs written by the tests."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import bench
from bench import __main__ as runner
from llamabundle.errors import UsageError
from llamabundle.log import Log

REPO = Path(__file__).resolve().parents[2]

# What the scripts print with --json (recorded from real runs, shortened).
BUILD_OVERHEAD = {"benchmark": "build_overhead", "recipe": "recipes/linux-x86_64-cpu.yaml", "jobs": None,
                  "plain_s": 573.3, "tool_s": 548.3, "ratio": 0.9564, "overhead_s": -25.0, "compiled": 312,
                  "target_ratio": 1.05}
CACHE_HIT = {"benchmark": "cache_hit", "recipe": "r.yaml", "repeat": 5, "hit_s_median": 0.85, "plain_s_median": 0.32,
             "hit_s": [0.85], "plain_s": [0.32], "ratio": 2.656, "overhead_s": 0.53, "target_overhead_s": 2.0,
             "zip_name": "linux-x86_64-cpu-2e5e45861ca1.zip", "zip_bytes": 15_800_000, "unpacked_bytes": 44_000_000,
             "files": 26, "roles": {"exe": 1, "backend": 14, "runtime": 9, "license": 2},
             "runtime_libraries": ["libggml.so.0"], "system_deps": ["libc.so.6"], "glibc_floor": "2.34"}
FETCH = ('{"baseline": "curl -sSfL -o FILE URL", "benchmark": "fetch_vs_curl", "check": {"hit": {"api_requests": 2, '
         '"cdn_requests": 1, "requests": ["GET /repos/acme/bundles/releases/tags/linux-x86_64-cpu-2e5e45861ca1", '
         '"GET /repos/acme/bundles/releases/assets/1003", "GET /cdn/1003/bundle.json"]}, "miss": {"api_requests": 1, '
         '"cdn_requests": 0, "requests": ["GET /repos/acme/bundles/releases/tags/windows-x86_64-cuda12.8-7640cb14e478"]}}, '
         '"import_s": 0.189, "repeat": 1, "series": [{"api_requests": 3, "baseline_s": [0.11], "baseline_s_median": 0.11, '
         '"cdn_requests": 2, "rate_mb_s": null, "ratio": 5.077, "tool_s": [0.559], "tool_s_median": 0.559}, '
         '{"api_requests": 3, "baseline_s": [0.241], "baseline_s_median": 0.241, "cdn_requests": 2, "rate_mb_s": 100.0, '
         '"ratio": 1.0996, "tool_s": [0.265], "tool_s_median": 0.265}], "size_mb": 20, "target_ratio": 1.15, '
         '"zip_bytes": 20978873}')
TOOLKIT = """{
  "recipe": "recipes/windows-x86_64-cuda12.8.yaml",
  "redist_bytes": 1612345678,
  "components": 7,
  "installer": "cuda_12.8.1_572.61_windows.exe",
  "installer_bytes": 3200000000,
  "installer_bytes_source": "NVIDIA download page figure 3.2 GB",
  "ratio": 0.5039,
  "saved_bytes": 1587654322,
  "first_install_s": 0.9,
  "first_install_bytes": 123456,
  "archives": 2,
  "second_install_s_median": 0.41,
  "second_install_s_max": 0.5,
  "second_install_bytes_downloaded": 0,
  "second_install_requests": 0,
  "second_install_library_call_s": 0.002,
  "repeat": 1
}"""

LLAMA_BENCH = [  # llama-bench -o json, the fields the runner reads
    {"build_commit": "0c1e5709", "gpu_info": "NVIDIA H200", "model_type": "qwen2 7B Q4_K - Medium", "n_prompt": 512,
     "n_gen": 0, "test_time": "2026-11-29T12:57:56Z", "avg_ts": 9640.086026, "stddev_ts": 848.6},
    {"build_commit": "0c1e5709", "gpu_info": "NVIDIA H200", "model_type": "qwen2 7B Q4_K - Medium", "n_prompt": 0,
     "n_gen": 128, "test_time": "2026-11-29T12:57:56Z", "avg_ts": 281.36262, "stddev_ts": 2.1},
]
FIRST_START = """a: not built; measured as (b) with CUDA_FORCE_PTX_JIT=1
a first_start_cold_s=66.12 first_start_warm_s=73.57 jit_cache_bytes=49898764
b first_start_cold_s=1.92 first_start_warm_s=1.78 jit_cache_bytes=0
c first_start_cold_s=1.69 first_start_warm_s=1.68 jit_cache_bytes=0
"""
OFFLOAD = """model `q4.gguf`: qwen2, 28 blocks, 0 experts, 4,459.8 MiB of tensors; -np 1, flash attention on

| -ngl | --n-cpu-moe | -c | kind | estimate MiB | llama.cpp GPU MiB | ratio |
|---:|---:|---:|---|---:|---:|---:|
| 29 | 0 | 4096 | model | 4,167.73 | 4,167.73 | 1.000 |
| 29 | 0 | 4096 | kv | 224.00 | 224.00 | 1.000 |
| 29 | 0 | 4096 | compute | 143.58 | 136.01 | 1.056 |
| 15 | 0 | 8192 | compute | 147.58 | 198.31 | 0.744 |
| 0 | 0 | 4096 | model | 0.00 | 0.00 | - |
| 1 | 0 | 4096 | compute | 143.58 | 183.44 | 0.783 |
| 0 | 0 | 4096 | compute | 143.58 | 183.44 | 0.783 |
"""
SIZES = "bundle zip: 480626672 bytes\nlibggml-cuda.so (compression size): 70513240 bytes\n"
SIZES_FIRST = ("bundle zip: 668399011 bytes\nlibggml-cuda.so (compression size): 70522232 bytes\n"
               "libggml-cuda.so (compression none): 438573200 bytes\n"
               "bundle zip with the uncompressed ggml-cuda (same packer): 706835617 bytes")


def results_tree(root: Path, *, scale_b: float = 1.0) -> Path:
    """bench/results as the GPU runs left it, small."""
    tp = root / "gpu-h200-throughput"
    tp.mkdir(parents=True)
    (tp / "README.md").write_text("# GPU throughput\n\nRun: 2026-11-29 by bench/gpu/throughput.sh\n")
    for b, f in (("a", 1.028), ("b", scale_b), ("c", 1.0)):
        entries = [dict(e, avg_ts=e["avg_ts"] * f) for e in LLAMA_BENCH]
        (tp / f"bench-{b}.json").write_text(json.dumps(entries))
    (tp / "first-start.txt").write_text(FIRST_START)
    sz = root / "gpu-h200-cuda13.0"
    (sz / "first-run-nccl").mkdir(parents=True)
    (sz / "README.md").write_text("# linux-x86_64-cuda13.0 on the NVIDIA H200 machine (2026-11-28)\n")
    (sz / "sizes.txt").write_text(SIZES)
    (sz / "first-run-nccl" / "sizes.txt").write_text(SIZES_FIRST)
    (root / "offload-h200.md").write_text(OFFLOAD)
    return root


def by_name(name: str) -> runner.Bench:
    return next(b for b in runner.BENCHES if b.name == name)


def cells(rows: list[runner.Row]) -> dict[str, runner.Row]:
    return {r.benchmark: r for r in rows}


# ---- the scripts' JSON ---------------------------------------------------------------------------


def test_last_json_object_finds_a_one_line_object_after_human_output_and_an_indented_one() -> None:
    human = "plain cmake + ninja :    573.3 s\n{not json, a brace in the human output}\n"
    assert runner.last_json_object(human + json.dumps(BUILD_OVERHEAD) + "\n") == BUILD_OVERHEAD
    assert runner.last_json_object("warning: x\n" + TOOLKIT + "\n")["ratio"] == 0.5039
    # the last object wins when two are printed
    assert runner.last_json_object('{"a": 1}\n{"a": 2}\n') == {"a": 2}
    with pytest.raises(ValueError):
        runner.last_json_object("ratio tool/plain : 0.956\n{broken\n")


def test_rows_from_the_scripts_json() -> None:
    (build,) = runner.rows_build_overhead(BUILD_OVERHEAD)
    assert (build.measured, build.baseline, build.ratio, build.target, build.met) == ("548.3 s", "573.3 s", "0.956",
                                                                                       "≤ 1.05", "yes")
    assert "-25.0 s" in build.note
    assert runner.rows_build_overhead(dict(BUILD_OVERHEAD, ratio=1.2))[0].met == "**no**"

    hit, size = runner.rows_cache_hit(CACHE_HIT)
    assert (hit.measured, hit.baseline, hit.target, hit.met) == ("0.85 s", "0.32 s", "overhead < 2 s", "yes")
    assert runner.rows_cache_hit(dict(CACHE_HIT, overhead_s=2.4))[0].met == "**no**"
    assert (size.measured, size.baseline, size.ratio) == ("15.8 MB, 26 files", "44.0 MB unpacked", "0.359")
    assert "backend 14" in size.note and "glibc ≥ 2.34" in size.note

    unpaced, paced, check_hit, check_miss = runner.rows_fetch(json.loads(FETCH))
    assert (unpaced.ratio, unpaced.met) == ("5.08", "**no**")
    assert (paced.benchmark, paced.measured, paced.ratio, paced.met) == (
        "fetch vs curl, paced CDN at 100 MB/s", "0.27 s", "1.10", "yes")
    assert (check_hit.measured, check_hit.met) == ("2 API + 1 CDN", "yes")
    assert "GET /cdn/1003/bundle.json" in check_hit.note
    assert (check_miss.measured, check_miss.met) == ("1 API + 0 CDN", "—")

    redist, second = runner.rows_toolkit(json.loads(TOOLKIT))
    assert (redist.measured, redist.baseline, redist.ratio) == ("1.612 GB (7 archives)", "3.200 GB", "0.504")
    assert (second.measured, second.target, second.met) == ("0 bytes, 0.41 s", "0 bytes", "yes")
    assert runner.rows_toolkit(dict(json.loads(TOOLKIT), second_install_bytes_downloaded=10))[1].met == "**no**"


def test_a_fetch_run_without_the_paced_series_says_so() -> None:
    f = json.loads(FETCH)
    f["series"] = f["series"][:1]  # --rate-mb 0
    rows = cells(runner.rows_fetch(f))
    assert rows["fetch vs curl, paced CDN"].measured.startswith("not run (")
    assert rows["fetch vs curl, unpaced loopback"].ratio == "5.08"


# ---- results recorded in bench/results -----------------------------------------------------------


def test_parsers_of_the_recorded_results() -> None:
    assert runner.parse_sizes(SIZES_FIRST) == {
        "bundle zip": 668399011, "libggml-cuda.so (compression size)": 70522232,
        "libggml-cuda.so (compression none)": 438573200,
        "bundle zip with the uncompressed ggml-cuda (same packer)": 706835617}
    lb = runner.parse_llama_bench(json.dumps(LLAMA_BENCH))
    assert set(lb) == {"pp512", "tg128"} and lb["tg128"]["avg_ts"] == pytest.approx(281.36262)
    values, notes = runner.parse_keyed_lines(FIRST_START)
    assert values["a"] == {"first_start_cold_s": 66.12, "first_start_warm_s": 73.57, "jit_cache_bytes": 49898764}
    assert notes == {"a": "not built; measured as (b) with CUDA_FORCE_PTX_JIT=1"}
    off = runner.parse_offload(OFFLOAD)
    assert off == {"blocks": 28, "ratios": {"model": [1.0], "kv": [1.0], "compute (all layers on the GPU)": [1.056],
                                            "compute (part of the layers)": [0.744, 0.783, 0.783]}}
    with pytest.raises(ValueError):
        runner.parse_offload("no table here\n")


def test_gpu_rows_are_read_from_results_with_their_date(tmp_path: Path) -> None:
    root = results_tree(tmp_path / "results", scale_b=0.97)
    out = runner.run_bench(by_name("gpu_throughput"), quick=False, log=Log(quiet=True), results=root)
    rows = cells(out.rows)
    b_tg = rows["GPU tg128 (b) bundle, `80-virtual, 90-real`"]
    assert (b_tg.ratio, b_tg.target, b_tg.met) == ("0.970", "≥ 0.98", "**no**")  # b made 3 % slower than c here
    a_pp = rows["GPU pp512 (a) bundle, `80-virtual` only (PTX JIT)"]
    assert (a_pp.ratio, a_pp.met) == ("1.028", "—") and "CUDA_FORCE_PTX_JIT=1" in a_pp.note
    assert "read from" in a_pp.note and "2026-11-29T12:57:56Z" in a_pp.note
    assert rows["GPU tg128 (c) plain cmake + ninja, `90-real`"].ratio == "1 (reference)"
    a_first = rows["first start, empty JIT cache (a) bundle, `80-virtual` only (PTX JIT)"]
    assert (a_first.measured, a_first.baseline, a_first.ratio) == ("66.12 s", "(c) 1.69 s", "39.1")
    assert out.figures is not None and out.figures["date"] == "2026-11-29"  # from the folder's README
    assert [r.benchmark for r in out.rows] == list(by_name("gpu_throughput").labels)

    sizes = runner.run_bench(by_name("gpu_sizes"), quick=False, log=Log(quiet=True), results=root)
    zip_row, comp = sizes.rows
    assert zip_row.measured == "480.6 MB" and "(2026-11-28)" in zip_row.note
    assert (comp.measured, comp.baseline, comp.ratio) == ("70.5 MB", "438.6 MB", "0.161")

    off = runner.run_bench(by_name("offload"), quick=False, log=Log(quiet=True), results=root)
    assert [(r.measured, r.ratio) for r in off.rows] == [("1.000–1.000", "1.000 (median)"), ("1.000–1.000", "1.000 (median)"),
                                                         ("1.056–1.056", "1.056 (median)"), ("0.744–0.783", "0.783 (median)")]
    assert [r.benchmark for r in off.rows] == list(by_name("offload").labels)


def test_missing_or_broken_results_give_not_run_rows(tmp_path: Path) -> None:
    root = results_tree(tmp_path / "results")
    (root / "gpu-h200-throughput" / "bench-c.json").unlink()
    out = runner.run_bench(by_name("gpu_throughput"), quick=False, log=Log(quiet=True), results=root)
    assert out.figures is None and "bench-c.json" in out.reason
    assert all(r.measured.startswith("not run (") and r.ratio == "—" for r in out.rows)
    assert len(out.rows) == len(by_name("gpu_throughput").labels)
    (root / "gpu-h200-cuda13.0" / "sizes.txt").write_text("bundle zip: lots\n")  # no figures in it
    sizes = runner.run_bench(by_name("gpu_sizes"), quick=False, log=Log(quiet=True), results=root)
    assert "unreadable figures" in sizes.reason and all(r.measured.startswith("not run (") for r in sizes.rows)


def test_the_repositorys_recorded_results_parse() -> None:
    for name in ("gpu_sizes", "gpu_throughput", "offload"):
        out = runner.run_bench(by_name(name), quick=False, log=Log(quiet=True))
        assert out.figures is not None, out.reason
        assert not any(r.measured.startswith("not run") for r in out.rows), name


# ---- running scripts -----------------------------------------------------------------------------


def script(path: Path, body: str) -> str:
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_script_that_writes_its_json_out_file_gives_rows(tmp_path: Path) -> None:
    figures = tmp_path / "figures.json"
    figures.write_text(json.dumps(CACHE_HIT))
    s = script(tmp_path / "ok.py", f"""
        import shutil, sys
        print("cache-hit build (median of 1) : 0.85 s")
        i = sys.argv.index("--json-out")
        assert sys.argv[1:i] == ["--repeat", "1"], sys.argv
        shutil.copy({str(figures)!r}, sys.argv[i + 1])
        """)
    bench_ = runner.Bench(name="cache_hit", script=s, quick_args=("--repeat", "1"), rows=runner.rows_cache_hit,
                          labels=by_name("cache_hit").labels)
    out = runner.run_bench(bench_, quick=True, log=Log(quiet=True), cwd=tmp_path)
    assert out.figures == CACHE_HIT and out.rows[0].measured == "0.85 s"
    # without --quick the quick arguments are not passed, and the script's assert fails: not run
    out = runner.run_bench(bench_, quick=False, log=Log(quiet=True), cwd=tmp_path)
    assert out.figures is None and all(r.measured.startswith("not run (") for r in out.rows)


def test_a_script_printing_json_on_stdout_gives_rows(tmp_path: Path) -> None:
    s = script(tmp_path / "tk.py", f"""
        import sys
        assert sys.argv[1:] == ["--json"], sys.argv
        print({TOOLKIT!r})
        """)
    b = runner.Bench(name="toolkit_bytes", script=s, json_flag="--json", rows=runner.rows_toolkit,
                     labels=by_name("toolkit_bytes").labels)
    out = runner.run_bench(b, quick=False, log=Log(quiet=True), cwd=tmp_path)
    assert [r.ratio for r in out.rows] == ["0.504", "—"]


def test_a_failing_script_gives_not_run_rows_with_its_reason(tmp_path: Path) -> None:
    s = script(tmp_path / "fail.py", """
        import sys
        print("building…")
        sys.exit("the first build failed: no compiler")
        """)
    b = runner.Bench(name="cache_hit", script=s, rows=runner.rows_cache_hit, labels=by_name("cache_hit").labels)
    out = runner.run_bench(b, quick=False, log=Log(quiet=True), cwd=tmp_path)
    assert out.figures is None
    assert "exit code 1" in out.reason and "the first build failed: no compiler" in out.reason
    assert [r.measured for r in out.rows] == [f"not run ({out.reason})"] * 2
    assert all(r.baseline == r.ratio == r.met == "—" for r in out.rows)


def test_a_script_whose_json_lacks_figures_gives_not_run_rows(tmp_path: Path) -> None:
    s = script(tmp_path / "half.py", """
        import json, sys
        open(sys.argv[sys.argv.index("--json-out") + 1], "w").write(json.dumps({"benchmark": "build_overhead"}))
        """)
    b = runner.Bench(name="build_overhead", script=s, rows=runner.rows_build_overhead,
                     labels=by_name("build_overhead").labels)
    out = runner.run_bench(b, quick=False, log=Log(quiet=True), cwd=tmp_path)
    assert "unreadable figures (KeyError" in out.reason and out.rows[0].measured.startswith("not run (")


def test_quick_does_not_run_the_cold_build_benchmark(tmp_path: Path) -> None:
    b = runner.Bench(name="build_overhead", script=str(tmp_path / "does-not-exist.py"), quick_args=None,
                     rows=runner.rows_build_overhead, labels=by_name("build_overhead").labels)
    out = runner.run_bench(b, quick=True, log=Log(quiet=True), cwd=tmp_path)
    assert out.reason == "--quick" and out.rows[0].measured == "not run (--quick)"
    assert by_name("build_overhead").quick_args is None
    assert by_name("fetch_vs_curl").quick_args == ("--size-mb", "50", "--repeat", "1")


def test_select_names_what_is_not_run_and_refuses_unknown_names() -> None:
    names = [b.name for b in runner.BENCHES]
    assert runner.select(names, only=None, skip="build_overhead,cache_hit") == {"build_overhead": "--skip",
                                                                                  "cache_hit": "--skip"}
    sel = runner.select(names, only="fetch_vs_curl,offload", skip="offload")
    assert sel["offload"] == "--skip" and sel["cache_hit"] == "not in --only" and "fetch_vs_curl" not in sel
    with pytest.raises(UsageError) as e:
        runner.select(names, only="fetch", skip=None)
    assert "fetch_vs_curl" in e.value.render()


def test_table_and_results_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    ok = script(tmp_path / "ok.py", f"""
        import sys
        print("human output")
        print({json.dumps(BUILD_OVERHEAD)!r})
        """)
    bad = script(tmp_path / "bad.py", "import sys\nsys.exit(3)\n")
    monkeypatch.setattr(runner, "BENCHES", (
        runner.Bench(name="build_overhead", script=ok, json_flag="--json", rows=runner.rows_build_overhead,
                     labels=by_name("build_overhead").labels),
        runner.Bench(name="cache_hit", script=bad, rows=runner.rows_cache_hit, labels=by_name("cache_hit").labels),
        runner.Bench(name="toolkit_bytes", script=bad, rows=runner.rows_toolkit, labels=by_name("toolkit_bytes").labels)))
    out = tmp_path / "RESULTS.md"
    assert runner.main(["--skip", "toolkit_bytes", "--out", str(out)]) == 0
    text = out.read_text()
    assert "- date (UTC): " in text and " UTC\n" in text
    assert "- machine: " in text and " cores, " in text and "Python 3." in text
    assert f"- command: `python3 -m bench --skip toolkit_bytes --out {out}`" in text
    assert "- checkout: " in text and "quick run" not in text
    lines = text.splitlines()
    assert "| benchmark | measured | baseline | ratio | target | met? | note |" in lines
    assert any(x.startswith("| tool overhead: cold `llamabundle build` vs plain cmake + ninja | 548.3 s | 573.3 s | 0.956 |")
               for x in lines)
    assert any(x.startswith("| cache hit: second `build` vs cp + unzip of the zip | not run (") and "exit code 3" in x
               for x in lines)
    assert any(x.startswith("| second `toolkit install` of the same plan | not run (--skip) |") for x in lines)
    figures = json.loads(text.split("```json\n")[1].split("```")[0])
    assert figures["build_overhead"] == BUILD_OVERHEAD and figures["toolkit_bytes"] == {"not_run": "--skip"}
    printed = capsys.readouterr().out
    assert "| 548.3 s |" in printed and "## Figures" not in printed  # stdout: the table, not the raw figures


def test_render_table_escapes_pipes() -> None:
    table = runner.render_table([runner.Row(benchmark="a | b", note="x\ny")])
    assert table.splitlines()[2] == "| a \\| b | — | — | — | — | — | x y |"


def test_machine_info_reads_cpuinfo_and_meminfo() -> None:
    info = runner.machine_info("processor : 0\nmodel name\t: Intel(R) Xeon(R) Processor\n", "MemTotal:       24641536 kB\n")
    assert "Intel(R) Xeon(R) Processor" in info and "23.5 GiB RAM" in info
    assert "CPU model unknown" in runner.machine_info("", "") and "RAM unknown" in runner.machine_info("", "")


# ---- the scripts' JSON options -------------------------------------------------------------------


def test_emit_json_prints_the_last_line_and_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ap = argparse.ArgumentParser()
    bench.add_json_args(ap)
    a = ap.parse_args(["--json", "--json-out", str(tmp_path / "f.json")])
    print("human output")
    bench.emit_json(a, {"ratio": 0.95})
    assert capsys.readouterr().out.splitlines()[-1] == '{"ratio": 0.95}'
    assert json.loads((tmp_path / "f.json").read_text()) == {"ratio": 0.95}
    bench.emit_json(ap.parse_args([]), {"ratio": 1})
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("name", ["build_overhead", "cache_hit", "fetch_vs_curl"])
def test_the_scripts_offer_the_json_options(name: str) -> None:
    r = subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), "--help"], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--json-out" in r.stdout and "--json " in r.stdout
