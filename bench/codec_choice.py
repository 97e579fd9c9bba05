"""The blob codec measured on a whole bundle: for every file of a bundle zip, the zip's deflate (its compressed
size, and the seconds to inflate it on one core) against zstd at each level asked for (its size through
store.codec.pack, the seconds to compress, and the seconds to decompress through store.codec.unpack, which
also hashes, as an install does). One run, one core, files in memory: ratios of bytes and of seconds.

Usage: python -m bench.codec_choice BUNDLE.zip [--levels 3,9] [--json] [--json-out FILE]"""

from __future__ import annotations

import argparse
import hashlib
import io
import time
import zipfile
from pathlib import Path
from typing import Any

from bench import add_json_args, emit_json
from llamabundle.store import codec


def measure(zip_path: Path, levels: list[int]) -> dict[str, Any]:
    z = zipfile.ZipFile(zip_path)
    members = [i for i in z.infolist() if not i.is_dir()]
    raw_total = sum(i.file_size for i in members)
    deflated = sum(i.compress_size for i in members)
    t = time.perf_counter()
    data = {}
    for i in members:  # inflate (and hash: an install checks every file) on one core
        b = z.read(i)
        hashlib.sha256(b).hexdigest()
        data[i.filename] = b
    inflate_s = time.perf_counter() - t
    rows: dict[str, Any] = {}
    for level in levels:
        packed, pack_s, unpack_s = 0, 0.0, 0.0
        for b in data.values():
            out = io.BytesIO()
            t = time.perf_counter()
            codec.pack(io.BytesIO(b), out, level=level)
            pack_s += time.perf_counter() - t
            packed += out.tell()
            out.seek(0)
            t = time.perf_counter()
            got = codec.unpack(out, io.BytesIO(), limit=len(b))
            unpack_s += time.perf_counter() - t
            assert got.size == len(b)
        rows[f"zstd-{level}"] = {"bytes": packed, "bytes_vs_zip": round(packed / deflated, 4), "compress_s": round(pack_s, 2),
                                 "decompress_s": round(unpack_s, 2), "decompress_vs_inflate": round(unpack_s / inflate_s, 3)}
    return {"zip": str(zip_path), "files": len(members), "raw_bytes": raw_total, "zip_bytes": zip_path.stat().st_size,
            "deflated_bytes": deflated, "inflate_s": round(inflate_s, 2), "zstd": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("zip", type=Path)
    ap.add_argument("--levels", default="3", help="zstd levels, comma-separated (default: 3, the store's)")
    add_json_args(ap)
    args = ap.parse_args()
    r = measure(args.zip, [int(x) for x in args.levels.split(",")])
    print(f"{r['zip']}: {r['files']} files, {r['raw_bytes'] / 1e6:.1f} MB unpacked, zip {r['zip_bytes'] / 1e6:.1f} MB "
          f"(deflate {r['deflated_bytes'] / 1e6:.1f} MB; inflate and hash: {r['inflate_s']:.2f} s on one core)")
    for name, row in r["zstd"].items():
        print(f"  {name}: {row['bytes'] / 1e6:.1f} MB ({row['bytes_vs_zip']:.3f} of deflate), compress {row['compress_s']:.1f} s, "
              f"decompress and hash {row['decompress_s']:.2f} s ({row['decompress_vs_inflate']:.3f} of inflate)")
    emit_json(args, r)


if __name__ == "__main__":
    main()
