"""verify's ops level: numbers, not only a device list. llama.cpp's own `test-backend-ops` (built beside the
bundle from the same build tree by `build --ops-tool`, never shipped inside it) is copied into the unpacked
bundle for the run only, and run from there against each GPU device the bundle lists, comparing it with the
bundle's CPU backend, over a bounded set of the operations inference uses, within a time budget. The report
gives per-device pass/fail counts and the failing cases."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import cache, proc
from .backends.base import RunEnv
from .errors import UsageError, VerifyError

TOOL = "test-backend-ops"
OPS = ("MUL_MAT", "MUL_MAT_ID", "FLASH_ATTN_EXT", "SOFT_MAX", "ROPE", "RMS_NORM", "GET_ROWS", "CPY", "ADD", "MUL",
       "SCALE", "GLU", "UNARY")
DEFAULT_BUDGET = 300.0  # seconds for all devices together
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CASE = re.compile(r"^\s+([A-Z][A-Z0-9_]*)\((.*)\): (.*)$")
# the device variables a caller may set for this run (GGML_VK_VISIBLE_DEVICES=0 makes lavapipe a device)
DEVICE_ENV = ("GGML_VK_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


@dataclass(kw_only=True)
class DeviceOps:
    """test-backend-ops' result for one device."""

    device: str
    serves: str | None = None  # an RPC device: the device of this machine its server serves
    passed: int = 0
    failed: int = 0
    not_supported: int = 0
    ops_run: list[str] = field(default_factory=list)
    ops_left: list[str] = field(default_factory=list)  # not reached within the budget
    failures: list[str] = field(default_factory=list)  # the failing cases, as test-backend-ops names them
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "serves" or v is not None}

    def summary(self) -> str:
        left = f"; {len(self.ops_left)} ops not reached in the budget ({', '.join(self.ops_left)})" if self.ops_left else ""
        return (f"{self.device}{f' (serving {self.serves})' if self.serves else ''}: {self.passed} passed, {self.failed} failed, {self.not_supported} not supported "
                f"over {', '.join(self.ops_run) or 'no op'} in {self.seconds:.0f}s{left}")


def sibling_tool(bundle: Path) -> Path:
    """Where `build --ops-tool` puts the tool of a bundle zip: `<name>.test-backend-ops` beside it."""
    return cache.sibling(bundle, cache.OPS_TOOL_SUFFIX)


def read_cases(text: str, into: DeviceOps) -> None:
    """Count test-backend-ops' console lines: `  OP(params): OK | FAIL | not supported [...]`."""
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).rstrip()
        m = _CASE.match(line)
        if not m:
            continue
        verdict = m.group(3)
        if verdict.endswith("OK"):
            into.passed += 1
        elif verdict.endswith("FAIL"):
            into.failed += 1
            into.failures.append(f"{m.group(1)}({m.group(2)})" + (f": {verdict[:-4].strip()}" if verdict[:-4].strip() else ""))
        elif verdict.startswith("not supported"):
            into.not_supported += 1


def run_ops(root: Path, tool: Path, devices: list[str], *, env: dict[str, str], budget: float = DEFAULT_BUDGET,
            ops: tuple[str, ...] = OPS, device_runs: Mapping[str, RunEnv] | None = None) -> list[DeviceOps]:
    """Run the tool from inside `root` against each device, op by op, within the budget (shared evenly among
    the devices, and within a device among the ops still to run, so that a slow op cannot starve the others),
    in `env` and what the device's own `device_runs` gives each run (an RPC device: the preload, and a server for
    the run). The tool is removed from `root` afterwards."""
    if not tool.is_file():
        raise UsageError(f"no {TOOL} at {tool}", why="the ops level runs llama.cpp's test-backend-ops from the same build",
                         fix="build with `llamabundle build RECIPE --ops-tool` (it writes <zip>.test-backend-ops beside "
                             "the zip), or pass --ops-tool PATH")
    inside = root / TOOL
    shutil.copy2(tool, inside)
    inside.chmod(0o755)
    results = []
    try:
        per_device = budget / max(len(devices), 1)
        for dev in devices:
            r = DeviceOps(device=dev)
            start = time.monotonic()
            for i, op in enumerate(ops):
                device_left = per_device - (time.monotonic() - start)
                if device_left <= 1:
                    r.ops_left = list(ops[i:])
                    break
                slot = device_left / (len(ops) - i)  # a fair share of what is left: every op is reached
                try:
                    with (device_runs or {}).get(dev, _nothing)() as extra:  # a failure is raised inside: what
                        # lives for the run (RPC's server) adds its words to it
                        out = proc.capture([str(inside), "test", "-b", dev, "-o", op], cwd=root, env={**env, **extra},
                                           timeout=slot)
                        text = out.stdout + out.stderr
                        if out.returncode not in (0, 1):
                            raise VerifyError(f"{TOOL} -b {dev} -o {op} exited with {out.returncode}",
                                              details="\n".join(text.strip().splitlines()[-15:]))
                except proc.Timeout as t:  # its share ran out: what it did counts, the next op goes on
                    read_cases(_text(t.output) + _text(t.stderr), r)
                    r.ops_run.append(op + " (partly)")
                    continue
                read_cases(text, r)
                r.ops_run.append(op)
            r.seconds = time.monotonic() - start
            results.append(r)
    finally:
        inside.unlink(missing_ok=True)
    return results


def _nothing() -> AbstractContextManager[Mapping[str, str]]:
    return nullcontext({})


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode("utf-8", "replace")
