"""The GitHub store against a flaky CDN and malformed releases (issue 12), with tests/fakegithub.py.

A short or dropped body of a small asset (bundle.json, SHA256SUMS) is retried and resumed like the zip, and
when it keeps failing that is a network error, never "delete the release"; a release whose bundle.json
arrived whole and is wrong (not JSON, wrong types, re-keyed, another bundle's) is refused with exit 5 and
the advice to delete it; several processes fetching one entry into one directory all end with the one zip."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from llamabundle.bundle.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError
from llamabundle.errors import StoreError
from llamabundle.net import NetworkError
from tests import bundles
from tests.fakegithub import FakeGitHub
from tests.ghstore import (
    INPUTS,
    KEY,
    OTHER_KEY,
    REPO,
    TAG,
    TOKEN,
    Captured,
    make_bundle,
    sha256,
    store_for,
)
from tests.loopback import Reply

ROOT = Path(__file__).resolve().parents[2]


def published(gh: FakeGitHub, tmp: Path, **kw: Any) -> tuple[Path, Manifest]:
    zip_path, m = make_bundle(tmp, **kw)
    assert store_for(gh).publish(zip_path, m).created
    return zip_path, m


def release_with(gh: FakeGitHub, tmp: Path, manifest_bytes: bytes) -> None:
    """A published release for KEY whose bundle.json is `manifest_bytes`, as someone else made it."""
    zip_path, _m = make_bundle(tmp)
    gh.add_ref(TAG)
    gh.add_release(TAG, draft=False, assets={"bundle.zip": zip_path.read_bytes(), "bundle.json": manifest_bytes})


def no_condemnation(e: BaseException) -> None:
    text = e.render() if isinstance(e, StoreError) else str(e)
    assert "delete" not in text.lower() and "corrupt" not in text.lower() and "inconsistent" not in text.lower()


# ------------------------------------------------------------------- transfers retried, not condemned


def test_a_manifest_body_dropped_once_is_resumed(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, m = published(gh, tmp_path)
    gh.drop_asset("bundle.json", after=100)  # announces the whole body, hangs up after 100 bytes
    sleeps: list[float] = []
    cap = Captured()
    entry = store_for(gh, sleeps=sleeps, log=cap.log).lookup(KEY)
    assert entry is not None and entry.manifest == m and entry.zip_sha256 == sha256(zip_path)
    first, again = gh.downloads("bundle.json")
    assert "range" not in first.headers
    assert again.headers["range"] == "bytes=100-" and again.headers["if-range"]  # resumed, not restarted
    assert all("authorization" not in r.headers for r in (first, again))  # the CDN never sees the token
    assert len(sleeps) == 1
    assert "connection dropped after 100 of" in cap.text and TOKEN not in cap.text


def test_a_short_manifest_body_is_completed_from_the_assets_size(gh: FakeGitHub, tmp_path: Path) -> None:
    _zip, m = published(gh, tmp_path)
    gh.short_asset("bundle.json", keep=60, times=2)  # twice a complete-looking answer of 60 bytes
    cap = Captured()
    entry = store_for(gh, log=cap.log).lookup(KEY)
    assert entry is not None and entry.manifest == m
    # 60 bytes of more: resumed; the second short answer has nothing past 60 (416): started over, whole
    assert [r.headers.get("range") for r in gh.downloads("bundle.json")] == [None, "bytes=60-", None]
    assert "ended after 60 of" in cap.text and "refused to resume (HTTP 416)" in cap.text


def test_a_dropped_sha256sums_is_resumed(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, _m = published(gh, tmp_path)
    for a in gh.assets.values():
        a.digest = None  # assets from before GitHub computed digests: the zip's sha256 is in SHA256SUMS
    gh.drop_asset("SHA256SUMS", after=20)
    entry = store_for(gh).lookup(KEY)
    assert entry is not None and entry.zip_sha256 == sha256(zip_path)
    assert [r.headers.get("range") for r in gh.downloads("SHA256SUMS")] == [None, "bytes=20-"]


def test_a_resumed_body_that_does_not_match_the_digest_is_downloaded_whole(gh: FakeGitHub, tmp_path: Path) -> None:
    _zip, m = published(gh, tmp_path)
    (asset,) = [a for a in gh.assets.values() if a.name == "bundle.json"]
    etag = f'"{hashlib.sha256(asset.data).hexdigest()[:16]}"'

    def other_bytes_then_drop(req: Any, h: Any) -> bool:  # a cache that served other bytes under the same ETag
        if req.host != "cdn" or "bundle.json" not in req.path:
            return False
        h.reply(Reply(200, {"Accept-Ranges": "bytes", "ETag": etag, "Content-Length": str(len(asset.data))},
                      b"X" * 100))  # the whole length announced, 100 bytes sent, then the connection closes
        return True

    gh.add_fault(other_bytes_then_drop)
    entry = store_for(gh).lookup(KEY)
    assert entry is not None and entry.manifest == m
    # resumed onto the wrong 100 bytes: the digest says so, and the whole body is fetched again
    assert [r.headers.get("range") for r in gh.downloads("bundle.json")] == [None, "bytes=100-", None]


@pytest.mark.parametrize("fault", ["drop", "short"])
def test_a_manifest_body_that_never_arrives_whole_is_a_network_error(gh: FakeGitHub, tmp_path: Path,
                                                                     fault: str) -> None:
    published(gh, tmp_path)
    if fault == "drop":
        gh.drop_asset("bundle.json", after=10, times=None)
    else:
        gh.short_asset("bundle.json", keep=10, times=None)
    sleeps: list[float] = []
    with pytest.raises(NetworkError) as e:
        store_for(gh, sleeps=sleeps, max_attempts=3).lookup(KEY)
    assert e.value.exit_code == 6
    assert e.value.what.startswith(f"cannot download bundle.json of release {TAG} from {REPO}: ")
    assert "gave up after 3 attempts" in e.value.why
    if fault == "drop":
        assert "connection dropped" in e.value.what
    no_condemnation(e.value)
    assert len(gh.downloads("bundle.json")) == 3 and len(sleeps) == 2
    assert TOKEN not in e.value.render()
    gh.faults.clear()  # the network is back: the release was fine all along
    assert store_for(gh).lookup(KEY) is not None


# ------------------------------------------------------------------- content really wrong: exit 5


def test_a_complete_manifest_that_is_not_json_condemns_the_release(gh: FakeGitHub, tmp_path: Path) -> None:
    release_with(gh, tmp_path, b"<html>Service Unavailable</html>")
    sleeps: list[float] = []
    with pytest.raises(ManifestError) as e:
        store_for(gh, sleeps=sleeps).lookup(KEY)
    assert e.value.exit_code == 5
    assert e.value.what.startswith(f"bundle.json of release {TAG} is not valid JSON")
    assert f"delete the release {TAG} in {REPO}" in e.value.fix
    assert len(gh.downloads("bundle.json")) == 1 and sleeps == []  # whole, so not retried


def _manifest(tag: str = "test-bundle", **inputs_kw: Any) -> dict[str, Any]:
    """A consistent manifest (as a dict) of the bundle with inputs_for(tag, **inputs_kw)."""
    inputs = bundles.inputs_for(tag, **inputs_kw)
    return {"format": 1, "name": "test-bundle", "key": bundles.key_of(inputs), "inputs": inputs,
            "platform": inputs["platform"], "llama_cpp": {"commit": inputs["commit"]},
            "files": [{"path": "LICENSE", "sha256": "0" * 64, "size": 4, "role": "license"}]}


MALFORMED: dict[str, tuple[Any, str]] = {
    "a list": ([1, 2], "bundle.json of release {tag} is a list, not an object"),
    "files a string": ({**_manifest(), "files": "x"}, "'files' is the string 'x', not a list"),
    "files of numbers": ({**_manifest(), "files": [1]}, "'files[0]' is a number, not an object"),
    "platform a number": ({**_manifest(), "platform": 5}, "'platform' is a number, not a string"),
    "key a number": ({**_manifest(), "key": 12345}, "'key' is a number, not a string"),
    "llama_cpp a string": ({**_manifest(), "llama_cpp": "x"}, "'llama_cpp' is the string 'x', not an object"),
    "re-keyed": ({**_manifest(), "key": "f" * 64}, "its key ffffffffffff is not the sha256 of the inputs"),
    "inputs edited": ({**_manifest(), "inputs": {**INPUTS["test-bundle"], "recipe": "evil"}},
                      f"its key {KEY[:12]} is not the sha256 of the inputs"),
    "windows under a linux key": ({**_manifest(), "platform": "windows-x86_64"},
                                  "it says platform windows-x86_64, its inputs say linux-x86_64"),
    "a windows bundle in the linux release": (_manifest(platform="windows-x86_64"), "names key"),
    "another bundle's manifest": (_manifest("other"), f"names key {OTHER_KEY[:12]}, not {KEY[:12]}"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_or_re_keyed_manifest_is_refused_naming_what(gh: FakeGitHub, tmp_path: Path, case: str) -> None:
    data, says = MALFORMED[case]
    release_with(gh, tmp_path, json.dumps(data).encode())
    with pytest.raises(ManifestError) as e:
        store_for(gh).lookup(KEY)
    assert e.value.exit_code == 5
    assert says.format(tag=TAG) in e.value.what
    assert TAG in e.value.what
    assert f"delete the release {TAG} in {REPO}" in e.value.fix
    assert "Traceback" not in e.value.render()


def test_an_oversized_manifest_is_refused_without_downloading_it(gh: FakeGitHub, tmp_path: Path) -> None:
    release_with(gh, tmp_path, b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(ManifestError) as e:
        store_for(gh).lookup(KEY)
    assert e.value.exit_code == 5 and "more than 16 MiB" in e.value.what
    assert f"delete the release {TAG}" in e.value.fix
    assert gh.downloads("bundle.json") == []


def test_a_manifest_that_does_not_match_its_digest_condemns_the_release(gh: FakeGitHub, tmp_path: Path) -> None:
    _zip, _m = published(gh, tmp_path)
    (asset,) = [a for a in gh.assets.values() if a.name == "bundle.json"]
    asset.data = asset.data.replace(b'"test-bundle"', b'"test-bundlX"')  # same size, other bytes, old digest
    with pytest.raises(ManifestError) as e:
        store_for(gh).lookup(KEY)
    assert e.value.exit_code == 5 and "does not match its digest" in e.value.what
    assert f"delete the release {TAG}" in e.value.fix
    assert len(gh.downloads("bundle.json")) == 1


def test_publish_refuses_a_manifest_whose_key_is_not_its_own(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, m = make_bundle(tmp_path)
    forged = Manifest(**{**{f: getattr(m, f) for f in m.__dataclass_fields__}, "key": OTHER_KEY})
    with pytest.raises(ManifestError) as e:
        store_for(gh, tags={}).publish(zip_path, forged)
    assert e.value.exit_code == 5 and "is not the sha256 of the inputs" in e.value.what
    assert gh.requests == [] and gh.releases == {}


# --------------------------------------------------------------- concurrent fetches, real processes

# A fetch in its own process: looks the key up, prints READY, waits for `go`, fetches, prints DONE <path>.
CHILD = r"""
import json, sys, time
from pathlib import Path
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["root"])
from llamabundle.errors import LlamaBundleError
from llamabundle.store.github import GitHubStore

store = GitHubStore(cfg["repo"], api_url=cfg["api"], token=cfg["token"], tags={cfg["key"]: cfg["tag"]}, backoff=0.05)
try:
    entry = store.lookup(cfg["key"])
    print("READY", flush=True)
    while cfg["go"] and not Path(cfg["go"]).exists():
        time.sleep(0.01)
    got = store.fetch(entry, Path(cfg["dest"]))
except LlamaBundleError as e:
    print("ERROR", type(e).__name__, e.what, flush=True)
    sys.exit(e.exit_code)
print("DONE", got, flush=True)
"""


def spawn_fetch(gh: FakeGitHub, dest: Path, go: Path | None) -> subprocess.Popen[str]:
    cfg = {"root": str(ROOT), "repo": REPO, "api": gh.api_url, "token": TOKEN, "key": KEY, "tag": TAG,
           "dest": str(dest), "go": str(go) if go else ""}
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


BIG = {"llama-server": os.urandom(2 << 20), "LICENSE": b"MIT License\n"}  # 2 MiB that do not compress


@pytest.mark.race
def test_three_processes_fetching_one_entry_into_one_dest_all_succeed(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, _m = published(gh, tmp_path, files=BIG)
    gh.cdn_rate = 4 << 20  # half a second for the zip: the three overlap
    dest, go = tmp_path / "cache" / "fetched" / KEY, tmp_path / "go"
    procs = [spawn_fetch(gh, dest, go) for _ in range(3)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    go.touch()
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all(f"DONE {dest / 'bundle.zip'}" in out for out in outs), outs
    assert sorted(p.name for p in dest.iterdir()) == ["bundle.zip"]  # no .part, .part.json or lock left
    assert sha256(dest / "bundle.zip") == sha256(zip_path)
    assert len(gh.downloads("bundle.zip")) == 1  # the others waited, and found it there with its sha256
    assert sum("another process is downloading it" in out for out in outs) == 2


@pytest.mark.race
def test_a_fetch_killed_mid_download_is_resumed_by_the_next(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, _m = published(gh, tmp_path, files=BIG)
    gh.cdn_rate = 1 << 20
    dest = tmp_path / "dl"
    p = spawn_fetch(gh, dest, None)
    part = dest / "bundle.zip.part"
    deadline = time.monotonic() + 30
    while not (part.is_file() and part.stat().st_size >= 256 << 10) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=10)
    have = part.stat().st_size
    assert 0 < have < zip_path.stat().st_size
    assert (dest / "bundle.zip.part.lock").exists()  # a dead holder's lock file: its lock died with it

    gh.cdn_rate = None
    q = spawn_fetch(gh, dest, None)
    out = q.communicate(timeout=60)[0]
    assert q.returncode == 0, out
    assert sorted(x.name for x in dest.iterdir()) == ["bundle.zip"]
    assert sha256(dest / "bundle.zip") == sha256(zip_path)
    last = gh.downloads("bundle.zip")[-1]
    assert last.headers["range"] == f"bytes={have}-" and last.headers["if-range"]
