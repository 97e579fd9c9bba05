"""bundle.json's `cuda` section, typed: the toolkit the bundle was built with, the SASS and PTX ggml-cuda
really carries, the driver floor, nvcc's version. Read (and checked, field by field) here, for verify,
probe, doctor, the index and the app-side API; written by the backend from the staged files."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...bundle.manifest import (
    SCHEMA_STRINGS,
    Manifest,
    ManifestError,
    as_obj,
    as_str,
    as_strs,
    schema_maybe,
    schema_text,
)
from .archs import split_archs

NAME = "cuda"


@dataclass(frozen=True, kw_only=True)
class CudaInfo:
    """bundle.json's `cuda` section, typed."""

    toolkit: str
    sass: tuple[str, ...]
    ptx: tuple[str, ...]
    driver_floor: str | None
    nvcc: str | None = None

    def archs_json(self) -> dict[str, list[str]]:
        return {"sass": list(self.sass), "ptx": list(self.ptx)}


def read(m: Manifest) -> CudaInfo | None:
    """The bundle's CUDA section (None: it has none); a field of the wrong type is a ManifestError naming it,
    and so are SASS and PTX other than the archs its key inputs ask for (the claim is bound to the key;
    verify proves it from ggml-cuda itself)."""
    c = m.sections.get(NAME)
    if c is None:
        return None
    archs = as_obj(c.get("archs", {}), "cuda.archs")
    info = _info(c, archs)
    asked = m.inputs.get(NAME)
    if isinstance(asked, Mapping) and "archs" in asked:
        try:
            wanted = split_archs([str(a) for a in asked["archs"]])
        except (ValueError, TypeError) as e:
            raise ManifestError(f"bundle {m.key[:12]} refused: its inputs' CUDA archs are not archs", why=str(e)) from None
        if info.archs_json() != wanted:
            raise ManifestError(f"bundle {m.key[:12]} refused: it says SASS {list(info.sass)} and PTX {list(info.ptx)}, "
                                f"its inputs ask for SASS {wanted['sass']} and PTX {wanted['ptx']}",
                                why="the manifest was edited: the archs a bundle carries are part of its key")
    return info


def _info(c: Mapping[str, object], archs: Mapping[str, object]) -> CudaInfo:
    return CudaInfo(toolkit=as_str(c.get("toolkit"), "cuda.toolkit") or "",
                    sass=as_strs(archs.get("sass", []), "cuda.archs.sass"),
                    ptx=as_strs(archs.get("ptx", []), "cuda.archs.ptx"),
                    driver_floor=as_str(c.get("driver_floor"), "cuda.driver_floor", optional=True),
                    nvcc=as_str(c.get("nvcc"), "cuda.nvcc", optional=True))


def schema() -> dict[str, Any]:
    text, maybe, strings = schema_text, schema_maybe, SCHEMA_STRINGS
    return {
        "type": "object",
        "required": ["toolkit"],
        "properties": {
            "toolkit": text(description="the CUDA toolkit release the bundle was built with, e.g. 12.8.1"),
            "nvcc": maybe(text()),
            "archs": {"type": "object", "properties": {"sass": strings, "ptx": strings}},
            "driver_floor": maybe(text(description="the oldest NVIDIA driver that runs the bundle")),
            "compression_mode": maybe(text()),
        },
    }
