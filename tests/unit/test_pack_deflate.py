"""pack's deflate ahead of the writer (bundle/deflate.py): the members' streams are made in worker threads and, for
large members, kept in the cache by content, and the zip is byte for byte the one zipfile alone writes (what
every published zip was made by, and what the OCI store rebuilds a zip to); a damaged cached stream is made again,
never used."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest

from llamabundle.bundle import ZIP_EPOCH_DEFAULT, deflate, pack
from llamabundle.digest import walk


def zipfile_alone(root: Path, out: Path) -> bytes:
    """What pack wrote before it deflated ahead: zipfile, member by member, the same headers."""
    names = sorted(walk(root), key=lambda n: (n != "bundle.json", n))
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for name in names:
            info = zipfile.ZipInfo(name, date_time=ZIP_EPOCH_DEFAULT)
            info.create_system = 3
            info.external_attr = (0o100755 if os.access(root / name, os.X_OK) else 0o100644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with open(root / name, "rb") as src, zf.open(info, "w") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    return out.read_bytes()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    root.mkdir()
    (root / "bundle.json").write_text('{"format": 1}\n')
    (root / "empty").write_bytes(b"")
    (root / "libbig.so").write_bytes(os.urandom(3 << 20) + bytes(6 << 20) + b"ggml " * 200_000)  # past CACHE_MIN
    (root / "llama-server").write_bytes(b"\x7fELF" + os.urandom(70_000))
    (root / "llama-server").chmod(0o755)
    (root / "ünïcode.txt").write_text("a name zipfile flags as UTF-8\n")
    return root


def test_the_zip_is_zipfiles_own_with_and_without_the_cache_hit_or_miss(tree: Path, tmp_path: Path) -> None:
    want = zipfile_alone(tree, tmp_path / "alone.zip")
    assert pack(tree, tmp_path / "plain.zip").read_bytes() == want
    cache = tmp_path / "deflated"
    assert pack(tree, tmp_path / "miss.zip", cache=cache).read_bytes() == want
    kept = list(cache.iterdir())
    assert [p.name.split(".")[0] for p in kept] == [__import__("hashlib").sha256((tree / "libbig.so").read_bytes()).hexdigest()]
    assert pack(tree, tmp_path / "hit.zip", cache=cache).read_bytes() == want
    assert deflate.deflate(tree / "libbig.so", cache=cache).cached
    assert not deflate.deflate(tree / "llama-server", cache=cache).cached, "small members are not kept"
    with zipfile.ZipFile(tmp_path / "hit.zip") as zf:
        assert zf.testzip() is None and zf.read("libbig.so") == (tree / "libbig.so").read_bytes()


def test_zipfile_is_never_fed_a_member_and_a_hit_reads_it_once(tree: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRC-32 and size zipfile records come from the pass that hashed or deflated the member: without the cache,
    and on a hit, every member is opened once; on a miss a large member twice (hashed for the lookup, then
    deflated), a small one once."""
    import builtins
    import collections

    opened: collections.Counter[str] = collections.Counter()

    def counting(file: object, *args: object, **kwargs: object) -> object:
        if isinstance(file, Path) and file.parent == tree:
            opened[file.name] += 1
        return builtins.open(file, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(deflate, "open", counting, raising=False)
    monkeypatch.setattr("llamabundle.bundle.open", counting, raising=False)
    want = zipfile_alone(tree, tmp_path / "alone.zip")
    cache = tmp_path / "deflated"
    once = {n: 1 for n in walk(tree)}
    for name, kwargs, expect in (("plain", {}, once), ("miss", {"cache": cache}, {**once, "libbig.so": 2}),
                                 ("hit", {"cache": cache}, once)):
        opened.clear()
        assert pack(tree, tmp_path / f"{name}.zip", **kwargs).read_bytes() == want  # type: ignore[arg-type]
        assert opened == expect, (name, opened)
    assert deflate.deflate(tree / "libbig.so", cache=cache).cached


def test_a_damaged_or_foreign_cached_stream_is_never_used(tree: Path, tmp_path: Path) -> None:
    want = zipfile_alone(tree, tmp_path / "alone.zip")
    cache = tmp_path / "deflated"
    pack(tree, tmp_path / "fill.zip", cache=cache)
    (entry,) = cache.iterdir()
    raw = bytearray(entry.read_bytes())
    raw[-100] ^= 0xFF  # a flipped bit in the stream
    entry.write_bytes(bytes(raw))
    assert not deflate.deflate(tree / "libbig.so", cache=cache).cached
    assert pack(tree, tmp_path / "again.zip", cache=cache).read_bytes() == want
    entry.write_bytes(b"short")
    assert pack(tree, tmp_path / "short.zip", cache=cache).read_bytes() == want
    (tree / "libbig.so").write_bytes((tree / "libbig.so").read_bytes()[:-1] + b"!")  # another content: another name
    assert not deflate.deflate(tree / "libbig.so", cache=cache).cached


def test_an_unwritable_cache_costs_only_the_deflate(tree: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    assert pack(tree, tmp_path / "z.zip", cache=blocked).read_bytes() == zipfile_alone(tree, tmp_path / "alone.zip")


def test_members_are_read_ahead_within_the_bound_and_in_order(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deflate, "MAX_WAITING", 1)  # one member at a time: still every one, in order
    names = sorted(walk(tree))
    got = list(deflate.streams(tree, names, workers=4))
    assert [n for n, _ in got] == names
    assert all(isinstance(s.data, bytes) and s.data for _, s in got)
