"""Lost answers: how often one run of `llama-server --verbose --list-devices` loses its 'loaded CPU backend'
line on a busy machine (llama.cpp's log thread is not waited for at exit), against how often one run of the
bundle's own llamabundle-probe fails to say which CPU module it loaded (its JSON: ggml's log goes to a
synchronous callback). Both run from the bundle in the load check's clean environment, interleaved, while
BUSY processes spin on the CPU.

Usage: python -m bench.probe_answers UNPACKED_BUNDLE_DIR [--runs N] [--busy N] [--json] [--json-out FILE]
Prints both rates, the probe's median time against llama-server's, and their ratios."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import add_json_args, emit_json
from llamabundle.platforms import load as base


def _spin() -> None:
    while True:
        pass


def _timed(argv: list[str], root: Path, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=root.parent, env=env, capture_output=True, text=True, timeout=120)
    return time.perf_counter() - t0, out


def _probe_answered(out: subprocess.CompletedProcess[str]) -> bool:
    try:
        got = json.loads(out.stdout)
    except ValueError:
        return False
    return out.returncode == 0 and any(m["loaded"] and m["registered"] == "CPU" for m in got["modules"])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--busy", type=int, default=4)
    add_json_args(ap)
    a = ap.parse_args(argv)
    root = a.bundle.resolve()
    env = base.clean_env(root)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(a.busy)]
    for s in spinners:
        s.start()
    lost_list = lost_probe = 0
    t_list: list[float] = []
    t_probe: list[float] = []
    try:
        for _ in range(a.runs):
            dt, out = _timed([str(root / "llama-server"), "--verbose", "--list-devices"], root, env)
            t_list.append(dt)
            lost_list += "loaded CPU backend from" not in out.stderr + out.stdout
            dt, out = _timed([str(root / "llamabundle-probe")], root, env)
            t_probe.append(dt)
            lost_probe += not _probe_answered(out)
    finally:
        for s in spinners:
            s.terminate()
    ml, mp = statistics.median(t_list), statistics.median(t_probe)
    print(f"{a.busy} busy processes on {os.cpu_count()} cores, {a.runs} runs each, interleaved")
    print(f"llama-server --verbose --list-devices: the CPU line lost in {lost_list}/{a.runs} ({lost_list / a.runs:.1%}), "
          f"median {ml * 1000:.0f} ms")
    print(f"llamabundle-probe: no answer in {lost_probe}/{a.runs} ({lost_probe / a.runs:.1%}), median {mp * 1000:.0f} ms")
    print(f"ratios (probe / list-devices): lost {lost_probe}/{lost_list}, time {mp / ml:.3f}")
    emit_json(a, {"runs": a.runs, "busy": a.busy, "list_devices_lost": lost_list, "probe_lost": lost_probe,
                  "list_devices_median_s": ml, "probe_median_s": mp, "time_ratio": mp / ml})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
