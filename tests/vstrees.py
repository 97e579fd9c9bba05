"""Visual Studio as llamabundle sees it from Linux, for the MSVC tests: `make_vs` lays out an installation's
tree (the parts llamabundle reads) in a temp dir, and `recorded` gives a recorded vswhere output
(tests/data/vswhere) with each installationPath pointed at such a tree."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

RECORDED = Path(__file__).resolve().parent / "data" / "vswhere"
CRT = ("concrt140.dll", "msvcp140.dll", "msvcp140_1.dll", "msvcp140_2.dll", "msvcp140_atomic_wait.dll",
       "msvcp140_codecvt_ids.dll", "vccorlib140.dll", "vcruntime140.dll", "vcruntime140_1.dll")
PLACEHOLDER = b"MZ placeholder: the redist file's bytes do not matter here"


def make_vs(root: Path, *, tools: Sequence[str] = ("14.44.35207",), default: str | None = None,
            redist: str = "14.44.35112", crt_dir: str = "Microsoft.VC143.CRT", dll: bytes = PLACEHOLDER) -> Path:
    """A Visual Studio installation as the installer lays it out (only the parts llamabundle reads)."""
    build = root / "VC" / "Auxiliary" / "Build"
    build.mkdir(parents=True)
    (build / "vcvars64.bat").write_text('@call "%~dp0vcvarsall.bat" x64 %*\r\n')
    (build / "Microsoft.VCToolsVersion.default.txt").write_text((default or tools[-1]) + "\r\n", encoding="utf-8-sig")
    (build / "Microsoft.VCRedistVersion.default.txt").write_text(redist + "\r\n")
    for t in tools:
        (root / "VC" / "Tools" / "MSVC" / t / "bin" / "Hostx64" / "x64").mkdir(parents=True)
    r = root / "VC" / "Redist" / "MSVC" / redist
    for rel, names in {f"x64/{crt_dir}": CRT, f"x64/{crt_dir[:-4]}.OpenMP": ("vcomp140.dll",),
                       f"debug_nonredist/x64/{crt_dir[:-4]}.OpenMP.LLVM": ("libomp140.x86_64.dll",),
                       f"debug_nonredist/x64/{crt_dir[:-4]}.DebugCRT": ("msvcp140d.dll", "vcruntime140d.dll"),
                       f"onecore/x64/{crt_dir}": CRT, f"onecore/x64/{crt_dir[:-4]}.OpenMP": ("vcomp140.dll",)}.items():
        (r / rel).mkdir(parents=True)
        for n in names:
            (r / rel / n).write_bytes(dll)
    return root


def recorded(name: str, trees: Mapping[str, Path] = {}) -> str:
    """A recording, with each installationPath pointed at the tree made for its instanceId."""
    items = json.loads((RECORDED / name).read_text(encoding="utf-8"))
    for i in items:
        if i["instanceId"] in trees:
            i["installationPath"] = str(trees[i["instanceId"]])
    return json.dumps(items, indent=2)
