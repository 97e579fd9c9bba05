"""NVIDIA's CUDA redist server, faked for the toolkit tests: SMALL archives with the real layout (and one
hostile one) and the manifest describing them, served from a directory by a tests/loopback.py server with
Range/If-Range, counted requests and injected faults; `Repo` is all of it for one test (the `repo` fixture)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from llamabundle.backends.cuda.toolkit import redist
from llamabundle.backends.cuda.toolkit.plan import plan_toolkit
from llamabundle.log import Log
from tests.loopback import Loopback, Reply, Request, error

ROOT = Path(__file__).resolve().parents[1]
WINDOWS_RECIPE = ROOT / "recipes" / "windows-x86_64-cuda12.8.yaml"
WINDOWS_12_8_1_TOTAL = 1_255_664_179
RECIPE_13 = """\
recipe: 1
name: linux-x86_64-cuda13
platform: linux-x86_64
llama_cpp:
  commit: 0c1e57098bba43ac29e6e3b677cdceebdd22334f
  sources:
    - github: ggml-org/llama.cpp
backends: [cpu, cuda]
toolchain: {compiler: gcc}
cuda:
  toolkit: 13.0.2
  source: redist
  components: [cuda_nvcc, cuda_cudart]
  archs: [86-real, 120a-real]
targets: [llama-server]
"""  # a CUDA 13 recipe whose toolkit is the fake one (the `recipe13` fixture writes it)

NVCC = b"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n"
COMMON_H = b"/* shipped identically by cuda_nvcc and cuda_cudart */\n"


@dataclass(frozen=True)
class Link:
    target: str


# component -> (version, {platform: {path inside the archive's top dir: bytes | Link}})
FAKE: dict[str, tuple[str, dict[str, dict[str, bytes | Link]]]] = {
    "cuda_nvcc": ("13.0.88", {
        "linux-x86_64": {"LICENSE": b"nvcc license\n", "bin/nvcc": NVCC, "include/fatbinary_section.h": b"/* fatbin */\n",
                         "include/common.h": COMMON_H},
        "windows-x86_64": {"LICENSE": b"nvcc license\n", "bin/nvcc.exe": b"MZ nvcc\n", "include/fatbinary_section.h": b"/* fatbin */\n"},
    }),
    "cuda_crt": ("13.0.88", {
        "linux-x86_64": {"LICENSE": b"crt license\n", "include/crt/host_config.h": b"/* crt */\n"},
        "windows-x86_64": {"LICENSE": b"crt license\n", "include/crt/host_config.h": b"/* crt */\n"},
    }),
    "libnvvm": ("13.0.88", {
        "linux-x86_64": {"LICENSE": b"nvvm license\n", "nvvm/bin/cicc": b"#!/bin/sh\nexit 0\n",
                         "nvvm/libdevice/libdevice.10.bc": b"BC\xc0\xde"},
        "windows-x86_64": {"LICENSE": b"nvvm license\n", "nvvm/bin/cicc.exe": b"MZ cicc\n"},
    }),
    "cuda_cudart": ("13.0.96", {
        "linux-x86_64": {"LICENSE": b"cudart license\n", "include/cuda_runtime.h": b"/* cuda_runtime */\n",
                         "include/common.h": COMMON_H, "lib/libcudart.so.13.0.96": b"\x7fELF cudart\n",
                         "lib/libcudart.so.13": Link("libcudart.so.13.0.96"), "lib/libcudart.so": Link("libcudart.so.13"),
                         "lib/libcudart_static.a": b"!<arch>\n"},
        "windows-x86_64": {"LICENSE": b"cudart license\n", "include/cuda_runtime.h": b"/* cuda_runtime */\n",
                           "lib/x64/cudart.lib": b"!<arch>\n", "bin/cudart64_13.dll": b"MZ cudart\n"},
    }),
    # ships include/cuda_runtime.h too, with other bytes: installing it with cuda_cudart must fail
    "cuda_conflict": ("13.0.1", {
        "linux-x86_64": {"LICENSE": b"x\n", "include/cuda_runtime.h": b"/* something else */\n"},
    }),
}


def _exec(rel: str) -> bool:
    return rel.startswith(("bin/", "nvvm/bin/"))


def make_tar(path: Path, top: str, files: dict[str, bytes | Link], *, evil: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:xz") as tf:
        dirs = sorted({str(Path(rel).parent) for rel in files} - {"."})
        for d in ["", *dirs]:
            ti = tarfile.TarInfo(f"{top}/{d}".rstrip("/"))
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(ti)
        for rel, body in sorted(files.items()):
            ti = tarfile.TarInfo(f"{top}/{rel}")
            if isinstance(body, Link):
                ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, body.target, 0o777
                tf.addfile(ti)
            else:
                ti.size, ti.mode = len(body), 0o755 if _exec(rel) else 0o644
                tf.addfile(ti, io.BytesIO(body))
        if evil:
            ti = tarfile.TarInfo(f"{top}/../../evil")
            ti.size = 4
            tf.addfile(ti, io.BytesIO(b"evil"))


def make_zip(path: Path, top: str, files: dict[str, bytes | Link]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, body in sorted(files.items()):
            assert not isinstance(body, Link), "Windows archives hold no links"
            zi = zipfile.ZipInfo(f"{top}/{rel}", date_time=(2025, 1, 1, 0, 0, 0))
            zi.external_attr = (0o100755 if rel.endswith(".exe") else 0o100644) << 16
            zf.writestr(zi, body)


def build_repo(root: Path, *, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Archives under root/<relative_path> and the manifest (a dict, NVIDIA's format) describing them."""
    manifest: dict[str, Any] = {"release_date": "2025-10-09", "release_label": "13.0.2", "release_product": "cuda"}
    for comp, (version, platforms) in FAKE.items():
        entry: dict[str, Any] = {"name": comp.upper(), "license": "CUDA Toolkit", "license_path": f"{comp}/LICENSE.txt",
                                 "version": version}
        for plat, files in platforms.items():
            ext = "zip" if plat.startswith("windows") else "tar.xz"
            top = f"{comp}-{plat}-{version}-archive"
            rel = f"{comp}/{plat}/{top}.{ext}"
            if ext == "zip":
                make_zip(root / rel, top, files)
            else:
                make_tar(root / rel, top, files)
            body = (root / rel).read_bytes()
            entry[plat] = {"relative_path": rel, "sha256": hashlib.sha256(body).hexdigest(),
                           "md5": hashlib.md5(body).hexdigest(), "size": str(len(body))}
        manifest[comp] = entry
    # an archive that tries to write outside its directory
    top = "cuda_evil-linux-x86_64-13.0.1-archive"
    rel = f"cuda_evil/linux-x86_64/{top}.tar.xz"
    make_tar(root / rel, top, {"LICENSE": b"x\n", "bin/nvcc": NVCC}, evil=True)
    body = (root / rel).read_bytes()
    manifest["cuda_evil"] = {"name": "EVIL", "version": "13.0.1", "linux-x86_64": {
        "relative_path": rel, "sha256": hashlib.sha256(body).hexdigest(), "size": str(len(body))}}
    manifest.update(extra or {})
    return manifest


class Server:
    """A directory served on 127.0.0.1, with Range/If-Range, counted requests and faults. Made stopped:
    `start()` and `close()`, or use it as a context manager.

    faults[path] is a list of actions taken by the next requests of that path: "500" or "truncate"
    (announce the whole length, send half of it, drop the connection). `delay` slows every answer."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.faults: dict[str, list[str]] = {}
        self.delay = 0.0
        self.lock = threading.Lock()
        self.loop = Loopback(self._answer)
        self.url = self.loop.url

    def start(self) -> Self:
        self.loop.start()
        return self

    def close(self) -> None:
        self.loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def requests(self) -> list[tuple[str, str | None]]:
        """(path, Range header) of every request so far."""
        return [(_rel(r), r.headers.get("range")) for r in list(self.loop.requests)]

    @property
    def bytes_sent(self) -> int:
        """Body bytes of the archives served so far (error pages not counted)."""
        return sum(r.sent for r in list(self.loop.requests))

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    def reset(self) -> None:
        self.loop.forget()

    def _answer(self, req: Request) -> Reply:
        rel = _rel(req)
        with self.lock:
            todo = self.faults.get(rel) or []
            fault = todo.pop(0) if todo else None
        if fault == "500":
            return error(500, "injected", delay=self.delay)
        path = self.root / rel
        if not rel or not path.is_file():
            return error(404, delay=self.delay)
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
        start, status, headers = 0, 200, {}
        rng = req.headers.get("range")
        if rng and rng.startswith("bytes=") and req.headers.get("if-range", etag) == etag:
            start, status = int(rng[len("bytes="):].split("-")[0]), 206
            headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        headers |= {"Content-Length": str(len(body) - start), "Accept-Ranges": "bytes", "ETag": etag}
        out = body[start:]
        return Reply(status, headers, out, cut=len(out) // 2 if fault == "truncate" else None, delay=self.delay)


def _rel(req: Request) -> str:
    return req.path.split("?", 1)[0].lstrip("/")


@dataclass
class Repo:
    dir: Path
    manifest: dict[str, Any]
    manifest_path: Path
    server: Server
    cache: Path
    log: Log = field(default_factory=lambda: Log(quiet=True))

    def rel(self, comp: str, platform: str = "linux-x86_64") -> str:
        return self.manifest[comp][platform]["relative_path"]

    def plan(self, components: list[str], platform: str = "linux-x86_64", manifest: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        return plan_toolkit(version="13.0.2", components=components, platform=platform, manifest=manifest or self.manifest)

    def install(self, plan, **kw: Any) -> redist.InstallResult:  # type: ignore[no-untyped-def]
        return redist.install(plan, cache_dir=self.cache, base_url=self.server.url, log=self.log, backoff=0.0, **kw)


@contextmanager
def serve_repo(tmp: Path) -> Iterator[Repo]:
    """The fake archives under tmp/redist, their manifest in tmp/redistrib_13.0.2.json, served while inside."""
    d = tmp / "redist"
    manifest = build_repo(d)
    mpath = tmp / "redistrib_13.0.2.json"
    mpath.write_text(json.dumps(manifest, indent=2))
    with Server(d) as server:
        yield Repo(dir=d, manifest=manifest, manifest_path=mpath, server=server, cache=tmp / "cache")


def leftovers(repo: Repo) -> list[str]:
    """Temporary trees or partial downloads left anywhere in the cache."""
    return sorted(str(p.relative_to(repo.cache)) for p in repo.cache.rglob("*")
                  if ".tmp-" in p.name or p.name.endswith((".part", ".part.json", ".x")) or ".old-" in p.name)
