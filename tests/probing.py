"""Fake NVIDIA hosts and CUDA bundles for the probe, install, doctor and telemetry tests: `fake_smi` writes an
executable nvidia-smi printing given CSV lines (optionally failing, hanging or waiting on a gate file), and
`make_stage` a real unpacked bundle (keyed by its inputs) whose llama-server is a small shell program answering
--list-devices like llama.cpp (SERVERS); `run_probe` runs the probe on them, `cli` the llamabundle command."""

from __future__ import annotations

import hashlib
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from llamabundle import bundle
from llamabundle.bundle.manifest import Manifest
from llamabundle.digest import canonical_json
from llamabundle.log import Log
from llamabundle.runtime.install import install_bundle
from llamabundle.runtime.probe import ProbeResult, probe
from llamabundle.store.local import LocalStore

REPO = Path(__file__).resolve().parents[1]
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
NAME = "linux-x86_64-cuda13.0"
H200 = "NVIDIA H200, 580.95.05, 143771, 143155"
OLD = "NVIDIA GeForce RTX 3060, 551.61, 12288, 11019"
QUIET = Log(quiet=True)
SLEEP = shutil.which("sleep")  # the fakes run with a PATH that holds nothing else

_HEAD = b'#!/bin/sh\nd=$(dirname "$0")\n'
CUDA_LOADED = b'echo "load_backend: loaded CUDA backend from $d/libggml-cuda.so" >&2\n'
CPU_LOADED = b'echo "load_backend: loaded CPU backend from $d/libggml-cpu.so" >&2\n'
SERVERS = {  # llama-server --verbose --list-devices, as llama.cpp answers it (stderr: backends; stdout: devices)
    "ok": _HEAD + CUDA_LOADED + CPU_LOADED + b'echo "Available devices:"\necho "  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"\n',
    "cpu_only": _HEAD + b'echo "ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected" >&2\n'
                + CPU_LOADED + b'echo "Available devices:"\n',
    "no_device": _HEAD + CUDA_LOADED + CPU_LOADED + b'echo "Available devices:"\n',
    "broken": _HEAD + b'echo "$d/llama-server: error while loading shared libraries: libcudart.so.13: cannot open shared '
              b'object file: No such file or directory" >&2\nexit 127\n',
    "outside": _HEAD + b'echo "load_backend: loaded CUDA backend from /usr/lib/libggml-cuda.so" >&2\n' + CPU_LOADED
               + b'echo "Available devices:"\necho "  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"\n',
    "hang": b"#!/bin/sh\nexec sleep 60\n",
    # CPU + CUDA + Vulkan bundles: one H200 seen through both GPU backends; an AMD GPU through Vulkan only;
    # lavapipe only (ggml-vulkan lists no CPU implementation); no Vulkan driver at all (the backend is silent)
    "both": _HEAD + CUDA_LOADED + b'echo "load_backend: loaded Vulkan backend from $d/libggml-vulkan.so" >&2\n' + CPU_LOADED
            + b'echo "Available devices:"\necho "  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"\n'
              b'echo "  Vulkan0: NVIDIA H200 (143155 MiB, 143155 MiB free)"\n',
    "vulkan_amd": _HEAD + b'echo "load_backend: loaded Vulkan backend from $d/libggml-vulkan.so" >&2\n' + CPU_LOADED
                  + b'echo "Available devices:"\necho "  Vulkan0: AMD Radeon RX 7900 XTX (RADV NAVI31) (24560 MiB, 24000 MiB free)"\n',
    "vulkan_lavapipe": _HEAD + b'echo "ggml_vulkan: No devices found." >&2\n'
                       + b'echo "load_backend: loaded Vulkan backend from $d/libggml-vulkan.so" >&2\n' + CPU_LOADED
                       + b'echo "Available devices:"\n',
    "vulkan_silent": _HEAD + CPU_LOADED + b'echo "Available devices:"\n',
}


def make_stage(tmp: Path, *, name: str = NAME, server: str = "ok", backends: tuple[str, ...] = ("cpu", "cuda"),
               floor: str | None = "572.61", toolkit: str = "13.0.2", commit: str = COMMIT, salt: str = "",
               platform: str = "linux-x86_64", parts: bool = False, drivers: str | None = None) -> tuple[Path, Manifest]:
    """An unpacked bundle made with the real helpers; its key is the sha256 of its inputs, as a build's is.
    Returns the typed manifest (bundle.write_manifest's), as read_manifest would read it back. `parts`: it also
    carries CUDA's runtime library and licence, and bundle.json says which files each GPU backend needs.
    `drivers`: the bundle carries a `llamabundle-probe` (in its CPU part) printing this for --drivers and
    exiting 2 for anything else, as a probe older than --drivers does ("exit N" for text: it exits N)."""
    stage = tmp / f"stage-{uuid.uuid4().hex[:8]}"
    stage.mkdir(parents=True)
    files = {"llama-server": (SERVERS[server], "exe"), "libggml-cpu.so": (b"cpu backend\n", "backend"),
             "LICENSE": (b"MIT License\n", "license")}
    if "cuda" in backends:
        files["libggml-cuda.so"] = (b"cuda backend " + salt.encode() + b"\n", "backend")
    if "cuda" in backends and parts:
        files["libcudart.so.13"] = (b"cuda runtime\n" * 1000, "runtime")
        files["LICENSE-CUDA.txt"] = (b"NVIDIA licence\n", "license")
    if "vulkan" in backends:
        files["libggml-vulkan.so"] = (b"vulkan backend\n" * 100, "backend")
    if drivers is not None:
        answer = (f"exit {drivers[5:]}" if drivers.startswith("exit ")
                  else f"cat <<'EOF'\n{drivers}\nEOF\nexit 0")
        files["llamabundle-probe"] = (f'#!/bin/sh\n[ "$1" = --drivers ] || exit 2\n{answer}\n'.encode(), "exe")
    for rel, (data, _role) in files.items():
        (stage / rel).write_bytes(data)
    (stage / "llama-server").chmod(0o755)
    if drivers is not None:
        (stage / "llamabundle-probe").chmod(0o755)
    cuda = {"toolkit": toolkit, "driver_floor": floor} if "cuda" in backends else None
    inputs = {"platform": platform, "commit": commit, "backends": sorted(backends), "cuda": cuda, "salt": salt}
    manifest = bundle.write_manifest(stage, {
        "name": name, "key": hashlib.sha256(canonical_json(inputs).encode()).hexdigest(), "inputs": inputs,
        "platform": platform, "llama_cpp": {"commit": commit, "version": "b6000"}, "backends": sorted(backends),
        "cuda": {**cuda, "archs": {"sass": ["90"], "ptx": ["75"]}} if cuda else None,
        "files": bundle.file_entries(stage, {rel: role for rel, (_d, role) in files.items()}),
        **({"parts": {b: sorted(n for n in files if b in n.lower() and n != "libggml-cpu.so")
                      for b in backends if b != "cpu"}} if parts else {}),
    })
    return stage, manifest


def make_zip(tmp: Path, **kw: Any) -> tuple[Path, Manifest]:
    stage, manifest = make_stage(tmp, **kw)
    return bundle.pack(stage, tmp / f"{manifest.name}-{manifest.key[:12]}.zip", source_date_epoch=0), manifest


def publish(store_root: Path, tmp: Path, **kw: Any) -> Manifest:
    zip_path, manifest = make_zip(tmp, **kw)
    LocalStore(store_root).publish(zip_path, manifest)
    return manifest


def fake_smi(where: Path, *lines: str, rc: int = 0, stderr: str = "", gate: Path | None = None,
             started: Path | None = None, hang: bool = False, calls: Path | None = None) -> Path:
    """An executable `nvidia-smi` printing the CSV lines; optionally it appends its arguments to `calls` (one
    line a call), marks `started` and waits for `gate`."""
    where.mkdir(parents=True, exist_ok=True)
    body = ["#!/bin/sh"] + ([f'echo "$@" >> {shlex.quote(str(calls))}'] if calls else [])
    if started:
        body.append(f": > {shlex.quote(str(started))}")
    if gate:
        body.append(f"while [ ! -e {shlex.quote(str(gate))} ]; do {SLEEP} 0.01; done")
    if hang:
        body.append(f"exec {SLEEP} 60")
    body += [f"echo {shlex.quote(line)}" for line in lines] + ([f"echo {shlex.quote(stderr)} >&2"] if stderr else [])
    body.append(f"exit {rc}")
    exe = where / "nvidia-smi"
    exe.write_text("\n".join(body) + "\n")
    exe.chmod(0o755)
    return exe


def run_probe(tmp: Path, env: dict[str, str], smi: Path | None, **kw: Any) -> ProbeResult:
    kw.setdefault("root", tmp / "data")
    kw.setdefault("cache_dir", tmp / "cache")
    return probe(env=env, nvidia_smi=str(smi) if smi else None, proc_version=kw.pop("proc_version", tmp / "no-proc"), **kw)


def installed(tmp: Path, **kw: Any) -> Manifest:
    m = publish(tmp / "store", tmp, **kw)
    install_bundle(LocalStore(tmp / "store"), m.key, root=tmp / "data", log=QUIET)
    return m


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llamabundle", *args], capture_output=True, text=True, cwd=REPO, check=False,
                          env={**env, "PYTHONPATH": str(REPO), "NO_COLOR": "1"}, timeout=120)
