"""NVIDIA's CUDA redist manifests (``redistrib_<version>.json``): what each component's archive is called,
how big it is and its sha256, per platform. The manifests shipped in ``llamabundle/data/cuda/`` are the pin:
by default nothing else is trusted. An explicit manifest (a path or an already-parsed dict) can be passed
instead, for mirrors and tests (docs/cuda-toolkit.md shows one)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from .... import data, untrusted
from ....errors import ToolchainError

PLATFORMS = ("linux-x86_64", "windows-x86_64")  # those NVIDIA ships toolkits for (a subset of platforms.NAMES)
ARCHIVE_SUFFIXES = (".tar.xz", ".zip")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_COMPONENT = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True, kw_only=True)
class Archive:
    """One component's archive for one platform, as the manifest pins it."""

    component: str
    version: str
    platform: str
    relative_path: str
    sha256: str
    size: int
    license_path: str | None = None

    @property
    def name(self) -> str:
        return PurePosixPath(self.relative_path).name

    @property
    def kind(self) -> str:
        return "zip" if self.name.endswith(".zip") else "tar"

    def url(self, base_url: str) -> str:
        return base_url.rstrip("/") + "/" + self.relative_path


@dataclass(frozen=True, kw_only=True)
class Manifest:
    release: str  # the manifest's release_label, e.g. "12.8.1"
    components: Mapping[str, Mapping[str, Any]]
    pin: str  # sha256 of the manifest's canonical JSON: part of a toolkit root's content address
    origin: str  # where it came from, for messages

    def archive(self, component: str, platform: str) -> Archive:
        info = self.components.get(component)
        if info is None:
            near = ", ".join(sorted(c for c in self.components if c.split("_")[-1] in component)[:5])
            raise ToolchainError(f"'{component}' is not a component of CUDA {self.release}",
                                 why=f"the manifest {self.origin} does not list it",
                                 fix=f"use a component from the manifest{' (e.g. ' + near + ')' if near else ''}")
        entry = info.get(platform)
        if not isinstance(entry, Mapping):
            have = ", ".join(p for p in info if isinstance(info[p], Mapping)) or "none"
            raise ToolchainError(f"CUDA {self.release} has no {platform} archive of {component}",
                                 why=f"the manifest {self.origin} lists it only for: {have}",
                                 fix="drop the component from the recipe or pick another platform")
        return _archive(component, platform, info, entry, self.origin)


def load_manifest(source: str | Path | Mapping[str, Any] | None = None, *, version: str | None = None) -> Manifest:
    """The pinned manifest of `version` (default), or an explicit one: a path to a JSON file or a dict.

    When both are given, the explicit manifest must be labelled `version`."""
    if source is None:
        if version is None:
            raise ValueError("load_manifest needs a version or a manifest")
        toolkits = data.cuda_toolkits()
        if version not in toolkits:
            raise ToolchainError(f"CUDA {version} is not pinned in this llamabundle",
                                 why="there is no NVIDIA redist manifest for it in llamabundle/data/cuda",
                                 fix="use one of: " + ", ".join(toolkits) + " (or pass --manifest FILE)")
        name = toolkits[version]["manifest"]
        raw_text = resources.files(data.__name__).joinpath("cuda/" + name).read_text(encoding="utf-8")
        manifest = _parse(json.loads(raw_text), origin=f"{name} (pinned)")
    elif isinstance(source, Mapping):
        manifest = _parse(source, origin="<manifest dict>")
    else:
        path = Path(source)
        try:
            raw = untrusted.read(path)
        except FileNotFoundError:
            raise ToolchainError(f"{path}: no such manifest file", fix="pass the path of a redistrib_*.json") from None
        except (OSError, ValueError) as e:
            raise ToolchainError(f"{path}: not a readable JSON manifest", why=str(e),
                                 fix="pass one of NVIDIA's redistrib_*.json files") from None
        manifest = _parse(raw, origin=str(path))
    if version is not None and manifest.release != version:
        raise ToolchainError(f"the manifest {manifest.origin} is for CUDA {manifest.release}, not {version}",
                             fix=f"use the redistrib_{version}.json manifest")
    return manifest


def _parse(raw: Any, *, origin: str) -> Manifest:
    if not isinstance(raw, Mapping):
        raise ToolchainError(f"{origin}: a redist manifest is a JSON object", fix="pass one of NVIDIA's redistrib_*.json files")
    release = raw.get("release_label")
    if not isinstance(release, str) or not re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", release):
        raise ToolchainError(f"{origin}: missing or malformed release_label ({release!r})",
                             fix="pass one of NVIDIA's redistrib_*.json files")
    components = {k: v for k, v in raw.items() if isinstance(v, Mapping)}
    pin = hashlib.sha256(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return Manifest(release=release, components=components, pin=pin, origin=origin)


def _archive(component: str, platform: str, info: Mapping[str, Any], entry: Mapping[str, Any], origin: str) -> Archive:
    def bad(why: str) -> ToolchainError:
        return ToolchainError(f"{origin}: the {platform} entry of {component} is malformed", why=why,
                              fix="use NVIDIA's manifest unchanged")

    if not _COMPONENT.match(component):
        raise bad(f"component name {component!r}")
    version = info.get("version")
    if not isinstance(version, str) or not re.fullmatch(r"[0-9]+(\.[0-9]+)*", version):
        raise bad(f"version {version!r}")
    rel = entry.get("relative_path")
    if not isinstance(rel, str) or "\\" in rel:
        raise bad(f"relative_path {rel!r}")
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or "." in p.parts or not _FILE_NAME.match(p.name) \
            or not p.name.endswith(ARCHIVE_SUFFIXES) or any(not _FILE_NAME.match(part) for part in p.parts):
        raise bad(f"relative_path {rel!r} is not a plain relative path to a .tar.xz or .zip")
    sha = entry.get("sha256")
    if not isinstance(sha, str) or not _HEX64.match(sha):
        raise bad(f"sha256 {sha!r}")
    try:
        size = int(entry["size"])  # NVIDIA writes sizes as strings
    except (KeyError, TypeError, ValueError):  # KeyError: no size at all
        raise bad(f"size {entry.get('size')!r}") from None
    if size <= 0:
        raise bad(f"size {size}")
    lic = info.get("license_path")
    return Archive(component=component, version=version, platform=platform, relative_path=rel, sha256=sha,
                   size=size, license_path=lic if isinstance(lic, str) else None)
