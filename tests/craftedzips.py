"""Crafted variants of a good bundle zip, made by editing its bytes as an attacker (or a broken tool) would:
a member encrypted or compressed by another method, a data descriptor, local headers that disagree with the
central directory, two central entries over one member's bytes, a member larger than bundle.json lists it."""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

LOCAL, CENTRAL, END = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"


def _records(b: bytes | bytearray, sig: bytes, name_at: int, nlen_at: int) -> list[tuple[int, str]]:
    """(offset, name) of every record with this signature (the zips here hold no such bytes inside data)."""
    out, i = [], 0
    while (j := b.find(sig, i)) >= 0:
        nlen = struct.unpack_from("<H", b, j + nlen_at)[0]
        out.append((j, bytes(b[j + name_at:j + name_at + nlen]).decode("utf-8", "replace")))
        i = j + 4
    return out


def locals_of(b: bytes | bytearray) -> list[tuple[int, str]]:
    return _records(b, LOCAL, 30, 26)


def centrals_of(b: bytes | bytearray) -> list[tuple[int, str]]:
    return _records(b, CENTRAL, 46, 28)


def _patch(src: bytes, member: str, edit: Callable[[bytearray, int, bool], None], *, local: bool = True,
           central: bool = True) -> bytes:
    b = bytearray(src)
    hits = 0
    for at, name in (locals_of(b) if local else []):
        if name == member:
            edit(b, at, True)
            hits += 1
    for at, name in (centrals_of(b) if central else []):
        if name == member:
            edit(b, at, False)
            hits += 1
    assert hits, f"no member {member}"
    return bytes(b)


def encrypted(src: bytes, member: str) -> bytes:
    def edit(b: bytearray, at: int, is_local: bool) -> None:
        off = at + (6 if is_local else 8)
        struct.pack_into("<H", b, off, struct.unpack_from("<H", b, off)[0] | 0x1)
    return _patch(src, member, edit)


def method(src: bytes, member: str, number: int) -> bytes:
    def edit(b: bytearray, at: int, is_local: bool) -> None:
        struct.pack_into("<H", b, at + (8 if is_local else 10), number)
    return _patch(src, member, edit)


def local_name(src: bytes, member: str) -> bytes:
    """The member's local header names another file of the same length (the central directory does not)."""
    def edit(b: bytearray, at: int, is_local: bool) -> None:
        b[at + 30] = ord("X") if b[at + 30] != ord("X") else ord("Y")
    return _patch(src, member, edit, central=False)


def local_size(src: bytes, member: str) -> bytes:
    """The member's local header says it is one byte larger than the central directory does."""
    def edit(b: bytearray, at: int, is_local: bool) -> None:
        struct.pack_into("<I", b, at + 22, struct.unpack_from("<I", b, at + 22)[0] + 1)
    return _patch(src, member, edit, central=False)


def overlapping(src: bytes, member: str) -> bytes:
    """The member's central entry twice: two members over one member's bytes (an overlapping zip bomb's trick)."""
    b = bytearray(src)
    end = b.rfind(END)
    cd_size, cd_offset = struct.unpack_from("<II", b, end + 12)
    count = struct.unpack_from("<H", b, end + 10)[0]
    at, name = next((a, n) for a, n in centrals_of(b) if n == member)
    nlen, xlen, clen = struct.unpack_from("<HHH", b, at + 28)
    entry = bytes(b[at:at + 46 + nlen + xlen + clen])
    out = b[:cd_offset + cd_size] + entry + b[cd_offset + cd_size:]
    e = out.rfind(END)
    struct.pack_into("<HH", out, e + 8, count + 1, count + 1)
    struct.pack_into("<I", out, e + 12, cd_size + len(entry))
    return bytes(out)


class _Unseekable(io.RawIOBase):
    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        self.data += b
        return len(b)


def descriptors(src: bytes) -> bytes:
    """The same members, written as a streaming zip writer does: sizes and CRC after each member's data."""
    sink = _Unseekable()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(sink, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            new = zipfile.ZipInfo(info.filename, info.date_time)
            new.external_attr, new.create_system, new.compress_type = info.external_attr, info.create_system, zipfile.ZIP_DEFLATED
            with zout.open(new, "w") as dst:
                dst.write(zin.read(info))
    return bytes(sink.data)


def rewritten(src: bytes, *, order: Callable[[list[str]], list[str]] | None = None,
              change: dict[str, bytes] | None = None) -> bytes:
    """The same members (in another order, some with other bytes), written by zipfile with sizes in the local headers."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        infos = {i.filename: i for i in zin.infolist()}
        for name in (order or list)(list(infos)):
            zout.writestr(infos[name], (change or {}).get(name, zin.read(infos[name])))
    return out.getvalue()


def crafted(src: Path, kind: str, member: str) -> bytes:
    """One of KINDS made from the zip at src, against `member` (a file bundle.json lists)."""
    data = src.read_bytes()
    return KINDS[kind](data, member)


KINDS: dict[str, Callable[[bytes, str], bytes]] = {
    "encrypted": encrypted,
    "shrink": lambda b, m: method(b, m, 1),
    "aes": lambda b, m: method(b, m, 99),
    "bzip2": lambda b, m: method(b, m, 12),
    "descriptors": lambda b, m: descriptors(b),
    "encrypted-descriptors": lambda b, m: encrypted(descriptors(b), m),
    "local-name": local_name,
    "local-size": local_size,
    "overlapping": overlapping,
    "larger-than-listed": lambda b, m: rewritten(b, change={m: zipfile.ZipFile(io.BytesIO(b)).read(m) + b"\0" * 4096}),
    "manifest-last": lambda b, m: rewritten(b, order=lambda names: sorted(names, key=lambda n: n == "bundle.json")),
}
# what each is refused for (a substring of the message); "manifest-last" is a good bundle read another way
REFUSED = {"encrypted": "is encrypted", "shrink": "method 1 (shrink)", "aes": "method 99 (AES encryption)",
           "bzip2": "method 12 (bzip2)", "descriptors": "data descriptor", "encrypted-descriptors": "data descriptor",
           "local-name": "local header that disagrees", "local-size": "in its local header",
           "overlapping": "overlaps member", "larger-than-listed": "bytes; bundle.json says"}
