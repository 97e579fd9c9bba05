"""pack of an unpacked bundle (issue 34: a rebuild's collect, pack and verify of a CUDA bundle took 44 of its 50
seconds on an H100 machine), measured in one run against zipfile alone, member after member, as pack wrote before:

    python -m bench.pack_speed BUNDLE_DIR [--repeat N] [--json-out F]

Rows: zipfile alone; pack with no cache (members deflated ahead in worker threads); pack with an empty deflate
cache (the first build); pack with that cache filled (the next build: the large members' streams copied). Every
row's zip must be zipfile's, byte for byte, or the run says so and exits 1."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from llamabundle.bundle import pack
from tests.unit.test_pack_deflate import zipfile_alone


def timed(f: Callable[[], object]) -> float:
    t0 = time.monotonic()
    f()
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-pack-"))
    rows: dict[str, list[float]] = {"zipfile alone": [], "pack, no cache": [], "pack, empty cache": [],
                                    "pack, cache filled": []}
    digests: set[str] = set()
    try:
        for i in range(a.repeat):
            cache = work / f"deflated-{i}"
            runs: list[tuple[str, Callable[[], object]]] = [
                ("zipfile alone", lambda: zipfile_alone(a.bundle, work / "alone.zip")),
                ("pack, no cache", lambda: pack(a.bundle, work / "none.zip")),
                ("pack, empty cache", partial(pack, a.bundle, work / "empty.zip", cache=cache)),
                ("pack, cache filled", partial(pack, a.bundle, work / "filled.zip", cache=cache)),
            ]
            for name, run in runs:
                rows[name].append(timed(run))
            for z in ("alone", "none", "empty", "filled"):
                digests.add(hashlib.sha256((work / f"{z}.zip").read_bytes()).hexdigest())
            shutil.rmtree(cache)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = sum((a.bundle / n).stat().st_size for n in os.listdir(a.bundle))
    base = statistics.median(rows["zipfile alone"])
    print(f"{a.bundle}: {size / 1e6:.1f} MB unpacked, {os.cpu_count()} cores, median of {a.repeat}")
    for name, times in rows.items():
        print(f"{name:22} {statistics.median(times):7.2f} s  {statistics.median(times) / base:5.2f}")
    same = len(digests) == 1
    print(f"the same zip in every row: {'yes' if same else 'NO'}")
    if a.json_out:
        a.json_out.write_text(json.dumps({"benchmark": "pack_speed", "unpacked_bytes": size, "cores": os.cpu_count(),
                                          "seconds": rows, "same_zip": same}, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
