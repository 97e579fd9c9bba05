"""Bundle stores: where built bundles are kept and found again by cache key (DESIGN §6).

`open_store(url, settings=…)` is the one place that turns a store URL and the run's settings into a store:
a directory path or file://PATH is a `store.local.LocalStore`, github:OWNER/REPO a `store.github.GitHubStore`,
oci://HOST[:PORT]/REPO a `store.oci.OciStore`. The stores are given explicit values (a root, an API URL, a token,
credentials, a timeout), never the settings.
The protocol they share (`Store`, `Entry`, `Published`) is `store.base`, which imports no concrete store; the
concrete stores are imported here only when a URL asks for them, so that importing the package (or the
protocol) does not import `requests` or the filesystem store."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import UsageError
from .base import Entry, Published, Store

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..log import Log

__all__ = ["Entry", "Published", "Store", "StoreSettings", "open_store"]


class StoreSettings(Protocol):
    """The fields of the run's settings (the CLI's `Settings`) that the factory hands to a store."""

    @property
    def github_api_url(self) -> str: ...

    @property
    def github_token(self) -> str | None: ...

    @property
    def connect_timeout(self) -> float: ...

    @property
    def registry_user(self) -> str | None: ...

    @property
    def registry_password(self) -> str | None: ...

    @property
    def registry_insecure(self) -> bool: ...

    @property
    def registry_mount_from(self) -> tuple[str, ...]: ...


def open_store(url: str, *, settings: StoreSettings | None = None, log: Log | None = None,
               tags: Mapping[str, str] | None = None) -> Store:
    """The store for `url`: a path or file://PATH is a local directory store; github:OWNER/REPO the GitHub
    Releases store, with the API URL, token and connect timeout from `settings` (GitHubStore's defaults
    without); oci://HOST[:PORT]/REPO an OCI registry store, with the registry credentials from `settings` (for
    ghcr.io without a password: the GitHub token); `log` for their messages and `tags` (key -> release tag)
    from the recipe when there is one."""
    if url.startswith("oci://"):
        from .oci import OciStore, parse_url

        if settings is None:
            return OciStore(url, log=log, tags=tags)
        ref = parse_url(url, insecure=settings.registry_insecure)  # strict: a bad URL is a UsageError here
        password = settings.registry_password or (settings.github_token if ref.host == "ghcr.io" else None)
        return OciStore(url, user=settings.registry_user, password=password, insecure=settings.registry_insecure,
                        connect_timeout=settings.connect_timeout, log=log, tags=tags,
                        mount_from=settings.registry_mount_from)
    if url.startswith("github:"):
        from .github import GitHubStore

        repo = url.removeprefix("github:")
        if settings is None:
            return GitHubStore(repo, log=log, tags=tags)
        return GitHubStore(repo, api_url=settings.github_api_url, token=settings.github_token,
                           connect_timeout=settings.connect_timeout, log=log, tags=tags)
    if "://" in url and not url.startswith("file://"):
        raise UsageError(f"store '{url}' has an unknown scheme",
                         fix="use a directory path, file://PATH, github:OWNER/REPO or oci://HOST[:PORT]/REPO")
    path = url.removeprefix("file://")
    if not path.strip():
        raise UsageError(f"store '{url}' names no directory", why="an empty path would mean the current directory",
                         fix="give the store's directory: a path, or file:///absolute/path")
    from .local import LocalStore

    return LocalStore(Path(path).expanduser())
