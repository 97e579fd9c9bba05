"""The GitHub store's publish protocol (DESIGN §6): take the tag first (`POST /git/refs`: exactly one
concurrent publisher wins), then draft release → zip → SHA256SUMS → bundle.json → publish. A loser waits for
the winner's release; a tag whose release stays a draft longer than `stale_after` seconds is taken over (its
draft deleted only when none of its uploaded assets differs from ours). A publisher that fails removes its
draft and the tag; an uploaded asset with another digest is never cleaned up."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from ...bundle import MANIFEST
from ...bundle import manifest as manifest_mod
from ...errors import StoreError
from .. import sums
from .client import (
    AssetConflictError,
    GitHubClient,
    GitHubError,
    GitHubValidationError,
    RefExistsError,
    age,
    already_exists,
    asset_digest,
    sha256_bytes,
)
from .releases import GitHubEntry, Releases, blob_assets


@dataclass(frozen=True)
class Extra:
    """An asset published beside the zip, listed in SHA256SUMS."""
    name: str
    ctype: str
    open: Callable[[], IO[bytes] | bytes]
    size: int
    sha256: str


class Publisher:
    """One bundle's publish into one repository."""

    def __init__(self, client: GitHubClient, releases: Releases, *, stale_after: float, poll_interval: float,
                 wait_timeout: float, on_step: Callable[[str], None]) -> None:
        self.client, self.releases = client, releases
        self.stale_after, self.poll_interval, self.wait_timeout, self.on_step = (stale_after, poll_interval,
                                                                                 wait_timeout, on_step)

    def publish(self, zip_path: Path, zip_sha: str, mbytes: bytes, *, tag: str, key: str,
                lookup: Callable[[str], GitHubEntry | None], extra: Sequence[Extra] = ()) -> tuple[GitHubEntry, bool]:
        """(the entry, whether this publisher created it). `extra`: assets uploaded after the zip (the blobs)."""
        sums_bytes = "".join([sums.line(zip_sha, zip_path.name), *(sums.line(x.sha256, x.name) for x in extra)]).encode()
        ours = {zip_path.name: zip_sha, sums.NAME: sha256_bytes(sums_bytes), MANIFEST: sha256_bytes(mbytes)}
        for _round in range(4):
            existing = lookup(key)
            if existing is not None:
                return existing, False
            if self._take_tag(tag):
                won = self._as_winner(tag, key, zip_path, zip_sha, sums_bytes, mbytes, extra)
                if won is not None:
                    return won, True
            entry = self._wait_for_winner(tag, key, ours)
            if entry is not None:
                return entry, False
            # the tag was given up (or found stale and cleared): try to take it again
        raise StoreError(f"cannot take the tag {tag} in {self.client.repo}", why="other publishers kept taking it over",
                         fix="retry later")

    # ---------------------------------------------------------------------------------------- the tag

    def _default_head(self) -> str:
        c = self.client
        repo = c.json(c.api("GET", c.repo_api, what=f"read the repository {c.repo}"), c.repo)
        branch = repo.get("default_branch") or "main"
        ref = c.json(c.api("GET", f"{c.repo_api}/git/ref/heads/{quote(branch, safe='/')}",
                           what=f"read the head of {branch}"), f"refs/heads/{branch}")
        sha = (ref.get("object") or {}).get("sha")
        if not isinstance(sha, str) or not sha:
            raise StoreError(f"cannot read the head of {branch} in {c.repo}", why="the answer has no object.sha")
        return sha

    def _take_tag(self, tag: str) -> bool:
        c = self.client
        sha = self._default_head()
        try:
            c.api("POST", f"{c.repo_api}/git/refs", json_body={"ref": f"refs/tags/{tag}", "sha": sha},
                  ok=(201,), what=f"create the tag {tag}")
        except RefExistsError as e:
            # after a lost answer the tag may be our own: claim it, and let _first_claim settle it
            return e.lost
        return True

    def _delete_ref(self, tag: str, *, attempts: int | None = None) -> None:
        c = self.client
        # GitHub answers 422 "Reference does not exist" for a missing ref
        c.api("DELETE", f"{c.repo_api}/git/refs/tags/{quote(tag, safe='')}", ok=(204, 404, 422),
              attempts=attempts, what=f"delete the tag {tag}")

    # ---------------------------------------------------------------------------------------- winner

    def _as_winner(self, tag: str, key: str, zip_path: Path, zip_sha: str, sums_bytes: bytes,
                   mbytes: bytes, extra: Sequence[Extra]) -> GitHubEntry | None:
        """The entry, or None when another publisher turned out to hold the tag first (we stepped back)."""
        c = self.client
        c.log.info(f"    github: took the tag {tag} in {c.repo}; creating a draft release")
        self.on_step("tag")
        rel_id: int | None = None
        publishing = False
        body = f"llamabundle bundle, cache key `{key}`"
        nonce = f"<!-- llamabundle publisher {random.getrandbits(64):016x} -->"
        try:
            try:
                rel = c.json(c.api("POST", f"{c.repo_api}/releases", ok=(201,), what=f"create the release {tag}",
                                   json_body={"tag_name": tag, "name": tag, "draft": True,
                                              "make_latest": "false",  # never the repo's "Latest"
                                              "body": f"{body}\n{nonce}"}), "the release")
            except GitHubValidationError as e:
                if not already_exists(e.errors, e.why):
                    raise
                c.log.info(f"    github: the release {tag} was published meanwhile; stepping back")
                return None  # another publisher held the tag too, and published: its tag, not ours to delete
            rel_id = int(rel["id"])
            if not self._first_claim(tag, rel_id, nonce):
                c.log.info(f"    github: another publisher holds {tag} too, and came first; stepping back")
                c.api("DELETE", f"{c.repo_api}/releases/{rel_id}", ok=(204, 404), what="delete our draft")
                return None
            self.on_step("draft")
            upload = c.trust_upload(rel)
            zip_asset = c.upload(rel_id, upload, zip_path.name, "application/zip",
                                 lambda: open(zip_path, "rb"),  # noqa: SIM115 - upload closes it
                                 zip_path.stat().st_size, zip_sha)
            self.on_step("uploaded")
            for x in extra:
                c.upload(rel_id, upload, x.name, x.ctype, x.open, x.size, x.sha256)
            c.upload(rel_id, upload, sums.NAME, "text/plain", lambda: sums_bytes, len(sums_bytes),
                     sha256_bytes(sums_bytes))
            c.upload(rel_id, upload, MANIFEST, "application/json", lambda: mbytes, len(mbytes), sha256_bytes(mbytes))
            publishing = True
            done = c.json(c.api("PATCH", f"{c.repo_api}/releases/{rel_id}",
                                # GitHub recomputes "Latest" when a draft is published: say no again
                                json_body={"draft": False, "make_latest": "false", "body": body},
                                what=f"publish the release {tag}"), "the release")
        except AssetConflictError:
            raise  # never clean up an uploaded asset with a different digest
        except BaseException as e:
            # a publish whose answers were all lost may have been applied: never delete a published release
            done = self._published(rel_id) if publishing and isinstance(e, Exception) else None
            if done is None:
                self._give_up(tag, rel_id)
                raise
        self.on_step("published")
        if done.get("draft"):
            raise StoreError(f"the release {tag} in {c.repo} stayed a draft after publishing", fix="retry")
        z = next((a for a in done.get("assets") or [] if a.get("name") == zip_path.name), zip_asset)
        c.log.info(f"    github: published {tag} in {c.repo}")
        assert rel_id is not None  # the draft was created before anything here could succeed
        return GitHubEntry(key=key, zip_name=zip_path.name, zip_sha256=zip_sha, zip_size=zip_path.stat().st_size,
                           manifest=manifest_mod.loads(mbytes), location=z.get("browser_download_url") or z.get("url", ""),
                           asset_url=z["url"], release_id=int(rel_id), blob_assets=blob_assets(done.get("assets") or []))

    def _first_claim(self, tag: str, rel_id: int, nonce: str) -> bool:
        """Whether our new draft is the tag's first release. Two publishers can both believe they hold the tag (a
        takeover racing another one, or a tag claimed after a lost answer): the one whose release came first goes
        on, the other steps back. Our own older drafts (a create retried after a lost answer) are removed."""
        c = self.client
        for x in self.releases.of_tag(tag):
            if x.get("id") == rel_id or (x.get("draft") and int(x["id"]) > rel_id):
                continue  # ours, or younger: its publisher steps back
            if not (x.get("draft") and nonce in str(x.get("body") or "")):
                return False
            c.api("DELETE", f"{c.repo_api}/releases/{x['id']}", ok=(204, 404), what="delete a duplicate of our draft")
        return True

    def _published(self, rel_id: int | None) -> dict[str, Any] | None:
        """Our release as GitHub has it when it is published (best effort), else None."""
        c = self.client
        try:
            r = c.api("GET", f"{c.repo_api}/releases/{rel_id}", ok=(200, 404), what="read our release")
            rel = c.json(r, "our release") if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - the original error is what matters
            return None
        return rel if isinstance(rel, dict) and rel.get("draft") is False else None

    def _give_up(self, tag: str, rel_id: int | None) -> None:
        """Best effort after a failed publish: remove our draft and the tag so that others need not wait."""
        c = self.client
        try:
            if rel_id is not None:
                c.api("DELETE", f"{c.repo_api}/releases/{rel_id}", ok=(204, 404), attempts=1,
                      what="delete our draft release")
            self._delete_ref(tag, attempts=1)
        except Exception:  # noqa: BLE001, S110 - the original error is what matters
            pass

    # ---------------------------------------------------------------------------------------- loser

    def _wait_for_winner(self, tag: str, key: str, ours: Mapping[str, str]) -> GitHubEntry | None:
        """Wait until the tag's release is published (its entry), or the tag is gone or stale (None). A stale
        draft is deleted only when none of its uploaded assets differs from ours (`ours`: name -> sha256)."""
        c = self.client
        start = time.monotonic()
        last_note = -1e9
        while True:
            rel = self.releases.by_tag(tag)
            if rel is not None:
                entry = self.releases.entry(rel, key)
                if entry is None:
                    raise StoreError(f"release {tag} in {c.repo} is published but incomplete",
                                     why=f"it lacks {MANIFEST} or exactly one uploaded .zip",
                                     fix=f"delete the release {tag} (and its tag) and publish again")
                return entry
            r = c.api("GET", f"{c.repo_api}/git/ref/tags/{quote(tag, safe='')}", ok=(200, 404),
                      what=f"read the tag {tag}")
            if r.status_code == 404:
                return None  # the holder gave up
            rels = self.releases.of_tag(tag)
            published = any(not x.get("draft") for x in rels)  # since we looked: never untag a published release
            draft = min((x for x in rels if x.get("draft")), key=lambda x: x.get("created_at") or "", default=None)
            waited = time.monotonic() - start
            old = waited if draft is None else age(draft.get("created_at"))
            if old > self.stale_after and not published:
                c.log.info(f"    github: the tag {tag} has had no published release for {old:.0f}s; taking it over")
                if draft is not None:
                    for a in draft.get("assets") or []:
                        if a.get("state") == "uploaded" and a.get("name") in ours and asset_digest(a) != ours[a["name"]]:
                            raise AssetConflictError(
                                f"the stale draft release {tag} in {c.repo} holds a different {a['name']}",
                                why=f"its digest is {a.get('digest') or 'unknown'}, ours is sha256:{ours[a['name']]}",
                                fix=f"delete the draft release {tag} and its tag by hand if it is wrong, then retry")
                    try:
                        c.api("DELETE", f"{c.repo_api}/releases/{draft['id']}", ok=(204,),
                              what="delete a stale draft release")
                    except GitHubError as e:
                        if e.status != 404:
                            raise
                        if not e.lost:  # (after a lost answer the delete was ours)
                            continue  # someone else is taking it over: look again
                self._delete_ref(tag)
                return None
            if waited > self.wait_timeout:
                raise StoreError(f"timed out waiting for the release {tag} in {c.repo}",
                                 why=f"another publisher holds the tag (waited {waited:.0f}s)", fix="retry later")
            if waited - last_note >= 30 or last_note < 0:
                last_note = waited
                c.log.info(f"    github: another publisher holds {tag}; waiting for its release "
                           f"({waited:.0f}s so far)")
            c.sleep(self.poll_interval)
