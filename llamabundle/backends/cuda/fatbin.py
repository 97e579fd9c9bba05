"""Which GPU code a CUDA binary carries: the fat binary containers of its `.nv_fatbin` section,
read without cuobjdump (same answer as `cuobjdump --list-elf --list-ptx`, checked in the tests).

Container: u32 magic 0xBA55ED50, u16 version, u16 header size, u64 size of the entries.
Entry: u16 kind (1 PTX, 2 ELF/cubin), u16, u32 header size, u64 padded payload size, …,
u32 at +28 the SM number (90, 120), u64 flags at +40 (bit 20: arch-specific 'a', bit 21: family 'f').
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from ...errors import VerifyError

MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
FLAG_ARCH_SPECIFIC = 1 << 20
FLAG_FAMILY = 1 << 21


@dataclass(frozen=True, kw_only=True)
class FatbinArchs:
    sass: tuple[str, ...]
    ptx: tuple[str, ...]
    entries: int

    def to_json(self) -> dict[str, list[str]]:
        return {"sass": list(self.sass), "ptx": list(self.ptx)}


def _order(name: str) -> tuple[int, str]:
    return int(re.sub(r"\D", "", name)), name


def parse_fatbin(data: bytes) -> FatbinArchs:
    sass: set[str] = set()
    ptx: set[str] = set()
    entries = 0
    pos = 0
    while pos + 16 <= len(data):
        magic, _ver, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:
            nxt = data.find(struct.pack("<I", MAGIC), pos + 1)  # containers may be padded apart
            if nxt < 0:
                break
            pos = nxt
            continue
        end = pos + header_size + fat_size
        if end > len(data) or header_size < 16:
            raise VerifyError("a CUDA fat binary container is truncated", why=f"at offset {pos}")
        p = pos + header_size
        while p + 48 <= end:
            kind, _u, entry_size, padded = struct.unpack_from("<HHIQ", data, p)
            if entry_size < 48 or p + entry_size + padded > end:
                raise VerifyError("a CUDA fat binary entry is malformed", why=f"at offset {p}")
            sm = struct.unpack_from("<I", data, p + 28)[0]
            flags = struct.unpack_from("<Q", data, p + 40)[0]
            suffix = "a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY else ""
            name = f"{sm}{suffix}"
            if kind == KIND_PTX:
                ptx.add(name)
            elif kind in (KIND_ELF, 0x10):
                sass.add(name)
            entries += 1
            p += entry_size + padded
        pos = end
    return FatbinArchs(sass=tuple(sorted(sass, key=_order)), ptx=tuple(sorted(ptx, key=_order)), entries=entries)


PE_SECTION = ".nv_fatb"  # a PE section name has at most 8 characters: nvcc's .nv_fatbin, cut short


def binary_archs(path: Path) -> FatbinArchs:
    """The SASS and PTX architectures embedded in an ELF binary (shared library, executable, object) or a
    PE one (ggml-cuda.dll)."""
    from ...deps.pe import is_pe

    if is_pe(path):
        import pefile

        try:
            with pefile.PE(str(path), fast_load=True) as pe:
                found = [sec for sec in pe.sections if sec.Name.rstrip(b"\0").decode("ascii", "replace") == PE_SECTION]
                return parse_fatbin(found[0].get_data()) if found else FatbinArchs(sass=(), ptx=(), entries=0)
        except (pefile.PEFormatError, OSError, struct.error) as e:
            raise VerifyError(f"cannot read the GPU code of {path.name}", why=str(e)) from None
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            section = elf.get_section_by_name(".nv_fatbin")
            if section is None:
                return FatbinArchs(sass=(), ptx=(), entries=0)
            return parse_fatbin(section.data())
    except (ELFError, OSError, struct.error) as e:
        raise VerifyError(f"cannot read the GPU code of {path.name}", why=str(e)) from None
