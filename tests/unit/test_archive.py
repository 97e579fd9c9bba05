"""Safe extraction of hostile zips and tars: each is refused, leaves neither dest nor a partial
directory behind, and writes nothing outside dest."""

from __future__ import annotations

import io
import os
import stat
import struct
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from llamabundle.archive import UnsafeArchive, extract_tar, extract_zip
from llamabundle.errors import VerifyError


def tree(root: Path) -> list[str]:
    """Every path under root (symlinks not followed), relative, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def make_zip(path: Path, members: list[tuple[str | zipfile.ZipInfo, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return path


def make_tar(path: Path, members: list[tarfile.TarInfo | tuple[str, bytes]], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tf:  # type: ignore[call-overload]
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tf.addfile(m)
            else:
                name, data = m
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                ti.mode = 0o644
                tf.addfile(ti, io.BytesIO(data))
    return path


def tinfo(name: str, kind: bytes, **kw: object) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


@pytest.fixture()
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """tmp_path/in (the archive), tmp_path/work/deep/dest (where it goes); a '../' from the partial
    directory lands in tmp_path/work/deep, two in tmp_path/work."""
    (tmp_path / "in").mkdir()
    (tmp_path / "work" / "deep").mkdir(parents=True)
    return tmp_path / "in", tmp_path / "work" / "deep" / "dest"


def assert_refused(extract: Callable[[], object], tmp_path: Path, *, unsafe: bool = True) -> VerifyError:
    before = tree(tmp_path)
    with pytest.raises(VerifyError) as e:
        extract()
    assert e.value.exit_code == 5
    if unsafe:
        assert isinstance(e.value, UnsafeArchive), e.value.what
    assert tree(tmp_path) == before, "nothing written: no dest, no .partial dir, nothing outside"
    assert list((tmp_path / "work" / "deep").iterdir()) == []
    return e.value


# ------------------------------------------------------------------------------------ zip: hostile


@pytest.mark.parametrize(("name", "why"), [
    ("../evil", "'..'"),
    ("ok/../../evil", "'..'"),
    ("/abs", "absolute"),
    ("/tmp/llamabundle-evil", "absolute"),
    ("C:\\x", "absolute"),
    ("\\\\server\\share\\x", "absolute"),
    ("..\\evil", "'..'"),
])
def test_zip_refuses_escaping_names(layout: tuple[Path, Path], tmp_path: Path, name: str, why: str) -> None:
    src, dest = layout
    z = make_zip(src / "a.zip", [("good.txt", b"fine"), (name, b"evil")])
    err = assert_refused(lambda: extract_zip(z, dest), tmp_path)
    assert why in err.what and name in err.what
    assert not Path("/tmp/llamabundle-evil").exists()


def test_zip_refuses_a_symlink_member(layout: tuple[Path, Path], tmp_path: Path) -> None:
    src, dest = layout
    link = zipfile.ZipInfo("libggml.so")
    link.create_system = 3
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    z = make_zip(src / "a.zip", [("a.txt", b"a"), (link, b"../../../../etc/passwd")])
    err = assert_refused(lambda: extract_zip(z, dest), tmp_path)
    assert "symbolic link" in err.what and "libggml.so" in err.what


def test_zip_refuses_a_bomb_over_max_total(layout: tuple[Path, Path], tmp_path: Path) -> None:
    src, dest = layout
    z = make_zip(src / "bomb.zip", [("a", b"\0" * 600), ("b", b"\0" * 600)])
    assert z.stat().st_size < 1000
    err = assert_refused(lambda: extract_zip(z, dest, max_total=1000), tmp_path)
    assert "more than 1000 bytes" in err.what
    # At the limit it extracts.
    assert extract_zip(z, dest, max_total=1200) == ["a", "b"]
    assert (dest / "b").read_bytes() == b"\0" * 600


def _lie_about_size(path: Path, name: bytes, size: int) -> None:
    """Rewrite the uncompressed size of `name` in its local header and the central directory."""
    data = bytearray(path.read_bytes())
    local = data.index(b"PK\x03\x04")
    while data[local + 30 : local + 30 + len(name)] != name:
        local = data.index(b"PK\x03\x04", local + 4)
    struct.pack_into("<I", data, local + 22, size)
    central = data.index(b"PK\x01\x02")
    while data[central + 46 : central + 46 + len(name)] != name:
        central = data.index(b"PK\x01\x02", central + 4)
    struct.pack_into("<I", data, central + 24, size)
    path.write_bytes(bytes(data))


def test_zip_whose_header_lies_about_its_size_is_refused(layout: tuple[Path, Path], tmp_path: Path) -> None:
    src, dest = layout
    z = make_zip(src / "liar.zip", [("small.txt", b"ok"), ("big.bin", b"\0" * 2_000_000)])
    _lie_about_size(z, b"big.bin", 100)
    with zipfile.ZipFile(z) as zf:
        assert zf.getinfo("big.bin").file_size == 100  # the lie is what a reader sees
    assert_refused(lambda: extract_zip(z, dest, max_total=1000), tmp_path, unsafe=False)


def test_zip_with_corrupt_compressed_data_is_refused(layout: tuple[Path, Path], tmp_path: Path) -> None:
    src, dest = layout
    text = "".join(f"line {i}\n" for i in range(20000)).encode()
    z = make_zip(src / "a.zip", [("t.txt", text)])
    data = bytearray(z.read_bytes())
    data[60] ^= 0xFF  # inside the deflate stream's block header: zlib itself fails
    z.write_bytes(bytes(data))
    err = assert_refused(lambda: extract_zip(z, dest), tmp_path, unsafe=False)
    assert "damaged" in err.what


def test_zip_with_a_flipped_data_byte_fails_its_crc(layout: tuple[Path, Path], tmp_path: Path) -> None:
    src, dest = layout
    z = make_zip(src / "a.zip", [("a.txt", b"first"), ("t.txt", os.urandom(5000))])
    data = bytearray(z.read_bytes())
    data[z.read_bytes().index(b"t.txt") + 5 + 100] ^= 0x01
    z.write_bytes(bytes(data))
    err = assert_refused(lambda: extract_zip(z, dest), tmp_path, unsafe=False)
    assert "damaged" in err.what


@pytest.mark.parametrize("content", [b"", b"not a zip at all", None])
def test_zip_unreadable_or_truncated(layout: tuple[Path, Path], tmp_path: Path, content: bytes | None) -> None:
    src, dest = layout
    z = src / "bad.zip"
    if content is None:
        good = make_zip(src / "good.zip", [("a.txt", os.urandom(4000)), ("b.txt", b"b")]).read_bytes()
        (src / "good.zip").unlink()
        content = good[: len(good) // 2]
    z.write_bytes(content)
    err = assert_refused(lambda: extract_zip(z, dest), tmp_path, unsafe=False)
    assert err.what == "bad.zip is not a readable zip"


def test_zip_into_an_existing_dest_is_refused(tmp_path: Path) -> None:
    z = make_zip(tmp_path / "a.zip", [("a.txt", b"a")])
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_text("keep")
    with pytest.raises(FileExistsError):
        extract_zip(z, dest)
    assert tree(dest) == ["keep"]


# ------------------------------------------------------------------------------------ zip: good


def test_good_zip_extracts_contents_and_exec_bits(layout: tuple[Path, Path]) -> None:
    src, dest = layout
    exe = zipfile.ZipInfo("bin/llama-server")
    exe.create_system = 3
    exe.external_attr = 0o100755 << 16
    odd = zipfile.ZipInfo("bin/tool")  # exec for the owner only, group-writable: normalised
    odd.create_system = 3
    odd.external_attr = 0o100770 << 16
    plain = zipfile.ZipInfo("lib/libggml.so")
    plain.create_system = 3
    plain.external_attr = 0o100666 << 16
    z = make_zip(src / "good.zip", [("README", b"readme\n"), (exe, b"#!/bin/sh\necho hi\n"), (odd, b"t"),
                                    (plain, b"lib" * 1000), ("empty/", b"")])
    names = extract_zip(z, dest)
    assert names == ["README", "bin/llama-server", "bin/tool", "lib/libggml.so"]
    assert tree(dest) == ["README", "bin", "bin/llama-server", "bin/tool", "empty", "lib", "lib/libggml.so"]
    assert (dest / "bin" / "llama-server").read_bytes() == b"#!/bin/sh\necho hi\n"
    assert (dest / "lib" / "libggml.so").read_bytes() == b"lib" * 1000
    modes = {n: stat.S_IMODE((dest / n).stat().st_mode) for n in names}
    assert modes == {"README": 0o644, "bin/llama-server": 0o755, "bin/tool": 0o755, "lib/libggml.so": 0o644}
    assert not [p for p in dest.parent.iterdir() if p.name != "dest"]


# ------------------------------------------------------------------------------------ tar: hostile


@pytest.mark.parametrize("name", ["../evil", "pkg/../../evil", "/abs/evil", "/tmp/llamabundle-evil-tar"])
def test_tar_refuses_escaping_names(layout: tuple[Path, Path], tmp_path: Path, name: str) -> None:
    src, dest = layout
    t = make_tar(src / "a.tar", [("pkg/ok.txt", b"ok"), (name, b"evil")])
    assert_refused(lambda: extract_tar(t, dest), tmp_path)
    assert not Path("/tmp/llamabundle-evil-tar").exists()


@pytest.mark.parametrize("target", ["../../outside", "/etc/passwd", "../../../../../../../etc"])
def test_tar_refuses_a_symlink_out(layout: tuple[Path, Path], tmp_path: Path, target: str) -> None:
    src, dest = layout
    t = make_tar(src / "a.tar", [("pkg/ok.txt", b"ok"), tinfo("pkg/link", tarfile.SYMTYPE, linkname=target)])
    assert_refused(lambda: extract_tar(t, dest), tmp_path)


def test_tar_refuses_writing_through_a_symlink(layout: tuple[Path, Path], tmp_path: Path) -> None:
    src, dest = layout
    outside = tmp_path / "work"
    t = make_tar(src / "a.tar", [tinfo("pkg/dir", tarfile.SYMTYPE, linkname=str(outside)),
                                 ("pkg/dir/planted", b"evil")])
    assert_refused(lambda: extract_tar(t, dest), tmp_path)
    assert not (outside / "planted").exists()


def test_tar_refuses_a_hardlink_out(layout: tuple[Path, Path], tmp_path: Path) -> None:
    src, dest = layout
    victim = tmp_path / "victim"
    victim.write_text("secret")
    t = make_tar(src / "a.tar", [tinfo("pkg/hl", tarfile.LNKTYPE, linkname=str(victim))])
    assert_refused(lambda: extract_tar(t, dest), tmp_path)
    assert victim.read_text() == "secret"


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_tar_refuses_device_files(layout: tuple[Path, Path], tmp_path: Path, kind: bytes) -> None:
    src, dest = layout
    t = make_tar(src / "a.tar", [("pkg/ok.txt", b"ok"), tinfo("pkg/dev", kind, devmajor=1, devminor=3)])
    assert_refused(lambda: extract_tar(t, dest), tmp_path)


@pytest.mark.parametrize("content", [b"", b"garbage, not a tar" * 100])
def test_tar_unreadable(layout: tuple[Path, Path], tmp_path: Path, content: bytes) -> None:
    src, dest = layout
    t = src / "bad.tar.gz"
    t.write_bytes(content)
    err = assert_refused(lambda: extract_tar(t, dest), tmp_path, unsafe=False)
    assert err.what == "bad.tar.gz is not a readable tar archive"


@pytest.mark.parametrize("mode", ["w", "w:gz", "w:xz", "w:bz2"])
def test_tar_truncated(layout: tuple[Path, Path], tmp_path: Path, mode: str) -> None:
    src, dest = layout
    t = make_tar(src / "a.tar", [("pkg/a.bin", os.urandom(30000)), ("pkg/b.bin", os.urandom(30000))], mode)
    t.write_bytes(t.read_bytes()[: t.stat().st_size // 2])
    err = assert_refused(lambda: extract_tar(t, dest), tmp_path, unsafe=False)
    assert err.what == "a.tar is not a readable tar archive"


def test_tar_gz_with_corrupt_data_is_refused(layout: tuple[Path, Path], tmp_path: Path) -> None:
    """A flipped byte inside gzip data is caught by the gzip CRC even though the tar ends before it."""
    src, dest = layout
    payload = os.urandom(20000) + b"A" * 200000
    t = make_tar(src / "a.tar.gz", [("pkg/big.bin", payload)], "w:gz")
    data = bytearray(t.read_bytes())
    for i in range(2000, 2060):
        data[i] ^= 0x5A
    t.write_bytes(bytes(data))
    assert_refused(lambda: extract_tar(t, dest), tmp_path, unsafe=False)


# ------------------------------------------------------------------------------------ tar: good


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_good_tar_extracts_contents_exec_bits_and_inner_links(layout: tuple[Path, Path], mode: str) -> None:
    src, dest = layout
    exe = tarfile.TarInfo("pkg-1.0/bin/run.sh")
    exe.mode = 0o755
    body = b"#!/bin/sh\necho hi\n"
    exe.size = len(body)
    t = src / "good.tar"
    with tarfile.open(t, mode) as tf:  # type: ignore[call-overload]
        tf.addfile(tinfo("pkg-1.0", tarfile.DIRTYPE, mode=0o755))
        tf.addfile(exe, io.BytesIO(body))
        data = tarfile.TarInfo("pkg-1.0/src/a.c")
        data.size = 9
        data.mode = 0o666
        tf.addfile(data, io.BytesIO(b"int a;\n//"))
        tf.addfile(tinfo("pkg-1.0/src/link.c", tarfile.SYMTYPE, linkname="a.c"))
    extract_tar(t, dest)
    assert tree(dest) == ["pkg-1.0", "pkg-1.0/bin", "pkg-1.0/bin/run.sh", "pkg-1.0/src", "pkg-1.0/src/a.c",
                          "pkg-1.0/src/link.c"]
    assert (dest / "pkg-1.0/bin/run.sh").read_bytes() == body
    assert stat.S_IMODE((dest / "pkg-1.0/bin/run.sh").stat().st_mode) & 0o111 == 0o111
    assert stat.S_IMODE((dest / "pkg-1.0/src/a.c").stat().st_mode) & 0o111 == 0
    assert stat.S_IMODE((dest / "pkg-1.0/src/a.c").stat().st_mode) & 0o022 == 0  # no group/other write
    assert os.readlink(dest / "pkg-1.0/src/link.c") == "a.c"
    assert (dest / "pkg-1.0/src/link.c").read_bytes() == b"int a;\n//"
    assert not [p for p in dest.parent.iterdir() if p.name != "dest"]


def test_tar_select_keeps_only_a_subtree(layout: tuple[Path, Path]) -> None:
    src, dest = layout
    t = make_tar(src / "s.tar.gz", [("pkg/README", b"r"), ("pkg/src/a.c", b"a"), ("pkg/src/sub/b.c", b"b"),
                                    ("pkg/docs/x.md", b"x"), ("other/src/c.c", b"c")], "w:gz")
    extract_tar(t, dest, select="pkg/src/")
    assert tree(dest) == ["pkg", "pkg/src", "pkg/src/a.c", "pkg/src/sub", "pkg/src/sub/b.c"]
    assert (dest / "pkg/src/sub/b.c").read_bytes() == b"b"


def test_tar_select_skips_hostile_members_outside_the_subtree(layout: tuple[Path, Path]) -> None:
    src, dest = layout
    t = make_tar(src / "s.tar", [("pkg/src/a.c", b"a"), ("../evil", b"e"),
                                 tinfo("pkg/dev", tarfile.CHRTYPE, devmajor=1, devminor=3)])
    extract_tar(t, dest, select="pkg/src/")
    assert tree(dest) == ["pkg", "pkg/src", "pkg/src/a.c"]


def test_tar_into_an_existing_dest_is_refused(tmp_path: Path) -> None:
    t = make_tar(tmp_path / "a.tar", [("a.txt", b"a")])
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(FileExistsError):
        extract_tar(t, dest)
    assert tree(dest) == []
