"""The local directory store (DESIGN §6): lookup / fetch / publish with real zips, real files and real
concurrent processes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamabundle import bundle
from llamabundle.bundle.manifest import Manifest, ManifestError, parse
from llamabundle.errors import StoreError, UsageError, VerifyError
from llamabundle.store import open_store
from llamabundle.store.base import Entry
from llamabundle.store.local import SUMS, LocalStore
from tests import bundles as tb
from tests.processes import wait_for

TAG = "store"
KEY = tb.key_for(TAG)  # the sha256 of the bundle's recorded inputs, as a build's key is
OTHER_KEY = tb.key_for("other")
FILES = {"llama-server": b"#!/bin/sh\necho not an ELF\n", "LICENSE": b"MIT License\n"}
ROLES = {"llama-server": "exe", "LICENSE": "license"}


def make_bundle(tmp: Path, tag: str = TAG, *, name: str = "bundle.zip",
                files: dict[str, bytes] = FILES) -> tuple[Path, Manifest]:
    """A small valid bundle zip (non-ELF files) whose key is tb.key_for(tag), and its typed manifest."""
    tmp.mkdir(parents=True, exist_ok=True)
    zip_path, m = tb.make_zip(tmp, files, ROLES, zip_name=name, name="test-bundle", inputs=tb.inputs_for(tag))
    return zip_path, parse(m)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ lookup / publish


def test_lookup_miss_is_none(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")  # the root does not even exist yet
    assert store.lookup(KEY) is None
    (tmp_path / "store").mkdir()
    assert store.lookup(KEY) is None


def test_lookup_refuses_a_non_key(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for bad in ("../" + KEY[3:], KEY.upper(), KEY[:-1]):
        with pytest.raises(StoreError) as e:
            store.lookup(bad)
        assert e.value.exit_code == 6
        assert "is not a cache key" in e.value.what


def test_publish_then_lookup_hits_with_the_zip_digest(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    done = store.publish(zip_path, manifest)
    assert done.created is True

    entry = store.lookup(KEY)
    assert isinstance(entry, Entry)
    assert entry == done.entry
    assert entry.key == KEY
    assert entry.zip_name == "bundle.zip"
    assert entry.zip_sha256 == sha256(zip_path)
    assert entry.zip_size == zip_path.stat().st_size
    assert entry.manifest == manifest and entry.manifest.key == KEY
    assert entry.location == str((tmp_path / "store" / KEY / "bundle.zip").resolve())

    entry_dir = tmp_path / "store" / KEY
    assert sorted(p.name for p in entry_dir.iterdir()) == ["SHA256SUMS", "bundle.json", "bundle.zip"]
    assert (entry_dir / SUMS).read_text() == f"{sha256(zip_path)}  bundle.zip\n"
    assert json.loads((entry_dir / "bundle.json").read_text()) == manifest.to_json()
    assert (entry_dir / "bundle.zip").read_bytes() == zip_path.read_bytes()
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".publish-")]
    # other keys are still misses
    assert store.lookup(OTHER_KEY) is None


def test_second_publish_keeps_the_first(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    first = store.publish(zip_path, manifest)
    before = (tmp_path / "store" / KEY / "bundle.zip").stat().st_mtime_ns
    again = store.publish(zip_path, manifest)
    assert (first.created, again.created) == (True, False)
    assert again.entry == first.entry
    assert (tmp_path / "store" / KEY / "bundle.zip").stat().st_mtime_ns == before


def test_fetch_copies_a_verified_zip(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    entry = store.publish(zip_path, manifest).entry
    dest = tmp_path / "dl" / "nested"
    got = store.fetch(entry, dest)
    assert got == dest / "bundle.zip"
    assert sha256(got) == entry.zip_sha256 == sha256(zip_path)
    assert sorted(p.name for p in dest.iterdir()) == ["bundle.zip"]  # no .part left behind
    # the fetched zip is a bundle that unpacks and validates against its manifest
    assert bundle.unpack(got, tmp_path / "unpacked")[0] == manifest
    assert (tmp_path / "unpacked" / "LICENSE").read_bytes() == FILES["LICENSE"]


def test_fetch_of_a_vanished_entry_or_into_a_file_is_a_store_error(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    entry = store.publish(zip_path, manifest).entry
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    with pytest.raises(StoreError) as e:
        store.fetch(entry, a_file)
    assert e.value.exit_code == 6
    assert e.value.what == f"cannot create {a_file}"
    assert a_file.read_text() == "not a directory"

    (tmp_path / "store" / KEY / "bundle.zip").unlink()  # removed after the lookup
    dest = tmp_path / "dl"
    with pytest.raises(StoreError) as e:
        store.fetch(entry, dest)
    assert e.value.exit_code == 6
    assert e.value.what == f"cannot read {(tmp_path / 'store' / KEY / 'bundle.zip').resolve()}"
    assert list(dest.iterdir()) == []  # no .part left behind


def test_fetch_refuses_a_zip_that_no_longer_matches_the_entry(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    entry = store.publish(zip_path, manifest).entry
    stored = tmp_path / "store" / KEY / "bundle.zip"
    stored.write_bytes(stored.read_bytes() + b"appended")  # changed between lookup and fetch
    dest = tmp_path / "dl"
    with pytest.raises(VerifyError) as e:
        store.fetch(entry, dest)
    assert e.value.exit_code == 5
    assert "does not match its sha256 in the store" in e.value.what
    assert list(dest.iterdir()) == []


def test_a_lookup_reads_the_zip_once_until_the_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zip's sha256 is read in full once; the store then remembers the file's state (device, inode, size,
    mtime and ctime) beside it, and a lookup of an unchanged zip reads none of it. A zip changed in place, its
    size and mtime put back, has another ctime: it is read again, and refused."""
    from llamabundle.store import local

    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    store.publish(zip_path, manifest)
    reads: list[Path] = []
    real = local._digest
    monkeypatch.setattr(local, "_digest", lambda p: reads.append(p) or real(p))
    first, second = store.lookup(KEY), store.lookup(KEY)
    assert first == second and first is not None and first.zip_sha256 == sha256(zip_path)
    assert reads == [] and (tmp_path / "store" / ".verified" / f"{KEY}.json").is_file()  # read by publish's own lookup
    stored = tmp_path / "store" / KEY / "bundle.zip"
    st = stored.stat()
    data = bytearray(stored.read_bytes())
    data[-30] ^= 0xFF
    stored.write_bytes(bytes(data))
    os.utime(stored, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(VerifyError, match="does not match its SHA256SUMS"):
        store.lookup(KEY)
    assert reads == [stored]


def test_a_fetch_of_a_stamped_zip_copies_it_without_hashing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zip whose state the store's stamp vouches for (found right by a full read) is copied by the kernel, not
    read and hashed again: a cache-hit build copies the zip beside the bundle it assembles. The copy is the zip."""
    from llamabundle.store import local

    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    entry = store.publish(zip_path, manifest).entry
    hashed: list[object] = []
    real_chunks, real_digest = local._copy_chunks, local._digest
    monkeypatch.setattr(local, "_copy_chunks", lambda src, w, sp, f, h, sink: (hashed.append(h), real_chunks(src, w, sp, f, h, sink)))
    monkeypatch.setattr(local, "_digest", lambda p: hashed.append(p) or real_digest(p))
    got = store.fetch(entry, tmp_path / "dl")
    assert hashed == [] and got.read_bytes() == zip_path.read_bytes()
    # without its stamp (a read-only share writes none) the zip is hashed as it is copied
    (tmp_path / "store" / ".verified" / f"{KEY}.json").unlink()
    got = store.fetch(entry, tmp_path / "dl2")
    assert len(hashed) == 1 and hashed[0] is not None and got.read_bytes() == zip_path.read_bytes()


def test_a_stamped_zip_changed_while_it_is_copied_is_hashed_and_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The stamp vouches for one file state only: a zip written to once its stamp was read (its ctime moves) has
    its copy hashed, and a copy that is not the listed zip is refused, nothing left in dest."""
    from llamabundle.store import local

    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    entry = store.publish(zip_path, manifest).entry
    stored = tmp_path / "store" / KEY / "bundle.zip"
    real = local._kernel_copy

    def changed_meanwhile(src: object, w: object, final: Path) -> bool:  # after the stamp was read, before the copy
        with open(stored, "r+b") as f:
            f.seek(-30, os.SEEK_END)
            f.write(b"\xff")
        return real(src, w, final)  # type: ignore[arg-type]

    monkeypatch.setattr(local, "_kernel_copy", changed_meanwhile)
    with pytest.raises(VerifyError, match="does not match its sha256 in the store"):
        store.fetch(entry, tmp_path / "dl")
    assert list((tmp_path / "dl").iterdir()) == []


def test_partial_entry_is_not_a_hit_and_publish_replaces_it(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    root = tmp_path / "store"
    partial = root / KEY
    partial.mkdir(parents=True)
    (partial / "bundle.zip").write_bytes(b"half a zip")  # a crashed publisher: no bundle.json
    (partial / "junk.tmp").write_bytes(b"x")
    store = LocalStore(root)
    assert store.lookup(KEY) is None

    done = store.publish(zip_path, manifest)
    assert done.created is True
    assert sorted(p.name for p in partial.iterdir()) == ["SHA256SUMS", "bundle.json", "bundle.zip"]
    assert (partial / "bundle.zip").read_bytes() == zip_path.read_bytes()
    assert store.lookup(KEY).zip_sha256 == sha256(zip_path)


def test_a_changed_byte_in_the_stored_zip_is_a_verify_error(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    store.publish(zip_path, manifest)
    stored = tmp_path / "store" / KEY / "bundle.zip"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0x01
    stored.write_bytes(bytes(data))
    with pytest.raises(VerifyError) as e:
        store.lookup(KEY)
    assert e.value.exit_code == 5
    assert str(stored.resolve()) in e.value.what
    assert "SHA256SUMS" in e.value.what


def test_entry_whose_manifest_names_another_key_is_refused(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    store.publish(zip_path, manifest)
    mpath = tmp_path / "store" / KEY / "bundle.json"
    other = {**manifest.to_json(), "key": OTHER_KEY}
    mpath.write_text(json.dumps(other))  # re-keyed: its key is not the sha256 of its inputs
    with pytest.raises(ManifestError) as e:
        store.lookup(KEY)
    assert e.value.exit_code == 5
    assert f"store entry {(tmp_path / 'store' / KEY).resolve()}" in e.value.what
    assert "is not the sha256 of the inputs" in e.value.what
    # a consistent manifest of another bundle, under this key
    _zip2, m2 = make_bundle(tmp_path / "b", "other")
    mpath.write_text(m2.text())
    with pytest.raises(ManifestError) as e:
        store.lookup(KEY)
    assert e.value.exit_code == 5 and f"names key {OTHER_KEY[:12]}, not {KEY[:12]}" in e.value.what


@pytest.mark.parametrize(("text", "field", "what"), [
    ("[1, 2]", "", "is a list, not an object"),
    ('{"files": "x"}', "files", "'files' is the string 'x', not a list"),
    ('{"files": [1]}', "files[0]", "'files[0]' is a number, not an object"),
    ('{"platform": 5}', "platform", "'platform' is a number, not a string"),
    ('{"key": 12345}', "key", "'key' is a number, not a string"),
    ('{"llama_cpp": "x"}', "llama_cpp", "'llama_cpp' is the string 'x', not an object"),
    ("not json", "", "is not valid JSON"),
    (b"\xff\xfe", "", "is not UTF-8 text"),
])
def test_a_malformed_manifest_is_a_verify_error_naming_the_field(tmp_path: Path, text: str | bytes, field: str,
                                                                 what: str) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    store.publish(zip_path, manifest)
    mpath = (tmp_path / "store" / KEY / "bundle.json").resolve()
    if isinstance(text, str) and text.startswith("{"):
        text = json.dumps({**manifest.to_json(), **json.loads(text)})
    mpath.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ManifestError) as e:
        LocalStore(tmp_path / "store").lookup(KEY)
    assert e.value.exit_code == 5 and e.value.field == field
    assert e.value.what.startswith(str(mpath)) and what in e.value.what, e.value.what
    assert f"remove {mpath.parent}" in e.value.fix


@pytest.mark.parametrize("sums", [b"", b"nonsense\n", b"\xff\xfe  bundle.zip\n", ("0" * 64 + "  ../bundle.zip\n").encode(),
                                  ("0" * 64 + "  a.zip\n" + "1" * 64 + "  b.zip\n").encode()])
def test_a_damaged_sha256sums_is_a_store_error(tmp_path: Path, sums: bytes) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store = LocalStore(tmp_path / "store")
    store.publish(zip_path, manifest)
    (tmp_path / "store" / KEY / SUMS).write_bytes(sums)
    with pytest.raises(StoreError) as e:
        LocalStore(tmp_path / "store").lookup(KEY)
    assert e.value.exit_code == 6 and "store entry" in e.value.what


def test_publish_refuses_a_manifest_whose_key_is_not_its_inputs(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    liar = parse({**manifest.to_json(), "key": "f" * 64})
    with pytest.raises(ManifestError) as e:
        LocalStore(tmp_path / "store").publish(zip_path, liar)
    assert e.value.exit_code == 5 and "not the sha256 of the inputs" in e.value.what
    assert not (tmp_path / "store").exists()  # refused before anything was written


def test_a_store_that_is_a_regular_file_is_a_usage_error(tmp_path: Path) -> None:
    a_file = tmp_path / "store.txt"
    a_file.write_text("not a store")
    for root in (a_file, a_file / "below"):
        with pytest.raises(UsageError) as e:
            LocalStore(root)
        assert e.value.exit_code == 2 and f"store {root} is not a directory" in e.value.what
    assert a_file.read_text() == "not a store"


def test_sha256sums_is_utf8_and_names_non_ascii_zips(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path, name="bündel-ü ☃.zip")
    store = LocalStore(tmp_path / "störe")
    entry = store.publish(zip_path, manifest).entry
    assert entry.zip_name == "bündel-ü ☃.zip"
    sums = (tmp_path / "störe" / KEY / SUMS).read_bytes()
    assert sums == f"{sha256(zip_path)}  bündel-ü ☃.zip\n".encode()
    got = store.fetch(entry, tmp_path / "dl")
    assert got.name == "bündel-ü ☃.zip" and sha256(got) == sha256(zip_path)


# ------------------------------------------------------------------------------ open_store


def test_open_store_path_and_file_url(tmp_path: Path) -> None:
    s = open_store(str(tmp_path / "a"))
    assert isinstance(s, LocalStore)
    assert s.root == (tmp_path / "a").resolve()
    assert s.url == str((tmp_path / "a").resolve())

    f = open_store(f"file://{tmp_path}/b")
    assert isinstance(f, LocalStore)
    assert f.root == (tmp_path / "b").resolve()

    # a store opened by URL sees what one opened by path published
    zip_path, manifest = make_bundle(tmp_path)
    s.publish(zip_path, manifest)
    assert open_store(f"file://{tmp_path}/a").lookup(KEY).zip_sha256 == sha256(zip_path)


def test_open_store_github_is_the_releases_store() -> None:
    from llamabundle.store.github import GitHubStore

    s = open_store("github:ggml-org/bundles")
    assert isinstance(s, GitHubStore)
    assert s.url == "github:ggml-org/bundles"


@pytest.mark.parametrize("url", ["s3://bucket/x", "https://example.com/store"])
def test_open_store_unknown_scheme(url: str) -> None:
    with pytest.raises(UsageError) as e:
        open_store(url)
    assert e.value.exit_code == 2
    assert "unknown scheme" in e.value.what
    assert url in e.value.what


# ------------------------------------------------------------------------------ concurrency

_PUBLISHER = r"""
import json, os, sys, time
from pathlib import Path
from llamabundle.bundle.manifest import loads
from llamabundle.store.local import LocalStore
root, zip_path, manifest_path, ready, go = sys.argv[1:6]
manifest = loads(Path(manifest_path).read_bytes())
Path(ready).touch()
deadline = time.monotonic() + 30
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("barrier timed out")
    time.sleep(0.001)
done = LocalStore(Path(root)).publish(Path(zip_path), manifest)
print(json.dumps({"created": done.created, "sha": done.entry.zip_sha256, "location": done.entry.location}))
"""


@pytest.mark.race
def test_two_processes_publishing_the_same_key_leave_one_complete_entry(tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_text(manifest.text())
    root = tmp_path / "store"
    go = tmp_path / "go"
    readies = [tmp_path / f"ready-{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(root), str(zip_path), str(manifest_path),
                               str(r), str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in readies]
    try:
        wait_for(lambda: all(r.exists() for r in readies), procs=procs, name="both publishers to start")
        go.touch()  # both are spinning on the barrier: release them together
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    results = [json.loads(out.strip().splitlines()[-1]) for out, _err in outs]
    assert sorted(r["created"] for r in results) == [False, True]
    assert {r["sha"] for r in results} == {sha256(zip_path)}
    assert {r["location"] for r in results} == {str((root / KEY / "bundle.zip").resolve())}

    entries = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert entries == [KEY, "blobs"]  # the entry, and its files by content
    assert sorted(p.name for p in (root / KEY).iterdir()) == ["SHA256SUMS", "bundle.json", "bundle.zip"]
    assert not [p.name for p in root.iterdir() if p.name.startswith(".publish-")]
    assert LocalStore(root).lookup(KEY).zip_sha256 == sha256(zip_path)


@pytest.mark.race
def test_two_concurrent_cli_publishes_both_succeed(tmp_path: Path) -> None:
    zip_path, _manifest = make_bundle(tmp_path)
    root = tmp_path / "store"
    env = {**os.environ, "NO_COLOR": "1"}
    argv = [sys.executable, "-m", "llamabundle", "publish", str(zip_path), "--store", str(root)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    states = sorted(out.split(":", 1)[0] for out, _err in outs)
    assert states == ["already published", "published"], outs
    for out, _err in outs:
        assert f"{KEY} -> {(root / KEY / 'bundle.zip').resolve()}" in out
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [KEY, "blobs"]
    assert sorted(p.name for p in (root / KEY).iterdir()) == ["SHA256SUMS", "bundle.json", "bundle.zip"]
    assert not [p.name for p in root.iterdir() if p.name.startswith(".publish-")]
