"""zipstream: a bundle zip unpacked while its bytes arrive, from a file or a download that drops and resumes."""

from __future__ import annotations

import hashlib
import io
import os
import random
import stat
import struct
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest

from llamabundle import pipeline
from llamabundle.archive import UnsafeArchive
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.bundle import zipstream
from llamabundle.bundle.manifest import Manifest
from llamabundle.errors import VerifyError
from llamabundle.settings import Settings
from llamabundle.verify import Level
from tests import ghstore
from tests.bundles import inputs_for, key_of
from tests.bundles import make_zip as make_bundle_zip
from tests.fakegithub import FakeGitHub

KEY = key_of(inputs_for("zipstream"))

FILES = {"bundle.json": b'{"format": 1}\n', "llama-server": os.urandom(300_000),
         "libggml-base.so": b"\x7fELF" + bytes(range(256)) * 2000, "LICENSE": b"MIT License\n" * 50}


def make_zip(path: Path, files: dict[str, bytes] = FILES, *, modes: dict[str, int] | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system = 3
            info.external_attr = (modes or {}).get(name, 0o100644) << 16
            info.compress_type = zipfile.ZIP_STORED if name == "llama-server" else zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return path


def feed(z: Path, dest: Path, sizes: list[int] | None = None, *, workers: int | None = None) -> list[zipstream.Member]:
    data = z.read_bytes()
    zs = zipstream.ZipStream(dest, label=z.name, workers=workers)
    at, i = 0, 0
    while at < len(data):
        n = sizes[i % len(sizes)] if sizes else len(data)
        zs.update(data[at:at + n])
        at, i = at + n, i + 1
    return zs.finish()


@pytest.mark.parametrize("sizes", [None, [1], [7, 4096, 3], [65536]], ids=["whole", "bytewise", "ragged", "64k"])
def test_any_chunking_gives_the_same_files_and_hashes(tmp_path: Path, sizes: list[int] | None) -> None:
    z = make_zip(tmp_path / "b.zip", FILES if sizes != [1] else {k: v[:3000] for k, v in FILES.items()},
                 modes={"llama-server": 0o100755})
    dest = tmp_path / "out"
    members = feed(z, dest, sizes)
    with zipfile.ZipFile(z) as zf:
        expected = {i.filename: zf.read(i) for i in zf.infolist()}
    assert [m.name for m in members] == list(expected)
    for m in members:
        assert (dest / m.name).read_bytes() == expected[m.name]
        assert m.sha256 == hashlib.sha256(expected[m.name]).hexdigest()
    assert stat.S_IMODE((dest / "llama-server").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "LICENSE").stat().st_mode) == 0o644


MANY = {f"lib{i:02d}.so": bytes(random.Random(i).choices(range(16), k=200_000 + 997 * i)) for i in range(24)}


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_workers_inflate_whole_members_in_parallel_with_the_same_files_and_hashes(
        tmp_path: Path, workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each deflated member goes to a worker once its bytes are all here (one worker: each inflates as it
    streams); the files, hashes and order are the same, also when the in-flight bound makes the feeder wait."""
    monkeypatch.setattr(zipstream, "MAX_INFLIGHT", 300_000)  # about two members at a time
    threads: set[str] = set()
    whole = zipstream._Inflating.whole

    def spy(self: zipstream._Inflating, data: bytes) -> zipstream.Member:
        threads.add(threading.current_thread().name)
        return whole(self, data)

    monkeypatch.setattr(zipstream._Inflating, "whole", spy)
    z = make_zip(tmp_path / "many.zip", {"bundle.json": b"{}", **MANY})
    members = feed(z, tmp_path / "out", [65536], workers=workers)
    assert [m.name for m in members] == ["bundle.json", *MANY]
    for m in members[1:]:
        assert m.sha256 == hashlib.sha256(MANY[m.name]).hexdigest()
        assert (tmp_path / "out" / m.name).read_bytes() == MANY[m.name]
    assert (len(threads) > 0) == (workers > 1) and all(t.startswith("zipstream") for t in threads)
    assert not [t for t in threading.enumerate() if t.name.startswith("zipstream")], "the workers are stopped"


def test_a_worker_inflates_a_large_member_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole member handed to a worker is fed to zlib IN_CHUNK at a time: fed at once, zlib's unconsumed_tail
    copied the rest of it after every OUT_CHUNK of output (the CUDA bundle unpacked slower with workers than
    without)."""
    big = os.urandom(1 << 19) * 6  # 3 MiB that deflate to more than IN_CHUNK
    sizes: list[int] = []
    original = zipstream._Inflating.feed

    def spy(self: zipstream._Inflating, piece: bytes | memoryview, *, last: bool) -> None:
        if self.name == "libbig.so":
            sizes.append(len(piece))
        original(self, piece, last=last)

    monkeypatch.setattr(zipstream._Inflating, "feed", spy)
    z = make_zip(tmp_path / "big.zip", {"bundle.json": b"{}", "libbig.so": big})
    [_, member] = feed(z, tmp_path / "out", [1 << 20], workers=2)
    assert member.sha256 == hashlib.sha256(big).hexdigest() and (tmp_path / "out" / "libbig.so").read_bytes() == big
    assert max(sizes) == zipstream.IN_CHUNK and len(sizes) >= 8, sizes


def test_a_damaged_member_inflated_by_a_worker_fails_the_stream_and_leaves_nothing(tmp_path: Path) -> None:
    z = make_zip(tmp_path / "many.zip", {"bundle.json": b"{}", **MANY})
    data = bytearray(z.read_bytes())
    with zipfile.ZipFile(z) as zf:
        info = zf.getinfo("lib05.so")
    struct.pack_into("<I", data, info.header_offset + 14, info.CRC ^ 1)  # the local header's CRC
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match="'lib05.so' is damaged"):
        feed(bad, tmp_path / "out", [65536], workers=4)
    assert not (tmp_path / "out").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("zipstream")]


def test_closing_a_pipelined_stream_midway_stops_its_workers(tmp_path: Path) -> None:
    """An interrupted fetch: close() before finish leaves no thread writing into what the caller removes."""
    z = make_zip(tmp_path / "many.zip", {"bundle.json": b"{}", **MANY})
    data = z.read_bytes()
    stream = zipstream.Pipelined(zipstream.ZipStream(tmp_path / "out", label="many.zip", workers=4))
    for at in range(0, len(data) * 2 // 3, 65536):
        stream.update(data[at:at + 65536])
    stream.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("zipstream")]
    stream.inner.discard()
    assert not (tmp_path / "out").exists()


def test_reset_forgets_what_was_written(tmp_path: Path) -> None:
    z = make_zip(tmp_path / "b.zip")
    data = z.read_bytes()
    dest = tmp_path / "out"
    zs = zipstream.ZipStream(dest, label="b.zip")
    zs.update(data[: len(data) // 2])
    assert (dest / "bundle.json").is_file()
    zs.reset()
    assert not dest.exists()
    zs.update(data)
    assert len(zs.finish()) == len(FILES)
    assert (dest / "LICENSE").read_bytes() == FILES["LICENSE"]


def test_a_zip_with_data_descriptors_is_not_streamed_and_unpack_falls_back(tmp_path: Path) -> None:
    class Unseekable(io.RawIOBase):
        def __init__(self) -> None:
            self.buf = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            self.buf += b
            return len(b)

    sink = Unseekable()
    with zipfile.ZipFile(sink, "w", zipfile.ZIP_DEFLATED) as zf:  # not seekable: sizes go after the data
        for name, data in FILES.items():
            with zf.open(name, "w") as w:
                w.write(data)
    z = tmp_path / "dd.zip"
    z.write_bytes(bytes(sink.buf))
    with pytest.raises(zipstream.NotStreamable):
        feed(z, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_truncated_zip_fails_and_leaves_nothing(tmp_path: Path) -> None:
    z = make_zip(tmp_path / "b.zip")
    cut = tmp_path / "cut.zip"
    for n in (100, z.stat().st_size // 2, z.stat().st_size - 10):
        cut.write_bytes(z.read_bytes()[:n])
        with pytest.raises(VerifyError):
            feed(cut, tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_a_symlink_member_is_refused(tmp_path: Path) -> None:
    z = make_zip(tmp_path / "b.zip", {"LICENSE": b"x", "evil": b"/etc/passwd"}, modes={"evil": 0o120777})
    with pytest.raises(UnsafeArchive, match="'evil' is a symbolic link"):
        feed(z, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "C:/windows"])
def test_a_member_escaping_the_destination_is_refused_before_it_is_written(tmp_path: Path, name: str) -> None:
    z = make_zip(tmp_path / "b.zip", {"LICENSE": b"x", name: b"boo"})
    with pytest.raises(UnsafeArchive):
        feed(z, tmp_path / "d" / "out")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["b.zip", "d"]


def test_a_central_directory_that_disagrees_with_the_members_is_refused(tmp_path: Path) -> None:
    z = make_zip(tmp_path / "b.zip")
    data = bytearray(z.read_bytes())
    cd = data.rindex(b"PK\x01\x02" + data[data.index(b"PK\x01\x02") + 4: data.index(b"PK\x01\x02") + 8])
    first = data.index(b"PK\x01\x02")
    name_at = first + 46
    assert data[name_at:name_at + 11] == b"bundle.json"
    data[name_at:name_at + 11] = b"bundle.jsoo"  # the listing names a member that was never streamed
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bytes(data))
    assert cd >= first
    with pytest.raises(VerifyError, match="central directory does not match"):
        feed(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_member_larger_than_its_header_is_refused(tmp_path: Path) -> None:
    z = make_zip(tmp_path / "b.zip", {"big": b"\0" * 1_000_000})
    data = bytearray(z.read_bytes())
    struct.pack_into("<I", data, 22, 1000)  # the local header's uncompressed size: a lie, as in a zip bomb
    bomb = tmp_path / "bomb.zip"
    bomb.write_bytes(bytes(data))
    with pytest.raises(UnsafeArchive, match="larger than its header says"):
        feed(bomb, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_declared_size_over_the_limit_is_refused_before_inflating(tmp_path: Path) -> None:
    z = make_zip(tmp_path / "b.zip", {"a": b"\0" * 5000, "b": b"\0" * 5000})
    zs = zipstream.ZipStream(tmp_path / "out", label="b.zip", max_total=8000)
    with pytest.raises(UnsafeArchive, match="expands to more than 8000 bytes"):
        zs.update(z.read_bytes())
    zs.discard()
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------- fetch: download + unpack in one pass


def make_bundle(tmp: Path, files: dict[str, bytes]) -> tuple[Path, Manifest]:
    roles = {rel: "license" if rel == "LICENSE" else "runtime" for rel in files}
    zip_path, manifest = make_bundle_zip(tmp, files, roles, name="t", inputs=inputs_for("zipstream"))
    return zip_path, manifest_mod.parse(manifest)


def test_fetch_cut_at_half_resumes_unpacks_and_transfers_under_1_6x(tmp_path: Path) -> None:
    files = {"payload.bin": random.Random(1).randbytes(400_000), "LICENSE": b"MIT License\n"}
    zip_path, manifest = make_bundle(tmp_path, files)
    size = zip_path.stat().st_size
    with FakeGitHub(ghstore.REPO, token=ghstore.TOKEN) as gh:
        ghstore.store_for(gh).publish(zip_path, manifest)
        store = ghstore.store_for(gh)
        def cut_zip_once(req: Any, h: Any) -> bool:  # the zip download (not the manifest's) hangs up half-way
            if req.host == "cdn" and "/bundle.zip?" in req.path:
                h.serve_cdn(cut=size // 2)
                return True
            return False

        gh.add_fault(cut_zip_once)
        since = len(gh.requests)
        out = tmp_path / "out"
        settings = Settings.from_env({"LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")})
        outcome = pipeline.fetch(KEY, store=store, settings=settings, log=ghstore.Captured().log, out=out,
                                 level=Level.STATIC, zip_=True)  # the zip, not the release's blobs
        zip_gets = [r for r in gh.requests[since:] if r.host == "cdn" and "/bundle.zip?" in r.path]
    assert outcome.out_dir == out
    assert sorted(p.name for p in out.iterdir()) == ["LICENSE", "bundle.json", "payload.bin"]
    assert (out / "payload.bin").read_bytes() == files["payload.bin"]
    assert outcome.verify is not None and outcome.verify.levels == {"manifest": "passed", "static": "passed"}
    # the cut GET brought half, the resumed one (Range from there) the rest: 1.5x the asset at most
    assert [r.headers.get("range") for r in zip_gets] == [None, f"bytes={size // 2}-"]
    transferred = size // 2 + (size - size // 2)
    assert transferred < 1.6 * size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle.zip", "cache", "out", "stage-bundle.zip-0"]  # no temp dir left


def test_fetch_of_a_tampered_asset_leaves_no_output(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path, {"payload.bin": os.urandom(200_000), "LICENSE": b"MIT\n"})
    with FakeGitHub(ghstore.REPO, token=ghstore.TOKEN) as gh:
        store = ghstore.store_for(gh)
        store.publish(zip_path, manifest)
        (asset,) = [a for a in gh.assets.values() if a.name == "bundle.zip"]
        data = bytearray(asset.data)
        data[len(data) // 2] ^= 1
        asset.data = bytes(data)
        out = tmp_path / "out"
        settings = Settings.from_env({"LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")})
        with pytest.raises(VerifyError) as e:
            pipeline.fetch(KEY, store=store, settings=settings, log=ghstore.Captured().log, out=out, zip_=True)
    assert e.value.exit_code == 5
    assert not out.exists()
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []  # no zip, no partial, no unpacked files


def test_a_member_expanding_beyond_the_ratio_is_refused_before_inflating(tmp_path: Path) -> None:
    z = make_zip(tmp_path / "b.zip", {"LICENSE": b"x", "zeros": b"\0" * (8 << 20)})  # deflates ~1000-fold
    with pytest.raises(UnsafeArchive, match="'zeros' expands"):
        feed(z, tmp_path / "out")
    assert not (tmp_path / "out").exists()
