"""The GitHub store as the store tests use it against tests/fakegithub.py: the repo and token, small real
bundles whose keys really are the sha256 of their inputs (KEY, OTHER_KEY), `store_for` a GitHubStore on the
fake that records its sleeps, and `Captured`, a log whose text can be read back."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

from rich.console import Console

from llamabundle.bundle import manifest as manifest_mod
from llamabundle.bundle.manifest import Manifest
from llamabundle.log import Log
from llamabundle.store.github import GitHubStore
from tests import bundles
from tests.fakegithub import FakeGitHub

# keys that really are the sha256 of the inputs their bundles record
INPUTS = {tag: bundles.inputs_for(tag) for tag in ("test-bundle", "other")}
KEY = bundles.key_of(INPUTS["test-bundle"])
OTHER_KEY = bundles.key_of(INPUTS["other"])
TAG = f"test-bundle-{KEY[:12]}"  # make_bundle names its bundles test-bundle
TOKEN = "ghp_SeCrEtT0kEn0123456789abcdefABCDEF"
REPO = "acme/bundles"
FILES = {"llama-server": b"#!/bin/sh\necho not an ELF\n" + bytes(range(256)) * 64, "LICENSE": b"MIT License\n"}
ROLES = {"llama-server": "exe", "LICENSE": "license"}


def make_bundle(tmp: Path, key: str = KEY, *, name: str = "bundle.zip",
                files: dict[str, bytes] = FILES) -> tuple[Path, Manifest]:
    """A small bundle (non-ELF files, a llama-server large enough that downloads span several chunks) whose
    key is the sha256 of its inputs: KEY or OTHER_KEY."""
    inputs = next(i for i in INPUTS.values() if bundles.key_of(i) == key)
    tmp.mkdir(parents=True, exist_ok=True)
    zip_path, m = bundles.make_zip(tmp, files, ROLES, zip_name=name if key == KEY else f"{key[:4]}-{name}",
                                   inputs=inputs)
    return zip_path, manifest_mod.parse(m)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Captured:
    def __init__(self) -> None:
        self.buf = io.StringIO()
        self.log = Log(console=Console(file=self.buf, width=300, highlight=False))

    @property
    def text(self) -> str:
        return self.buf.getvalue()


def store_for(gh: FakeGitHub, *, log: Log | None = None, sleeps: list[float] | None = None, **kw: Any) -> GitHubStore:
    rec = sleeps if sleeps is not None else []
    kw.setdefault("sleep", rec.append)
    kw.setdefault("tags", {KEY: TAG})  # as a command that has the recipe passes its tag
    return GitHubStore(REPO, api_url=gh.api_url, token=TOKEN, log=log or Captured().log, **kw)
