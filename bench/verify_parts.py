"""Where a bundle's load check spends its time (issue 34: the cache-hit build's verify): each program the load
level runs from inside an unpacked bundle, alone, in the clean environment verify gives it, median of --repeat runs:

- probe: `llamabundle-probe` (every backend module opened, scored and loaded; the devices);
- list: `llama-server --verbose --list-devices`;
- list, no GPU: the same with CUDA_VISIBLE_DEVICES and GGML_VK_VISIBLE_DEVICES empty (the GPU backends load,
  their devices are hidden);
- rpc-server listening: from its start to its first accepted connection (a bundle with rpc);
- rpc client: `llama-server --rpc HOST:PORT --list-devices` against it (served device: the server's choice);
- rpc client, no GPU: the client with its GPUs hidden; rpc, CPU served: the server started with `-d CPU`;
- static, load: `llamabundle verify DIR --level static` and `--level load` (this tree's code, as a user runs it).

    python -m bench.verify_parts BUNDLE_DIR [--repeat N] [--json] [--json-out FILE]"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import add_json_args, emit_json
from llamabundle.backends import rpc
from llamabundle.platforms import load

HIDE = {"CUDA_VISIBLE_DEVICES": "", "GGML_VK_VISIBLE_DEVICES": ""}


def timed(argv: list[str], *, root: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=root.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300,
                   check=False)
    return time.perf_counter() - t0


def with_server(root: Path, env: dict[str, str], *, devices: tuple[str, ...] = (),
                client: Callable[[str], float] | None = None) -> float:
    """The server's seconds to listen, or (with `client`) the client's seconds against it."""
    port = rpc.free_port()
    argv = [str(root / rpc.SERVER), "-H", rpc.LOOPBACK, "-p", str(port), *(["-d", ",".join(devices)] if devices else [])]
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, cwd=root.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rpc.wait_listening(port, p.poll, log_path=root.parent / ".none", timeout=60)
        listening = time.perf_counter() - t0
        return client(f"{rpc.LOOPBACK}:{port}") if client is not None else listening
    finally:
        p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    add_json_args(ap)
    a = ap.parse_args()
    root = a.bundle.resolve()
    env = load.clean_env(root)
    server = [str(root / "llama-server")]
    parts: dict[str, Callable[[], float]] = {
        "probe": lambda: timed([str(root / "llamabundle-probe")], root=root, env=env),
        "list": lambda: timed([*server, "--verbose", "--list-devices"], root=root, env=env),
        "list, no GPU": lambda: timed([*server, "--verbose", "--list-devices"], root=root, env={**env, **HIDE}),
    }
    if (root / rpc.SERVER).is_file():
        parts |= {
            "rpc-server listening": lambda: with_server(root, env),
            "rpc client": lambda: with_server(root, env, client=lambda ep: timed(
                [*server, "--rpc", ep, "--list-devices"], root=root, env=env)),
            "rpc client, no GPU": lambda: with_server(root, env, client=lambda ep: timed(
                [*server, "--rpc", ep, "--list-devices"], root=root, env={**env, **HIDE})),
            "rpc, CPU served": lambda: with_server(root, env, devices=("CPU",), client=lambda ep: timed(
                [*server, "--rpc", ep, "--list-devices"], root=root, env=env)),
        }
    lb = [sys.executable, "-m", "llamabundle", "--quiet", "verify", str(root)]
    parts |= {"static": lambda: timed([*lb, "--level", "static"], root=root, env=dict(os.environ)),
              "load": lambda: timed([*lb, "--level", "load"], root=root, env=dict(os.environ))}
    seconds = {name: [run() for _ in range(a.repeat)] for name, run in parts.items()}
    median = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"{root.name}: median of {a.repeat}")
    for name, m in median.items():
        print(f"{name:24s} {m:6.2f} s")
    emit_json(a, {"benchmark": "verify_parts", "bundle": str(root), "repeat": a.repeat, "seconds": seconds,
                  "median": median})


if __name__ == "__main__":
    main()
