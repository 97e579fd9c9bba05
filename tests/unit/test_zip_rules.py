"""Bundle zips are read by our rules (issue 30): before a member's bytes are read it must be stored or
deflated, unencrypted, without a data descriptor, its local header agreeing with the central directory, its
bytes overlapping no other member's, and listed in bundle.json with its size. The one reader
(bundle.extract) serves verify, publish, fetch, install and a cache hit; here it is run directly, through
`verify`, and through `fetch` and `install` from a store whose entry holds the crafted zip. Each refusal is
exit 5 naming the member; nothing is left behind. Before this, zipfile raised for several of them (exit 70)."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest

from llamabundle import bundle, digest
from llamabundle.archive import UnsafeArchive, extract_zip
from llamabundle.errors import VerifyError
from tests import bundles as tb
from tests import craftedzips as cz
from tests.clirun import run

FILES = {"llama-server": b"#!/bin/sh\nexit 0\n" + b"x" * 5000, "libggml-base.so": b"\x7fELF" + bytes(range(256)) * 40,
         "LICENSE": b"MIT License\n"}
ROLES = {"llama-server": "exe", "libggml-base.so": "backend", "LICENSE": "license"}
MEMBERS = ("bundle.json", "llama-server", "libggml-base.so")
# as patterns; a zip streamed in one pass may be refused at another check first (still exit 5, naming it)
REFUSED = {**{k: re.escape(v) for k, v in cz.REFUSED.items()}, "overlapping": "overlaps member|does not match the members",
           "local-size": "in its local header|is damaged"}


def _good(tmp: Path) -> tuple[Path, dict[str, object]]:
    return tb.make_zip(tmp, FILES, ROLES, zip_name="good.zip", executables=("llama-server",))


def _crafted(tmp: Path, kind: str, member: str) -> Path:
    good, _ = _good(tmp)
    p = tmp / f"{kind}.zip"
    p.write_bytes(cz.crafted(good, kind, member))
    return p


CASES = [(k, m) for k in cz.REFUSED for m in (MEMBERS if k in ("encrypted", "shrink", "aes", "local-size") else
                                              ("bundle.json",) if k == "bzip2" else ("libggml-base.so",))]


@pytest.mark.parametrize(("kind", "member"), CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_the_reader_refuses_a_crafted_zip_naming_the_member_and_leaves_nothing(tmp_path: Path, kind: str,
                                                                                member: str) -> None:
    z = _crafted(tmp_path, kind, member)
    parent = tmp_path / "x"
    parent.mkdir()
    with pytest.raises(VerifyError) as e:
        bundle.extract(z, parent / "dest")
    assert e.value.exit_code == 5
    assert re.search(REFUSED[kind], e.value.what), e.value.what
    assert z.name in e.value.what
    assert kind in ("overlapping", "local-name", "descriptors", "encrypted-descriptors") or f"'{member}'" in e.value.what
    assert list(parent.iterdir()) == []


def test_a_good_bundle_with_bundle_json_last_is_read_from_its_central_directory(tmp_path: Path) -> None:
    z = _crafted(tmp_path, "manifest-last", "bundle.json")
    assert zipfile.ZipFile(z).namelist()[-1] == "bundle.json"
    hashes = bundle.extract(z, tmp_path / "dest")
    assert hashes is None  # not streamed: checked from the central directory, then extracted
    assert {p.name for p in (tmp_path / "dest").iterdir()} == {*FILES, "bundle.json"}
    manifest, check = bundle.unpack(z, tmp_path / "again")
    assert check.files == len(FILES)
    good, _ = _good(tmp_path / "g")
    assert bundle.extract(good, tmp_path / "streamed") is not None  # the packed layout streams, hashed on the way


def test_other_archives_may_carry_data_descriptors_but_are_held_to_the_other_rules(tmp_path: Path) -> None:
    wheel = tmp_path / "w.zip"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("pkg/lib.so", b"\0" * 1000)
        zf.writestr("pkg/METADATA", b"Name: x\n")
    streamed = tmp_path / "streamed.zip"
    streamed.write_bytes(cz.descriptors(wheel.read_bytes()))
    assert sorted(extract_zip(streamed, tmp_path / "a")) == ["pkg/METADATA", "pkg/lib.so"]
    assert (tmp_path / "a" / "pkg" / "lib.so").read_bytes() == b"\0" * 1000
    with pytest.raises(UnsafeArchive, match="data descriptor"):
        extract_zip(streamed, tmp_path / "b", descriptors=False)
    for kind, data in (("encrypted", cz.encrypted(streamed.read_bytes(), "pkg/lib.so")),
                       ("shrink", cz.method(wheel.read_bytes(), "pkg/METADATA", 1))):
        p = tmp_path / f"{kind}.zip"
        p.write_bytes(data)
        with pytest.raises(UnsafeArchive, match=re.escape(cz.REFUSED[kind]) if kind != "encrypted" else "is encrypted"):
            extract_zip(p, tmp_path / kind)
        assert not (tmp_path / kind).exists()


@pytest.mark.parametrize("kind", sorted(cz.REFUSED))
def test_verify_refuses_each_with_exit_5_and_no_traceback(tmp_path: Path, kind: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    z = _crafted(tmp_path, kind, "libggml-base.so" if kind != "bzip2" else "bundle.json")
    code, out, err = run(capsys, "verify", z)
    assert code == 5, (code, out, err)
    assert err.startswith("error: ") and re.search(REFUSED[kind], err), err
    assert "Traceback" not in err and "internal error" not in err


def _store_with(tmp: Path, z: Path, manifest: dict[str, object]) -> Path:
    """A local store whose entry holds the crafted zip (its SHA256SUMS right) and the good bundle.json."""
    key = str(manifest["key"])
    entry = tmp / "store" / key
    entry.mkdir(parents=True)
    (entry / "b.zip").write_bytes(z.read_bytes())
    (entry / "SHA256SUMS").write_text(f"{digest.sha256_file(z)}  b.zip\n")
    (entry / bundle.MANIFEST).write_text(json.dumps(manifest))
    return tmp / "store"


@pytest.mark.parametrize("kind", ["encrypted", "shrink", "aes", "descriptors", "local-name", "overlapping",
                                  "larger-than-listed"])
def test_fetch_and_install_from_a_store_refuse_each_and_leave_nothing(tmp_path: Path, kind: str,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    good, manifest = _good(tmp_path / "g")
    z = tmp_path / f"{kind}.zip"
    z.write_bytes(cz.crafted(good, kind, "libggml-base.so"))
    store = _store_with(tmp_path, z, manifest)
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    key = str(manifest["key"])
    code, out, err = run(capsys, "fetch", key, "--store", store, "--out", tmp_path / "out")
    assert code == 5 and re.search(REFUSED[kind], err), (code, err)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir() if ".out." in p.name] == []
    code, out, err = run(capsys, "install", "--key", key, "--store", store, "--dest", tmp_path / "apps")
    assert code == 5 and re.search(REFUSED[kind], err), (code, err)
    assert "Traceback" not in err and "internal error" not in err
    left = [p.relative_to(tmp_path / "apps").as_posix() for p in (tmp_path / "apps").rglob("*")]
    assert [p for p in left if p.startswith("bundles/test-bundle/") or p.endswith(".partial")] == [], left
