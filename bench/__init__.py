"""Benchmarks of llamabundle against the plain ways of doing the same thing (`python3 -m bench` runs them
all and prints one table: bench/__main__.py). This module holds only what the scripts share: their
machine-readable output (`--json`: one JSON object as the last stdout line; `--json-out FILE`)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def timed_run(argv: list[str], env: dict[str, str]) -> float:
    """Seconds one command took (its output captured); a failure ends the benchmark with its stderr."""
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return took


def add_json_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON object, the last stdout line")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the figures as a JSON object to this file")


def emit_json(a: argparse.Namespace, result: dict[str, Any]) -> None:
    """After the human output: the figures as JSON where --json / --json-out asked for them."""
    if a.json_out:
        a.json_out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    if a.json:
        print(json.dumps(result, sort_keys=True), flush=True)
