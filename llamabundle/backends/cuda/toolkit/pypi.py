"""CUDA toolkit from NVIDIA's PyPI wheels (`cuda.source: pypi`): plan (pure, from data/cuda_pypi.json)
and install (each wheel by URL from the package index, sha256-checked as it streams → safe extraction →
the one layout of layout.py).

The wheels hold their files under `nvidia/cu13/{bin,include,lib,nvvm}`; that tree is flattened into
the toolkit root. Wheels carry no symbolic links, so the development names CMake looks for
(`libcudart.so` → `libcudart.so.13`) and `lib64 -> lib` are created, and — as the Linux wheels have
no `lib/stubs/libcuda.so` — a driver stub is generated from `cuda.h` with the host C compiler.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from filelock import FileLock

from .... import data, net, platforms, proc, pyindex
from ....archive import extract_zip
from ....digest import sha256_file, sha256_json
from ....errors import ToolchainError, VerifyError
from ....log import Log
from ....settings import Settings
from . import layout
from .plan import check_components

SOURCE = "pypi"
_SONAME_FILE = re.compile(r"^(lib.+?\.so)\.[0-9]+(\.[0-9]+)*$")


@dataclass(frozen=True, kw_only=True)
class WheelRecord:
    """One wheel to install: a redist component's PyPI project at that component's exact version."""

    component: str
    project: str
    version: str
    filename: str
    sha256: str
    size: int


@cache
def pypi_data() -> dict[str, Any]:
    info: dict[str, Any] = json.loads(resources.files(data).joinpath("cuda_pypi.json").read_text(encoding="utf-8"))
    for version, tk in info["toolkits"].items():
        assert not set(tk["wheels"]) & set(tk["missing"]), version
        for comp, wheel in tk["wheels"].items():
            assert set(wheel) == {"project", "version", "files"}, (version, comp)
            for f in wheel["files"].values():
                assert re.fullmatch(r"[0-9a-f]{64}", f["sha256"]) and f["filename"].endswith(".whl"), (version, comp)
    return info


def pypi_versions() -> list[str]:
    return sorted(pypi_data()["toolkits"])


def plan_pypi(version: str, platform: str, components: Sequence[str]) -> list[WheelRecord]:
    """The wheels that install `components` (plus what they require) of CUDA `version` on `platform`,
    sorted by component. Pure: reads only the packaged data. Raises ToolchainError naming every
    component that cannot come from PyPI."""
    info = pypi_data()
    tk = info["toolkits"].get(version)
    if tk is None:
        raise ToolchainError(f"CUDA {version} is not available from PyPI wheels",
                             why=f"llamabundle knows the PyPI wheels of CUDA {', '.join(pypi_versions())}",
                             fix="use one of those toolkit versions, or `cuda.source: redist`")
    if not components:
        raise ToolchainError(f"no CUDA components requested for CUDA {version}", fix="list components in `cuda.components`")
    wanted = sorted(set(components))
    seen: set[str] = set()
    todo = list(wanted)
    while todo:  # closure over `requires` (data, not code branches)
        comp = todo.pop()
        if comp in seen:
            continue
        seen.add(comp)
        todo.extend(info["requires"].get(comp, ()))
    unknown: list[str] = []
    missing: list[str] = []
    no_platform: list[str] = []
    records: list[WheelRecord] = []
    for comp in sorted(seen):
        wheel = tk["wheels"].get(comp)
        if wheel is None:
            (missing if comp in tk["missing"] else unknown).append(comp)
            continue
        f = wheel["files"].get(platform)
        if f is None:
            no_platform.append(comp)
            continue
        records.append(WheelRecord(component=comp, project=wheel["project"], version=wheel["version"],
                                   filename=f["filename"], sha256=f["sha256"], size=int(f["size"])))
    problems = []
    for comp in missing:
        problems.append(f"{comp}: {tk['missing'][comp]}")
    for comp in no_platform:
        problems.append(f"{comp}: no {platform} wheel of {tk['wheels'][comp]['project']}=={tk['wheels'][comp]['version']}")
    for comp in unknown:
        problems.append(f"{comp}: not a component with a PyPI wheel in CUDA {version}")
    if problems:
        bad = [*missing, *no_platform, *unknown]
        raise ToolchainError(f"CUDA {version} from PyPI cannot provide {', '.join(bad)} for {platform}",
                             why="; ".join(problems),
                             fix=f"drop {'it' if len(bad) == 1 else 'them'} from `cuda.components` or use "
                                 f"`cuda.source: redist`; PyPI has: {', '.join(sorted(tk['wheels']))}")
    return records


def plan_pin(records: Sequence[WheelRecord]) -> str:
    """sha256 of the canonical JSON of the wheel records: the content address of an install."""
    return sha256_json([dataclasses.asdict(r) for r in records])


def default_root(settings: Settings, *, version: str, platform: str, records: Sequence[WheelRecord]) -> Path:
    return layout.toolkit_root(settings.cache_dir, version=version, platform=platform, source=SOURCE,
                               components=[r.component for r in records], pin=plan_pin(records))


# ------------------------------------------------------------------------------------------ install


def install_from_pypi(*, version: str, platform: str, components: Sequence[str], settings: Settings, log: Log,
                      dest: Path | None = None) -> layout.Toolkit:
    """Install the wheels of `components` into the content-addressed root (or `dest`) and return it.

    A complete install of the same set is verified (layout.read_installed) and returned without a
    download. Otherwise: cached wheels are re-hashed and reused, the rest come from the
    package index by URL, checked against their pinned sha256, and the root is assembled beside its final place, marker last, then renamed."""
    check_components(components)  # before any download: a set without cuda_nvcc would install and then fail its check
    records = plan_pypi(version, platform, components)
    root = dest if dest is not None else default_root(settings, version=version, platform=platform, records=records)
    root = Path(os.path.abspath(root))
    lock_dir = settings.cache_dir / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    lock_name = f"toolkit-{root.name}-{hashlib.sha256(str(root).encode()).hexdigest()[:8]}.lock"
    with FileLock(str(lock_dir / lock_name)):
        have = layout.read_installed(root)
        if have is not None:
            want = {r.component: r.version for r in records}
            held = (layout.read_marker(root) or {}).get("components")
            if (have.version, have.platform, have.source, held) != (version, platform, SOURCE, want):
                raise ToolchainError(f"{root} holds another toolkit: CUDA {have.version} ({have.source}, {have.platform}) "
                                     f"with {', '.join(sorted(held or {}))}",
                                     why=f"asked for CUDA {version} from {SOURCE} for {platform} with {', '.join(want)}",
                                     fix=f"remove {root} or install somewhere else")
            log.info(f"    CUDA {version} ({SOURCE}): {root} is installed")
            return have
        with log.step(f"CUDA {version} from PyPI: {len(records)} wheels → {root}"):
            wheels = _fetch_wheels(records, settings=settings, log=log, platform=platform)
            for stale in root.parent.glob(f".{root.name}.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if root.exists() or root.is_symlink():
                log.warn(f"removing the incomplete toolkit in {root}")
                if root.is_dir() and not root.is_symlink():
                    shutil.rmtree(root)
                else:
                    root.unlink()
            tmp = root.parent / f".{root.name}.partial-{os.getpid()}"
            tmp.mkdir(parents=True)
            try:
                _assemble(tmp, records, wheels, version=version, platform=platform, settings=settings, log=log)
                os.replace(tmp, root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        tk = layout.read_installed(root)
        assert tk is not None
        return tk


def download_dir(settings: Settings, record: WheelRecord) -> Path:
    return settings.cache_dir / "downloads" / record.sha256


def _fetch_wheels(records: Sequence[WheelRecord], *, settings: Settings, log: Log, platform: str) -> dict[str, Path]:
    """Every record's wheel in `<cache>/downloads/<sha256>/`: cached ones after a re-hash, the rest from the index."""
    found: dict[str, Path] = {}
    need: list[WheelRecord] = []
    for r in records:
        cached = download_dir(settings, r) / r.filename
        if cached.is_file():
            got = sha256_file(cached)
            if got == r.sha256:
                found[r.component] = cached
                continue
            log.warn(f"{cached} has sha256 {got}, not the pinned {r.sha256}: not trusted, downloading it again")
            cached.unlink()
        need.append(r)
    if need:
        total = sum(r.size for r in need)
        log.info(f"    downloading {len(need)} wheels ({total / 1e6:.1f} MB) from "
                 f"{settings.pip_index_url or pyindex.DEFAULT_INDEX}")
        found.update(_download_wheels(need, settings=settings, log=log))
    return found


def _download_wheels(records: Sequence[WheelRecord], *, settings: Settings, log: Log) -> dict[str, Path]:
    """Each wheel by URL from the index's project page, checked against its pinned sha256 and size
    while it streams (net.download: resumable, retried, with progress)."""
    http = net.session()
    pages: dict[str, list[pyindex.IndexFile]] = {}
    result: dict[str, Path] = {}
    for i, r in enumerate(records, 1):
        if r.project not in pages:
            pages[r.project] = pyindex.project_files(r.project, index_url=settings.pip_index_url, http=http,
                                                     connect_timeout=settings.connect_timeout)
        log.info(f"    wheel {i}/{len(records)}: {r.filename} ({r.size / 1e6:.1f} MB)")
        result[r.component] = pyindex.download_pinned(
            r.project, r.filename, sha256=r.sha256, size=r.size, dest_dir=download_dir(settings, r),
            index_url=settings.pip_index_url, http=http, log=log, connect_timeout=settings.connect_timeout,
            files=pages[r.project])
    return result


def _assemble(root: Path, records: Sequence[WheelRecord], wheels: dict[str, Path], *, version: str, platform: str,
              settings: Settings, log: Log) -> None:
    info = pypi_data()
    prefix = PurePosixPath(info["prefix"])
    drop = tuple(info["drop"])
    owner: dict[str, str] = {}
    work = root / ".llamabundle-extract"
    for r in records:
        unpacked = work / r.component
        try:
            extract_zip(wheels[r.component], unpacked)
        except VerifyError as e:
            raise VerifyError(f"wheel {r.filename} was refused", why=e.what, fix="remove it from the download cache "
                              f"({wheels[r.component].parent}) and install again") from None
        tree = unpacked.joinpath(*prefix.parts)
        if not tree.is_dir():
            raise ToolchainError(f"wheel {r.filename} has no {prefix}/ tree",
                                 why="its layout is not the one llamabundle knows for CUDA 13 wheels",
                                 fix="report this: data/cuda_pypi.json needs the wheel's layout")
        for src in sorted(p for p in tree.rglob("*") if p.is_file()):
            rel = src.relative_to(tree).as_posix()
            if rel.startswith(drop):
                continue
            target = root / rel
            if target.exists():
                if sha256_file(target) != sha256_file(src):
                    raise ToolchainError(f"wheels {owner[rel]} and {r.component} both hold {rel}, with different bytes",
                                         fix="install fewer components; report the conflict")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, target)
            owner[rel] = r.component
        licenses = sorted(p for p in unpacked.glob("*.dist-info/licenses/**/*") if p.is_file()) or \
            sorted(p for p in unpacked.glob("*.dist-info/*") if p.is_file() and p.name.upper().startswith(("LICENSE", "LICENCE")))
        if not licenses:
            raise ToolchainError(f"wheel {r.filename} carries no license file",
                                 why="every toolkit component ships with NVIDIA's license",
                                 fix="report this: the wheel is not the expected one")
        (root / f"LICENSE.{r.component}").write_bytes(b"\n".join(p.read_bytes() for p in licenses))
        shutil.rmtree(unpacked)
    shutil.rmtree(work, ignore_errors=True)

    for d in info["executable_dirs"]:
        for p in sorted((root / d).glob("*")) if (root / d).is_dir() else ():
            if p.is_file() and not p.is_symlink() and _is_program(p):
                p.chmod(0o755)
    if platforms.get(platform).system != "windows":
        _link_sonames(root / "lib")
        if (root / "lib").is_dir() and not (root / "lib64").exists():
            os.symlink("lib", root / "lib64")
        stub = info.get("driver_stub")
        if stub and platform in stub["platforms"] and any(r.component == stub["component"] for r in records):
            _driver_stub(root, stub, settings=settings, log=log)

    layout.write_version_json(root, version=version, components={r.component: r.version for r in records})
    layout.write_marker(root, version=version, platform=platform, source=SOURCE,
                        components={r.component: r.version for r in records})


def _is_program(path: Path) -> bool:
    if path.suffix.lower() in (".exe", ".dll", ".bat", ".cmd"):
        return True
    with open(path, "rb") as f:
        head = f.read(4)
    return head == b"\x7fELF" or head[:2] == b"#!"


def _link_sonames(lib: Path) -> None:
    """`libX.so -> libX.so.N` for each versioned library lacking its development name (the shortest
    version wins: libnvrtc-builtins.so -> libnvrtc-builtins.so.13.0)."""
    if not lib.is_dir():
        return
    best: dict[str, str] = {}
    for p in sorted(lib.iterdir()):
        m = _SONAME_FILE.match(p.name)
        if m and p.is_file():
            dev = m.group(1)
            if dev not in best or len(p.name) < len(best[dev]):
                best[dev] = p.name
    for dev, target in sorted(best.items()):
        if not (lib / dev).exists() and not (lib / dev).is_symlink():
            os.symlink(target, lib / dev)


def driver_symbols(header_text: str) -> list[str]:
    """Every driver API entry point cuda.h names: declarations, `#define cuX cuX_v2` versions and the
    per-thread-stream (_ptds/_ptsz) variants."""
    names = set(re.findall(r"\bCUDAAPI\s+(cu[A-Za-z0-9_]+)\s*\(", header_text))
    for a, b in re.findall(r"^[ \t]*#[ \t]*define[ \t]+(cu[A-Za-z0-9_]+)[ \t]+(cu[A-Za-z0-9_]+)[ \t]*$", header_text, re.M):
        names.update((a, b))
    for _, kind, inner in re.findall(r"^[ \t]*#[ \t]*define[ \t]+(cu[A-Za-z0-9_]+)[ \t]+__CUDA_API_PT(DS|SZ)\((cu[A-Za-z0-9_]+)\)",
                                     header_text, re.M):
        names.update((inner, f"{inner}_pt{kind.lower()}"))
    return sorted(names)


def _driver_stub(root: Path, stub: dict[str, Any], *, settings: Settings, log: Log) -> None:
    """lib/stubs/libcuda.so as the redist cudart ships it: every driver entry point, returning
    CUDA_ERROR_STUB_LIBRARY (34), SONAME libcuda.so.1 — for linking only, never for running."""
    header = root / stub["header"]
    if not header.is_file():
        raise ToolchainError(f"{stub['header']} is missing from the {stub['component']} wheel",
                             fix="report this: the driver stub is generated from it")
    names = driver_symbols(header.read_text(encoding="utf-8", errors="replace"))
    if not names:
        raise ToolchainError(f"{stub['header']} declares no driver API functions", fix="report this")
    cc = shutil.which("cc") or proc.which("gcc", purpose="to generate the libcuda.so link stub",
                                          fix="install a C compiler (gcc)")
    out = root / stub["path"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".cuda-stub-") as tmp_s:
        src = Path(tmp_s) / "libcuda_stub.c"
        src.write_text("/* generated by llamabundle from cuda.h: a link-time stub of the CUDA driver */\n"
                       + "".join(f"int {n}(void) {{ return 34; }}\n" for n in names), encoding="utf-8")
        proc.run([cc, "-shared", "-fPIC", "-nostdlib", "-O0", f"-Wl,-soname,{stub['soname']}", "-o", str(out), str(src)],
                 log=log, error=ToolchainError, what="generating the libcuda.so link stub", timeout=300)
    out.chmod(0o755)
