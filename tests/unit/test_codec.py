"""store.codec's unpack of a large file (PIPELINED bytes or more): decompressed here, hashed and written by two
threads of their own, with the same result as the one-thread path; a stream that is not zstd, one longer than its
limit, one cut short and a write that fails end as they do there, and no thread is left behind."""

from __future__ import annotations

import hashlib
import io
import os
import threading

import pytest
import zstandard

from llamabundle.store import codec


def _frame(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_checksum=True).compress(data)


@pytest.fixture
def small_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipelined path from 1 MiB on, in chunks of 64 KiB, so that a test file of a few MiB takes it."""
    monkeypatch.setattr(codec, "PIPELINED", 1 << 20)
    monkeypatch.setattr(codec, "PIPE_CHUNK", 64 << 10)


DATA = os.urandom(1 << 20) * 3 + b"tail" * 1000  # compressible, 3 MiB and a bit


@pytest.mark.usefixtures("small_pipeline")
@pytest.mark.parametrize("cpus", [1, 2])
def test_both_paths_write_and_hash_every_byte_alike(cpus: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)  # one core: the one-thread path
    started = threading.active_count()
    out = io.BytesIO()
    got = codec.unpack(io.BytesIO(frame := _frame(DATA)), out, limit=len(DATA))
    assert (got.sha256, got.size, got.packed_size) == (hashlib.sha256(DATA).hexdigest(), len(DATA), len(frame))
    assert out.getvalue() == DATA and threading.active_count() == started


@pytest.mark.usefixtures("small_pipeline")
def test_a_frame_longer_than_its_limit_stops_one_byte_past_it() -> None:
    out = io.BytesIO()
    got = codec.unpack(io.BytesIO(_frame(DATA)), out, limit=len(DATA) - 100_000)
    assert got.size == len(DATA) - 100_000 + 1 and out.getvalue() == DATA[:got.size]
    assert got.sha256 == hashlib.sha256(DATA[:got.size]).hexdigest()


@pytest.mark.usefixtures("small_pipeline")
def test_a_stream_that_is_not_zstd_is_a_codec_error_and_one_cut_short_gives_fewer_bytes() -> None:
    started = threading.active_count()
    with pytest.raises(codec.CodecError, match="not a zstd frame"):
        codec.unpack(io.BytesIO(b"not zstd at all" * 100_000), io.BytesIO(), limit=len(DATA))
    frame = _frame(DATA)
    got = codec.unpack(io.BytesIO(frame[:len(frame) // 2]), out := io.BytesIO(), limit=len(DATA))
    assert 0 < got.size < len(DATA) and out.getvalue() == DATA[:got.size]  # the caller compares the size
    assert threading.active_count() == started


class _FullDisk(io.BytesIO):
    def __init__(self, room: int) -> None:
        super().__init__()
        self.room, self.writes = room, 0

    def write(self, b: object) -> int:
        self.writes += 1
        if self.tell() + len(b) > self.room:  # type: ignore[arg-type]
            raise OSError(28, "No space left on device")
        return super().write(b)  # type: ignore[arg-type]


@pytest.mark.usefixtures("small_pipeline")
def test_a_write_that_fails_stops_the_reading_and_is_raised() -> None:
    big = os.urandom(256) * (64 << 10)  # 16 MiB: 256 chunks, far more than the queues hold
    out = _FullDisk(room=1 << 20)
    started = threading.active_count()
    with pytest.raises(OSError, match="No space left"):
        codec.unpack(io.BytesIO(_frame(big)), out, limit=len(big))
    assert out.writes == 17  # the failed write is the last: what the reader had queued was drained, not written
    assert threading.active_count() == started
