"""One large file out of its zstd blob (issue 34: the largest file of a bundle sets a hit's time): store.codec.unpack
with its one-thread loop (decompress, hash, write in turn) against its pipelined path (hashing and writing on two
threads of their own beside the decompression), in the same run, the file packed first as a store packs it.

    python -m bench.unpack_speed FILE [--repeat N] [--json] [--json-out FILE]"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench import add_json_args, emit_json
from llamabundle.store import codec


def once(blob: Path, dest: Path, size: int, *, pipelined: bool) -> float:
    dest.unlink(missing_ok=True)
    saved = codec.PIPELINED
    codec.PIPELINED = 0 if pipelined else size + 1
    try:
        t0 = time.perf_counter()
        with open(blob, "rb") as src, open(dest, "xb") as out:
            got = codec.unpack(src, out, limit=size)
        spent = time.perf_counter() - t0
    finally:
        codec.PIPELINED = saved
    assert got.size == size
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    add_json_args(ap)
    a = ap.parse_args()
    size = a.file.stat().st_size
    with tempfile.TemporaryDirectory(prefix="unpack-speed-") as tmp:
        blob, dest = Path(tmp) / "blob.zst", Path(tmp) / "out"
        codec.pack_file(a.file, blob)
        seconds: dict[str, list[float]] = {"one thread": [], "pipelined": []}
        for _ in range(a.repeat):  # interleaved: the page cache and the clock treat both alike
            for name in seconds:
                seconds[name].append(once(blob, dest, size, pipelined=name == "pipelined"))
    median = {k: statistics.median(v) for k, v in seconds.items()}
    ratio = median["pipelined"] / median["one thread"]
    print(f"{a.file.name}: {size / 1e6:.1f} MB, {os.cpu_count()} cores, median of {a.repeat}")
    for name, m in median.items():
        print(f"{name:12s} {m:6.3f} s")
    print(f"pipelined / one thread: {ratio:.2f}")
    emit_json(a, {"benchmark": "unpack_speed", "file": a.file.name, "size": size, "seconds": seconds,
                  "median": median, "ratio": ratio})


if __name__ == "__main__":
    main()
