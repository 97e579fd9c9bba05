"""How often llama-server --verbose --list-devices loses its 'loaded CPU backend' line on a busy machine
(llama.cpp's log thread is not waited for at exit), one run against the load check's repeated runs.

Usage: python bench/list_devices_lost_lines.py UNPACKED_BUNDLE_DIR [RUNS] [BUSY]
BUSY processes spin on the CPU meanwhile (default: two per core). Prints both rates and their ratio."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

from llamabundle.errors import VerifyError
from llamabundle.platforms import load as base


def _spin() -> None:
    while True:
        pass


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve()
    runs = int(argv[2]) if len(argv) > 2 else 200
    busy = int(argv[3]) if len(argv) > 3 else 2 * (os.cpu_count() or 1)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for s in spinners:
        s.start()
    try:
        env = base.clean_env(root)
        single = 0
        for _ in range(runs):
            out = subprocess.run([str(root / "llama-server"), "--verbose", "--list-devices"], cwd=root.parent, env=env,
                                 capture_output=True, text=True, timeout=120)
            single += "loaded CPU backend from" not in out.stderr + out.stdout
        checked = 0
        for _ in range(runs):
            try:
                base.run_list_devices(root, exe_name="llama-server")
            except VerifyError:
                checked += 1
    finally:
        for s in spinners:
            s.terminate()
    print(f"{busy} busy processes, {runs} runs each")
    print(f"one run of llama-server --list-devices: the CPU line lost in {single}/{runs} ({single / runs:.1%})")
    print(f"the load check (up to {base.LIST_ATTEMPTS} runs): failed in {checked}/{runs} ({checked / runs:.1%})")
    print(f"ratio (load check / one run): {(checked / single) if single else float('nan'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
