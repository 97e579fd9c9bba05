"""Reading a GitHub store's releases: a release per cache key, and when one is a complete entry. A hit is a
*published* release whose assets include `bundle.json` and exactly one uploaded `.zip` (its `digest`, or its
SHA256SUMS line, is the entry's sha256), and whose bundle.json is a manifest of the key asked for
(manifest.check_consistent): one that is not is refused (exit 5) with the advice to delete the release."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from ...bundle import MANIFEST
from ...bundle import manifest as manifest_mod
from ...bundle.manifest import Expect, Manifest, ManifestError
from ...errors import StoreError
from .. import sums
from ..base import Entry
from .blobs import is_blob_asset
from .client import GitHubClient, asset_digest, asset_size


@dataclass(frozen=True, kw_only=True)
class GitHubEntry(Entry):
    asset_url: str  # the zip's API asset URL (download with Accept: application/octet-stream)
    release_id: int
    blob_assets: Mapping[str, Any] = field(default_factory=dict)  # name -> uploaded asset: blobs.json, blobs.*.zst


def blob_assets(assets: list[dict[str, Any]]) -> dict[str, Any]:
    """The release's uploaded assets that hold its files by content (store.github.blobs)."""
    return {a["name"]: a for a in assets if isinstance(a, dict) and isinstance(a.get("name"), str)
            and is_blob_asset(a["name"]) and a.get("state") == "uploaded"}


def manifest_tag(key: str, manifest: Manifest) -> str:
    """The release tag a bundle is published under: the one its recipe's template gave at build time
    (bundle.json `publish.tag`), else the schema's default template `{name}-{key12}`."""
    if manifest.publish_tag:
        return manifest.publish_tag
    return f"{manifest.name or 'llamabundle'}-{key[:12]}"


class Releases:
    """The releases of one repository, as the store's lookup and its publishers read them."""

    def __init__(self, client: GitHubClient) -> None:
        self.client = client

    def by_key(self, key: str, *, max_pages: int = 10) -> dict[str, Any] | None:
        """Without the recipe (a bare key) the tag is unknown: the newest published release whose tag ends
        with the key's first 12 digits (every tag template holds {key} or {key12}), 100 per request."""
        c = self.client
        for page in range(1, max_pages + 1):
            r = c.api("GET", f"{c.repo_api}/releases?per_page=100&page={page}", ok=(200,))
            listed = c.json(r, "the release list")
            rels = [x for x in listed if isinstance(x, dict)] if isinstance(listed, list) else []
            for rel in rels:
                tag = str(rel.get("tag_name") or "")
                if not rel.get("draft") and tag.endswith((key[:12], key)):
                    return rel
            if len(rels) < 100:
                return None
        return None

    def by_tag(self, tag: str) -> dict[str, Any] | None:
        """The tag's published release (None: none, or still a draft)."""
        c = self.client
        r = c.api("GET", f"{c.repo_api}/releases/tags/{quote(tag, safe='')}", ok=(200, 404),
                  what=f"look up the release {tag}")
        if r.status_code == 404:
            return None
        rel: dict[str, Any] = c.json(r, f"the release {tag}")
        if rel.get("draft"):
            return None
        c.trust_upload(rel)
        return rel

    def of_tag(self, tag: str) -> list[dict[str, Any]]:
        """The tag's releases, drafts included (the newest 100 releases; a publisher's are among them)."""
        c = self.client
        r = c.api("GET", f"{c.repo_api}/releases?per_page=100", what="list releases")
        return [x for x in c.json(r, "the release list") if isinstance(x, dict) and x.get("tag_name") == tag]

    def entry(self, rel: dict[str, Any], key: str | None) -> GitHubEntry | None:
        """The release's entry (None: incomplete); its bundle.json must be a manifest of `key` (None: of
        whatever key it names, still the sha256 of its inputs, as when listing)."""
        c = self.client
        assets = [a for a in rel.get("assets") or [] if isinstance(a, dict)]
        manifest_asset = next((a for a in assets if a.get("name") == MANIFEST), None)
        zips = [a for a in assets if str(a.get("name", "")).endswith(".zip")]
        if (manifest_asset is None or manifest_asset.get("state") != "uploaded" or len(zips) != 1
                or zips[0].get("state") != "uploaded"):
            return None  # incomplete: not a hit
        tag = rel.get("tag_name", "?")
        condemn = f"delete the release {tag} in {c.repo}, then publish the bundle again"
        raw = c.asset_bytes(manifest_asset, f"{MANIFEST} of release {tag}", error=ManifestError, fix=condemn)
        try:
            manifest = manifest_mod.loads(raw, where=f"{MANIFEST} of release {tag}")
            manifest_mod.check_consistent(manifest, Expect(key=key))
        except ManifestError as e:
            if str(tag) not in e.what:
                e.what = f"release {tag} in {c.repo}: {e.what}"
            e.fix, e.args = condemn, (e.what,)
            raise
        z = zips[0]
        zip_size = asset_size(z)
        if zip_size is None:
            raise StoreError(f"release {tag} in {c.repo} gives no size for {z.get('name')}",
                             why="GitHub lists every uploaded asset with its size",
                             fix=f"delete the release {tag} and publish again")
        sha = asset_digest(z) or self._listed_sha(assets, tag, z["name"])
        if sha is None:
            raise StoreError(f"release {tag} in {c.repo} gives no sha256 for {z['name']}",
                             why=f"the asset has no digest and {sums.NAME} does not list it",
                             fix=f"delete the release {tag} and publish again")
        return GitHubEntry(key=manifest.key, zip_name=z["name"], zip_sha256=sha, zip_size=zip_size,
                           manifest=manifest, location=z.get("browser_download_url") or z.get("url", ""),
                           asset_url=z["url"], release_id=int(rel["id"]), blob_assets=blob_assets(assets))

    def _listed_sha(self, assets: list[dict[str, Any]], tag: str, name: str) -> str | None:
        """The zip's sha256 as the release's SHA256SUMS lists it (None: no such asset or line)."""
        asset = next((a for a in assets if a.get("name") == sums.NAME and a.get("state") == "uploaded"), None)
        if asset is None:
            return None
        text = self.client.asset_bytes(asset, f"{sums.NAME} of release {tag}").decode("utf-8", "replace")
        listed = {read[1]: read[0] for line in text.splitlines() if (read := sums.read_line(line.strip()))}
        return listed.get(name)
