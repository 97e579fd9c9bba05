"""The source cache's re-proof before use: the stat walk of a cached llama.cpp tree against its marker
(llamabundle.source.reprove) on a synthetic tree as large as the real one (3,665 files), against reading
and hashing every file as the fetch-time proof of a pypi: source does (git blob sha1 of each file).

    python bench/source_reproof.py [--files 3665] [--repeat 20] [--json] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import add_json_args, emit_json  # noqa: E402
from llamabundle import gitindex  # noqa: E402
from llamabundle.source import MARKER, Marker, parse_marker, record_tree, reprove, write_marker  # noqa: E402

COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
LLAMA_CPP_FILES = 3665  # files in llama.cpp at a 2025 commit (git ls-files | wc -l)


def make_tree(root: Path, files: int, *, seed: int = 12) -> int:
    """A tree shaped like llama.cpp's: some 300 directories up to 5 deep, file sizes spread like source
    files (median about 6 KB, a few of several hundred KB). Returns the bytes written."""
    rng = random.Random(seed)
    dirs = [root]
    for i in range(max(1, files // 12)):
        parent = rng.choice(dirs[: max(1, len(dirs))])
        if len(parent.relative_to(root).parts) >= 5:
            parent = root
        d = parent / f"d{i}"
        d.mkdir(parents=True, exist_ok=True)
        dirs.append(d)
    total = 0
    for i in range(files):
        size = min(int(rng.lognormvariate(8.7, 1.3)), 2_000_000)
        (rng.choice(dirs) / f"f{i}.c").write_bytes(rng.randbytes(size))
        total += size
    return total


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=LLAMA_CPP_FILES)
    ap.add_argument("--repeat", type=int, default=20)
    add_json_args(ap)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lb-reproof-") as tmp:
        tree = Path(tmp) / "src" / COMMIT
        tree.mkdir(parents=True)
        written = make_tree(tree, a.files)
        t0 = time.perf_counter()
        record = record_tree(tree)
        first_walk = time.perf_counter() - t0
        write_marker(tree, Marker(commit=COMMIT, origin="bench", commit_time=None, proof={"method": "bench"}, tree=record))
        marker_bytes = (tree / MARKER).stat().st_size

        reproofs, walks, parses = [], [], []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            marker, why = reprove(tree, COMMIT)
            reproofs.append(time.perf_counter() - t0)
            assert marker is not None and why is None, why
            t0 = time.perf_counter()
            record_tree(tree)
            walks.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            parse_marker((tree / MARKER).read_text(encoding="utf-8"))
            parses.append(time.perf_counter() - t0)

        hashes = []
        for _ in range(max(1, min(a.repeat, 3))):
            t0 = time.perf_counter()
            for path in record.listing:
                gitindex.blob_sha1((tree / path).read_bytes())
            hashes.append(time.perf_counter() - t0)
    reproof = statistics.median(reproofs)
    rehash = statistics.median(hashes)
    result = {"benchmark": "source_reproof", "files": record.files, "bytes": written, "repeat": a.repeat,
              "reproof_ms_median": ms(reproof), "reproof_ms_min": ms(min(reproofs)), "reproof_ms_max": ms(max(reproofs)),
              "stat_walk_ms_median": ms(statistics.median(walks)), "marker_parse_ms_median": ms(statistics.median(parses)),
              "first_walk_ms": ms(first_walk), "marker_bytes": marker_bytes, "rehash_ms_median": ms(rehash),
              "ratio": round(reproof / rehash, 4) if rehash else None}
    print(f"re-proof of {record.files} files ({written / 1e6:.1f} MB): {result['reproof_ms_median']} ms median "
          f"(stat walk {result['stat_walk_ms_median']} ms, marker of {marker_bytes} bytes parsed in "
          f"{result['marker_parse_ms_median']} ms); hashing every file: {result['rehash_ms_median']} ms")
    emit_json(a, result)


if __name__ == "__main__":
    main()
