"""A GitHub release's files by content (store/github/blobs.py): beside the zip, each file once as a zstd frame,
one asset per part of the bundle (`blobs.<part>.zst`, split under GitHub's 2 GiB limit) and `blobs.json` saying
where each frame lies. Installs and fetches read only the frames they lack, each with a Range request (resumed
where it drops, checked against the index's sha256 and the manifest's), against the fake GitHub's API and CDN."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pytest
import zstandard

from llamabundle.bundle import manifest as manifest_mod
from llamabundle.bundle import parts
from llamabundle.bundle.manifest import Manifest
from llamabundle.errors import StoreError, VerifyError
from llamabundle.runtime.install import install_bundle, list_installed
from llamabundle.store.github import blobs
from tests import bundles, ghstore, loopback
from tests.fakegithub import FakeGitHub
from tests.probing import make_zip

PLATFORM = "linux-x86_64"
ALL = ("cpu", "cuda", "vulkan")


@pytest.fixture
def gh() -> Any:
    with FakeGitHub(ghstore.REPO, token=ghstore.TOKEN) as fake:
        yield fake


def published(gh: FakeGitHub, tmp: Path, **kw: Any) -> tuple[Path, Manifest, Any]:
    zip_path, m = make_zip(tmp, backends=ALL, parts=True)
    store = ghstore.store_for(gh, tags={}, **kw)
    store.publish(zip_path, m)
    return zip_path, m, store


def assets_of(gh: FakeGitHub) -> dict[str, Any]:
    (rel,) = gh.releases.values()
    return {gh.assets[a].name: gh.assets[a] for a in rel.assets}


def index_of(gh: FakeGitHub) -> dict[str, Any]:
    got: dict[str, Any] = json.loads(assets_of(gh)["blobs.json"].data)
    return got


def served(gh: FakeGitHub, since: int) -> dict[str, int]:
    """Blob asset or zip -> bytes asked for by the Range requests of the CDN since request `since` (a GET without a
    Range counts the whole asset); bundle.json and blobs.json, read by every lookup, are left out."""
    out: dict[str, int] = {}
    sizes = {a.name: len(a.data) for a in gh.assets.values()}
    for r in gh.requests[since:]:
        if r.host != "cdn":
            continue
        name = r.path.split("?")[0].rsplit("/", 1)[-1]
        if not name.endswith((".zst", ".zip")):
            continue
        rng = r.headers.get("range")
        if rng:
            first, last = rng.removeprefix("bytes=").split("-")
            n = int(last) - int(first) + 1
        else:
            n = sizes.get(name, 0)
        out[name] = out.get(name, 0) + n
    return out


def test_a_release_holds_each_part_as_one_asset_of_frames_and_an_index(gh: FakeGitHub, tmp_path: Path) -> None:
    _zip, m, _store = published(gh, tmp_path)
    got = assets_of(gh)
    assert sorted(got) == sorted([f"{m.name}-{m.key[:12]}.zip", "SHA256SUMS", "bundle.json", "blobs.json",
                                  "blobs.cpu.zst", "blobs.cuda.zst", "blobs.vulkan.zst"])
    index = index_of(gh)
    assert index["manifest_sha256"] == parts.published_sha256(m) and index["codec"] == "zstd"
    assert {a["name"]: a["size"] for a in index["assets"]} == {n: len(got[n].data) for n in got if n.endswith(".zst")}
    data = {f.path: f for f in m.files}
    for f in data.values():
        fr = index["blobs"][f.sha256]
        frame = got[fr["asset"]].data[fr["offset"]:fr["offset"] + fr["length"]]
        assert hashlib.sha256(frame).hexdigest() == fr["sha256"]
        assert hashlib.sha256(zstandard.ZstdDecompressor().decompressobj().decompress(frame)).hexdigest() == f.sha256
        part = next((b for b, listed in (m.parts or {}).items() if f.path in listed), "cpu")
        assert fr["asset"] == f"blobs.{part}.zst", f.path
    # the frames of a part fill its asset exactly: nothing else is uploaded
    for name in ("blobs.cpu.zst", "blobs.cuda.zst", "blobs.vulkan.zst"):
        assert sum(fr["length"] for fr in index["blobs"].values() if fr["asset"] == name) == len(got[name].data)
    sums = assets_of(gh)["SHA256SUMS"].data.decode()
    assert all(f"{hashlib.sha256(a.data).hexdigest()}  {n}\n" in sums for n, a in got.items()
               if n not in ("SHA256SUMS", "bundle.json"))


def test_a_cpu_install_reads_only_the_cpu_frames_and_adding_cuda_only_its_own(gh: FakeGitHub, tmp_path: Path) -> None:
    _zip, m, store = published(gh, tmp_path)
    index = index_of(gh)
    frames = index["blobs"]
    root = tmp_path / "data"
    since = len(gh.requests)
    cpu = install_bundle(ghstore.store_for(gh, tags={}), m.key, root=root, log=ghstore.Captured().log,
                         platform=PLATFORM, backends_wanted="cpu")
    assert cpu.installed.manifest.backends == ("cpu",)
    cpu_files = [f for f in m.files if not any(f.path in listed for listed in (m.parts or {}).values())]
    assert served(gh, since) == {"blobs.cpu.zst": sum(frames[f.sha256]["length"] for f in cpu_files)}
    assert cpu.transfer.downloaded == served(gh, since)["blobs.cpu.zst"]

    since = len(gh.requests)
    both = install_bundle(store, m.key, root=root, log=ghstore.Captured().log, platform=PLATFORM,
                          backends_wanted="cpu,cuda")
    assert both.installed.manifest.backends == ("cpu", "cuda")
    cuda = set((m.parts or {})["cuda"])
    assert served(gh, since) == {"blobs.cuda.zst": sum(frames[f.sha256]["length"] for f in m.files if f.path in cuda)}
    assert both.transfer.fetched == len(cuda) and both.transfer.from_cache == sum(f.size for f in cpu_files)
    for f in both.installed.manifest.files:
        assert hashlib.sha256((both.installed.path / f.path).read_bytes()).hexdigest() == f.sha256


def random_bundle(tmp: Path) -> tuple[Path, Manifest]:
    rnd = random.Random(7)
    files = {"llama-server": rnd.randbytes(300_000), "libggml-cpu.so": rnd.randbytes(200_000),
             "libggml-base.so": rnd.randbytes(150_000), "LICENSE": b"MIT License\n"}
    roles = {"llama-server": "exe", "libggml-cpu.so": "backend", "libggml-base.so": "runtime", "LICENSE": "license"}
    zip_path, m = bundles.make_zip(tmp, files, roles, zip_name="bundle.zip", inputs=ghstore.INPUTS["test-bundle"])
    return zip_path, manifest_mod.parse(m)


def test_a_part_larger_than_an_asset_goes_on_in_the_next_and_installs_whole(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, m = random_bundle(tmp_path)
    store = ghstore.store_for(gh, max_asset=400_000)
    store.publish(zip_path, m)
    got = assets_of(gh)
    # LICENSE and two files fill the first asset; the third (300 kB, incompressible) goes on in the second
    assert sorted(n for n in got if n.endswith(".zst")) == ["blobs.all.2.zst", "blobs.all.zst"]
    assert all(len(got[n].data) <= 400_000 for n in got if n.endswith(".zst"))
    done = install_bundle(ghstore.store_for(gh), m.key, root=tmp_path / "data", log=ghstore.Captured().log,
                          platform=PLATFORM)
    assert done.installed.manifest == m and not gh.downloads("bundle.zip")
    with FakeGitHub(ghstore.REPO, token=ghstore.TOKEN) as fresh, \
            pytest.raises(StoreError, match="compresses to 150[0-9]{3} bytes, too large for one GitHub asset"):
        ghstore.store_for(fresh, max_asset=100_000).publish(zip_path, m)
    assert not fresh.releases  # refused before the tag was taken


def test_a_frame_download_cut_short_resumes_from_where_it_stopped(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, m = random_bundle(tmp_path)
    ghstore.store_for(gh).publish(zip_path, m)
    server = next(f for f in m.files if f.path == "llama-server")
    fr = index_of(gh)["blobs"][server.sha256]
    first = f"bytes={fr['offset']}-{fr['offset'] + fr['length'] - 1}"

    def cut(req: Any, h: Any) -> bool:  # llama-server's frame: the answer hangs up after 100 kB of it
        if req.host == "cdn" and "blobs.all.zst" in req.path and req.headers.get("range") == first:
            h.serve_cdn(cut=100_000)
            return True
        return False

    gh.add_fault(cut)
    cap = ghstore.Captured()
    done = install_bundle(ghstore.store_for(gh, log=cap.log), m.key, root=tmp_path / "data", log=cap.log,
                          platform=PLATFORM)
    assert done.installed.manifest == m
    ranges = [r.headers.get("range") for r in gh.downloads("blobs.all.zst")]
    i = ranges.index(first)
    # from the cut on (other frames' requests, 4 at a time, come in between)
    assert f"bytes={fr['offset'] + 100_000}-{fr['offset'] + fr['length'] - 1}" in ranges[i + 1:]
    assert ranges.count(first) == 1 and "resuming at byte 100000" in cap.text
    assert fr["length"] > 100_000


def test_a_cdn_that_ignores_range_still_gives_the_right_frames(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, m = random_bundle(tmp_path)
    ghstore.store_for(gh).publish(zip_path, m)
    group = assets_of(gh)["blobs.all.zst"]

    def whole(req: Any, h: Any) -> bool:
        if req.host == "cdn" and "blobs.all.zst" in req.path:
            h.reply(loopback.ranged(h.request, group.data, ranges=False))
            return True
        return False

    gh.add_fault(whole, once=False)
    done = install_bundle(ghstore.store_for(gh), m.key, root=tmp_path / "data", log=ghstore.Captured().log,
                          platform=PLATFORM)
    assert done.installed.manifest == m
    assert done.transfer.downloaded > len(group.data)  # the bytes before each frame came too, and were skipped


def test_a_tampered_frame_is_refused_and_nothing_is_installed(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, m = random_bundle(tmp_path)
    ghstore.store_for(gh).publish(zip_path, m)
    group = assets_of(gh)["blobs.all.zst"]
    data = bytearray(group.data)
    data[len(data) // 2] ^= 1
    group.data = bytes(data)
    root = tmp_path / "data"
    with pytest.raises(VerifyError) as e:
        install_bundle(ghstore.store_for(gh), m.key, root=root, log=ghstore.Captured().log, platform=PLATFORM)
    assert e.value.exit_code == 5 and "are not its frame" in e.value.render()
    assert list_installed(root) == []
    assert not [p for p in (root / "blobs").rglob("*") if p.is_file() and p.stat().st_nlink > 1]


def hostile(index: dict[str, Any], how: str) -> bytes:
    sha = next(iter(index["blobs"]))
    if how == "not json":
        return b"{not json"
    if how == "another bundle":
        index["manifest_sha256"] = "0" * 64
    elif how == "past the end":
        index["blobs"][sha]["offset"] = index["assets"][0]["size"]
    elif how == "a file without a frame":
        del index["blobs"][sha]
    elif how == "an asset not in the release":
        index["assets"][0]["name"] = "blobs.other.zst"
    elif how == "a negative length":
        index["blobs"][sha]["length"] = -1
    return json.dumps(index).encode()


@pytest.mark.parametrize("how", ["not json", "another bundle", "past the end", "a file without a frame",
                                 "an asset not in the release", "a negative length"])
def test_an_unusable_index_is_said_once_and_the_zip_installs(gh: FakeGitHub, tmp_path: Path, how: str) -> None:
    zip_path, m = random_bundle(tmp_path)
    ghstore.store_for(gh).publish(zip_path, m)
    a = assets_of(gh)["blobs.json"]
    a.data = hostile(json.loads(a.data), how)
    a.digest = "sha256:" + hashlib.sha256(a.data).hexdigest()  # a release edited by hand: its digest agrees
    cap = ghstore.Captured()
    done = install_bundle(ghstore.store_for(gh, log=cap.log), m.key, root=tmp_path / "data", log=cap.log,
                          platform=PLATFORM)
    assert done.installed.manifest == m
    assert "is not an index of the release's blobs" in cap.text and "its zip is downloaded instead" in cap.text
    assert len(gh.downloads("bundle.zip")) == 1 and not gh.downloads("blobs.all.zst")


def test_a_release_published_before_blobs_installs_from_its_zip(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, m = random_bundle(tmp_path)
    ghstore.store_for(gh).publish(zip_path, m)
    (rel,) = gh.releases.values()
    rel.assets = [i for i in rel.assets if not gh.assets[i].name.startswith("blobs.")]
    store = ghstore.store_for(gh)
    entry = store.lookup(m.key)
    assert entry is not None and not store.has_blobs(entry)
    done = install_bundle(store, m.key, root=tmp_path / "data", log=ghstore.Captured().log, platform=PLATFORM)
    assert done.installed.manifest == m and len(gh.downloads("bundle.zip")) == 1


def test_the_index_reader_refuses_what_lies_outside_the_release(tmp_path: Path) -> None:
    zip_path, m = random_bundle(tmp_path)
    packed = blobs.pack(zip_path, m, tmp_path)
    sizes = {g.name: g.size for g in packed.groups}
    frames = blobs.read_index(packed.index, m, sizes, where="blobs.json")
    assert set(frames) == {f.sha256 for f in m.files}
    with pytest.raises(StoreError) as e:
        blobs.read_index(packed.index, m, {n: s + 1 for n, s in sizes.items()}, where="blobs.json")
    assert "is not an uploaded asset of" in e.value.why
    with pytest.raises(StoreError) as e:
        blobs.read_index(json.dumps({"schema": 2}).encode(), m, sizes, where="blobs.json")
    assert e.value.why == "it is not a schema 1 zstd index"
