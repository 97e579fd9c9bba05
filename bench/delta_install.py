"""Installs by content against the zip: a first install and an update between two bundles shaped like the CUDA
13.0 bundle measured on the H200 (issue 33: libcublasLt 541.6 MB, libnvrtc 109.3, libggml-cuda 70.5, libcublas 54.2,
llama-server and 14 CPU variants; each file half random, half zeros, so that deflate has work), scaled by
--scale. The update is a new llama.cpp commit: libggml-cuda, llama-server and the CPU variants change, NVIDIA's
libraries do not. Both bundles are published to one directory store (files by content) and installed with
install_bundle from it, by content; the same installs from the zip are the baseline (the entry without its
blobs, as a store of an earlier llamabundle holds it).

Usage: python -m bench.delta_install [--scale F] [--repeat N] [--json] [--json-out FILE]
Prints bytes downloaded and seconds for each path, and their ratios (blobs / zip)."""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import add_json_args, emit_json
from llamabundle import bundle
from llamabundle.bundle.manifest import Manifest
from llamabundle.digest import canonical_json
from llamabundle.log import Log
from llamabundle.runtime.install import install_bundle
from llamabundle.store.local import BLOBS, LocalStore

MB = 1_000_000
NVIDIA = {"libcublasLt.so.13": 541.6, "libnvrtc.so.13": 109.3, "libcublas.so.13": 54.2, "libnvrtc-builtins.so.13.0": 6.3,
          "libcudart.so.13": 2.1}
OURS = {"libggml-cuda.so": 70.5, "llama-server": 9.0, "libggml-base.so": 1.5, "libllama.so": 3.0,
        **{f"libggml-cpu-{v}.so": 1.6 for v in ("x64", "sse42", "sandybridge", "ivybridge", "piledriver", "haswell",
                                                 "skylakex", "cannonlake", "cascadelake", "icelake", "cooperlake",
                                                 "zen4", "alderlake", "sapphirerapids")}}
ROLES = {"llama-server": "exe", "libggml-cuda.so": "backend", **{n: "runtime" for n in NVIDIA}}


def content(name: str, size: int, commit: str) -> bytes:
    """Half pseudo-random bytes (what a compressor cannot shrink), half zeros; the same for the same name, size and
    commit (NVIDIA's files ignore the commit)."""
    seed = hashlib.sha256(f"{name}/{commit if name not in NVIDIA else ''}".encode()).digest()
    half = size // 2
    return random.Random(seed).randbytes(half) + bytes(size - half)


def make(tmp: Path, commit: str, scale: float) -> tuple[Path, Manifest]:
    stage = tmp / f"stage-{commit}"
    stage.mkdir()
    for name, mb in {**NVIDIA, **OURS}.items():
        (stage / name).write_bytes(content(name, int(mb * MB * scale), commit))
    (stage / "llama-server").chmod(0o755)
    roles = {n: ROLES.get(n, "backend" if n.startswith("libggml-cpu") else "runtime") for n in (*NVIDIA, *OURS)}
    inputs = {"recipe": "bench-delta", "platform": "linux-x86_64", "commit": commit, "cuda": None}
    key = hashlib.sha256(canonical_json(inputs).encode()).hexdigest()
    m = bundle.write_manifest(stage, {"name": "bench-cuda", "key": key, "inputs": inputs, "platform": "linux-x86_64",
                                      "llama_cpp": {"commit": commit}, "files": bundle.file_entries(stage, roles)})
    return bundle.pack(stage, tmp / f"bench-cuda-{key[:12]}.zip", source_date_epoch=0), m


def zip_only(store: Path, src: LocalStore, key: str) -> None:
    """The entry alone, without the store's blobs: installs from it download the zip."""
    shutil.copytree(src.root / key, store / key)


def timed_install(store: Path, key: str, root: Path) -> tuple[float, Any]:
    t0 = time.perf_counter()
    got = install_bundle(LocalStore(store), key, root=root, log=Log(quiet=True))
    return time.perf_counter() - t0, got.transfer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.125, help="file sizes as a fraction of the H200 bundle's (default 1/8)")
    ap.add_argument("--repeat", type=int, default=3)
    add_json_args(ap)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lb-delta-") as d:
        tmp = Path(d)
        za, ma = make(tmp, "a" * 40, a.scale)
        zb, mb = make(tmp, "b" * 40, a.scale)
        blobs, zips = tmp / "store", tmp / "zips"
        store = LocalStore(blobs)
        store.publish(za, ma)
        store.publish(zb, mb)
        for key in (ma.key, mb.key):
            zip_only(zips, store, key)
        unique = sum(p.stat().st_size for p in blobs.joinpath(*BLOBS).iterdir())
        both = sum(f.size for f in (*ma.files, *mb.files))
        rows: dict[str, list[float]] = {k: [] for k in ("zip_first", "blob_first", "zip_update", "blob_update")}
        moved: dict[str, int] = {}
        for i in range(a.repeat):
            for path, where in (("zip", zips), ("blob", blobs)):
                root = tmp / f"root-{path}-{i}"
                t, first = timed_install(where, ma.key, root)
                rows[f"{path}_first"].append(t)
                t, update = timed_install(where, mb.key, root)
                rows[f"{path}_update"].append(t)
                moved[f"{path}_first"], moved[f"{path}_update"] = first.downloaded, update.downloaded
                shutil.rmtree(root)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {"scale": a.scale, "zip_a_bytes": za.stat().st_size if za.exists() else None, "files": len(ma.files),
              "store_blob_bytes": unique, "store_both_bundles_file_bytes": both, **{f"{k}_s": v for k, v in med.items()},
              **{f"{k}_bytes": v for k, v in moved.items()},
              "update_bytes_ratio": moved["blob_update"] / moved["zip_update"],
              "first_time_ratio": med["blob_first"] / med["zip_first"],
              "update_time_ratio": med["blob_update"] / med["zip_update"]}
    print(f"two bundles of {len(ma.files)} files (scale {a.scale}); the store keeps {unique / MB:.1f} MB of blobs for "
          f"{both / MB:.1f} MB of files")
    print(f"first install: zip {moved['zip_first'] / MB:.1f} MB in {med['zip_first']:.2f} s; by content "
          f"{moved['blob_first'] / MB:.1f} MB in {med['blob_first']:.2f} s (time ratio {result['first_time_ratio']:.2f})")
    print(f"update to a new commit: zip {moved['zip_update'] / MB:.1f} MB in {med['zip_update']:.2f} s; by content "
          f"{moved['blob_update'] / MB:.1f} MB in {med['blob_update']:.2f} s (bytes ratio "
          f"{result['update_bytes_ratio']:.3f}, time ratio {result['update_time_ratio']:.2f})")
    emit_json(a, result)


if __name__ == "__main__":
    os.environ.setdefault("LLAMABUNDLE_NO_TELEMETRY", "1")
    main()
