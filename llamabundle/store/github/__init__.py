"""The GitHub Releases store: the REST client (client.py), reading releases as entries (releases.py), the
tag-first publish protocol (publish.py) and the store that composes them (store.py)."""

from __future__ import annotations

from .client import (
           DEFAULT_API_URL,
           AssetConflictError,
           GitHubError,
           GitHubValidationError,
           RateLimitError,
           RefExistsError,
)
from .releases import GitHubEntry, manifest_tag
from .store import GitHubStore

__all__ = ["DEFAULT_API_URL", "AssetConflictError", "GitHubEntry", "GitHubError", "GitHubStore", "GitHubValidationError",
           "RateLimitError", "RefExistsError", "manifest_tag"]
