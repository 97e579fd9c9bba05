"""Toolkit bytes: what the redist source downloads for the Windows CUDA 12.8.1 recipe against NVIDIA's
full local installer, and the cost of a second `llamabundle toolkit install` of the same plan.

1. The plan of recipes/windows-x86_64-cuda12.8.yaml (seven components, sizes from the pinned
   manifest llamabundle/data/cuda/redistrib_12.8.1.json) vs the local installer.
   The manifest does not list the installer. Its size is the figure NVIDIA publishes on the CUDA 12.8
   Update 1 download page (developer.nvidia.com/cuda-12-8-1-download-archive, Windows / x86_64 /
   exe (local): cuda_12.8.1_572.61_windows.exe, "3.2 GB"), taken as 3.2e9 bytes: INSTALLER_BYTES
   below. That page gives one decimal digit, so the ratio is good to about ±2 %; pass
   --installer-bytes N to use an exact count (e.g. from `curl -sI` of the installer URL).
2. A second install: small archives with the real layout served by a local HTTP server; the first
   install downloads them, the second (a fresh `python -m llamabundle toolkit install` process) must
   download 0 bytes. Its wall time (process start included) is printed.

    python bench/toolkit_bytes.py [--installer-bytes N] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llamabundle import keys

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

INSTALLER_NAME = "cuda_12.8.1_572.61_windows.exe"
INSTALLER_URL = f"https://developer.download.nvidia.com/compute/cuda/12.8.1/local_installers/{INSTALLER_NAME}"
INSTALLER_BYTES = 3_200_000_000  # NVIDIA download page: "3.2 GB" (see the docstring)
RECIPE = REPO / "recipes" / "windows-x86_64-cuda12.8.yaml"


def plan_bytes() -> tuple[int, list[tuple[str, str, int]]]:
    from llamabundle.backends.cuda.toolkit.plan import plan_for_recipe

    plan = plan_for_recipe(keys.load(RECIPE))
    return plan.total_bytes, [(a.component, a.archive.version, a.archive.size) for a in plan.archives]


def second_install(repeat: int) -> dict[str, object]:
    from tests.redist import Server, build_repo  # small archives with the real layout, a real server

    work = Path(tempfile.mkdtemp(prefix="lb-toolkit-"))
    manifest = build_repo(work / "redist")
    mpath = work / "redistrib_13.0.2.json"
    mpath.write_text(json.dumps(manifest))
    server = Server(work / "redist")
    server.start()
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMABUNDLE_CACHE_DIR": str(work / "cache"),
           "LLAMABUNDLE_CUDA_REDIST_URL": server.url}
    argv = [sys.executable, "-m", "llamabundle", "--quiet", "toolkit", "install", "--version", "13.0.2",
            "--components", "cuda_nvcc,cuda_cudart", "--platform", "linux-x86_64", "--manifest", str(mpath), "--json"]
    try:
        def once() -> tuple[float, dict]:
            t0 = time.monotonic()
            r = subprocess.run(argv, env=env, capture_output=True, text=True)
            took = time.monotonic() - t0
            if r.returncode != 0:
                sys.exit(f"toolkit install failed ({r.returncode}):\n{r.stderr[-3000:]}")
            return took, json.loads(r.stdout)

        t_first, first = once()
        first_bytes = server.bytes_sent
        times, served, requests = [], [], []
        for _ in range(repeat):
            server.reset()
            took, out = once()
            assert out["reused"] and out["downloaded_bytes"] == 0, out
            times.append(took)
            served.append(server.bytes_sent)
            requests.append(len(server.requests))
        # the same, without the interpreter start: the library call alone
        from llamabundle.backends.cuda.toolkit import redist
        from llamabundle.backends.cuda.toolkit.plan import plan_toolkit
        from llamabundle.log import Log

        plan = plan_toolkit(version="13.0.2", components=["cuda_nvcc", "cuda_cudart"], platform="linux-x86_64",
                            manifest=manifest)
        t0 = time.monotonic()
        res = redist.install(plan, cache_dir=work / "cache", base_url=server.url, log=Log(quiet=True))
        t_lib = time.monotonic() - t0
        assert res.reused
        return {"first_install_s": round(t_first, 3), "first_install_bytes": first_bytes,
                "archives": len(first["downloaded"]),
                "second_install_s_median": round(statistics.median(times), 3),
                "second_install_s_max": round(max(times), 3),
                "second_install_bytes_downloaded": max(served), "second_install_requests": max(requests),
                "second_install_library_call_s": round(t_lib, 4), "repeat": repeat}
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--installer-bytes", type=int, default=INSTALLER_BYTES)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    total, comps = plan_bytes()
    second = second_install(a.repeat)
    result = {"recipe": str(RECIPE.relative_to(REPO)), "redist_bytes": total, "components": len(comps),
              "installer": INSTALLER_NAME, "installer_bytes": a.installer_bytes,
              "installer_bytes_source": "NVIDIA download page figure 3.2 GB" if a.installer_bytes == INSTALLER_BYTES
              else "--installer-bytes",
              "ratio": round(total / a.installer_bytes, 4), "saved_bytes": a.installer_bytes - total, **second}
    if a.json:
        print(json.dumps(result, indent=2))
        return
    print(f"Windows CUDA 12.8.1 plan ({result['recipe']}), redist archives:")
    for name, version, size in comps:
        print(f"  {name:<14} {version:<10} {size:>15,}")
    print(f"  {'total':<25} {total:>15,} bytes ({total / 1e9:.3f} GB)")
    print(f"full local installer {INSTALLER_NAME}: {a.installer_bytes:,} bytes ({result['installer_bytes_source']})")
    print(f"redist / installer = {result['ratio']:.3f}  ({total / a.installer_bytes:.1%}; "
          f"{result['saved_bytes'] / 1e9:.2f} GB not downloaded)")
    print(f"second toolkit install (local server, small archives, {a.repeat} runs): median "
          f"{second['second_install_s_median']:.3f} s, max {second['second_install_s_max']:.3f} s per process; "
          f"{second['second_install_bytes_downloaded']} bytes downloaded, {second['second_install_requests']} requests; "
          f"library call alone {second['second_install_library_call_s'] * 1000:.1f} ms")
    print(f"(first install: {second['first_install_bytes']:,} bytes in {second['archives']} archives, "
          f"{second['first_install_s']:.3f} s)")


if __name__ == "__main__":
    main()
