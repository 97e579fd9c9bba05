"""deps.elf.read_elf, llamabundle's own ELF reader (the static check reads every binary of a bundle on each fetch):
the same answers as pyelftools on real libraries and on synthetic files of every class and byte order, and on
hostile files a VerifyError, never an internal error or an endless loop."""

from __future__ import annotations

import glob
import random
import re
import struct
from pathlib import Path

import pytest
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

from llamabundle.deps.elf import is_elf, read_elf
from llamabundle.errors import VerifyError


def _pyelftools(path: Path) -> tuple[object, ...]:
    """What pyelftools reads from the same sections: the reference the reader is held to."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        needed: list[str] = []
        runpath: list[str] = []
        soname = None
        glibc: set[str] = set()
        for s in elf.iter_sections():
            if isinstance(s, DynamicSection):
                for t in s.iter_tags():
                    tag = t.entry.d_tag
                    if tag == "DT_NEEDED":
                        needed.append(t.needed)
                    elif tag == "DT_SONAME":
                        soname = t.soname
                    elif tag in ("DT_RUNPATH", "DT_RPATH"):
                        runpath += getattr(t, tag[3:].lower()).split(":")
            elif isinstance(s, GNUVerNeedSection):
                for _v, auxs in s.iter_versions():
                    glibc |= {a.name for a in auxs if re.fullmatch(r"GLIBC_\d+(\.\d+)*", a.name)}
        return (elf["e_machine"], elf.elfclass, soname, tuple(needed), tuple(p for p in runpath if p),
                tuple(sorted(glibc)))


def _ours(path: Path) -> tuple[object, ...]:
    i = read_elf(path)
    return (i.machine, i.elfclass, i.soname, i.needed, i.runpath, i.glibc)


def _synthetic(*, elfclass: int, little: bool, machine: int) -> bytes:
    """A minimal ELF file with .dynstr, .dynamic (two NEEDED, SONAME, RUNPATH with an empty part) and
    .gnu.version_r (two files, three versions), laid out by hand for the given class and byte order."""
    e = "<" if little else ">"
    w = "Q" if elfclass == 64 else "I"
    strings = b"\0libc.so.6\0libm.so.6\0libsyn.so.1\0$ORIGIN::/opt/x\0GLIBC_2.17\0GLIBC_2.34\0GLIBC_PRIVATE\0.x\0"

    def at(s: bytes) -> int:
        return strings.index(s + b"\0")

    dyn_fmt = e + ("qQ" if elfclass == 64 else "iI")
    dynamic = b"".join(struct.pack(dyn_fmt, t, v) for t, v in [
        (1, at(b"libc.so.6")), (1, at(b"libm.so.6")), (14, at(b"libsyn.so.1")), (29, at(b"$ORIGIN::/opt/x")),
        (0, 0), (1, at(b"libsyn.so.1"))])  # after DT_NULL: never read
    vn = e + "HHIII"
    va = e + "IHHII"
    verneed = (struct.pack(vn, 1, 2, at(b"libc.so.6"), 16, 48)
               + struct.pack(va, 0, 0, 2, at(b"GLIBC_2.17"), 16) + struct.pack(va, 0, 0, 3, at(b"GLIBC_PRIVATE"), 0)
               + struct.pack(vn, 1, 1, at(b"libm.so.6"), 16, 0) + struct.pack(va, 0, 0, 4, at(b"GLIBC_2.34"), 0))
    ehsize = 64 if elfclass == 64 else 52
    body = bytearray(b"\0" * ehsize)
    placed = []
    for data in (strings, dynamic, verneed, strings):  # the last: .shstrtab, the same bytes
        placed.append((len(body), len(data)))
        body += data
        body += b"\0" * (-len(body) % 8)
    shdr = e + f"II{w}{w}{w}{w}II{w}{w}"
    shentsize = struct.calcsize(shdr)
    sections = [struct.pack(shdr, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                struct.pack(shdr, at(b".x"), 3, 0, 0, *placed[0], 0, 0, 1, 0),
                struct.pack(shdr, at(b".x"), 6, 0, 0, *placed[1], 1, 0, 8, struct.calcsize(dyn_fmt)),
                struct.pack(shdr, at(b".x"), 0x6FFFFFFE, 0, 0, *placed[2], 1, 2, 4, 0),
                struct.pack(shdr, at(b".x"), 3, 0, 0, *placed[3], 0, 0, 1, 0)]
    shoff = len(body)
    body += b"".join(sections)
    ident = b"\x7fELF" + bytes([2 if elfclass == 64 else 1, 1 if little else 2, 1]) + b"\0" * 9
    header = ident + struct.pack(e + f"HHI{w}{w}{w}IHHHHHH", 3, machine, 1, 0, 0, shoff, 0, ehsize, 0, 0, shentsize,
                                 len(sections), 4)
    body[:ehsize] = header
    return bytes(body)


@pytest.mark.parametrize(("elfclass", "little", "machine"), [
    (64, True, 62), (64, True, 183), (32, True, 3), (64, False, 22), (32, False, 20)])
def test_synthetic_files_of_every_class_and_byte_order_read_as_pyelftools_reads_them(
        tmp_path: Path, elfclass: int, little: bool, machine: int) -> None:
    f = tmp_path / "libsyn.so.1"
    f.write_bytes(_synthetic(elfclass=elfclass, little=little, machine=machine))
    ours = _ours(f)
    assert ours == _pyelftools(f)
    assert ours[1:] == (elfclass, "libsyn.so.1", ("libc.so.6", "libm.so.6"), ("$ORIGIN", "/opt/x"),
                        ("GLIBC_2.17", "GLIBC_2.34"))


def _real_elf_files() -> list[Path]:
    out = []
    for pattern in ("/usr/lib/x86_64-linux-gnu/lib*.so*", "/usr/lib/aarch64-linux-gnu/lib*.so*",
                    "/usr/aarch64-linux-gnu/lib/lib*.so*", "/usr/bin/*"):
        out += [Path(p) for p in sorted(glob.glob(pattern))[:150]]
    return [p for p in out if p.is_file() and is_elf(p)]


def test_real_libraries_and_programs_read_as_pyelftools_reads_them() -> None:
    files = _real_elf_files()
    assert len(files) >= 50, "this machine's own libraries are the sample"
    differ = [(f, _ours(f), _pyelftools(f)) for f in files if _ours(f) != _pyelftools(f)]
    assert differ == []
    assert any(read_elf(f).glibc for f in files) and any(read_elf(f).soname for f in files)


def _mutations(data: bytes, rng: random.Random, count: int) -> list[bytes]:
    out = [data[:n] for n in (16, 40, 63, len(data) // 2, len(data) - 1)]  # cut short
    for _ in range(count):
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        out.append(bytes(b))
    return out


def test_hostile_files_are_a_verify_error_never_an_internal_error(tmp_path: Path) -> None:
    """Mutations of the synthetic file (every byte of it matters) and of a real library's headers: each either
    reads or is a VerifyError naming the file; pyelftools' own verdict is not required to agree."""
    rng = random.Random(34)
    seeds = [_synthetic(elfclass=64, little=True, machine=62), _synthetic(elfclass=32, little=False, machine=20)]
    real = next((p for p in _real_elf_files() if p.stat().st_size < 4 << 20 and read_elf(p).needed), None)
    if real is not None:
        seeds.append(real.read_bytes())
    f = tmp_path / "libhostile.so"
    errors = reads = 0
    for seed in seeds:
        for data in _mutations(seed, rng, 300):
            f.write_bytes(data)
            try:
                read_elf(f)
                reads += 1
            except VerifyError as e:
                assert "libhostile.so" in e.what and e.exit_code == 5
                errors += 1
    assert errors > 0 and reads > 0


def test_a_version_needs_chain_longer_than_its_section_is_refused(tmp_path: Path) -> None:
    """vn_cnt claims 65535 versions, each a byte after the last: the walk stops at the section's size."""
    data = bytearray(_synthetic(elfclass=64, little=True, machine=62))
    with open(tmp_path / "x", "wb") as out:
        out.write(data)
    with open(tmp_path / "x", "rb") as fh:
        off = next(s for s in ELFFile(fh).iter_sections() if isinstance(s, GNUVerNeedSection))["sh_offset"]
    struct.pack_into("<H", data, off + 2, 0xFFFF)  # vn_cnt
    struct.pack_into("<I", data, off + 16 + 12, 1)  # the first version's vna_next: the next one a byte on
    f = tmp_path / "libloop.so"
    f.write_bytes(bytes(data))
    with pytest.raises(VerifyError) as e:
        read_elf(f)
    assert "libloop.so" in e.value.what


def test_the_section_table_past_the_end_is_refused(tmp_path: Path) -> None:
    data = bytearray(_synthetic(elfclass=64, little=True, machine=62))
    struct.pack_into("<Q", data, 40, len(data) - 10)  # e_shoff
    f = tmp_path / "libcut.so"
    f.write_bytes(bytes(data))
    with pytest.raises(VerifyError) as e:
        read_elf(f)
    assert "past the end" in (e.value.why or "")
