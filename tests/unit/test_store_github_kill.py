"""The GitHub store's publish across real processes and lost answers (DESIGN §6), against tests/fakegithub.py.

A publisher runs in a subprocess and is SIGKILLed at a step (`on_step`): right after taking the tag, after
creating its draft, after uploading its zip. A later run takes the stale tag over, alone or racing fresh
publishers. Then every mutation whose answer is lost after GitHub applied it (a 502, a hang-up): create the
tag, create the draft, upload an asset, publish, delete during a takeover; each retry reconciles."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from llamabundle.bundle.manifest import Manifest
from llamabundle.store.github import AssetConflictError
from tests.fakegithub import FakeGitHub, Request
from tests.ghstore import (
    KEY,
    REPO,
    TAG,
    TOKEN,
    Captured,
    make_bundle,
    sha256,
    store_for,
)

pytestmark = pytest.mark.race

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["SHA256SUMS", "blobs.all.zst", "blobs.json", "bundle.json", "bundle.zip"]

# A publisher in its own process: prints "STEP <step>" at each step and sleeps at `pause` (to be killed),
# then "DONE {created, sha}" or "ERROR <class> <what>" (and the error's exit code).
CHILD = r"""
import json, sys, time
from pathlib import Path
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["root"])
from llamabundle.bundle import manifest
from llamabundle.errors import LlamaBundleError
from llamabundle.store.github import GitHubStore

def on_step(step):
    print("STEP", step, flush=True)
    if step == cfg["pause"]:
        time.sleep(120)

store = GitHubStore(cfg["repo"], api_url=cfg["api"], token=cfg["token"], tags={cfg["key"]: cfg["tag"]},
                    stale_after=cfg["stale_after"], poll_interval=0.05, wait_timeout=20, backoff=0.05,
                    on_step=on_step)
try:
    done = store.publish(Path(cfg["zip"]), manifest.loads(Path(cfg["manifest"]).read_bytes()))
except LlamaBundleError as e:
    print("ERROR", type(e).__name__, e.what, flush=True)
    sys.exit(e.exit_code)
print("DONE", json.dumps({"created": done.created, "sha": done.entry.zip_sha256}), flush=True)
"""


def spawn(gh: FakeGitHub, zip_path: Path, manifest: Manifest, *, pause: str = "", stale_after: float = 1800.0
          ) -> subprocess.Popen[str]:
    mpath = zip_path.with_suffix(".manifest.json")
    mpath.write_text(manifest.text(), encoding="utf-8")
    cfg = {"root": str(ROOT), "repo": REPO, "api": gh.api_url, "token": TOKEN, "key": KEY, "tag": TAG,
           "zip": str(zip_path), "manifest": str(mpath), "pause": pause, "stale_after": stale_after}
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def kill_at(gh: FakeGitHub, zip_path: Path, manifest: Manifest, step: str) -> list[str]:
    """Run a publisher until it reports `step`, then SIGKILL it; the lines it printed."""
    p = spawn(gh, zip_path, manifest, pause=step)
    watchdog = threading.Timer(20, p.kill)
    watchdog.start()
    lines: list[str] = []
    try:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line.rstrip("\n"))
            if line.strip() == f"STEP {step}":
                os.kill(p.pid, signal.SIGKILL)
                break
    finally:
        watchdog.cancel()
        p.wait(10)
        p.stdout.close()  # type: ignore[union-attr]
    assert p.returncode == -signal.SIGKILL, lines
    return lines


def finish(p: subprocess.Popen[str]) -> tuple[int, str, dict[str, Any] | None]:
    out, _ = p.communicate(timeout=30)
    done = [ln for ln in out.splitlines() if ln.startswith("DONE ")]
    return p.returncode, out, json.loads(done[-1][5:]) if done else None


def assert_published_once(gh: FakeGitHub, zip_path: Path) -> None:
    """Exactly one release, published, holding our three assets and nothing else; a lookup hits."""
    (rel,) = gh.releases.values()
    assert rel.tag_name == TAG and not rel.draft
    assert gh.asset_names(rel) == NAMES and len(gh.assets) == 5
    assert all(gh.assets[a].state == "uploaded" for a in rel.assets)
    (z,) = [gh.assets[a] for a in rel.assets if gh.assets[a].name == "bundle.zip"]
    assert z.digest == f"sha256:{sha256(zip_path)}" and z.data == zip_path.read_bytes()
    entry = store_for(gh).lookup(KEY)
    assert entry is not None and entry.zip_sha256 == sha256(zip_path) and entry.release_id == rel.id
    assert f"refs/tags/{TAG}" in gh.refs


# -------------------------------------------------------------------- SIGKILL, then a takeover


def test_killed_right_after_taking_the_tag_then_a_later_run_takes_over(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    assert kill_at(gh, zip_path, manifest, "tag")[-1] == "STEP tag"
    assert f"refs/tags/{TAG}" in gh.refs and gh.releases == {}  # a tag with no release at all
    assert store_for(gh).lookup(KEY) is None

    rc, out, done = finish(spawn(gh, zip_path, manifest, stale_after=0.3))  # no draft: stale after 0.3 s of waiting
    assert rc == 0 and done == {"created": True, "sha": sha256(zip_path)}, out
    assert "taking it over" in out
    assert gh.count("DELETE", f"/git/refs/tags/{TAG}") == 1
    assert_published_once(gh, zip_path)


def test_killed_after_the_draft_then_a_later_run_takes_over(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    kill_at(gh, zip_path, manifest, "draft")
    (old,) = gh.releases.values()
    assert old.draft and old.assets == [] and f"refs/tags/{TAG}" in gh.refs
    assert store_for(gh).lookup(KEY) is None

    gh.backdate(3600)  # the server now says the draft is an hour old
    rc, out, done = finish(spawn(gh, zip_path, manifest, stale_after=60))
    assert rc == 0 and done == {"created": True, "sha": sha256(zip_path)}, out
    assert old.id not in gh.releases
    assert_published_once(gh, zip_path)


def test_killed_after_uploading_the_zip_leftovers_are_reconciled(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    kill_at(gh, zip_path, manifest, "uploaded")
    (old,) = gh.releases.values()
    assert old.draft and gh.asset_names(old) == ["bundle.zip"]  # zip uploaded, SHA256SUMS and bundle.json not
    with gh.lock:  # and an upload the kill cut short, as GitHub leaves it: a `starter` asset
        gh._add_asset(old, "SHA256SUMS", b"0123", state="starter", digest=False)
    gh.backdate(3600)
    assert store_for(gh).lookup(KEY) is None

    rc, out, done = finish(spawn(gh, zip_path, manifest, stale_after=60))
    assert rc == 0 and done == {"created": True, "sha": sha256(zip_path)}, out
    assert old.id not in gh.releases
    assert_published_once(gh, zip_path)


def test_a_stale_draft_holding_a_different_zip_is_a_conflict_not_a_clobber(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    kill_at(gh, zip_path, manifest, "uploaded")
    (old,) = gh.releases.values()
    theirs = zip_path.read_bytes()
    gh.backdate(3600)
    # a rebuild of the same key whose zip differs (a non-reproducible build)
    other_zip, other_manifest = make_bundle(tmp_path / "other", KEY,
                                            files={"llama-server": b"another build\n", "LICENSE": b"MIT\n"})
    assert sha256(other_zip) != sha256(zip_path)

    rc, out, done = finish(spawn(gh, other_zip, other_manifest, stale_after=60))
    assert rc == 6 and done is None, out
    assert "ERROR AssetConflictError" in out and "different bundle.zip" in out
    # nothing was cleaned up: the draft, its uploaded zip and the tag are as the killed publisher left them
    assert list(gh.releases) == [old.id] and gh.releases[old.id].draft
    assert [gh.assets[a].data for a in old.assets] == [theirs]
    assert f"refs/tags/{TAG}" in gh.refs
    assert gh.count("DELETE") == 0
    # the same conflict in process is the typed error
    with pytest.raises(AssetConflictError) as e:
        store_for(gh, stale_after=60).publish(other_zip, other_manifest)
    assert e.value.exit_code == 6


# ------------------------------------------------------------------------ a takeover racing others


@pytest.mark.parametrize(("step", "stale_after"), [("tag", 1.5), ("draft", 60.0)])
def test_a_takeover_racing_fresh_publishers_leaves_one_release(gh: FakeGitHub, tmp_path: Path, step: str,
                                                               stale_after: float) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    kill_at(gh, zip_path, manifest, step)
    gh.backdate(3600)  # a stale draft (step "draft"); with no draft, staleness is each waiter's own clock
    procs = [spawn(gh, zip_path, manifest, stale_after=stale_after) for _ in range(3)]
    results = [finish(p) for p in procs]
    for rc, out, done in results:
        assert rc == 0 and done is not None and done["sha"] == sha256(zip_path), out
    assert sorted(d["created"] for _, _, d in results if d) == [False, False, True], [o for _, o, _ in results]
    assert_published_once(gh, zip_path)
    assert not [r for r in gh.releases.values() if r.draft]


# ------------------------------------------------------------- lost answers: applied, then 502 or hang-up
# Each mutation's answer is lost after the server applied it; the retry must re-read the state, and end in one
# published release, without waiting for the tag to go stale (`poll_interval` 123 would be a wait: refused).

POLL = 123.0


def quick(gh: FakeGitHub, sleeps: list[float], **kw: Any) -> Any:
    def sleep(s: float) -> None:
        assert s != POLL, "waited for another publisher"
        sleeps.append(s)

    kw.setdefault("log", Captured().log)
    return store_for(gh, sleep=sleep, poll_interval=POLL, **kw)


@pytest.mark.parametrize("status", [502, None])
def test_a_tag_created_but_its_answer_lost_is_ours(gh: FakeGitHub, tmp_path: Path, status: int | None) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.lose_answer_once("POST", "/git/refs", status=status)
    sleeps: list[float] = []
    done = quick(gh, sleeps).publish(zip_path, manifest)
    assert done.created is True
    assert gh.count("POST", "/git/refs") == 2  # the retry found the tag taken: by us, as it turns out
    assert gh.count("DELETE", "/git/refs") == 0 and len(sleeps) == 1  # one backoff, no wait, no takeover
    assert_published_once(gh, zip_path)
    assert "publisher" not in next(iter(gh.releases.values())).body  # the claim marker is gone once published


def test_a_tag_claimed_after_a_lost_answer_but_held_by_another_steps_back(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    theirs: list[Any] = []

    def another_got_there(req: Request, h: Any) -> bool:  # our create was not applied: another publisher's was
        if not (req.method == "POST" and req.path.endswith("/git/refs")):
            return False
        h.read_body()
        gh.add_ref(TAG)
        theirs.append(gh.add_release(TAG, draft=True, assets={"bundle.zip": zip_path.read_bytes()}))
        h.reply_json(502, {"message": "Bad Gateway"})
        return True

    gh.add_fault(another_got_there)
    polls: list[float] = []

    def sleep(s: float) -> None:
        polls.append(s)
        if s == POLL:  # while we wait, the other publisher finishes
            with gh.lock:
                gh._add_asset(theirs[0], "bundle.json", manifest.text().encode())
                theirs[0].draft = False

    done = store_for(gh, sleep=sleep, poll_interval=POLL).publish(zip_path, manifest)
    assert done.created is False and done.entry.release_id == theirs[0].id
    assert list(gh.releases) == [theirs[0].id]  # our draft was created, found younger, and deleted
    assert gh.count("POST", f"/repos/{REPO}/releases") - gh.count("POST", "/uploads/") == 1
    (deleted,) = [r.path for r in gh.requests if r.method == "DELETE"]  # ours; their tag is left alone
    assert deleted.startswith(f"/repos/{REPO}/releases/") and int(deleted.rsplit("/", 1)[1]) > theirs[0].id
    assert gh.count("POST", "/uploads/") == 0


def test_a_draft_created_but_its_answer_lost_leaves_no_duplicate(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.lose_answer_once("POST", f"/repos/{REPO}/releases")
    done = quick(gh, []).publish(zip_path, manifest)
    assert done.created is True
    assert gh.count("POST", f"/repos/{REPO}/releases") - gh.count("POST", "/uploads/") == 2  # two drafts made
    assert gh.count("DELETE", "/releases/") == 1  # the first one, found by our marker, removed
    assert_published_once(gh, zip_path)


@pytest.mark.parametrize(("name", "status"), [("bundle.zip", None), ("SHA256SUMS", 502), ("bundle.json", 504)])
def test_an_upload_applied_but_its_answer_lost_is_not_repeated(gh: FakeGitHub, tmp_path: Path, name: str,
                                                             status: int | None) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.lose_answer_once("POST", f"name={name}", status=status)
    done = quick(gh, []).publish(zip_path, manifest)
    assert done.created is True
    assert gh.count("POST", f"name={name}") == 1  # the re-listed assets showed it uploaded with our digest
    assert gh.count("GET", "/assets?per_page") == 1 and gh.count("DELETE") == 0
    assert_published_once(gh, zip_path)


def test_a_publish_applied_but_its_answer_lost_is_not_undone(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.lose_answer_once("PATCH", "/releases/")
    assert quick(gh, []).publish(zip_path, manifest).created is True  # the retried PATCH finds it published
    assert gh.count("PATCH") == 2
    assert_published_once(gh, zip_path)


def test_a_publish_whose_every_answer_is_lost_keeps_the_release(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.lose_answer_once("PATCH", "/releases/")
    gh.status_once(502, method="PATCH", times=2)  # and the retries fail too
    done = quick(gh, [], max_attempts=3).publish(zip_path, manifest)
    assert done.created is True and done.entry.zip_sha256 == sha256(zip_path)
    assert gh.count("PATCH") == 3 and gh.count("DELETE") == 0  # neither the release nor its tag deleted
    assert_published_once(gh, zip_path)


def test_a_takeover_whose_deletes_lose_their_answers_goes_on(gh: FakeGitHub, tmp_path: Path) -> None:
    zip_path, manifest = make_bundle(tmp_path)
    gh.add_ref(TAG)
    old = gh.add_release(TAG, draft=True, created_at=time.time() - 4000, assets={"bundle.zip": b"half"},
                         state="starter")
    gh.lose_answer_once("DELETE", f"/releases/{old.id}", status=None)
    gh.lose_answer_once("DELETE", f"/git/refs/tags/{TAG}")
    done = quick(gh, [], stale_after=1800).publish(zip_path, manifest)
    assert done.created is True
    assert gh.count("DELETE", f"/releases/{old.id}") == 2  # the retry's 404: our delete had been applied
    assert gh.count("DELETE", f"/git/refs/tags/{TAG}") == 2  # the retry's 422: likewise
    assert old.id not in gh.releases
    assert_published_once(gh, zip_path)
