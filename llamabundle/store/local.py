"""A directory store: `<root>/<key>/` holds the zip, SHA256SUMS and bundle.json (written last).
Entries are assembled in a temporary directory and renamed into place under a per-key file lock,
so a reader never sees a partial entry and two publishers leave exactly one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock, Timeout

from ..bundle import MANIFEST, sha256_file
from ..errors import StoreError, VerifyError
from .base import Entry, Published

if TYPE_CHECKING:
    from ..net import Sink

SUMS = "SHA256SUMS"
LOCK_TIMEOUT = 600


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.url = str(self.root)

    def _entry_dir(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise StoreError(f"'{key}' is not a cache key", fix="a key is 64 hex digits (llamabundle key RECIPE)")
        return self.root / key

    def lookup(self, key: str) -> Entry | None:
        d = self._entry_dir(key)
        manifest_path = d / MANIFEST
        if not manifest_path.is_file():
            return None  # no manifest: nothing, or a partial entry that is not a hit
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            sums = dict(reversed(line.split(None, 1)) for line in (d / SUMS).read_text().splitlines() if line.strip())
        except (OSError, ValueError) as e:
            raise StoreError(f"store entry {d} is damaged", why=str(e), fix=f"remove {d} and build again") from None
        zips = [n for n in sums if n.endswith(".zip")]
        if len(zips) != 1 or manifest.get("key") != key:
            raise StoreError(f"store entry {d} is inconsistent", why="SHA256SUMS or bundle.json does not match the key",
                             fix=f"remove {d} and build again")
        zip_name = zips[0].lstrip("*")
        zip_path = d / zip_name
        if not zip_path.is_file():
            return None
        digest = sha256_file(zip_path)
        if digest != sums[zips[0]]:
            raise VerifyError(f"{zip_path} does not match its SHA256SUMS", why="the stored zip was changed or damaged",
                              fix=f"remove {d} and build again")
        return Entry(key=key, zip_name=zip_name, zip_sha256=digest, zip_size=zip_path.stat().st_size,
                     manifest=manifest, location=str(zip_path))

    def fetch(self, entry: Entry, dest: Path, *, sink: Sink | None = None) -> Path:
        src = self._entry_dir(entry.key) / entry.zip_name
        out = dest / entry.zip_name
        tmp = out.with_name(out.name + ".part")
        try:
            dest.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            if sink is not None:
                sink.reset()
            with open(src, "rb") as f, open(tmp, "wb") as w:  # one pass: copy, hash, feed
                while chunk := f.read(1 << 20):
                    w.write(chunk)
                    h.update(chunk)
                    if sink is not None:
                        sink.update(chunk)
            if h.hexdigest() != entry.zip_sha256:
                tmp.unlink()
                raise VerifyError(f"{src} does not match its sha256 in the store", why="it changed or was damaged "
                                  "after it was published", fix="publish the bundle again")
            os.replace(tmp, out)
        except OSError as e:
            if tmp.parent.is_dir():
                tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot copy {src} to {dest}", why=str(e),
                             fix="check that the store entry still exists and the destination is writable") from None
        return out

    def publish(self, zip_path: Path, manifest: dict[str, Any]) -> Published:
        key = manifest["key"]
        final = self._entry_dir(key)
        self.root.mkdir(parents=True, exist_ok=True)
        locks = self.root / ".locks"
        locks.mkdir(exist_ok=True)
        try:
            with FileLock(str(locks / f"{key}.lock"), timeout=LOCK_TIMEOUT):
                existing = self.lookup(key)
                if existing is not None:
                    return Published(entry=existing, created=False)
                shutil.rmtree(final, ignore_errors=True)  # leftovers of a crashed publish (no manifest)
                with tempfile.TemporaryDirectory(dir=self.root, prefix=".publish-") as tmp:
                    stage = Path(tmp) / key
                    stage.mkdir()
                    name = zip_path.name
                    shutil.copyfile(zip_path, stage / name)
                    digest = sha256_file(stage / name)
                    (stage / SUMS).write_text(f"{digest}  {name}\n")
                    (stage / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
                    os.replace(stage, final)
        except Timeout:
            raise StoreError(f"another process holds the lock on {key[:12]} in {self.root}",
                             why=f"waited {LOCK_TIMEOUT}s", fix="wait for the other build to finish, then retry") from None
        except OSError as e:
            raise StoreError(f"cannot write to the store {self.root}", why=str(e), fix="check the path and permissions") from None
        entry = self.lookup(key)
        assert entry is not None
        return Published(entry=entry, created=True)
