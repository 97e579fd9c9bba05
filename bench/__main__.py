"""One benchmark table: runs every benchmark script of bench/ with its JSON output, reads the GPU results
recorded in bench/results/, prints one markdown table and keeps it in bench/RESULTS.md.

    python3 -m bench [--only NAME,...] [--skip NAME,...] [--out bench/RESULTS.md] [--quick]

A benchmark that is skipped or fails gives "not run (reason)" rows; no figure is ever filled in.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from llamabundle import proc  # noqa: E402
from llamabundle.errors import LlamaBundleError, UsageError  # noqa: E402
from llamabundle.log import Log  # noqa: E402

RESULTS = REPO / "bench" / "results"
COLUMNS = ("benchmark", "measured", "baseline", "ratio", "target", "met?", "note")
DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})\b")
Figures = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Row:
    benchmark: str
    measured: str = "—"
    baseline: str = "—"
    ratio: str = "—"
    target: str = "—"
    met: str = "—"
    note: str = ""

    def cells(self) -> tuple[str, ...]:
        return (self.benchmark, self.measured, self.baseline, self.ratio, self.target, self.met, self.note)


@dataclass(frozen=True, kw_only=True)
class Bench:
    """A benchmark: a script run with its JSON option, or a reader of recorded results; its rows come from
    its figures. `labels` are the rows' names, shown as "not run" when there are no figures."""

    name: str
    labels: tuple[str, ...]
    rows: Callable[[Figures], list[Row]]
    script: str | None = None
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] | None = ()  # None: not run with --quick
    json_flag: str = "--json-out"  # "--json-out": a file; "--json": JSON on stdout
    read: Callable[[Path], Figures] | None = None


@dataclass(frozen=True, kw_only=True)
class Outcome:
    bench: Bench
    figures: Figures | None = None
    reason: str = ""
    rows: list[Row] = field(default_factory=list)


# ---- formatting -----------------------------------------------------------------------------------


def met(ok: bool | None) -> str:
    return "—" if ok is None else ("yes" if ok else "**no**")


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def not_run(bench: Bench, reason: str) -> list[Row]:
    return [Row(benchmark=label, measured=f"not run ({reason})") for label in bench.labels]


def render_table(rows: Sequence[Row]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return "\n".join([line(COLUMNS), "|---|---:|---:|---:|---|---|---|", *(line(r.cells()) for r in rows)]) + "\n"


# ---- scripts' JSON output -------------------------------------------------------------------------


def last_json_object(text: str) -> Figures:
    """The last JSON object in a script's output: a one-line object as the last line, or an indented one."""
    lines = text.splitlines()
    decoder = json.JSONDecoder()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("{"):
            try:
                obj, _ = decoder.raw_decode("\n".join(lines[i:]))
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    raise ValueError("no JSON object in the output")


def _tool_vs_plain(f: Figures, benchmark: str, note: str) -> list[Row]:
    """One row: the tool's seconds against plain cmake + ninja, with the ratio and its target."""
    return [Row(benchmark=benchmark, measured=f"{f['tool_s']:,.1f} s", baseline=f"{f['plain_s']:,.1f} s",
                ratio=f"{f['ratio']:.3f}", target=f"≤ {f['target_ratio']}", met=met(f["ratio"] <= f["target_ratio"]),
                note=note)]


def rows_build_overhead(f: Figures) -> list[Row]:
    return _tool_vs_plain(f, "tool overhead: cold `llamabundle build` vs plain cmake + ninja",
                          f"overhead {f['overhead_s']:+.1f} s; one cold build each, same flags, no ccache; "
                          f"{f['compiled']} compile steps")


def rows_first_contact(f: Figures) -> list[Row]:
    return _tool_vs_plain(f, "README (a) in a fresh clone, empty caches, vs plain cmake + ninja",
                          "venv + pip install + source + build + collect + pack + verify + store; "
                          f"the source step (sdist download and proof) {f['source_s']:.1f} s")


def rows_cache_hit(f: Figures) -> list[Row]:
    roles = ", ".join(f"{k} {v}" for k, v in f["roles"].items())
    return [Row(benchmark="cache hit: second `build` vs cp + unzip of the zip",
                measured=f"{f['hit_s_median']:.2f} s", baseline=f"{f['plain_s_median']:.2f} s",
                ratio=f"{f['ratio']:.2f}", target=f"overhead < {f['target_overhead_s']:g} s",
                met=met(f["overhead_s"] < f["target_overhead_s"]),
                note=f"overhead {f['overhead_s']:.2f} s; median of {f['repeat']}; PATH without any build tool"),
            Row(benchmark="CPU bundle size (zip / unpacked)", measured=f"{mb(f['zip_bytes'])}, {f['files']} files",
                baseline=f"{mb(f['unpacked_bytes'])} unpacked", ratio=f"{f['zip_bytes'] / f['unpacked_bytes']:.3f}",
                note=f"{f['zip_name']}: {roles}; glibc ≥ {f['glibc_floor']}")]


def rows_fetch(f: Figures) -> list[Row]:
    by_pace = {s["rate_mb_s"]: s for s in f["series"]}
    rows = []
    for label, series in (("fetch vs curl, unpaced loopback", by_pace.pop(None, None)),
                          ("fetch vs curl, paced CDN", next(iter(by_pace.values()), None))):
        if series is None:
            rows.append(Row(benchmark=label, measured="not run (no such series in this run)"))
            continue
        pace = "" if series["rate_mb_s"] is None else f" at {series['rate_mb_s']:g} MB/s"
        rows.append(Row(benchmark=label + pace, measured=f"{series['tool_s_median']:.2f} s",
                        baseline=f"{series['baseline_s_median']:.2f} s", ratio=f"{series['ratio']:.2f}",
                        target=f"≤ {f['target_ratio']}", met=met(series["ratio"] <= f["target_ratio"]),
                        note=f"{mb(f['zip_bytes'])} zip, median of {f['repeat']}; fetch = download + sha256 + unpack "
                             f"+ verify ({series['api_requests']} API + {series['cdn_requests']} CDN requests); "
                             f"baseline: {f['baseline']}"))
    for what in ("hit", "miss"):
        c = f["check"][what]
        rows.append(Row(benchmark=f"requests per `check` on a {what}",
                        measured=f"{c['api_requests']} API + {c['cdn_requests']} CDN",
                        target="≤ 2 API requests" if what == "hit" else "—",
                        met=met(c["api_requests"] <= 2) if what == "hit" else "—", note="; ".join(c["requests"])))
    return rows


def rows_toolkit(f: Figures) -> list[Row]:
    return [Row(benchmark="toolkit bytes: redist plan vs full installer (Windows CUDA 12.8.1)",
                measured=f"{f['redist_bytes'] / 1e9:.3f} GB ({f['components']} archives)",
                baseline=f"{f['installer_bytes'] / 1e9:.3f} GB", ratio=f"{f['ratio']:.3f}",
                note=f"installer {f['installer']}: {f['installer_bytes_source']}; {f['recipe']}"),
            Row(benchmark="second `toolkit install` of the same plan",
                measured=f"{f['second_install_bytes_downloaded']} bytes, {f['second_install_s_median']:.2f} s",
                baseline=f"first: {f['first_install_bytes']:,} bytes, {f['first_install_s']:.2f} s",
                target="0 bytes", met=met(f["second_install_bytes_downloaded"] == 0),
                note=f"local server, small archives; median of {f['repeat']} processes; "
                     f"{f['second_install_requests']} requests")]


def rows_source_reproof(f: Figures) -> list[Row]:
    return [Row(benchmark=f"source cache re-proof before use ({f['files']:,} files, stat walk)",
                measured=f"{f['reproof_ms_median']:.1f} ms", baseline=f"{f['rehash_ms_median']:.1f} ms hashing every file",
                ratio=f"{f['ratio']:.3f}",
                note=f"median of {f['repeat']}, page cache warm; stat walk {f['stat_walk_ms_median']:.1f} ms + marker "
                     f"({f['marker_bytes'] / 1e3:.0f} kB) parsed {f['marker_parse_ms_median']:.1f} ms; synthetic tree of "
                     f"{mb(f['bytes'])} shaped like llama.cpp's")]


STARTUP = ("--help", "key", "recipe lint", "check (miss)")


def rows_startup(f: Figures) -> list[Row]:
    after = f["after"]
    rows = [Row(benchmark=f"start-up: `llamabundle {name}` vs `python -c pass`", measured=f"{c['s'] * 1000:.0f} ms",
                baseline=f"{after['pass_s'] * 1000:.0f} ms", ratio=f"{c['ratio']:.1f}",
                note=f"{c['package_modules']} modules of the package; third-party: {', '.join(c['third_party']) or 'none'};"
                     f" median of {f['repeat']}") for name, c in after["commands"].items()]
    r = after["import_recipe"]
    bad = [m for m in r["third_party"] if m in ("requests", "rich", "elftools", "pefile")]
    rows.append(Row(benchmark="modules `import llamabundle.recipe` loads", measured=f"{len(r['package_modules'])} of the package",
                    target="≤ 6, none of requests, rich, pyelftools, pefile",
                    met=met(len(r["package_modules"]) <= 6 and not bad), note=", ".join(r["package_modules"])))
    return rows


# ---- results recorded in bench/results ------------------------------------------------------------


def recorded_date(path: Path) -> str:
    """The date a results file records: in the file, else in its folder's README.md, else its commit date."""
    for p in (path, path.parent / "README.md"):
        if p.is_file() and (m := DATE.search(p.read_text(errors="replace"))):
            return m.group(1)
    try:
        out = proc.capture(["git", "log", "-1", "--format=%cs", "--", str(path)], cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"committed {out}" if out else "date not recorded"


def parse_sizes(text: str) -> dict[str, int]:
    """`label: N bytes` lines (bench/gpu/cuda_build.sh's sizes.txt)."""
    return {m.group(1).strip(): int(m.group(2)) for m in re.finditer(r"^([^:\n]+):\s*(\d+) bytes\s*$", text, re.M)}


def parse_llama_bench(text: str) -> dict[str, Figures]:
    """llama-bench's `-o json`: per test (pp512, tg128), tokens per second with its deviation."""
    out = {}
    for e in json.loads(text):
        test = "+".join(x for x in (f"pp{e['n_prompt']}" if e["n_prompt"] else "", f"tg{e['n_gen']}" if e["n_gen"] else "")
                        if x)
        out[test] = {k: e.get(k) for k in ("avg_ts", "stddev_ts", "test_time", "build_commit", "gpu_info", "model_type")}
    return out


def parse_keyed_lines(text: str) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """`a key=value …` lines into values per build, and `a: text` lines into notes per build."""
    values: dict[str, dict[str, float]] = {}
    notes: dict[str, str] = {}
    for line in text.splitlines():
        if m := re.match(r"^(\w+):\s*(.+)$", line):
            notes[m.group(1)] = m.group(2).strip()
        elif m := re.match(r"^(\w+)\s+(\w+=\S+(?:\s+\w+=\S+)*)\s*$", line):
            values[m.group(1)] = {k: float(v) for k, v in (kv.split("=", 1) for kv in m.group(2).split())}
    return values, notes


def parse_offload(text: str) -> Figures:
    """bench/offload_compare.py's table: estimate / llama.cpp ratios per kind, compute split by full offload."""
    blocks = int(m.group(1)) if (m := re.search(r"(\d+) blocks", text)) else None
    ratios: dict[str, list[float]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or not cells[0].isdigit() or cells[6] in ("-", "inf", "ratio"):
            continue
        kind = cells[3]
        if kind == "compute" and blocks is not None:
            kind += " (all layers on the GPU)" if int(cells[0]) > blocks else " (part of the layers)"
        ratios.setdefault(kind, []).append(float(cells[6]))
    if not ratios:
        raise ValueError("no ratio rows in the offload table")
    return {"blocks": blocks, "ratios": ratios}


BUILDS = {"a": "(a) bundle, `80-virtual` only (PTX JIT)", "b": "(b) bundle, `80-virtual, 90-real`",
          "c": "(c) plain cmake + ninja, `90-real`"}
GPU_TARGET = 0.98


def read_gpu_throughput(folder: Path) -> Figures:
    first, notes = parse_keyed_lines((folder / "first-start.txt").read_text())
    builds = {b: {"bench": parse_llama_bench((folder / f"bench-{b}.json").read_text()), "first_start": first.get(b, {}),
                  "note": notes.get(b, "")} for b in BUILDS}
    return {"folder": str(folder.relative_to(REPO)) if folder.is_relative_to(REPO) else str(folder),
            "date": recorded_date(folder / "first-start.txt"), "builds": builds}


def rows_gpu_throughput(f: Figures) -> list[Row]:
    c = f["builds"]["c"]
    rows = []
    for b, label in BUILDS.items():
        build = f["builds"][b]
        for test in ("pp512", "tg128"):
            r, ref = build["bench"][test], c["bench"][test]
            ratio = r["avg_ts"] / ref["avg_ts"]
            src = f"read from {f['folder']} (llama-bench {r['test_time']}, {r['gpu_info']}, {r['model_type']})"
            rows.append(Row(benchmark=f"GPU {test} {label}", measured=f"{r['avg_ts']:,.1f} ± {r['stddev_ts']:,.1f} t/s",
                            baseline="—" if b == "c" else f"(c) {ref['avg_ts']:,.1f} t/s",
                            ratio="1 (reference)" if b == "c" else f"{ratio:.3f}",
                            target=f"≥ {GPU_TARGET}" if b == "b" else "—",
                            met=met(ratio >= GPU_TARGET) if b == "b" else "—",
                            note="; ".join(x for x in (src, build["note"]) if x)))
    ref_s = c["first_start"].get("first_start_cold_s")
    for b, label in BUILDS.items():
        s, name = f["builds"][b]["first_start"], f"first start, empty JIT cache {label}"
        if "first_start_cold_s" not in s:
            rows.append(Row(benchmark=name, measured="not run (not in first-start.txt)"))
            continue
        cold = s["first_start_cold_s"]
        notes = (f"read from {f['folder']}/first-start.txt ({f['date']})",
                 f"JIT cache written {mb(s.get('jit_cache_bytes', 0))}",
                 f"second start {s['first_start_warm_s']:.2f} s" if "first_start_warm_s" in s else "",
                 f["builds"][b]["note"])
        rows.append(Row(benchmark=name, measured=f"{cold:.2f} s",
                        baseline="—" if b == "c" or ref_s is None else f"(c) {ref_s:.2f} s",
                        ratio="1 (reference)" if b == "c" else (f"{cold / ref_s:.1f}" if ref_s else "—"),
                        note="; ".join(x for x in notes if x)))
    return rows


def read_gpu_sizes(folder: Path) -> Figures:
    sizes = folder / "sizes.txt"
    first = folder / "first-run-nccl" / "sizes.txt"
    return {"folder": str(folder.relative_to(REPO)) if folder.is_relative_to(REPO) else str(folder),
            "date": recorded_date(sizes), "shipped": parse_sizes(sizes.read_text()),
            "first_run": parse_sizes(first.read_text()) if first.is_file() else {}}


def rows_gpu_sizes(f: Figures) -> list[Row]:
    s, first = f["shipped"], f["first_run"]
    src = f"read from {f['folder']}/sizes.txt ({f['date']})"
    rows = [Row(benchmark="CUDA 13.0 bundle zip (H200 build, shipped recipe)", measured=mb(s["bundle zip"]),
                note=f"{src}; libggml-cuda.so (compression size) {mb(s['libggml-cuda.so (compression size)'])}")]
    size, none = first.get("libggml-cuda.so (compression size)"), first.get("libggml-cuda.so (compression none)")
    label = "libggml-cuda.so, GGML_CUDA_COMPRESSION_MODE size vs none"
    if size and none:
        zips = (first.get("bundle zip"), first.get("bundle zip with the uncompressed ggml-cuda (same packer)"))
        rows.append(Row(benchmark=label, measured=mb(size), baseline=mb(none), ratio=f"{size / none:.3f}",
                        note=f"read from {f['folder']}/first-run-nccl/sizes.txt ({f['date']}, the build with NCCL)"
                             + (f"; whole zip {mb(zips[0])} vs {mb(zips[1])} ({zips[0] / zips[1]:.3f})" if all(zips) else "")))
    else:
        rows.append(Row(benchmark=label, measured="not run (no compression-none figure recorded)"))
    return rows


def read_offload(path: Path) -> Figures:
    return {"file": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
            "date": recorded_date(path), **parse_offload(path.read_text())}


OFFLOAD_KINDS = ("model", "kv", "compute (all layers on the GPU)", "compute (part of the layers)")


def rows_offload(f: Figures) -> list[Row]:
    rows = []
    for kind in (*OFFLOAD_KINDS, "compute"):  # "compute": a table without the model's block count
        if kind not in f["ratios"]:
            continue
        r = f["ratios"][kind]
        rows.append(Row(benchmark=f"offload planner: {kind} buffer, estimate / llama.cpp",
                        measured=f"{min(r):.3f}–{max(r):.3f}", baseline="llama.cpp's buffer sizes",
                        ratio=f"{statistics.median(r):.3f} (median)",
                        note=f"read from {f['file']} ({f['date']}); {len(r)} points (zero on both sides left out)"))
    return rows


BENCHES: tuple[Bench, ...] = (
    Bench(name="build_overhead", script="bench/build_overhead.py", quick_args=None, rows=rows_build_overhead,
          labels=("tool overhead: cold `llamabundle build` vs plain cmake + ninja",)),
    Bench(name="first_contact", script="bench/first_contact.py", quick_args=None, rows=rows_first_contact,
          labels=("README (a) in a fresh clone, empty caches, vs plain cmake + ninja",)),
    Bench(name="cache_hit", script="bench/cache_hit.py", quick_args=("--repeat", "1"), rows=rows_cache_hit,
          labels=("cache hit: second `build` vs cp + unzip of the zip", "CPU bundle size (zip / unpacked)")),
    Bench(name="fetch_vs_curl", script="bench/fetch_vs_curl.py", quick_args=("--size-mb", "50", "--repeat", "1"),
          rows=rows_fetch, labels=("fetch vs curl, unpaced loopback", "fetch vs curl, paced CDN",
                                   "requests per `check` on a hit", "requests per `check` on a miss")),
    Bench(name="toolkit_bytes", script="bench/toolkit_bytes.py", quick_args=("--repeat", "1"), json_flag="--json",
          rows=rows_toolkit, labels=("toolkit bytes: redist plan vs full installer (Windows CUDA 12.8.1)",
                                     "second `toolkit install` of the same plan")),
    Bench(name="source_reproof", script="bench/source_reproof.py", quick_args=("--repeat", "3"),
          rows=rows_source_reproof, labels=("source cache re-proof before use (3,665 files, stat walk)",)),
    Bench(name="startup", script="bench/startup.py", quick_args=("--repeat", "3"), rows=rows_startup,
          labels=(*(f"start-up: `llamabundle {n}` vs `python -c pass`" for n in STARTUP),
                  "modules `import llamabundle.recipe` loads")),
    Bench(name="gpu_sizes", read=lambda root: read_gpu_sizes(root / "gpu-h200-cuda13.0"), rows=rows_gpu_sizes,
          labels=("CUDA 13.0 bundle zip (H200 build, shipped recipe)",
                  "libggml-cuda.so, GGML_CUDA_COMPRESSION_MODE size vs none")),
    Bench(name="gpu_throughput", read=lambda root: read_gpu_throughput(root / "gpu-h200-throughput"),
          rows=rows_gpu_throughput, labels=tuple(f"GPU {t} {label}" for label in BUILDS.values() for t in ("pp512", "tg128"))
          + tuple(f"first start, empty JIT cache {label}" for label in BUILDS.values())),
    Bench(name="offload", read=lambda root: read_offload(root / "offload-h200.md"), rows=rows_offload,
          labels=tuple(f"offload planner: {k} buffer, estimate / llama.cpp" for k in OFFLOAD_KINDS)),
)


# ---- running ----------------------------------------------------------------------------------------


def run_bench(bench: Bench, *, quick: bool, log: Log, results: Path = RESULTS, cwd: Path = REPO) -> Outcome:
    """Run one benchmark (or read its recorded results) and turn its figures into rows; any failure gives
    "not run" rows with the reason."""
    if quick and bench.quick_args is None:
        return Outcome(bench=bench, reason="--quick", rows=not_run(bench, "--quick"))
    try:
        if bench.read is not None:
            figures = bench.read(results)
        else:
            assert bench.script is not None
            with tempfile.TemporaryDirectory(prefix="lb-bench-") as tmp:
                json_path = Path(tmp) / "figures.json"
                argv = [sys.executable, str(cwd / bench.script), *(bench.quick_args if quick and bench.quick_args
                                                                     else bench.args)]
                argv += [bench.json_flag, str(json_path)] if bench.json_flag == "--json-out" else [bench.json_flag]
                with log.step(f"bench {bench.name}"):
                    out = proc.run(argv, log=log, error=LlamaBundleError, what=f"{bench.script}", cwd=cwd,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"}, echo_output=True)
                figures = json.loads(json_path.read_text()) if bench.json_flag == "--json-out" else last_json_object(out)
    except LlamaBundleError as e:
        last = next((x for x in reversed(e.details.splitlines()) if x.strip() and not x.startswith("---")), "")
        reason = f"{e.what}: {last.strip()[:160]}" if last else e.what
        return Outcome(bench=bench, reason=reason, rows=not_run(bench, reason))
    except (OSError, ValueError) as e:
        reason = f"{bench.name}: {type(e).__name__}: {e}"[:200]
        return Outcome(bench=bench, reason=reason, rows=not_run(bench, reason))
    try:
        rows = bench.rows(figures)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        reason = f"{bench.name}: unreadable figures ({type(e).__name__}: {e})"[:200]
        return Outcome(bench=bench, figures=figures, reason=reason, rows=not_run(bench, reason))
    return Outcome(bench=bench, figures=figures, rows=rows)


def select(names: Sequence[str], *, only: str | None, skip: str | None) -> dict[str, str]:
    """The benchmarks not to run, with the reason; unknown names are a usage error with a suggestion."""
    def parse(opt: str, value: str | None) -> list[str]:
        picked = [x.strip() for x in (value or "").split(",") if x.strip()]
        for x in picked:
            if x not in names:
                near = [n for n in names if n.startswith(x)] or difflib.get_close_matches(x, names, n=1)
                raise UsageError(f"{opt}: no benchmark named {x!r}", why="benchmarks: " + ", ".join(names),
                                 fix=f"did you mean {near[0]!r}?" if near else "use one of the names above")
        return picked

    only_l, skip_l = parse("--only", only), parse("--skip", skip)
    out = {n: "--skip" for n in skip_l}
    if only_l:
        out |= {n: "not in --only" for n in names if n not in only_l and n not in out}
    return out


def machine_info(cpuinfo: str, meminfo: str) -> str:
    model = m.group(1).strip() if (m := re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)) else "CPU model unknown"
    mem = f"{int(m.group(1)) / 2**20:.1f} GiB RAM" if (m := re.search(r"^MemTotal:\s*(\d+) kB", meminfo, re.M)) else "RAM unknown"
    return f"{platform.machine()}, {model}, {os.cpu_count()} cores, {mem}, Python {platform.python_version()}"


def git_commit(cwd: Path = REPO) -> str:
    try:
        head = proc.capture(["git", "rev-parse", "HEAD"], cwd=cwd)
        dirty = proc.capture(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def render_results(outcomes: Sequence[Outcome], *, date: str, machine: str, commit: str, command: str,
                   quick: bool) -> str:
    head = ["# Benchmark results", "", f"- date (UTC): {date}", f"- machine: {machine}", f"- checkout: {commit}",
            f"- command: `{command}`"]
    if quick:
        head.append("- **quick run** (`--quick`): small sizes, one repetition each, no cold builds; process start-up "
                    "weighs more than in a full run, so these are not the final figures")
    gpu = {d for o in outcomes if o.bench.read is not None and o.figures for d in DATE.findall(o.figures["date"])}
    foot = ["", "Rows marked \"read from bench/results\" were not measured by this run: they are the recorded results of "
            "the GPU machine" + (f" ({', '.join(sorted(set(gpu)))})" if gpu else "") + "; every other row was measured "
            "by the command above. \"not run\" rows have no figures.", "",
            "## Figures (JSON)", "", "```json",
            json.dumps({o.bench.name: o.figures if o.figures is not None else {"not_run": o.reason} for o in outcomes},
                       indent=2, sort_keys=True), "```"]
    return "\n".join([*head, "", render_table([r for o in outcomes for r in o.rows]).rstrip("\n"), *foot]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = [b.name for b in BENCHES]
    ap = argparse.ArgumentParser(prog="python3 -m bench", description=__doc__.split("\n\n")[0],
                                 epilog="benchmarks: " + ", ".join(names))
    ap.add_argument("--only", metavar="NAME,...", help="run only these benchmarks")
    ap.add_argument("--skip", metavar="NAME,...", help="do not run these benchmarks")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "RESULTS.md", help="where to keep the table")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repetition, no cold builds")
    a = ap.parse_args(argv)
    log = Log()
    try:
        skipped = select(names, only=a.only, skip=a.skip)
    except UsageError as e:
        log.error(e.render())
        return e.exit_code
    outcomes = [Outcome(bench=b, reason=skipped[b.name], rows=not_run(b, skipped[b.name])) if b.name in skipped
                else run_bench(b, quick=a.quick, log=log) for b in BENCHES]
    text = render_results(
        outcomes, date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine_info(*(_read(p) for p in ("/proc/cpuinfo", "/proc/meminfo"))), commit=git_commit(),
        command=shlex.join(["python3", "-m", "bench", *argv]), quick=a.quick)
    print(text.partition("\n## Figures")[0].rstrip("\n"))
    a.out.write_text(text)
    log.info(f"written to {a.out}")
    return 0


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
