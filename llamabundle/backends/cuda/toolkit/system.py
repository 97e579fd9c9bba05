"""An installed CUDA toolkit (CUDA_PATH, nvcc on PATH, /usr/local/cuda): used only when its version
equals the recipe's."""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from .... import data, proc, untrusted
from .layout import Toolkit

DEFAULT_ROOTS = (Path("/usr/local/cuda"), Path("C:/Program Files/NVIDIA GPU Computing Toolkit/CUDA"))


def candidates(env: Mapping[str, str], defaults: Sequence[Path] = DEFAULT_ROOTS) -> list[Path]:
    roots: list[Path] = []
    for var in ("CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"):
        if env.get(var):
            roots.append(Path(env[var]))
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        roots.append(Path(nvcc).resolve().parent.parent)
    roots += list(defaults)
    seen: list[Path] = []
    for r in roots:
        if r not in seen:
            seen.append(r)
    return seen


def installed_version(root: Path, want: str | None = None) -> str | None:
    """The release label of a toolkit install: version.json's cuda.version, else nvcc's 'release X.Y'."""
    vj = root / "version.json"
    if vj.is_file():
        try:
            return str(untrusted.read(vj)["cuda"]["version"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    nvcc = root / "bin" / "nvcc"
    if nvcc.is_file():
        out = proc.capture([str(nvcc), "--version"]).stdout
        m = re.search(r"release (\d+\.\d+), V(\d+\.\d+\.\d+)", out)
        if m:  # no version.json (a distro or container install): nvcc's own version names the release
            for label in ([want] if want in data.cuda_toolkits() else []) + list(data.cuda_toolkits()):
                if data.cuda_manifest(label)["cuda_nvcc"]["version"] == m.group(2):
                    return label
            return m.group(1)
    return None


def find_system_toolkit(version: str, platform: str, env: Mapping[str, str],
                        defaults: Sequence[Path] = DEFAULT_ROOTS) -> tuple[Toolkit | None, list[str]]:
    """(toolkit, notes): the first installed toolkit whose version equals `version`, and what was seen."""
    notes: list[str] = []
    for root in candidates(env, defaults):
        if not root.is_dir():
            continue
        found = installed_version(root, want=version)
        if found == version:
            return Toolkit(root=root, version=version, source="system", platform=platform), notes
        notes.append(f"{root}: CUDA {found or 'unknown version'}")
    return None, notes
