"""Fetch from the GitHub Releases store against a plain download of the same bytes.

Starts tests/fakegithub.py (a GitHub-compatible API on 127.0.0.1 whose asset downloads redirect to a "CDN"
on 127.0.0.2), publishes a bundle whose zip is about --size-mb MB (one file of random, incompressible
bytes) with `llamabundle publish`, then times, median of --repeat runs each, interleaved:

  (a) `python -m llamabundle fetch KEY --store github:acme/bundles --out DIR`: lookup (API), download
      (API 302 → CDN) with sha256 check, static + load verification, unpack and check every file;
  (b) `curl -sSfL -o FILE CDN-URL`: the download only (python's urllib when there is no curl; it says so).

Target: (a) / (b) ≤ 1.15. Measured twice: with the CDN as fast as loopback goes (on a 2-core machine the
Python server, the client and the page cache share the cores: this measures our CPU cost per byte) and with
the CDN paced at --rate-mb MB/s, the order of a real GitHub release download. Also counts the HTTP requests
of one `llamabundle check` on a hit and on a miss. Everything is local (loopback); nothing is left behind.

    python bench/fetch_vs_curl.py [--size-mb 200] [--repeat 3] [--rate-mb 100] [--json] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import add_json_args, emit_json  # noqa: E402
from llamabundle import bundle, keys  # noqa: E402
from tests.fakegithub import FakeGitHub  # noqa: E402

GH_REPO = "acme/bundles"
STORE = f"github:{GH_REPO}"
TOKEN = "ghp_bench0000000000000000000000000000000"
HIT_RECIPE = REPO / "recipes" / "linux-x86_64-cpu.yaml"
MISS_RECIPE = REPO / "recipes" / "windows-x86_64-cuda12.8.yaml"
# a shell script in place of llama-server that answers the load check like the real one (as in test_cli.py)
SERVER = b"""#!/bin/sh
echo "load_backend: loaded CPU backend from $(dirname "$0")/libggml-cpu.so" >&2
echo "Available devices:"
exit 0
"""


def make_bundle(work: Path, key: str, size: int) -> Path:
    stage = work / "stage"
    stage.mkdir()
    (stage / "llama-server").write_bytes(SERVER)
    (stage / "llama-server").chmod(0o755)
    (stage / "LICENSE").write_bytes(b"MIT License\n")
    with open(stage / "payload.bin", "wb") as f:  # random: the zip cannot be smaller than this
        left = size
        while left > 0:
            n = min(left, 16 << 20)
            f.write(os.urandom(n))
            left -= n
    roles = {"llama-server": "exe", "LICENSE": "license", "payload.bin": "runtime"}
    recipe = keys.load(HIT_RECIPE)
    assert keys.resolve(recipe).key == key
    bundle.write_manifest(stage, {"name": "linux-x86_64-cpu", "key": key, "inputs": keys.resolve(recipe).inputs,
                                  "platform": "linux-x86_64", "llama_cpp": {"commit": recipe.llama_cpp.commit},
                                  "files": bundle.file_entries(stage, roles)})
    zip_path = bundle.pack(stage, work / f"linux-x86_64-cpu-{key[:12]}.zip", source_date_epoch=0)
    shutil.rmtree(stage)
    return zip_path




def run(argv: list[str], env: dict[str, str], ok: tuple[int, ...] = (0,)) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    dt = time.perf_counter() - t0
    if p.returncode not in ok:
        sys.exit(f"{' '.join(argv)} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return dt, p


def time_series(a: argparse.Namespace, lb: list[str], env: dict[str, str], work: Path, key: str,
                baseline: list[str], zip_sha: str, gh: FakeGitHub) -> tuple[list[float], list[float], tuple[int, int]]:
    """`fetch` and the baseline, interleaved so that both see the same machine state."""
    tool_t, base_t, fetch_reqs = [], [], (0, 0)
    for i in range(a.repeat):
        env["LLAMABUNDLE_CACHE_DIR"] = str(work / f"cache-{i}")  # nothing cached: a real download
        out = work / f"out-{i}"
        mark = len(gh.requests)
        dt, _ = run([*lb, "fetch", key, "--store", STORE, "--out", str(out)], env)
        tool_t.append(dt)
        reqs = gh.requests[mark:]
        fetch_reqs = (sum(r.host == "api" for r in reqs), sum(r.host == "cdn" for r in reqs))
        if not (out / "bundle.json").is_file() or (out / "payload.bin").stat().st_size != a.size_mb << 20:
            sys.exit("the fetched bundle is incomplete")
        shutil.rmtree(out)
        shutil.rmtree(work / f"cache-{i}")

        f = work / f"curl-{i}.zip"
        dt, _ = run([x.replace("{out}", str(f)) for x in baseline], env)
        base_t.append(dt)
        if bundle.sha256_file(f) != zip_sha:
            sys.exit("the baseline download does not match the published zip")
        f.unlink()
    return tool_t, base_t, fetch_reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rate-mb", type=float, default=100.0, help="pace of the second series, MB/s (0: skip it)")
    add_json_args(ap)
    a = ap.parse_args()
    key = keys.resolve(keys.load(HIT_RECIPE)).key
    work = Path(tempfile.mkdtemp(prefix="lb-fetch-curl-"))
    try:
        with FakeGitHub(GH_REPO, token=TOKEN) as gh:
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("GITHUB_", "GH_", "LLAMABUNDLE_")) and k.lower() not in (
                       "http_proxy", "https_proxy", "all_proxy")}
            env |= {"LLAMABUNDLE_GITHUB_API_URL": gh.api_url, "GITHUB_TOKEN": TOKEN,
                    "NO_PROXY": "127.0.0.1,127.0.0.2,localhost", "PYTHONDONTWRITEBYTECODE": "1"}
            lb = [sys.executable, "-m", "llamabundle"]

            t0 = time.perf_counter()
            zip_path = make_bundle(work, key, a.size_mb << 20)
            zip_size, zip_sha = zip_path.stat().st_size, bundle.sha256_file(zip_path)
            print(f"bundle    {zip_path.name}: {zip_size / 1e6:.1f} MB (made in {time.perf_counter() - t0:.1f} s)")
            env["LLAMABUNDLE_CACHE_DIR"] = str(work / "cache-publish")
            dt, _ = run([*lb, "publish", str(zip_path), "--store", STORE], env)
            zip_path.unlink()
            (asset,) = [x for x in gh.assets.values() if x.name.endswith(".zip")]
            cdn_url = f"{gh.cdn_url}/cdn/{asset.id}/{asset.name}"
            print(f"published to the fake GitHub ({gh.api_url}, CDN {gh.cdn_url}) in {dt:.1f} s")

            # requests per `check`
            counts = {}
            for what, recipe, rc in (("hit", HIT_RECIPE, 0), ("miss", MISS_RECIPE, 1)):
                env["LLAMABUNDLE_CACHE_DIR"] = str(work / f"cache-check-{what}")
                mark = len(gh.requests)
                run([*lb, "check", str(recipe), "--store", STORE], env, ok=(rc,))
                reqs = gh.requests[mark:]
                counts[what] = (sum(r.host == "api" for r in reqs), sum(r.host == "cdn" for r in reqs),
                                [f"{r.method} {r.path.split('?')[0]}" for r in reqs])

            # timings, interleaved so that both see the same machine state
            curl = shutil.which("curl")
            if curl:
                baseline_name = "curl -sSfL -o FILE URL"
                baseline = [curl, "-sSfL", "-o", "{out}", cdn_url]
            else:
                baseline_name = "python -c urllib.request (no curl on this machine)"
                baseline = [sys.executable, "-c", "import shutil, sys, urllib.request\n"
                            "with urllib.request.urlopen(sys.argv[1]) as r, open(sys.argv[2], 'wb') as f:\n"
                            "    shutil.copyfileobj(r, f, 1 << 20)", cdn_url, "{out}"]
            series = {}
            for rate in (None, a.rate_mb * 1e6 if a.rate_mb else None):
                if rate is None and series:
                    break
                gh.cdn_rate = rate
                series[rate] = time_series(a, lb, env, work, key, baseline, zip_sha, gh)
            gh.cdn_rate = None
            dt_import, _ = run([*lb, "--version"], env)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nzip       {zip_size / 1e6:.1f} MB, sha256 {zip_sha[:16]}…, median of {a.repeat}"
          f"; `python -m llamabundle --version` alone: {dt_import:.2f} s")
    for rate, (tool_t, base_t, fetch_reqs) in series.items():
        tool, base = statistics.median(tool_t), statistics.median(base_t)
        ratio = tool / base
        print(f"CDN {'unpaced (loopback)' if rate is None else f'paced at {rate / 1e6:.0f} MB/s'}:")
        print(f"  (a) llamabundle fetch       {tool:7.2f} s   runs {', '.join(f'{t:.2f}' for t in tool_t)}"
              f"   ({zip_size / 1e6 / tool:.0f} MB/s; {fetch_reqs[0]} API + {fetch_reqs[1]} CDN requests)")
        print(f"  (b) {baseline_name:<24}{base:7.2f} s   runs {', '.join(f'{t:.2f}' for t in base_t)}"
              f"   ({zip_size / 1e6 / base:.0f} MB/s)")
        print(f"  ratio (a)/(b)               {ratio:7.2f}   target <= 1.15: {'met' if ratio <= 1.15 else 'NOT met'}")
    print("    (a) also checks the zip's sha256 and unpacks it while it downloads, checks every file's sha256 and")
    print("        verifies the bundle (static); (b) only downloads.")
    for what in ("hit", "miss"):
        api, cdn, lines = counts[what]
        print(f"check on a {what:<4}  {api} API request(s) + {cdn} CDN request(s): {'; '.join(lines)}")
    emit_json(a, {"benchmark": "fetch_vs_curl", "size_mb": a.size_mb, "repeat": a.repeat, "zip_bytes": zip_size,
                  "baseline": baseline_name, "import_s": round(dt_import, 3), "target_ratio": 1.15,
                  "series": [{"rate_mb_s": None if rate is None else rate / 1e6,
                              "tool_s_median": round(statistics.median(tool_t), 3),
                              "baseline_s_median": round(statistics.median(base_t), 3),
                              "tool_s": [round(t, 3) for t in tool_t], "baseline_s": [round(t, 3) for t in base_t],
                              "ratio": round(statistics.median(tool_t) / statistics.median(base_t), 4),
                              "api_requests": fetch_reqs[0], "cdn_requests": fetch_reqs[1]}
                             for rate, (tool_t, base_t, fetch_reqs) in series.items()],
                  "check": {what: {"api_requests": api, "cdn_requests": cdn, "requests": lines}
                            for what, (api, cdn, lines) in counts.items()}})


if __name__ == "__main__":
    main()
