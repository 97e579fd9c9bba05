"""Verification levels (DESIGN §7): manifest, static (imports resolve), load (llama-server loads
its backends from inside the bundle)."""

from __future__ import annotations

import platform as host_platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from . import bundle as bundle_mod
from .deps import elf
from .deps.policy import LibClass, linux_policy
from .errors import VerifyError

LOAD_TIMEOUT = 120
_LOADED = re.compile(r"load_backend: loaded (\S+) backend from (.+?)\s*$")
_DEVICE = re.compile(r"^\s+(\S+): (.+)$")


class Level(StrEnum):
    STATIC = "static"
    LOAD = "load"


@dataclass(kw_only=True)
class VerifyReport:
    path: str
    key: str
    platform: str
    files: int
    bytes: int
    levels: dict[str, str] = field(default_factory=dict)  # level -> passed | skipped: reason
    backends_loaded: dict[str, str] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, **asdict(self)}

    def lines(self) -> list[str]:
        """The human summary: one line per level, loaded backend and device."""
        out = [f"{level}: {result}" for level, result in self.levels.items()]
        out += [f"{name} backend loaded from {where}" for name, where in self.backends_loaded.items()]
        out += [f"device {dev}" for dev in self.devices]
        return out


def host_platform_name() -> str:
    system = {"Linux": "linux", "Windows": "windows"}.get(host_platform.system(), host_platform.system().lower())
    machine = {"AMD64": "x86_64", "x86_64": "x86_64"}.get(host_platform.machine(), host_platform.machine())
    return f"{system}-{machine}"


def verify_bundle(path: Path, *, level: Level) -> VerifyReport:
    """Verify a bundle zip or directory up to `level`. Raises VerifyError naming what failed."""
    with tempfile.TemporaryDirectory(prefix="llamabundle-verify-") as tmp:
        if path.is_file():
            root = Path(tmp) / "bundle"
            manifest = bundle_mod.unpack(path, root)
            check = bundle_mod.ContentCheck(files=len(manifest["files"]), bytes=sum(f["size"] for f in manifest["files"]))
        elif path.is_dir():
            manifest = bundle_mod.read_manifest(path)
            check = bundle_mod.check_contents(path, manifest)
            root = Path(tmp) / "bundle"
            if level is Level.LOAD:  # run a copy, never the original
                shutil.copytree(path, root, symlinks=False)
            else:
                root = path
        else:
            raise VerifyError(f"{path} does not exist", fix="pass a bundle zip or an unpacked bundle directory")
        report = VerifyReport(path=str(path), key=manifest["key"], platform=manifest["platform"],
                              files=check.files, bytes=check.bytes)
        report.levels["manifest"] = "passed"
        check_static(root, manifest)
        report.levels["static"] = "passed"
        if level is Level.LOAD:
            check_load(root, manifest, report)
        return report


def check_static(root: Path, manifest: dict[str, Any]) -> None:
    """Every import of every binary resolves inside the bundle, in the system allowlist or the driver set."""
    if not manifest["platform"].startswith("linux"):
        raise VerifyError(f"static verification of {manifest['platform']} bundles is not supported yet",
                          fix="verify it on a llamabundle version with PE support")
    policy = linux_policy()
    present = {f["path"] for f in manifest["files"]}
    for entry in manifest["files"]:
        f = root / entry["path"]
        if not elf.is_elf(f):
            continue
        info = elf.read_elf(f)
        for dep in info.needed:
            if dep in present or policy.classify(dep) is not LibClass.OTHER:
                continue
            raise VerifyError(f"{entry['path']} needs {dep}, which is neither in the bundle nor a system or driver library",
                              why="the bundle would fail to load on a clean machine", fix="rebuild the bundle")
        bad = [p for p in info.runpath if p not in ("$ORIGIN", "${ORIGIN}")]
        if bad:
            raise VerifyError(f"{entry['path']} has RUNPATH {':'.join(info.runpath)}",
                              why="only $ORIGIN keeps a bundle relocatable", fix="rebuild the bundle")


def check_load(root: Path, manifest: dict[str, Any], report: VerifyReport) -> None:
    if manifest["platform"] != host_platform_name():
        report.levels["load"] = f"skipped: a {manifest['platform']} bundle cannot run on {host_platform_name()}"
        return
    exe_name = "llama-server.exe" if manifest["platform"].startswith("windows") else "llama-server"
    exe = root / exe_name
    if not exe.is_file():
        raise VerifyError(f"the bundle has no {exe_name}", fix="include llama-server in the recipe's targets")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8", "TMPDIR": str(root.parent)}
    try:
        proc = subprocess.run([str(exe), "--verbose", "--list-devices"], cwd=root.parent, env=env, capture_output=True,
                              text=True, errors="replace", timeout=LOAD_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise VerifyError(f"{exe_name} --list-devices did not finish in {LOAD_TIMEOUT}s") from None
    except OSError as e:
        raise VerifyError(f"{exe_name} could not be started", why=str(e)) from None
    tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-20:])
    if proc.returncode != 0:
        raise VerifyError(f"{exe_name} --list-devices exited with {proc.returncode}",
                          why="the bundle does not load in a clean environment", details=tail)
    inside = root.resolve()
    for line in (proc.stderr + proc.stdout).splitlines():
        m = _LOADED.search(line)
        if m:
            report.backends_loaded[m.group(1)] = m.group(2)
    cpu = report.backends_loaded.get("CPU")
    if cpu is None:
        raise VerifyError(f"{exe_name} did not load a CPU backend", why="no 'loaded CPU backend from' line",
                          details=tail)
    if not Path(cpu).resolve().is_relative_to(inside):
        raise VerifyError(f"the CPU backend was loaded from {cpu}, outside the bundle",
                          why="a library outside the bundle shadows the bundled one", details=tail)
    in_list = False
    for line in proc.stdout.splitlines():
        if line.startswith("Available devices"):
            in_list = True
            continue
        m = _DEVICE.match(line)
        if in_list and m:
            report.devices.append(f"{m.group(1)}: {m.group(2)}")
    report.levels["load"] = "passed"
