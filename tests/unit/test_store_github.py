"""The GitHub Releases store (DESIGN §6) against tests/fakegithub.py: a GitHub-compatible API on 127.0.0.1
whose asset downloads redirect to a "CDN" on 127.0.0.2. Real bundles, real HTTP, real threads."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from llamabundle import bundle
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.bundle.manifest import Manifest
from llamabundle.errors import LlamaBundleError, StoreError, VerifyError
from llamabundle.net import NetworkError
from llamabundle.settings import Settings
from llamabundle.store import open_store
from llamabundle.store.github import (
    AssetConflictError,
    GitHubEntry,
    GitHubStore,
    GitHubValidationError,
    RateLimitError,
)
from tests.fakegithub import FakeGitHub, Request
from tests.ghstore import (
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


def with_fields(m: Manifest, **fields: Any) -> Manifest:
    """`m` with fields of its bundle.json replaced (as bundle.json records them)."""
    return manifest_mod.parse({**m.to_json(), **fields})


def api_requests(gh: FakeGitHub, since: int = 0) -> list[Request]:
    return [r for r in gh.requests[since:] if r.host == "api"]


# ------------------------------------------------------------------------------ lookup / publish


def test_lookup_miss_is_one_request(gh: FakeGitHub) -> None:
    store = store_for(gh)
    assert store.lookup(KEY) is None
    reqs = api_requests(gh)
    assert [(r.method, r.path) for r in reqs] == [("GET", f"/repos/{REPO}/releases/tags/{TAG}")]
    h = reqs[0].headers
    assert h["authorization"] == f"Bearer {TOKEN}"
    assert h["x-github-api-version"] == "2022-11-28"
    assert h["accept"] == "application/vnd.github+json"
    assert h["user-agent"].startswith("llamabundle/")


def test_a_bare_key_finds_its_release_by_listing_and_the_tag_comes_from_the_manifest(gh: FakeGitHub,
                                                                                    tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    manifest_with_tag = with_fields(manifest, publish={"tag": f"custom-{KEY}"})
    store_for(gh, tags={}).publish(zip_path, manifest_with_tag)  # `publish ZIP`: the tag recorded at build time
    assert [r.tag_name for r in gh.releases.values()] == [f"custom-{KEY}"]
    mark = len(gh.requests)
    entry = store_for(gh, tags={}).lookup(KEY)  # `fetch KEY`: no recipe, so no tag
    assert entry is not None and entry.zip_sha256 == sha256(zip_path)
    assert next(r.path.split("?")[0] for r in api_requests(gh, mark)).endswith("/releases")
    assert store_for(gh, tags={}).lookup(OTHER_KEY) is None
    # without a recorded tag, the schema's default template {name}-{key12}
    zip2, manifest2 = make_bundle(tmp_path / "b", OTHER_KEY)
    store_for(gh, tags={}).publish(zip2, manifest2)
    assert f"test-bundle-{OTHER_KEY[:12]}" in [r.tag_name for r in gh.releases.values()]


def test_lookup_refuses_a_non_key(gh: FakeGitHub) -> None:
    with pytest.raises(StoreError) as e:
        store_for(gh).lookup("../" + KEY[3:])
    assert e.value.exit_code == 6
    assert gh.requests == []


def test_publish_then_lookup_hits_in_two_requests(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    cap = Captured()
    store = store_for(gh, log=cap.log)
    done = store.publish(zip_path, manifest)
    assert done.created is True
    assert isinstance(done.entry, GitHubEntry)
    assert done.entry.zip_sha256 == sha256(zip_path)
    assert done.entry.zip_size == zip_path.stat().st_size
    assert done.entry.manifest == manifest

    # one published release with exactly its five assets, uploaded in order zip, blobs, SHA256SUMS, bundle.json
    (rel,) = gh.releases.values()
    assert (rel.tag_name, rel.draft) == (TAG, False)
    assert gh.asset_names(rel) == ["SHA256SUMS", "blobs.all.zst", "blobs.json", "bundle.json", "bundle.zip"]
    uploads = [r.path.split("name=")[1] for r in gh.requests if r.path.startswith("/uploads/")]
    assert uploads == ["bundle.zip", "blobs.all.zst", "blobs.json", "SHA256SUMS", "bundle.json"]
    assert f"refs/tags/{TAG}" in gh.refs
    by_name = {gh.assets[a].name: gh.assets[a] for a in rel.assets}
    assert by_name["SHA256SUMS"].data == "".join(f"{hashlib.sha256(by_name[n].data).hexdigest()}  {n}\n" for n in
                                                 ("bundle.zip", "blobs.all.zst", "blobs.json")).encode()
    assert json.loads(by_name["bundle.json"].data) == manifest.to_json()
    assert by_name["bundle.json"].data == manifest.text().encode()
    assert by_name["bundle.zip"].data == zip_path.read_bytes()
    assert by_name["bundle.zip"].content_type == "application/zip"

    # the publish order: ref taken before the draft, published last
    calls = [(r.method, r.path.split("?")[0]) for r in api_requests(gh)]
    i_ref = calls.index(("POST", f"/repos/{REPO}/git/refs"))
    i_draft = calls.index(("POST", f"/repos/{REPO}/releases"))
    i_patch = calls.index(("PATCH", f"/repos/{REPO}/releases/{rel.id}"))
    assert i_ref < i_draft < i_patch == len(calls) - 1

    mark = len(gh.requests)
    entry = store_for(gh).lookup(KEY)
    assert entry == done.entry
    assert len(api_requests(gh, mark)) <= 2
    assert entry.location.endswith(f"/releases/download/{TAG}/bundle.zip")
    assert store_for(gh).lookup(OTHER_KEY) is None
    assert TOKEN not in cap.text


def test_second_publish_reports_already_published(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    first = store_for(gh).publish(zip_path, manifest)
    again = store_for(gh).publish(zip_path, manifest)
    assert (first.created, again.created) == (True, False)
    assert again.entry == first.entry
    assert len(gh.releases) == 1
    assert gh.count("POST", "/git/refs") == 1


def _api(gh: FakeGitHub, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """A raw API call, as another tool (or a person) would make it."""
    import requests

    r = requests.request(method, f"{gh.api_url}/repos/{REPO}{path}", json=body, timeout=10,
                         headers={"Authorization": f"Bearer {TOKEN}", "Accept": "application/vnd.github+json"})
    return r.status_code, (r.json() if r.content else None)


def test_the_fake_keeps_latest_as_github_does(gh: FakeGitHub) -> None:
    assert _api(gh, "GET", "/releases/latest")[0] == 404
    _, a = _api(gh, "POST", "/releases", {"tag_name": "v1", "name": "v1"})  # make_latest absent: "true"
    assert _api(gh, "GET", "/releases/latest")[1]["id"] == a["id"]
    _, b = _api(gh, "POST", "/releases", {"tag_name": "v2", "make_latest": "false"})
    assert _api(gh, "GET", "/releases/latest")[1]["id"] == a["id"]
    _, c = _api(gh, "POST", "/releases", {"tag_name": "v3", "draft": True, "make_latest": "false"})
    _api(gh, "PATCH", f"/releases/{c['id']}", {"draft": False})  # publishing a draft: "true" unless told
    assert _api(gh, "GET", "/releases/latest")[1]["id"] == c["id"]
    _api(gh, "POST", "/releases", {"tag_name": "v4", "prerelease": True})  # a prerelease is never latest
    assert _api(gh, "GET", "/releases/latest")[1]["id"] == c["id"]
    _api(gh, "PATCH", f"/releases/{a['id']}", {"make_latest": "true"})
    assert _api(gh, "GET", "/releases/latest")[1]["id"] == a["id"]
    _api(gh, "DELETE", f"/releases/{a['id']}")  # the latest deleted: the newest published one ("legacy")
    assert _api(gh, "GET", "/releases/latest")[1]["id"] == c["id"]
    _api(gh, "PATCH", f"/releases/{b['id']}", {"make_latest": "legacy"})
    assert _api(gh, "GET", "/releases/latest")[1]["id"] == c["id"]


def test_publishing_never_takes_latest_from_the_apps_own_release(gh: FakeGitHub, tmp_path: Path) -> None:
    code, app = _api(gh, "POST", "/releases", {"tag_name": "v1.2.0", "name": "MyApp 1.2.0"})
    assert code == 201 and _api(gh, "GET", "/releases/latest")[1]["id"] == app["id"]
    zip_path, manifest = make_bundle(tmp_path)
    assert store_for(gh).publish(zip_path, manifest).created is True
    (ours,) = [r for r in gh.releases.values() if r.tag_name == TAG]
    assert not ours.draft
    code, latest = _api(gh, "GET", "/releases/latest")
    assert (code, latest["id"], latest["tag_name"]) == (200, app["id"], "v1.2.0")
    assert gh.latest == app["id"]
    # and with no release of its own, a bundle release does not become latest either
    gh.releases.pop(app["id"])
    gh.latest = None
    zip2, manifest2 = make_bundle(tmp_path / "b", OTHER_KEY)
    store_for(gh, tags={}).publish(zip2, manifest2)
    assert _api(gh, "GET", "/releases/latest")[0] == 404


def test_a_published_release_without_its_manifest_is_not_a_hit(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, _manifest = make_bundle(tmp_path)
    gh.add_ref(TAG)
    gh.add_release(TAG, draft=False, assets={"bundle.zip": zip_path.read_bytes()})
    assert store_for(gh).lookup(KEY) is None


def test_a_manifest_of_another_key_is_refused(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, _manifest = make_bundle(tmp_path)
    _other_zip, other = make_bundle(tmp_path / "b", OTHER_KEY)  # a real, consistent manifest: of another bundle
    gh.add_release(TAG, draft=False, assets={"bundle.zip": zip_path.read_bytes(), "bundle.json": other.text().encode()})
    with pytest.raises(VerifyError) as e:
        store_for(gh).lookup(KEY)
    assert e.value.exit_code == 5
    assert f"names key {OTHER_KEY[:12]}, not {KEY[:12]}" in e.value.what and TAG in e.value.what
    assert f"delete the release {TAG}" in e.value.fix


def test_without_a_digest_the_sha256_comes_from_sha256sums(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store_for(gh).publish(zip_path, manifest)
    for a in gh.assets.values():
        a.digest = None  # assets uploaded before GitHub computed digests
    entry = store_for(gh).lookup(KEY)
    assert entry is not None and entry.zip_sha256 == sha256(zip_path)


# ------------------------------------------------------------------------------------- fetch


def test_fetch_verifies_and_never_sends_the_token_to_the_cdn(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store_for(gh).publish(zip_path, manifest)
    store = store_for(gh)
    entry = store.lookup(KEY)
    gh.drop_download_once(after=500)  # the first download hangs up mid-body: resumed with Range + If-Range
    got = store.fetch(entry, tmp_path / "dl")
    assert got == tmp_path / "dl" / "bundle.zip"
    assert sha256(got) == entry.zip_sha256 == sha256(zip_path)
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == ["bundle.zip"]
    assert bundle.unpack(got, tmp_path / "unpacked")[0] == manifest

    cdn = [r for r in gh.requests if r.host == "cdn"]
    assert len(cdn) >= 3  # bundle.json on lookup, the cut download, the resume
    assert all("authorization" not in r.headers for r in cdn)
    assert cdn[-1].headers.get("range") == "bytes=500-" and cdn[-1].headers.get("if-range")
    asset_gets = [r for r in gh.requests if r.host == "api" and "/releases/assets/" in r.path]
    assert asset_gets and all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in asset_gets)
    assert all(r.headers.get("accept") == "application/octet-stream" for r in asset_gets)


def test_fetch_of_a_changed_asset_is_a_verify_error(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    store = store_for(gh)
    entry = store.publish(zip_path, manifest).entry
    (zip_asset,) = [a for a in gh.assets.values() if a.name == "bundle.zip"]
    data = bytearray(zip_asset.data)
    data[len(data) // 2] ^= 1
    zip_asset.data = bytes(data)
    with pytest.raises(VerifyError) as e:
        store.fetch(entry, tmp_path / "dl")
    assert e.value.exit_code == 5
    assert not (tmp_path / "dl" / "bundle.zip").exists()


# ------------------------------------------------------------------------------- concurrency


@pytest.mark.race
def test_four_concurrent_publishers_leave_one_release(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    barrier = threading.Barrier(4)
    results: list[Any] = [None] * 4
    logs = [Captured() for _ in range(4)]

    def run(i: int) -> None:
        store = store_for(gh, log=logs[i].log, sleep=lambda s: time.sleep(min(s, 0.02)))
        barrier.wait()
        try:
            results[i] = store.publish(zip_path, manifest)
        except BaseException as e:  # noqa: BLE001
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not [r for r in results if not hasattr(r, "created")], results
    assert sorted(r.created for r in results) == [False, False, False, True]
    assert {r.entry.zip_sha256 for r in results} == {sha256(zip_path)}
    (rel,) = gh.releases.values()
    assert not rel.draft
    assert gh.asset_names(rel) == ["SHA256SUMS", "blobs.all.zst", "blobs.json", "bundle.json", "bundle.zip"]
    assert len(gh.assets) == 5
    assert gh.count("POST", "/releases", host="api") - gh.count("POST", "/uploads/") == 1  # one draft created
    assert all(TOKEN not in c.text for c in logs)


def test_a_loser_waits_for_the_winners_release(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.add_ref(TAG)  # another publisher holds the tag and is uploading
    draft = gh.add_release(TAG, draft=True, assets={"bundle.zip": zip_path.read_bytes()})
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 2:  # meanwhile the winner finishes
            with gh.lock:
                gh._add_asset(draft, "bundle.json", manifest.text().encode())
                draft.draft = False

    cap = Captured()
    done = store_for(gh, log=cap.log, sleep=sleep, poll_interval=7).publish(zip_path, manifest)
    assert done.created is False
    assert done.entry.zip_sha256 == sha256(zip_path)
    assert sleeps == [7, 7]
    assert "another publisher holds" in cap.text
    assert len(gh.releases) == 1 and gh.count("POST", "/uploads/") == 0


def test_a_stale_tag_is_taken_over(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.add_ref(TAG)
    old = gh.add_release(TAG, draft=True, created_at=time.time() - 4000,
                         assets={"bundle.zip": b"half a zip"}, state="starter")
    cap = Captured()
    done = store_for(gh, log=cap.log, stale_after=1800).publish(zip_path, manifest)
    assert done.created is True
    assert old.id not in gh.releases
    (rel,) = gh.releases.values()
    assert not rel.draft and gh.asset_names(rel) == ["SHA256SUMS", "blobs.all.zst", "blobs.json", "bundle.json", "bundle.zip"]
    assert gh.count("DELETE", f"/git/refs/tags/{TAG}") == 1
    assert "taking it over" in cap.text
    assert store_for(gh).lookup(KEY).zip_sha256 == sha256(zip_path)


def test_a_tag_without_any_release_goes_stale_after_the_timeout(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.add_ref(TAG)  # a publisher died between taking the tag and creating its draft
    done = store_for(gh, stale_after=0.2, sleep=lambda s: time.sleep(0.05)).publish(zip_path, manifest)
    assert done.created is True
    assert len(gh.releases) == 1


def test_a_fresh_draft_is_not_stale(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.add_ref(TAG)
    gh.add_release(TAG, draft=True, created_at=time.time() - 10)
    with pytest.raises(StoreError) as e:  # wait_timeout=0: give up at once instead of waiting
        store_for(gh, stale_after=1800, wait_timeout=0).publish(zip_path, manifest)
    assert "timed out waiting" in e.value.what
    assert f"refs/tags/{TAG}" in gh.refs and len(gh.releases) == 1


# ------------------------------------------------------------------------- upload reconciliation


def test_a_502_leaving_a_starter_asset_is_reconciled(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.fail_upload_once("bundle.zip")
    sleeps: list[float] = []
    done = store_for(gh, sleeps=sleeps).publish(zip_path, manifest)
    assert done.created is True
    (rel,) = gh.releases.values()
    assert gh.asset_names(rel) == ["SHA256SUMS", "blobs.all.zst", "blobs.json", "bundle.json", "bundle.zip"]
    assert all(gh.assets[a].state == "uploaded" for a in rel.assets)
    assert gh.count("DELETE", "/releases/assets/") == 1  # the starter asset
    assert gh.count("POST", "name=bundle.zip") == 2
    assert len(sleeps) == 1
    assert store_for(gh).lookup(KEY).zip_sha256 == sha256(zip_path)


def test_an_uploaded_asset_with_the_same_digest_counts_as_done(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.conflict_upload_once("bundle.zip", zip_path.read_bytes())  # our bytes got there; the answer was lost
    done = store_for(gh).publish(zip_path, manifest)
    assert done.created is True
    assert gh.count("POST", "name=bundle.zip") == 1
    assert gh.count("DELETE", "/releases/assets/") == 0


def test_an_asset_with_a_different_digest_is_a_conflict(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.conflict_upload_once("bundle.zip", b"somebody else's zip")
    with pytest.raises(AssetConflictError) as e:
        store_for(gh).publish(zip_path, manifest)
    assert isinstance(e.value, StoreError) and e.value.exit_code == 6
    assert "different bundle.zip" in e.value.what
    assert gh.count("DELETE", "/releases/assets/") == 0  # never cleaned up
    assert [gh.assets[a].data for r in gh.releases.values() for a in r.assets] == [b"somebody else's zip"]


# ------------------------------------------------------------------------ retries and errors


def test_a_403_rate_limit_waits_for_the_reset(gh: FakeGitHub) -> None:
    gh.rate_limit_once(reset_in=3)
    sleeps: list[float] = []
    cap = Captured()
    assert store_for(gh, sleeps=sleeps, log=cap.log).lookup(KEY) is None
    assert len(sleeps) == 1 and 1.5 <= sleeps[0] <= 5
    assert gh.count("GET", "/releases/tags/") == 2
    assert "HTTP 403" in cap.text


def test_a_rate_limit_reset_too_far_away_is_an_error(gh: FakeGitHub) -> None:
    gh.rate_limit_once(reset_in=3600)
    sleeps: list[float] = []
    with pytest.raises(RateLimitError) as e:
        store_for(gh, sleeps=sleeps).lookup(KEY)
    assert e.value.exit_code == 6 and e.value.status == 403
    assert e.value.request_id
    assert sleeps == []


def test_5xx_and_429_are_retried_with_backoff(gh: FakeGitHub) -> None:
    gh.status_once(502, path_part="/releases/tags/")
    gh.status_once(429, path_part="/releases/tags/", headers={"retry-after": "2"})
    sleeps: list[float] = []
    assert store_for(gh, sleeps=sleeps).lookup(KEY) is None
    assert len(sleeps) == 2 and sleeps[1] == 2.0
    assert gh.count("GET", "/releases/tags/") == 3


def test_persistent_5xx_gives_up_after_bounded_attempts(gh: FakeGitHub) -> None:
    gh.status_once(503, path_part="/releases/tags/", times=10)
    sleeps: list[float] = []
    with pytest.raises(StoreError) as e:
        store_for(gh, sleeps=sleeps, max_attempts=4).lookup(KEY)
    assert e.value.exit_code == 6
    assert gh.count("GET", "/releases/tags/") == 4 and len(sleeps) == 3
    assert "gave up after 4 attempts" in e.value.why


def test_a_422_is_a_typed_error_with_the_request_id_and_the_tag_is_released(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)

    def fault(req: Request, h: Any) -> bool:
        if req.method == "POST" and req.path == f"/repos/{REPO}/releases":
            h.read_body()
            h.reply_json(422, {"message": "Validation Failed",
                               "errors": [{"resource": "Release", "code": "custom", "message": "tag_name is bad"}]},
                         headers={"x-github-request-id": "ABCD:1234"})
            return True
        return False

    gh.add_fault(fault)
    with pytest.raises(GitHubValidationError) as e:
        store_for(gh).publish(zip_path, manifest)
    assert e.value.exit_code == 6 and e.value.status == 422
    assert e.value.request_id == "ABCD:1234"
    assert "ABCD:1234" in e.value.render()
    assert "tag_name is bad" in e.value.why
    assert f"refs/tags/{TAG}" not in gh.refs  # given back, so that the next publisher need not wait


def test_the_token_never_appears_in_errors_or_logs(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)

    def echo(req: Request, h: Any) -> bool:  # a server that echoes the credentials in its error
        if req.path.endswith("/git/refs") and req.method == "POST":
            h.read_body()
            h.reply_json(422, {"message": f"bad header {req.headers.get('authorization')}"})
            return True
        return False

    gh.add_fault(echo)
    gh.fail_upload_once("bundle.json")
    cap = Captured()
    errors: list[LlamaBundleError] = []
    store = store_for(gh, log=cap.log)
    with pytest.raises(GitHubValidationError) as e:
        store.publish(zip_path, manifest)
    errors.append(e.value)
    assert "***" in e.value.why
    done = store.publish(zip_path, manifest)  # the fault was used once: now it works, with a retried upload
    store.fetch(done.entry, tmp_path / "dl")
    closed = _closed_port()
    with pytest.raises(StoreError) as e2:
        GitHubStore(REPO, api_url=f"http://127.0.0.1:{closed}", token=TOKEN, log=cap.log,
                    sleep=lambda s: None).lookup(KEY)
    errors.append(e2.value)
    for err in errors:
        for text in (str(err), err.render(), repr(err.args)):
            assert TOKEN not in text
    assert cap.text and TOKEN not in cap.text


def test_an_unreachable_api_fails_quickly_with_exit_6(tmp_path: Path) -> None:
    port = _closed_port()
    sleeps: list[float] = []
    store = GitHubStore(REPO, api_url=f"http://127.0.0.1:{port}", token=TOKEN, log=Captured().log,
                        sleep=sleeps.append, refused_attempts=2)
    with pytest.raises(NetworkError) as e:
        store.lookup(KEY)
    assert e.value.exit_code == 6
    assert "unreachable" in e.value.what
    assert len(sleeps) == 1  # two attempts in all
    zip_path, manifest = make_bundle(tmp_path)
    with pytest.raises(StoreError):
        store.publish(zip_path, manifest)
    assert len(sleeps) == 2


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---------------------------------------------------------------------------------- open_store


def test_open_store_github_builds_the_store_from_settings(gh: FakeGitHub, tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path, github_api_url=gh.api_url, github_token=TOKEN)
    store = open_store(f"github:{REPO}", settings=settings, log=Captured().log)
    assert isinstance(store, GitHubStore)
    assert (store.url, store.repo, store.api_url, store.token) == (f"github:{REPO}", REPO, gh.api_url, TOKEN)
    assert store.lookup(KEY) is None
    plain = open_store("github:o/r")
    assert isinstance(plain, GitHubStore) and plain.api_url == "https://api.github.com" and plain.token is None


@pytest.mark.parametrize("url", ["github:", "github:noslash", "github:a/b/c", "github:a b/c"])
def test_open_store_github_needs_owner_and_repo(url: str) -> None:
    with pytest.raises(LlamaBundleError) as e:
        open_store(url)
    assert e.value.exit_code == 2


def test_fetch_of_a_plain_entry_looks_the_asset_up_again(gh: FakeGitHub, tmp_path: Path) -> None:
    from llamabundle.store.base import Entry

    zip_path, manifest = make_bundle(tmp_path)
    e = store_for(gh).publish(zip_path, manifest).entry
    plain = Entry(key=e.key, zip_name=e.zip_name, zip_sha256=e.zip_sha256, zip_size=e.zip_size,
                  manifest=e.manifest, location=e.location)
    got = store_for(gh).fetch(plain, tmp_path / "dl")
    assert sha256(got) == sha256(zip_path)
