"""Reading the GPU architectures out of real nvcc output, as cuobjdump lists them."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from llamabundle.backends.cuda.fatbin import MAGIC, binary_archs, parse_fatbin
from llamabundle.errors import VerifyError

DATA = Path(__file__).resolve().parents[1] / "data"


def test_sass_and_ptx_with_arch_specific_suffix() -> None:
    got = binary_archs(DATA / "fatbin-75ptx-90-90a.o")
    assert got.sass == ("90", "90a")
    assert got.ptx == ("75",)
    assert got.entries == 3
    assert got.to_json() == {"sass": ["90", "90a"], "ptx": ["75"]}


def test_family_and_blackwell_entries_with_extended_headers() -> None:
    got = binary_archs(DATA / "fatbin-100f-120a-121.o")
    assert got.sass == ("100f", "121")
    assert got.ptx == ("120a",)


def test_a_binary_without_gpu_code(tmp_path: Path) -> None:
    got = binary_archs(Path("/bin/sh").resolve())
    assert got.sass == () and got.ptx == () and got.entries == 0


def test_a_truncated_container_is_an_error() -> None:
    data = (DATA / "fatbin-75ptx-90-90a.o").read_bytes()
    start = data.find(struct.pack("<I", MAGIC))
    _, _, header_size, fat_size = struct.unpack_from("<IHHQ", data, start)
    container = data[start:start + header_size + fat_size]
    assert parse_fatbin(container).sass == ("90", "90a")
    with pytest.raises(VerifyError) as e:
        parse_fatbin(container[: len(container) // 2])
    assert e.value.exit_code == 5


def test_not_an_elf_file(tmp_path: Path) -> None:
    (tmp_path / "x.so").write_bytes(b"nope")
    with pytest.raises(VerifyError):
        binary_archs(tmp_path / "x.so")
