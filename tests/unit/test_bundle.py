"""The bundle contract (DESIGN §5): manifest, content check, deterministic zip, safe unpack."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import stat
import zipfile
from pathlib import Path
from typing import Any

import pytest

from llamabundle import bundle, digest
from llamabundle.bundle import (
    MANIFEST,
    file_entries,
    pack,
    read_manifest,
    unpack,
    write_manifest,
)
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.errors import VerifyError
from tests.bundles import inputs_for, key_of


def check_contents(root: Path, m: manifest_mod.Manifest) -> manifest_mod.ContentCheck:
    """The trust check of an unpacked bundle, asking for nothing in particular."""
    check = manifest_mod.trust(m, root)
    assert check is not None
    return check


INPUTS = inputs_for("bundle")
KEY = key_of(INPUTS)
FILES = {
    "llama-server": (b"\x7fELF fake server\n" * 50, 0o755, "exe"),
    "libggml-cpu.so": (b"cpu backend " * 300, 0o644, "backend"),
    "libggml-base.so": (bytes(range(256)) * 8, 0o644, "runtime"),
    "LICENSE": (b"MIT License\n", 0o644, "license"),
}
ROLES = {name: role for name, (_, _, role) in FILES.items()}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_bundle(root: Path, *, manifest: bool = True) -> manifest_mod.Manifest | None:
    root.mkdir(parents=True)
    for name, (data, mode, _) in FILES.items():
        (root / name).write_bytes(data)
        os.chmod(root / name, mode)
    if not manifest:
        return None
    return write_manifest(root, {"name": "test", "key": KEY, "inputs": INPUTS, "platform": "linux-x86_64",
                                 "llama_cpp": {"commit": INPUTS["commit"], "version": "b1"},
                                 "files": file_entries(root, ROLES), "built_at": "2024-01-01T00:00:00Z"})


def expect_verify_error(fn: Any, *args: Any) -> VerifyError:
    with pytest.raises(VerifyError) as e:
        fn(*args)
    assert e.value.exit_code == 5
    return e.value


# ------------------------------------------------------------------------------------ entries


def test_file_entries_hash_size_role_sorted(tmp_path: Path) -> None:
    root = tmp_path / "b"
    make_bundle(root, manifest=False)
    (root / MANIFEST).write_text("{}")  # never listed in itself
    entries = file_entries(root, ROLES)
    assert [e["path"] for e in entries] == ["LICENSE", "libggml-base.so", "libggml-cpu.so", "llama-server"]
    for e in entries:
        data, _, role = FILES[e["path"]]
        assert e == {"path": e["path"], "sha256": sha(data), "size": len(data), "role": role}
    assert entries[3]["sha256"] == sha(b"\x7fELF fake server\n" * 50)
    assert entries[0]["size"] == 12


def test_file_entries_refuses_a_file_without_a_role(tmp_path: Path) -> None:
    root = tmp_path / "b"
    make_bundle(root, manifest=False)
    (root / "stray.txt").write_text("x")
    with pytest.raises(ValueError, match="stray.txt"):
        file_entries(root, ROLES)
    with pytest.raises(ValueError, match="LICENSE"):
        file_entries(root, {**ROLES, "stray.txt": "exe", "LICENSE": "documentation"})


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    f = tmp_path / "big"
    data = os.urandom((1 << 20) + 17)  # crosses the read chunk
    f.write_bytes(data)
    assert digest.sha256_file(f) == sha(data)


# ------------------------------------------------------------------------------------ manifest


def test_write_and_read_manifest_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "b"
    written = make_bundle(root)
    assert written is not None
    assert written.to_json()["format"] == 1
    assert written.tool is not None and written.tool.startswith("llamabundle ")
    on_disk = json.loads((root / MANIFEST).read_text())
    assert on_disk == written.to_json()
    assert list(on_disk) == sorted(on_disk)  # sort_keys: stable bytes
    read = read_manifest(root)
    assert read == written
    assert [f.path for f in read.files] == ["LICENSE", "libggml-base.so", "libggml-cpu.so", "llama-server"]
    assert read.key == KEY and read.inputs_key() == KEY


@pytest.mark.parametrize("fmt", [2, 0, "1", None])
def test_read_manifest_refuses_an_unknown_format(tmp_path: Path, fmt: Any) -> None:
    root = tmp_path / "b"
    make_bundle(root)
    m = json.loads((root / MANIFEST).read_text())
    m["format"] = fmt
    (root / MANIFEST).write_text(json.dumps(m))
    err = expect_verify_error(read_manifest, root)
    assert "unknown format" in err.what


def test_read_manifest_refuses_bad_json_missing_keys_and_absence(tmp_path: Path) -> None:
    root = tmp_path / "b"
    make_bundle(root)
    m = json.loads((root / MANIFEST).read_text())
    del m["key"]
    (root / MANIFEST).write_text(json.dumps(m))
    assert expect_verify_error(read_manifest, root).what == "bundle.json lacks 'key'"
    (root / MANIFEST).write_text("{not json")
    assert "not valid JSON" in expect_verify_error(read_manifest, root).what
    (root / MANIFEST).write_text("[1, 2]")
    assert expect_verify_error(read_manifest, root).what == "bundle.json is a list, not an object"
    (root / MANIFEST).unlink()
    assert "has no bundle.json" in expect_verify_error(read_manifest, root).what


# ------------------------------------------------------------------------------------ contents


def test_check_contents_passes_for_an_intact_bundle(tmp_path: Path) -> None:
    root = tmp_path / "b"
    m = make_bundle(root)
    c = check_contents(root, m)
    assert c.files == 4
    assert c.bytes == sum(len(d) for d, _, _ in FILES.values())


def test_check_contents_catches_one_changed_byte(tmp_path: Path) -> None:
    root = tmp_path / "b"
    m = make_bundle(root)
    data = bytearray((root / "libggml-cpu.so").read_bytes())
    data[100] ^= 0x01
    (root / "libggml-cpu.so").write_bytes(bytes(data))
    err = expect_verify_error(check_contents, root, m)
    assert err.what == "libggml-cpu.so does not match its sha256 in bundle.json"


def test_check_contents_catches_a_size_change(tmp_path: Path) -> None:
    root = tmp_path / "b"
    m = make_bundle(root)
    with open(root / "LICENSE", "ab") as f:
        f.write(b"\n")
    err = expect_verify_error(check_contents, root, m)
    assert err.what == "LICENSE has size 13, bundle.json says 12"


def test_check_contents_catches_an_extra_file(tmp_path: Path) -> None:
    root = tmp_path / "b"
    m = make_bundle(root)
    (root / "libevil.so").write_bytes(b"x")
    err = expect_verify_error(check_contents, root, m)
    assert err.what == "libevil.so is in the bundle but not in bundle.json"
    (root / "sub").mkdir()
    (root / "sub" / "more").write_bytes(b"y")
    err = expect_verify_error(check_contents, root, m)
    assert err.what.startswith("libevil.so is in the bundle") and "(and 1 more)" in err.what


def test_check_contents_catches_a_missing_file(tmp_path: Path) -> None:
    root = tmp_path / "b"
    m = make_bundle(root)
    (root / "libggml-base.so").unlink()
    err = expect_verify_error(check_contents, root, m)
    assert err.what == "libggml-base.so is listed in bundle.json but missing"


@pytest.mark.parametrize("bad", ["../outside", "a/../../x", "/etc/passwd", "bundle.json", "C:/x", "a\\b"])
def test_a_manifest_listing_an_invalid_path_is_refused(tmp_path: Path, bad: Any) -> None:
    root = tmp_path / "b"
    make_bundle(root)
    (tmp_path / "outside").write_bytes(b"x")
    m = json.loads((root / MANIFEST).read_text())
    m["files"].append({"path": bad, "sha256": sha(b"x"), "size": 1, "role": "exe"})
    (root / MANIFEST).write_text(json.dumps(m))
    err = expect_verify_error(read_manifest, root)
    assert err.what == f"bundle.json: 'files[4].path' is {bad!r}, not a relative path inside the bundle"


# ------------------------------------------------------------------------------------ pack


def zip_sha(path: Path) -> str:
    return sha(path.read_bytes())


def test_pack_is_byte_identical_across_runs_mtimes_and_modes(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    make_bundle(a)
    shutil.copytree(a, b)
    za = pack(a, tmp_path / "out" / "a.zip")
    zb = pack(a, tmp_path / "out" / "b.zip")
    assert za == tmp_path / "out" / "a.zip"
    assert za.read_bytes() == zb.read_bytes()
    # Another copy: other mtimes and other (but equivalent) modes.
    for i, p in enumerate(sorted(b.iterdir())):
        os.utime(p, (1_000_000_000 + i * 7777, 1_000_000_000 + i * 7777))
    os.chmod(b / "llama-server", 0o700)  # exec for the owner only: still 0755 in the zip
    os.chmod(b / "LICENSE", 0o600)
    os.chmod(b / "libggml-cpu.so", 0o664)
    zc = pack(b, tmp_path / "out" / "c.zip")
    assert zip_sha(zc) == zip_sha(za)


def test_pack_layout_order_times_and_modes(tmp_path: Path) -> None:
    root = tmp_path / "b"
    make_bundle(root)
    os.chmod(root / "libggml-cpu.so", 0o775)  # a backend with its exec bit keeps it
    z = pack(root, tmp_path / "b.zip")
    with zipfile.ZipFile(z) as zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        assert names == ["bundle.json", "LICENSE", "libggml-base.so", "libggml-cpu.so", "llama-server"]
        assert all(i.date_time == (1980, 1, 1, 0, 0, 0) for i in infos)
        modes = {i.filename: i.external_attr >> 16 for i in infos}
        assert modes == {"bundle.json": 0o100644, "LICENSE": 0o100644, "libggml-base.so": 0o100644,
                         "libggml-cpu.so": 0o100755, "llama-server": 0o100755}
        assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in infos)
        assert zf.read("LICENSE") == FILES["LICENSE"][0]
        assert zf.read("bundle.json") == (root / "bundle.json").read_bytes()
    assert not list(tmp_path.glob("*.part*"))


def test_pack_uses_source_date_epoch(tmp_path: Path) -> None:
    root = tmp_path / "b"
    make_bundle(root)
    epoch = 1_700_000_000  # 2023-11-14T22:13:20Z
    z1 = pack(root, tmp_path / "1.zip", source_date_epoch=epoch)
    with zipfile.ZipFile(z1) as zf:
        assert {i.date_time for i in zf.infolist()} == {(2023, 11, 14, 22, 13, 20)}
    z0 = pack(root, tmp_path / "0.zip")
    assert zip_sha(z0) != zip_sha(z1)
    zold = pack(root, tmp_path / "old.zip", source_date_epoch=0)  # before what zip can store
    with zipfile.ZipFile(zold) as zf:
        assert {i.date_time for i in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}
    assert zip_sha(zold) == zip_sha(z0)
    assert bundle.built_at(epoch) == "2023-11-14T22:13:20Z"
    assert dt.datetime.fromisoformat(bundle.built_at(None).replace("Z", "+00:00")).tzinfo is not None


def test_pack_failure_leaves_no_part_and_keeps_an_old_zip(tmp_path: Path) -> None:
    root = tmp_path / "b"
    make_bundle(root)
    out = tmp_path / "out" / "b.zip"
    pack(root, out)
    before = out.read_bytes()
    (root / "zz-dangling").symlink_to(tmp_path / "nowhere")  # listed, then cannot be read
    with pytest.raises(FileNotFoundError):
        pack(root, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["b.zip"]
    assert out.read_bytes() == before
    with pytest.raises(FileNotFoundError):
        pack(root, tmp_path / "out" / "new.zip")
    assert sorted(p.name for p in out.parent.iterdir()) == ["b.zip"]


# ------------------------------------------------------------------------------------ unpack


def test_unpack_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "b"
    written = make_bundle(root)
    z = pack(root, tmp_path / "b.zip")
    dest = tmp_path / "x" / "unpacked"
    m, check = unpack(z, dest)
    assert m == written
    assert (check.files, check.bytes) == (4, sum(len(d) for d, _m, _r in FILES.values()))
    assert sorted(p.name for p in dest.iterdir()) == sorted([*FILES, "bundle.json"])
    for name, (data, mode, _) in FILES.items():
        assert (dest / name).read_bytes() == data
        assert stat.S_IMODE((dest / name).stat().st_mode) == (0o755 if mode & 0o111 else 0o644)
    assert check_contents(dest, read_manifest(dest)).files == 4
    # Re-packing the unpacked tree gives the same bytes.
    assert zip_sha(pack(dest, tmp_path / "again.zip")) == zip_sha(z)
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["unpacked"]


def _rewrite_zip(src: Path, dst: Path, change: dict[str, bytes], add: dict[str, bytes] | None = None) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info, change.get(info.filename, zin.read(info)))
        for name, data in (add or {}).items():
            zout.writestr(name, data)


def test_unpack_of_a_tampered_member_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "b"
    make_bundle(root)
    z = pack(root, tmp_path / "b.zip")
    bad = tmp_path / "bad.zip"
    data = bytearray(FILES["libggml-cpu.so"][0])
    data[0] ^= 0xFF  # same size, other bytes
    _rewrite_zip(z, bad, {"libggml-cpu.so": bytes(data)})
    parent = tmp_path / "x"
    with pytest.raises(VerifyError) as e:
        unpack(bad, parent / "dest")
    assert e.value.exit_code == 5
    assert e.value.what == "libggml-cpu.so does not match its sha256 in bundle.json"
    assert list(parent.iterdir()) == []


def test_unpack_of_an_extra_member_or_bad_manifest_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "b"
    make_bundle(root)
    z = pack(root, tmp_path / "b.zip")
    extra = tmp_path / "extra.zip"
    _rewrite_zip(z, extra, {}, add={"libinjected.so": b"boo"})
    parent = tmp_path / "x"
    with pytest.raises(VerifyError, match="libinjected.so is in the bundle but not in bundle.json"):
        unpack(extra, parent / "dest")
    assert list(parent.iterdir()) == []
    m = json.loads((root / MANIFEST).read_text())
    m["format"] = 99
    nofmt = tmp_path / "fmt.zip"
    _rewrite_zip(z, nofmt, {"bundle.json": json.dumps(m).encode()})
    with pytest.raises(VerifyError, match="unknown format 99"):
        unpack(nofmt, parent / "dest")
    assert list(parent.iterdir()) == []


def test_unpack_of_a_damaged_zip_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "b"
    make_bundle(root)
    z = pack(root, tmp_path / "b.zip")
    cut = tmp_path / "cut.zip"
    cut.write_bytes(z.read_bytes()[: z.stat().st_size // 2])
    parent = tmp_path / "x"
    with pytest.raises(VerifyError) as e:
        unpack(cut, parent / "dest")
    assert e.value.exit_code == 5
    assert not (parent / "dest").exists()
    assert not parent.exists() or list(parent.iterdir()) == []


def test_diff_zips_names_each_differing_member_and_its_first_offset(tmp_path: Path) -> None:
    from llamabundle.bundle import diff_zips

    root = tmp_path / "b"
    make_bundle(root)
    a = pack(root, tmp_path / "a.zip", source_date_epoch=0)
    assert diff_zips(a, pack(root, tmp_path / "same.zip", source_date_epoch=0)) == []
    data = bytearray((root / "libggml-cpu.so").read_bytes())
    data[100] ^= 0xFF
    (root / "libggml-cpu.so").write_bytes(bytes(data))
    (root / "extra.txt").write_text("x")
    b = pack(root, tmp_path / "b.zip", source_date_epoch=0)
    assert diff_zips(a, b) == ["extra.txt: only in the second build",
                               f"libggml-cpu.so: differs from byte 100 (sizes {len(data)} and {len(data)})"]
    later = pack(root, tmp_path / "c.zip", source_date_epoch=1704067200)  # the same files, another date
    assert diff_zips(b, later) == [f"{n}: same bytes, other timestamp or mode" for n in sorted(
        p.name for p in root.iterdir())]


@pytest.mark.race
def test_pack_removes_a_killed_packs_part_file_and_leaves_only_the_zip(tmp_path: Path) -> None:
    root = tmp_path / "b"
    make_bundle(root)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".b.zip.part-4194999-1-abcdef").write_bytes(b"half a zip")  # its packer was SIGKILLed
    pack(root, out / "b.zip")
    assert sorted(p.name for p in out.iterdir()) == ["b.zip"]
