"""Files by content (the layered-bundles issue, parts 1 and 2, local store): a directory store keeps each file of
every bundle once, by sha256, written before the entry appears; an install downloads into the install root's blob
cache only the files it lacks, checks each one, links them into the version directory and checks the whole as
before. Bundles here share llama-server, the CPU backend and the LICENSE and differ in libggml-cuda.so."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest

from llamabundle import digest, scratch
from llamabundle.bundle.manifest import FileEntry
from llamabundle.errors import VerifyError
from llamabundle.runtime import install as install_mod
from llamabundle.runtime.install import BundleInvalid, check_bundle, install_bundle, list_installed, uninstall
from llamabundle.store import blobcache, codec
from llamabundle.store.local import BLOBS, LocalStore
from tests.installs import plant
from tests.probing import QUIET, make_zip, publish

PLATFORM = "linux-x86_64"


def blobs(store: Path) -> dict[str, int]:
    """The store's blobs: the sha256 they are named by -> the size of what they decompress to (checked to hash so)."""
    d = store.joinpath(*BLOBS)
    out = {}
    for p in sorted(d.iterdir()) if d.is_dir() else ():
        with open(p, "rb") as f:
            got = codec.unpack(f, io.BytesIO(), limit=1 << 30)
        assert p.name == got.sha256 + codec.SUFFIX
        out[got.sha256] = got.size
    return out


def packed(store: Path, *files: FileEntry) -> int:
    """The bytes an install downloads for these files: their zstd blobs."""
    return sum(store.joinpath(*BLOBS, f.sha256 + codec.SUFFIX).stat().st_size for f in files)


def cache(root: Path) -> list[str]:
    """The blobs of the install root's cache (its stamps file, blobcache.STAMPS, left out)."""
    d = root / install_mod.BLOB_CACHE
    return sorted(p.name for p in d.iterdir() if p.name != blobcache.STAMPS) if d.is_dir() else []


def test_a_store_keeps_each_file_once_and_a_second_bundle_adds_only_its_new_files(tmp_path: Path) -> None:
    store = tmp_path / "store"
    a = publish(store, tmp_path, salt="a")
    assert blobs(store) == {f.sha256: f.size for f in a.files}
    b = publish(store, tmp_path, salt="b")
    unique = {f.sha256: f.size for f in (*a.files, *b.files)}
    assert blobs(store) == unique and len(unique) == len(a.files) + 1  # only libggml-cuda.so differs
    assert not [p for p in store.joinpath(*BLOBS).iterdir() if p.name.startswith(".")]  # no temp file left


def test_an_install_downloads_only_what_the_machine_lacks_and_links_it(tmp_path: Path) -> None:
    store, root = tmp_path / "store", tmp_path / "data"
    a = publish(store, tmp_path, salt="a")
    b = publish(store, tmp_path, salt="b", name="other")
    first = install_bundle(LocalStore(store), a.key, root=root, log=QUIET)
    t = first.transfer
    assert (t.by, t.downloaded, t.from_cache, t.files, t.fetched) == ("blobs", packed(store, *a.files), 0, 4, 4)
    second = install_bundle(LocalStore(store), b.key, root=root, log=QUIET)
    cuda = next(f for f in b.files if f.path == "libggml-cuda.so")
    t = second.transfer
    assert (t.by, t.downloaded, t.fetched) == ("blobs", packed(store, cuda), 1)
    assert t.from_cache == sum(f.size for f in b.files) - cuda.size
    for inst, m in ((first.installed, a), (second.installed, b)):
        check_bundle(inst.path, key=m.key, platform=PLATFORM)
        server = inst.path / "llama-server"
        assert server.stat().st_mode & 0o777 == 0o755 and (inst.path / "LICENSE").stat().st_mode & 0o777 == 0o644
        assert server.stat().st_nlink == 3  # the cache's blob and both installs: one copy on disk
    assert first.to_json()["transfer"] == {"by": "blobs", "downloaded_bytes": packed(store, *a.files),
                                           "cached_bytes": 0, "files": 4, "files_downloaded": 4}


def test_a_changed_blob_in_the_store_is_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    store, root = tmp_path / "store", tmp_path / "data"
    m = publish(store, tmp_path)
    lic = next(f for f in m.files if f.path == "LICENSE")
    with open(store.joinpath(*BLOBS, lic.sha256 + codec.SUFFIX), "wb") as out:  # a good frame of other bytes
        codec.pack(io.BytesIO(b"MIT Licensf\n"), out)
    with pytest.raises(BundleInvalid) as e:
        install_bundle(LocalStore(store), m.key, root=root, log=QUIET)
    assert f"LICENSE ({lic.sha256[:12]}) from {store} does not match its sha256" in e.value.what
    assert list_installed(root) == []
    assert lic.sha256 not in cache(root) and not [n for n in cache(root) if n.startswith(".")]
    assert sorted(p.name for p in (root / "bundles" / m.name).iterdir()) == []


def test_an_install_changed_on_disk_never_feeds_the_next_one(tmp_path: Path) -> None:
    """Installs link the cache's blobs: a file edited in one install changes the blob. The next install checks
    every blob it would reuse, downloads that one again, and both bundles check."""
    store, root = tmp_path / "store", tmp_path / "data"
    a, b = publish(store, tmp_path, salt="a"), publish(store, tmp_path, salt="b", name="other")
    first = install_bundle(LocalStore(store), a.key, root=root, log=QUIET).installed
    (first.path / "LICENSE").write_bytes(b"edited\n")  # through the link: the cache's blob changes too
    second = install_bundle(LocalStore(store), b.key, root=root, log=QUIET)
    lic = next(f for f in b.files if f.path == "LICENSE")
    assert second.transfer.fetched == 2 and second.transfer.downloaded == packed(
        store, lic, next(f for f in b.files if f.path == "libggml-cuda.so"))
    check_bundle(second.installed.path, key=b.key, platform=PLATFORM)
    again = install_bundle(LocalStore(store), a.key, root=root, log=QUIET)  # the edited install fails its check
    assert not again.reused and again.transfer.by == "blobs" and again.transfer.downloaded == 0
    check_bundle(again.installed.path, key=a.key, platform=PLATFORM)


def test_an_unchanged_blob_is_not_read_again_and_a_changed_one_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After an install the cache stamps each blob's state (device, inode, size, mtime, ctime): the next install
    of a bundle sharing them reads none of them. A blob edited through an install's link, its size and mtime put
    back, has another ctime: it is read, found changed, and downloaded again."""
    store, root = tmp_path / "store", tmp_path / "data"
    a, b = publish(store, tmp_path, salt="a"), publish(store, tmp_path, salt="b", name="other")
    first = install_bundle(LocalStore(store), a.key, root=root, log=QUIET).installed
    read: list[Path] = []
    real = blobcache.sha256_file
    monkeypatch.setattr(blobcache, "sha256_file", lambda p: read.append(Path(p).name) or real(p))
    second = install_bundle(LocalStore(store), b.key, root=root, log=QUIET)
    assert read == [] and second.transfer.fetched == 1  # libggml-cuda.so, salted; the other files stamped
    lic = first.path / "LICENSE"
    st = lic.stat()
    lic.write_bytes(b"MIT Licensx\n")  # same size, through the link: the cache's blob changes too
    os.utime(lic, ns=(st.st_atime_ns, st.st_mtime_ns))
    third = install_bundle(LocalStore(store), a.key, root=root, log=QUIET)  # the edited install fails its check
    assert read == [next(blobcache.blob_name(f) for f in a.files if f.path == "LICENSE")]
    assert third.transfer.fetched == 1 and (third.installed.path / "LICENSE").read_bytes() == b"MIT License\n"


def test_a_zip_that_disagrees_with_its_manifest_is_not_published(tmp_path: Path) -> None:
    store = tmp_path / "store"
    zip_path, m = make_zip(tmp_path)
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(zip_path) as zin, zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info, b"MIT Licensf\n" if info.filename == "LICENSE" else zin.read(info))
    with pytest.raises(VerifyError) as e:
        LocalStore(store).publish(bad, m)
    assert e.value.what == "bad.zip:LICENSE does not match its sha256 in bundle.json"
    assert LocalStore(store).lookup(m.key) is None
    assert all(not n.startswith(".") for n in blobs(store))


def test_a_pinned_install_and_an_entry_without_blobs_download_the_zip(tmp_path: Path) -> None:
    store, root = tmp_path / "store", tmp_path / "data"
    zip_path, m = make_zip(tmp_path)
    plant(store, m.key, zip_path, m.text())  # as a store of an earlier llamabundle holds it: no blobs
    got = install_bundle(LocalStore(store), m.key, root=root, log=QUIET)
    assert got.transfer.by == "zip" and got.transfer.downloaded == zip_path.stat().st_size
    other = tmp_path / "store2"
    m2 = publish(other, tmp_path, salt="pinned")
    entry = LocalStore(other).lookup(m2.key)
    assert entry is not None
    pinned = install_bundle(LocalStore(other), m2.key, root=tmp_path / "data2", log=QUIET, expect_sha256=entry.zip_sha256)
    assert pinned.transfer.by == "zip"  # a pin is on the zip's bytes: the zip is what is read


def test_blobs_no_install_links_are_pruned_and_a_killed_downloads_leftover_swept(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store, root = tmp_path / "store", tmp_path / "data"
    a, b = publish(store, tmp_path, salt="a"), publish(store, tmp_path, salt="b", name="other")
    install_bundle(LocalStore(store), a.key, root=root, log=QUIET)
    uninstall(root, a.key)
    assert len(cache(root)) == 4  # kept a while: another install may be about to link them
    dead = scratch.owned(root / install_mod.BLOB_CACHE, blobcache.PREFIX, ".part")
    dead = dead.with_name(dead.name.replace(f"{os.getpid()}-", "999999999-", 1))
    dead.write_bytes(b"half a blob")
    monkeypatch.setattr(blobcache, "KEEP", -1)
    install_bundle(LocalStore(store), b.key, root=root, log=QUIET)
    assert cache(root) == sorted(blobcache.blob_name(f) for f in b.files)  # a's own one is gone
    assert not dead.exists()
    assert digest.sha256_file(root / install_mod.BLOB_CACHE / next(
        f.sha256 for f in b.files if f.path == "LICENSE")) == next(f.sha256 for f in b.files if f.path == "LICENSE")


@pytest.mark.parametrize("blob", [b"not zstd at all", "bomb"])
def test_a_blob_that_is_not_a_frame_of_its_file_or_inflates_past_it_is_refused(tmp_path: Path, blob: bytes | str) -> None:
    store, root = tmp_path / "store", tmp_path / "data"
    m = publish(store, tmp_path)
    lic = next(f for f in m.files if f.path == "LICENSE")
    with open(store.joinpath(*BLOBS, lic.sha256 + codec.SUFFIX), "wb") as out:
        if blob == "bomb":  # 64 MiB of zeros in a few KB: decompressing stops one byte past the file's size
            codec.pack(io.BytesIO(bytes(64 << 20)), out)
        else:
            assert isinstance(blob, bytes)
            out.write(blob)
    with pytest.raises(BundleInvalid) as e:
        install_bundle(LocalStore(store), m.key, root=root, log=QUIET)
    assert f"LICENSE ({lic.sha256[:12]}) from {store}" in e.value.what
    assert list_installed(root) == [] and not [n for n in cache(root) if n.startswith(".")]
    assert lic.sha256 not in cache(root)


def test_a_pin_of_the_published_bundle_json_installs_by_content_and_a_wrong_one_downloads_nothing(tmp_path: Path) -> None:
    """bundle.json names every file's sha256: pinning its sha256 (as the store publishes it) pins every byte, so
    the files may come by content; a pin that is neither the zip's nor the manifest's is refused before any."""
    store, root = tmp_path / "store", tmp_path / "data"
    m = publish(store, tmp_path, backends=("cpu", "cuda", "vulkan"), parts=True)
    published = digest.sha256_file(store / m.key / "bundle.json")
    got = install_bundle(LocalStore(store), m.key, root=root, log=QUIET, expect_sha256=published, backends_wanted="cpu")
    assert got.transfer.by == "blobs" and got.pinned is not None and got.pinned.sha256 == published
    again = install_bundle(LocalStore(store), m.key, root=root, log=QUIET, expect_sha256=published.upper(),
                           backends_wanted="cpu")
    assert again.reused  # the cut names the manifest it was cut from
    with pytest.raises(BundleInvalid) as e:
        install_bundle(LocalStore(store), m.key, root=tmp_path / "other", log=QUIET, expect_sha256="ab" * 32)
    assert "pinned by --expect-sha256" in e.value.what and not (tmp_path / "other" / install_mod.BLOB_CACHE).exists()


def test_fetch_by_content_downloads_only_what_the_cache_lacks_and_fetch_zip_reads_the_zip(tmp_path: Path) -> None:
    import json

    from tests.probing import cli

    store = tmp_path / "store"
    # CPU bundles (verify's static level reads a CUDA module's GPU code): two keys, the same files
    a, b = (publish(store, tmp_path, salt=s, name=s, backends=("cpu",)) for s in ("a", "b"))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")}

    def fetch(m: object, out: str, *more: str) -> dict[str, object]:
        r = cli("fetch", m.key, "--store", str(store), "--out", str(tmp_path / out), "--json", *more, env=env)
        assert r.returncode == 0, r.stderr
        got: dict[str, object] = json.loads(r.stdout)
        return got

    first, second = fetch(a, "a"), fetch(b, "b")
    assert first["zip"] is None and first["transfer"] == {"by": "blobs", "downloaded_bytes": packed(store, *a.files),
                                                          "cached_bytes": 0, "files": 3, "files_downloaded": 3}
    assert second["transfer"] == {"by": "blobs", "downloaded_bytes": 0, "cached_bytes": sum(f.size for f in b.files),
                                  "files": 3, "files_downloaded": 0}
    check_bundle(tmp_path / "b", key=b.key, platform=PLATFORM)
    assert (tmp_path / "b" / "llama-server").stat().st_nlink == 3  # the cache's blob, and a's and b's --out
    whole = fetch(b, "z", "--zip")
    assert whole["zip"] == str(tmp_path / "cache" / "fetched" / b.key / f"{b.name}-{b.key[:12]}.zip")
    assert whole["transfer"]["by"] == "zip"  # type: ignore[index]


def test_a_fetch_and_an_install_by_content_read_each_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files are hashed as they are written (a blob downloaded) or found (a blob reused): the trust check
    after takes those digests and reads none of them again (the second read of what was just written was a
    third of a hit's time on the H200)."""
    from llamabundle import pipeline
    from llamabundle.bundle import manifest as manifest_mod
    from llamabundle.settings import Settings

    read: list[Path] = []
    real = manifest_mod.sha256_file
    monkeypatch.setattr(manifest_mod, "sha256_file", lambda p: read.append(Path(p)) or real(p))
    store = tmp_path / "store"
    m = publish(store, tmp_path, backends=("cpu",))
    settings = Settings.from_env({"LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")})
    for out in ("cold", "warm"):  # the blobs downloaded, then found in the cache
        got = pipeline.fetch(m.key, store=LocalStore(store), settings=settings, log=QUIET, out=tmp_path / out)
        assert got.transfer is not None and got.verify is not None and got.verify.levels["manifest"] == "passed"
    install_bundle(LocalStore(store), m.key, root=tmp_path / "data", log=QUIET, platform=PLATFORM)
    assert read == []
    (tmp_path / "warm" / "LICENSE").write_bytes(b"MIT Licensx\n")  # same size: only reading it shows the change
    with pytest.raises(VerifyError):
        check_bundle(tmp_path / "warm", key=m.key, platform=PLATFORM)
    assert read != []
