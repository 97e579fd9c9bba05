"""Install a bundle from a store (DESIGN §5): download, extract safely, check everything, swap in atomically.

Layout under the data root: `bundles/<name>/current` (a small JSON pointer, replaced in one rename)
names a version directory `bundles/<name>/<key12>-<rand>/` holding the unpacked bundle. A new version
is downloaded and extracted into `bundles/<name>/.stage-*/`, checked there, renamed beside the old one,
and only then does the pointer move to it; the old version is removed after that. A SIGKILL at any
instant leaves the pointer on a complete, checked install; the next install of that name cleans up the
leftovers under the same per-name file lock. Every decision about a slot (what is installed, what to
replace, what to remove) is made holding that lock, from the first read to the last write."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from .. import platforms, scratch
from ..archive import extract_zip
from ..bundle import read_manifest
from ..bundle.manifest import Expect, Manifest, trust
from ..errors import StoreError, UsageError, VerifyError, disk_fix
from ..log import Log
from ..settings import Settings
from ..store.base import Entry, Store
from . import Reason, utc_timestamp, write_atomic

BUNDLES = "bundles"
POINTER = "current"
LOCK_TIMEOUT = 600
STAGE = ".stage-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
Hook = Callable[[str], None]  # called at "downloaded", "extracted", "verified", "swapping", "swapped"


class BundleInvalid(VerifyError):
    """A bundle that fails a check of DESIGN §5: refused, never installed (reason bundle_invalid, exit 5)."""

    reason = Reason.BUNDLE_INVALID


def data_root(settings: Settings, dest: Path | None = None) -> Path:
    """Where bundles are installed: --dest, else settings.data_dir ($LLAMABUNDLE_DATA_DIR, else the user data
    directory)."""
    if dest is not None:
        return dest.expanduser().resolve()
    return settings.data_dir


@dataclass(frozen=True, kw_only=True)
class Installed:
    name: str
    key: str
    path: Path
    installed_at: str
    manifest: Manifest

    @property
    def backends(self) -> list[str]:
        return list(self.manifest.backends)

    @property
    def cuda(self) -> dict[str, Any]:
        """bundle.json's `cuda` object as it was written ({} without CUDA)."""
        return dict(self.manifest.to_json().get("cuda") or {})

    def to_json(self) -> dict[str, Any]:
        cuda = self.manifest.cuda
        return {"name": self.name, "key": self.key, "path": str(self.path), "installed_at": self.installed_at,
                "platform": self.manifest.platform, "commit": self.manifest.llama_cpp.commit or None,
                "backends": self.backends, "toolkit": cuda.toolkit if cuda else None,
                "driver_floor": cuda.driver_floor if cuda else None}


@dataclass(frozen=True, kw_only=True)
class InstallOutcome:
    installed: Installed
    reused: bool  # the same key was already installed and intact
    replaced: str | None  # the key of the install this one replaced

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, **self.installed.to_json(), "reused": self.reused, "replaced": self.replaced}


def check_bundle(path: Path, *, key: str, platform: str, commit: str | None = None,
                 toolkit: str | None = None) -> Manifest:
    """Trust nothing unchecked (DESIGN §5): manifest.trust of the unpacked bundle against what was asked for
    (format, platform, key and the key of its inputs, commit, toolkit, every file). Returns the manifest;
    raises BundleInvalid."""
    try:
        m = read_manifest(path)
        trust(m, path, Expect(key=key, platform=platform, commit=commit, toolkit=toolkit))
    except VerifyError as e:
        raise _invalid(key, e.what, e.why) from None
    return m


_REFUSED = re.compile(r"^bundle [0-9a-f]{1,12} refused: ")  # manifest.check_consistent's prefix: said once here


def _invalid(key: str, what: str, why: str = "", *, fix: str = "") -> BundleInvalid:
    return BundleInvalid(f"bundle {key[:12]} refused (bundle_invalid): {_REFUSED.sub('', what, count=1)}",
                         why=why or "the bundle is not what was asked for",
                         fix=fix or "do not use it; fetch it again from a trusted store, or rebuild and publish it")


def list_installed(root: Path) -> list[Installed]:
    base = root / BUNDLES
    slots = sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")) if base.is_dir() else []
    return [i for i in map(_current, slots) if i is not None]


def _current(slot: Path) -> Installed | None:
    """The install the slot's pointer names, or None (no pointer, or what it names is gone)."""
    try:
        ptr = json.loads((slot / POINTER).read_text(encoding="utf-8"))
        version = ptr["dir"]
        if not isinstance(version, str) or not _NAME.fullmatch(version):
            return None
        manifest = read_manifest(slot / version)
    except (OSError, ValueError, KeyError, TypeError, VerifyError):
        return None
    return Installed(name=slot.name, key=manifest.key, path=slot / version, installed_at=str(ptr.get("installed_at", "")),
                     manifest=manifest)


def install_bundle(store: Store, key: str, *, root: Path, log: Log, commit: str | None = None, toolkit: str | None = None,
                   platform: str | None = None, hook: Hook | None = None) -> InstallOutcome:
    """Install the store's bundle `key` under root, replacing the install of the same name only once the new
    one is checked. `hook` is called at the named points (tests kill the process there)."""
    try:
        entry = store.lookup(key)
    except VerifyError as e:  # the store's bundle.json or zip is not what it claims: refused before any download
        raise _invalid(key, e.what, e.why, fix=e.fix) from None
    if entry is None:
        raise UsageError(f"no bundle with key {key[:12]} in {store.url}", fix="build and publish it first: llamabundle build RECIPE")
    name = entry.manifest.name
    if not _NAME.fullmatch(name):
        raise _invalid(key, f"the store names it {name!r}, which is not a usable bundle name")
    try:
        with _slot_lock(root, name, doing="installing or removing"):
            return _install_locked(store, entry, root / BUNDLES / name, log=log, platform=platform or platforms.host_name(),
                                   commit=commit, toolkit=toolkit, hook=hook or (lambda _point: None))
    except OSError as e:
        raise _os_error(f"cannot install {name} into {root}", e) from None


@contextmanager
def _slot_lock(root: Path, name: str, *, doing: str) -> Iterator[None]:
    """The per-name lock that every read-decide-write of `bundles/<name>/` holds."""
    locks = root / BUNDLES / ".locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(locks / f"{name}.lock"), timeout=LOCK_TIMEOUT)
        lock.acquire()
    except Timeout:
        raise StoreError(f"another process is {doing} {name} in {root}", why=f"waited {LOCK_TIMEOUT}s for its lock",
                         fix="wait for it to finish, then retry") from None
    except OSError as e:
        raise _os_error(f"cannot use the install root {root}", e) from None
    try:
        yield
    finally:
        lock.release()


def _os_error(what: str, e: OSError) -> StoreError:
    where = f" ({e.filename})" if e.filename else ""
    return StoreError(what, why=f"{e.strerror or e}{where}", fix=disk_fix(e))


def _install_locked(store: Store, entry: Entry, slot: Path, *, log: Log, platform: str, commit: str | None,
                    toolkit: str | None, hook: Hook) -> InstallOutcome:
    key = entry.key
    slot.mkdir(parents=True, exist_ok=True)
    old = _current(slot)
    for leftover in slot.iterdir():  # a killed install's stage, version or pointer temp file
        if leftover.name == POINTER or (old is not None and leftover == old.path):
            continue
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
    if old is not None and old.key == key:
        try:
            check_bundle(old.path, key=key, platform=platform, commit=commit, toolkit=toolkit)
            return InstallOutcome(installed=old, reused=True, replaced=None)
        except BundleInvalid as e:
            log.warn(f"the installed {slot.name} ({key[:12]}) fails its check ({e.what}); installing it again")  # noqa: G010 - Log.warn
    version = f"{key[:12]}-{secrets.token_hex(4)}"
    stage = scratch.make_dir(slot, STAGE)
    swapped = False
    try:
        with log.step(f"download {entry.zip_name} ({entry.zip_size / 1e6:.1f} MB) from {store.url}"):
            try:
                zip_path = store.fetch(entry, stage / "download")
            except VerifyError as e:
                raise _invalid(key, e.what, e.why) from None
        hook("downloaded")
        with log.step(f"extract and check {slot.name} ({key[:12]})"):
            try:
                extract_zip(zip_path, stage / version)
            except VerifyError as e:
                raise _invalid(key, e.what, e.why) from None
            hook("extracted")
            check_bundle(stage / version, key=key, platform=platform, commit=commit, toolkit=toolkit)
        hook("verified")
        os.replace(stage / version, slot / version)
        hook("swapping")
        write_atomic(slot / POINTER, json.dumps({"dir": version, "key": key, "installed_at": utc_timestamp()},
                                                sort_keys=True) + "\n")
        swapped = True
        hook("swapped")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if not swapped:
            shutil.rmtree(slot / version, ignore_errors=True)
    if old is not None and old.path.name != version:
        shutil.rmtree(old.path, ignore_errors=True)
    new = _current(slot)
    assert new is not None and new.key == key
    log.info(f"installed {slot.name} ({key[:12]}) in {new.path}")
    return InstallOutcome(installed=new, reused=False, replaced=old.key if old is not None else None)


def uninstall(root: Path, what: str) -> Installed:
    """Remove the install whose key (or unique key prefix of 6+ digits, or name) is `what`. The slot is read
    again holding its lock: an install that replaced the one asked for meanwhile is never removed."""
    found = [i for i in list_installed(root) if _matches(i, what)]
    if len(found) != 1:
        have = ", ".join(f"{i.name} ({i.key[:12]})" for i in list_installed(root)) or "none"
        raise UsageError(f"{'no' if not found else 'more than one'} installed bundle matches '{what}'",
                         why=f"installed in {root}: {have}", fix="pass a full key or a bundle name (llamabundle list)")
    name = found[0].name
    slot = root / BUNDLES / name
    try:
        with _slot_lock(root, name, doing="installing or removing"):
            inst = _current(slot)  # the decision: what is installed now, under the lock
            if inst is None or not _matches(inst, what):
                now = f"{name} is now {inst.key[:12]}" if inst is not None else f"{name} is no longer installed"
                raise UsageError(f"'{what}' is no longer installed: {now}; nothing was removed",
                                 why="another process changed it while this uninstall waited for its lock",
                                 fix="see what is installed (llamabundle list), then uninstall that if you mean to")
            (slot / POINTER).unlink(missing_ok=True)  # first: from here on nothing points at a half-removed tree
            shutil.rmtree(slot)
    except OSError as e:
        raise _os_error(f"cannot remove {slot}", e) from None
    return inst


def _matches(inst: Installed, what: str) -> bool:
    return inst.key == what or inst.name == what or (len(what) >= 6 and inst.key.startswith(what))
