"""Install a bundle from a store (DESIGN §5): download, extract safely, check everything, swap in atomically.
`bundles/<name>/current` (a JSON pointer, replaced in one rename) names a version directory beside it; a new
version is staged, checked, renamed beside the old one, and only then does the pointer move, so a SIGKILL at
any instant leaves the pointer on a complete, checked install. Every decision about a slot is made holding
its per-name file lock. A pin (`expect_sha256`, or a digest list the app ships) is trust from outside the
release: the zip's sha256 (compared before the download and on the downloaded bytes), or the published
bundle.json's, which names every file's sha256 (docs/install-rules.md gives every rule in order)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import backends, errors, platforms, scratch, untrusted
from ..backends.cuda import section as cuda_section
from ..backends.cuda.section import CudaInfo
from ..bundle import MANIFEST, extract, parts, read_manifest
from ..bundle.manifest import Expect, Manifest, check_consistent, trust
from ..digest import sha256_file
from ..errors import StoreError, UsageError, VerifyError, disk_fix
from ..log import Log
from ..reasons import Reason
from ..settings import Settings
from ..store import blobcache, sums
from ..store.base import BlobStore, Entry, Store, blob_source
from . import slotlock
from .results import utc_timestamp, write_atomic

BUNDLES = "bundles"
POINTER = "current"
LOCKS = ".locks"
POINTER_BYTES = 64 << 10  # a pointer names a directory, a key, a time and a digest: some 300 bytes
LOCK_TIMEOUT = 600
STAGE = ".stage-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
Hook = Callable[[str], None]  # called at "downloaded", "extracted", "verified", "swapping", "swapped"
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
EXPECT_SOURCE = "--expect-sha256"


class BundleInvalid(VerifyError):
    """A bundle that fails a check of DESIGN §5: refused, never installed (reason bundle_invalid, exit 5)."""

    reason = Reason.BUNDLE_INVALID


def data_root(settings: Settings, dest: Path | None = None) -> Path:
    """Where bundles are installed: --dest, else settings.data_dir ($LLAMABUNDLE_DATA_DIR, else the user data
    directory)."""
    if dest is not None:
        return dest.expanduser().resolve()
    root = settings.data_dir
    errors.own(root, "the install root, LLAMABUNDLE_DATA_DIR")  # a disk error under it says whose it is
    return root


@dataclass(frozen=True, kw_only=True)
class Installed:
    name: str
    key: str
    path: Path
    installed_at: str
    manifest: Manifest
    zip_sha256: str | None = None  # the sha256 of the zip it was unpacked from (None: an install that predates it)

    @property
    def backends(self) -> list[str]:
        return list(self.manifest.backends)

    @property
    def cuda(self) -> dict[str, Any]:
        """bundle.json's `cuda` object as it was written ({} without CUDA)."""
        return dict(self.manifest.to_json().get("cuda") or {})

    @property
    def cuda_info(self) -> CudaInfo | None:
        """bundle.json's `cuda` section, typed (None without CUDA)."""
        return cuda_section.read(self.manifest)

    def to_json(self) -> dict[str, Any]:
        cuda = self.cuda_info
        return {"name": self.name, "key": self.key, "path": str(self.path), "installed_at": self.installed_at,
                "platform": self.manifest.platform, "commit": self.manifest.llama_cpp.commit or None,
                "backends": self.backends, "toolkit": cuda.toolkit if cuda else None,
                "driver_floor": cuda.driver_floor if cuda else None}


@dataclass(frozen=True, kw_only=True)
class Pin:
    """The sha256 the bundle's zip must have, from outside the release: --expect-sha256 or a digest list."""

    sha256: str
    source: str  # EXPECT_SOURCE, or "digests:<file>"
    path: Path | None = None  # the digest list, and the line that gave the sha256
    line: int | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}" if self.path is not None else self.source

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "source": self.source}

    def fix(self, zip_name: str) -> str:
        trusted = (f"from a source you trust (the release job's output, or `gh attestation verify {zip_name} --repo "
                   "OWNER/REPO` on the downloaded zip)")
        if self.path is None:
            return (f"do not install it. If the bundle was rebuilt on purpose, pass its new sha256 {trusted}; "
                    "otherwise the release was replaced: report it and publish the bundle again from a trusted build")
        return (f"do not install it. If the bundle was rebuilt on purpose, put its new sha256 {trusted} on line "
                f"{self.line} of {self.path} and ship the list again; otherwise the release was replaced: report it "
                "and publish the bundle again from a trusted build")


def parse_sha256(text: str, *, what: str = EXPECT_SOURCE) -> str:
    """A sha256 given by hand (64 hex digits, either case), in lower case; else a UsageError (exit 2)."""
    if not _SHA256.fullmatch(text):
        raise UsageError(f"{what} '{text}' is not a sha256", why="a sha256 is 64 hex digits",
                         fix="pass the bundle zip's sha256 as `sha256sum BUNDLE.zip` prints it (or its release's SHA256SUMS line)")
    return text.lower()


@dataclass(frozen=True, kw_only=True)
class DigestList:
    """A digest list an app ships: the SHA256SUMS format a store publishes beside each zip (`<sha256>  <name>`
    lines; store.local's grammar), e.g. the SHA256SUMS assets of the releases it installs, concatenated. A name is
    a bundle zip's name as its release names it, or a cache key. Blank lines and `#` comments are skipped."""

    path: Path
    entries: Mapping[str, tuple[str, int]]  # name -> (sha256, line)

    @property
    def source(self) -> str:
        return f"digests:{self.path}"

    def pin_for(self, entry: Entry) -> Pin:
        """The pin of the store's entry: the line naming its zip (or its key). Not listed: refused (exit 5)."""
        as_text = os.fsencode(entry.zip_name).decode("utf-8", "surrogateescape")  # a local store's name is fsdecoded
        found = {name: self.entries[name] for name in dict.fromkeys((entry.zip_name, as_text, entry.key))
                 if name in self.entries}
        if not found:
            raise _invalid(entry.key, f"{entry.zip_name} is not in the digest list {self.path}",
                           why="only bundles whose zip sha256 the digest list holds are installed",
                           fix=f"if this bundle is one to install, add the line `<sha256>  {entry.zip_name}` (its release's "
                               f"SHA256SUMS line) to {self.path}, with the sha256 taken from a source you trust (the release "
                               f"job's output, or `gh attestation verify {entry.zip_name} --repo OWNER/REPO` on the zip), "
                               "and ship the updated list")
        (sha, line), *others = found.values()
        if any(o[0] != sha for o in others):
            lines = sorted(n for _sha, n in found.values())
            raise UsageError(f"{self.path}: lines {lines[0]} and {lines[1]} give two sha256 for {entry.zip_name} "
                             f"(by its name and by its key {entry.key[:12]})", why="a digest list names one zip once",
                             fix=f"keep the line with the sha256 you trust in {self.path}", file=str(self.path), line=lines[1])
        return Pin(sha256=sha, source=self.source, path=self.path, line=line)


def load_digests(path: Path) -> DigestList:
    """Parse a digest list; a file that is not one is a UsageError (exit 2) naming file:line."""
    fix = f"correct {path}: each line is `<sha256>  <zip name>`, as in a release's SHA256SUMS"
    if path.exists() and not path.is_file():  # a FIFO or device is never opened (reading a FIFO blocks)
        raise UsageError(f"the digest list {path} is not a regular file", fix="pass a digest list file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read the digest list {path}", why=e.strerror or str(e), fix=disk_fix(e)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        n = raw[:e.start].count(b"\n") + 1
        raise UsageError(f"{path}:{n}: the digest list is not UTF-8 text", why=e.reason, fix=fix,
                         file=str(path), line=n) from None
    entries: dict[str, tuple[str, int]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        read = sums.read_line(line)  # the grammar of SHA256SUMS, as the stores write and read it
        if read is None:
            raise UsageError(f"{path}:{n}: not a digest line: {line[:80]!r}",
                             why="a line is `<sha256>  <name>`: 64 lower-case hex digits, two spaces (or a space and `*`), "
                                 "and a bundle zip's file name (no directory) or a cache key", fix=fix, file=str(path), line=n)
        sha, name = read
        if name in entries and entries[name][0] != sha:
            raise UsageError(f"{path}:{n}: a second sha256 for {name} (line {entries[name][1]} gives another)",
                             why="a digest list names one zip once", fix=f"keep the line with the sha256 you trust in {path}",
                             file=str(path), line=n)
        entries.setdefault(name, (sha, n))
    if not entries:
        raise UsageError(f"the digest list {path} lists no bundle", why="it holds no `<sha256>  <zip name>` line",
                         fix=fix, file=str(path))
    return DigestList(path=path, entries=entries)


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """How an install got its files: `zip` (the whole zip downloaded), `blobs` (only the files the local blob
    cache lacked, by content) or `none` (already installed); bytes downloaded and bytes found in the cache."""
    by: str
    downloaded: int = 0
    from_cache: int = 0
    files: int = 0
    fetched: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"by": self.by, "downloaded_bytes": self.downloaded, "cached_bytes": self.from_cache,
                "files": self.files, "files_downloaded": self.fetched}


@dataclass(frozen=True, kw_only=True)
class InstallOutcome:
    installed: Installed
    reused: bool  # the same key was already installed and intact
    replaced: str | None  # the key of the install this one replaced
    pinned: Pin | None = None  # the pin the zip was checked against
    transfer: Transfer = Transfer(by="none")

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, **self.installed.to_json(), "reused": self.reused, "replaced": self.replaced,
                "pinned": self.pinned.to_json() if self.pinned is not None else None,
                "transfer": self.transfer.to_json()}


def check_bundle(path: Path, *, key: str, platform: str, commit: str | None = None,
                 toolkit: str | None = None, hashes: Mapping[str, str] | None = None) -> Manifest:
    """Trust nothing unchecked (DESIGN §5): manifest.trust of the unpacked bundle against what was asked for
    (format, platform, key and the key of its inputs, commit, the CUDA toolkit, every file) and each backend's
    section read typed. `hashes`: the sha256 of files this install has just written or checked (not read
    again). Returns the manifest; raises BundleInvalid."""
    try:
        m = read_manifest(path)
        trust(m, path, _expect(key, platform, commit, toolkit), hashes=hashes)
        backends.read_sections(m)
    except VerifyError as e:
        raise _invalid(key, e.what, e.why) from None
    return m


def _expect(key: str, platform: str, commit: str | None, toolkit: str | None) -> Expect:
    """What an install asks of a bundle, as the manifest checks take it."""
    return Expect(key=key, platform=platform, commit=commit, toolkits={"cuda": toolkit} if toolkit else {})


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
        ptr = untrusted.read(slot / POINTER, max_bytes=POINTER_BYTES)  # past the limits: damaged, as if absent
        version = ptr["dir"]
        if not isinstance(version, str) or not _NAME.fullmatch(version):
            return None
        manifest = read_manifest(slot / version)
    except (OSError, ValueError, KeyError, TypeError, VerifyError):
        return None
    zip_sha = ptr.get("zip_sha256")
    return Installed(name=slot.name, key=manifest.key, path=slot / version, installed_at=str(ptr.get("installed_at", "")),
                     manifest=manifest,
                     zip_sha256=zip_sha if isinstance(zip_sha, str) and re.fullmatch(r"[0-9a-f]{64}", zip_sha) else None)


def install_bundle(store: Store, key: str, *, root: Path, log: Log, commit: str | None = None, toolkit: str | None = None,
                   platform: str | None = None, hook: Hook | None = None, expect_sha256: str | None = None,
                   digests: DigestList | None = None, backends_wanted: str | None = None) -> InstallOutcome:
    """Install the store's bundle `key` under root, replacing the install of the same name only once the new
    one is checked. `expect_sha256` (or the line of `digests` naming the zip or the key) pins the zip's sha256:
    another zip is refused (exit 5) before anything is unpacked, and a bundle the list lacks is refused too.
    `backends_wanted` ("auto", or a comma-separated list; None: all) installs only the files those backends
    need (choose_backends). `hook` is called at the named points (tests kill the process there)."""
    if expect_sha256 is not None and digests is not None:
        raise UsageError("pass at most one of --expect-sha256 and --digests", fix="pin the zip by one of them")
    sha = parse_sha256(expect_sha256) if expect_sha256 is not None else None
    try:
        entry = store.lookup(key)
    except VerifyError as e:  # the store's bundle.json or zip is not what it claims: refused before any download
        raise _invalid(key, e.what, e.why, fix=e.fix) from None
    if entry is None:
        raise UsageError(f"no bundle with key {key[:12]} in {store.url}", fix="build and publish it first: llamabundle build RECIPE")
    pin = Pin(sha256=sha, source=EXPECT_SOURCE) if sha is not None else digests.pin_for(entry) if digests else None
    name = entry.manifest.name
    if not _NAME.fullmatch(name):
        raise _invalid(key, f"the store names it {name!r}, which is not a usable bundle name")
    auto = backends_wanted == "auto" and entry.manifest.parts is not None and len(entry.manifest.backends) > 1
    choice = (choose_backends(entry.manifest, backends_wanted, log=log)
              if backends_wanted is not None and not auto else None)
    want = parts.cut(entry.manifest, choice) if choice is not None else None if auto else entry.manifest
    try:
        with _slot_lock(root, name, doing="installing or removing",
                        on_wait=lambda owner: log.info(f"waiting for {owner.describe() if owner else 'another process'}, "
                                                       f"which holds the lock of {name} in {root}")):
            return _install_locked(store, entry, root / BUNDLES / name, log=log, platform=platform or platforms.host_name(),
                                   commit=commit, toolkit=toolkit, hook=hook or (lambda _point: None), pin=pin,
                                   want=want)
    except OSError as e:
        raise _os_error(f"cannot install {name} into {root}", e) from None


@contextmanager
def _slot_lock(root: Path, name: str, *, doing: str, on_wait: Callable[[slotlock.Owner | None], None] | None = None
               ) -> Iterator[None]:
    """The per-name lock that every read-decide-write of `bundles/<name>/` holds (runtime/slotlock.py: a
    directory any language can take). An OSError in the body passes through to the caller, which names what it was doing."""
    try:
        lock = slotlock.take(root / BUNDLES / LOCKS, name, timeout=LOCK_TIMEOUT, on_wait=on_wait)
    except OSError as e:
        raise _os_error(f"cannot use the install root {root}", e) from None
    except slotlock.Busy as e:
        who = e.owner.describe() if e.owner else "a process whose owner.json cannot be read"
        raise StoreError(f"another process ({who}) is {doing} {name} in {root}",
                         why=f"waited {LOCK_TIMEOUT}s for its lock {e.path}",
                         fix="wait for it to finish, then retry" if e.owner else
                             f"when no process is installing {name}, remove {e.path}") from None
    try:
        yield
    finally:
        lock.release()


def _os_error(what: str, e: OSError) -> StoreError:
    where = f" ({e.filename})" if e.filename else ""
    return StoreError(what, why=f"{e.strerror or e}{where}", fix=disk_fix(e))


def _pin_refused(entry: Entry, pin: Pin, got: str, *, where: str) -> BundleInvalid:
    return _invalid(entry.key, f"{entry.zip_name} has sha256 {got}, not the {pin.sha256} pinned by {pin.where}",
                    why=f"{where}: the zip is not the pinned one (a release whose zip and bundle.json were both replaced "
                        "still agrees with itself; only the pin, from outside the release, tells)",
                    fix=pin.fix(entry.zip_name))


Sight = Mapping[str, tuple[bool, str]]  # GPU backend -> (a device for it is here, why: a few words)


def choose_backends(m: Manifest, wanted: str, *, log: Log, sight: Sight | None = None) -> parts.Choice:
    """The backends to install: `auto` keeps each GPU backend that `sight` says has a device here (drivers_sight:
    the bundle's own llamabundle-probe asking the drivers; without it, Backend.device_present: the NVIDIA
    driver's device node or library, a Vulkan driver for a GPU), a list keeps those it names; the CPU part is
    always kept. A bundle packed before bundle.json had `parts` can only be installed whole."""
    gpu = [b for b in m.backends if b != parts.CPU]
    if wanted == "auto":
        seen = dict(sight) if sight is not None else present_sight(m)
        why = {b: seen[b][1] for b in gpu}
        keep = [parts.CPU, *(b for b in gpu if seen[b][0])]
        by = "auto"
    else:
        asked = [w.strip().lower() for w in wanted.split(",") if w.strip()]
        unknown = [w for w in asked if w not in m.backends]
        if not asked or unknown:
            raise UsageError(f"--backends {wanted!r} names {'nothing' if not asked else ', '.join(unknown)}, which "
                             f"{m.name} ({m.key[:12]}) does not hold" if asked else f"--backends {wanted!r} names no backend",
                             why=f"it holds {', '.join(m.backends)}",
                             fix=f"pass auto, or some of {', '.join(m.backends)} (the CPU part is always installed)")
        keep = [parts.CPU, *(b for b in gpu if b in asked)]
        why = {b: "asked for" if b in keep else "not asked for" for b in gpu}
        by = "list"
    keep = [b for b in m.backends if b in keep]
    if len(keep) < len(m.backends) and m.parts is None:
        raise UsageError(f"{m.name} ({m.key[:12]}) cannot be installed in part", why="its bundle.json has no `parts` "
                         "(it was packed by a llamabundle that did not record which files each backend needs)",
                         fix="install it whole (without --backends), or rebuild and publish it")
    log.info(f"backends: {', '.join(keep)}" + "".join(f"; {b}: {why[b]}" for b in gpu))
    return parts.Choice(backends=tuple(keep), why=why, by=by)


def present_sight(m: Manifest) -> dict[str, tuple[bool, str]]:
    """Each GPU backend of m by Backend.device_present (a device node, a driver library in a usual place)."""
    out = {}
    for b in (b for b in m.backends if b != parts.CPU):
        found = b in backends.REGISTRY and backends.REGISTRY[b].device_present()
        hint = backends.REGISTRY[b].device_hint if b in backends.REGISTRY else f"a {b} device"
        out[b] = (found, f"{hint}: {'found' if found else 'not found'} here")
    return out


def drivers_sight(m: Manifest, bundle_dir: Path, *, log: Log, env: Mapping[str, str] | None = None) -> dict[str, tuple[bool, str]]:
    """Each GPU backend of m as the GPU drivers answer the bundle's own `llamabundle-probe --drivers`, run from
    bundle_dir (the CPU part is enough: it opens the drivers, not the backend modules): CUDA where the NVIDIA
    driver lists a device, runs the bundle's CUDA major version and one of its GPUs is served by the bundle's SASS
    or PTX; Vulkan where the loader lists a GPU (not a CPU implementation). A bundle for another platform, one
    without the program, or a program that gives no answer: present_sight, said so."""
    from . import drivers

    fallback = present_sight(m)
    if m.platform != platforms.host_name():
        return fallback
    program = bundle_dir / platforms.get(m.platform).program_file(drivers.PROBE_PROGRAM)
    if not program.is_file():
        return fallback
    try:
        d = drivers.query(program, env=env)
    except drivers.DriversError as e:
        log.warn(f"{e.what} ({e.why}); choosing the backends by their drivers' files instead")  # noqa: G010 - Log.warn
        return fallback
    out = dict(fallback)
    said = f"{drivers.PROBE_PROGRAM} --drivers"
    if "cuda" in out:
        why_not = d.why_not("cuda")
        info = cuda_section.read(m)
        if not why_not and info is not None and d.cuda_driver_version and info.toolkit:
            have, need = d.cuda_driver_version.split(".")[0], info.toolkit.split(".")[0]
            if int(have) < int(need):
                why_not = (f"the NVIDIA driver runs CUDA {d.cuda_driver_version}, the bundle's runtime is CUDA "
                           f"{info.toolkit}" + (f" (driver {info.driver_floor} or newer)" if info.driver_floor else ""))
        devices = [f"CUDA{x.index}: {x.name or '?'}" for x in d.cuda_devices]
        if not why_not:
            caps = {f"CUDA{x.index}": x.compute_capability for x in d.cuda_devices if x.compute_capability}
            why_not = backends.get("cuda").unserved(m, devices, caps) or ""
        gpus = ", ".join(f"{x.name or '?'} ({x.compute_capability or '?'})" for x in d.cuda_devices)
        out["cuda"] = ((False, f"{why_not} ({said})") if why_not else
                       (True, f"{gpus} with CUDA {d.cuda_driver_version or '?'} ({said})"))
    if "vulkan" in out:
        why_not = d.why_not("vulkan")
        gpus = ", ".join(f"{x.name or '?'} ({x.type})" for x in d.vulkan_devices if x.gpu)
        out["vulkan"] = (False, f"{why_not} ({said})") if why_not else (True, f"{gpus} ({said})")
    return out


def _auto(entry: Entry, bundle_dir: Path, *, log: Log) -> Manifest:
    """`--backends auto`: the part of the entry that the drivers answering the bundle's probe in bundle_dir choose."""
    m = entry.manifest
    with log.step(f"ask the GPU drivers which backends of {m.name} ({m.key[:12]}) run here"):
        return parts.cut(m, choose_backends(m, "auto", log=log, sight=drivers_sight(m, bundle_dir, log=log)))


def _install_locked(store: Store, entry: Entry, slot: Path, *, log: Log, platform: str, commit: str | None,
                    toolkit: str | None, hook: Hook, pin: Pin | None, want: Manifest | None) -> InstallOutcome:
    """`want`: the part of the entry to install (None: `--backends auto`, decided by the bundle's own probe: the
    installed one of this key, else the CPU part fetched by content first, else the unpacked zip)."""
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
    if want is None and old is not None and old.key == key:
        want = _auto(entry, old.path, log=log)
    same = old is not None and want is not None and old.key == key and sorted(old.manifest.backends) == sorted(want.backends)
    if old is not None and same and (pin is None or pin.sha256 in (old.zip_sha256, parts.published_sha256(old.manifest))):
        try:
            check_bundle(old.path, key=key, platform=platform, commit=commit, toolkit=toolkit)
            return InstallOutcome(installed=old, reused=True, replaced=None, pinned=pin)
        except BundleInvalid as e:
            log.warn(f"the installed {slot.name} ({key[:12]}) fails its check ({e.what}); installing it again")  # noqa: G010 - Log.warn
    elif old is not None and same and pin is not None:
        log.info(f"the installed {slot.name} ({key[:12]}) is not known to come from the zip pinned by {pin.where}; "
                 "installing it again")
    on_manifest = pin is not None and pin.sha256 == parts.published_sha256(entry.manifest)
    if pin is not None and entry.zip_sha256 != pin.sha256 and not on_manifest:  # refused before any download
        raise _pin_refused(entry, pin, entry.zip_sha256, where=f"{store.url} lists it so (nothing was downloaded)")
    version = f"{key[:12]}-{os.urandom(4).hex()}"
    stage = scratch.make_dir(slot, STAGE)
    swapped = False
    # a pin of the zip is on the zip's bytes: the zip is read. A pin of bundle.json (which names every file's
    # sha256) holds for the files fetched by content too.
    by_content = blob_source(store, entry) if pin is None or on_manifest else None
    blob_cache = slot.parent.parent / BLOB_CACHE
    try:
        if by_content is not None:
            try:  # what was asked for, on the store's manifest, before a byte is downloaded
                check_consistent(entry.manifest, _expect(key, platform, commit, toolkit))
                backends.read_sections(entry.manifest)
            except VerifyError as e:
                raise _invalid(key, e.what, e.why) from None
            first = None
            if want is None:  # the CPU part first (every install holds it): its probe asks the drivers
                cpu = parts.cut(entry.manifest, parts.Choice(backends=(parts.CPU,), why={}, by="auto"))
                first = _install_blobs(by_content, entry, cpu, blob_cache, stage / "cpu-part", log=log,
                                       hook=lambda _p: None).done
                want = _auto(entry, stage / "cpu-part", log=log)
            transfer = _install_blobs(by_content, entry, want, blob_cache, stage / version, log=log, hook=hook)
            if first is not None:  # one install: what the CPU part's download brought counts as downloaded
                got = transfer.done
                fetched_bytes = sum(f.size for f in cpu.files) - first.from_cache
                transfer = _Got(zip_sha256=None, done=Transfer(
                    by="blobs", downloaded=first.downloaded + got.downloaded, files=got.files,
                    fetched=first.fetched + got.fetched, from_cache=got.from_cache - fetched_bytes),
                    hashes=transfer.hashes)
            with log.step(f"check {slot.name} ({key[:12]})"):  # bundle.json is the store's: its files are what is left
                check_bundle(stage / version, key=key, platform=platform, commit=commit, toolkit=toolkit,
                             hashes=transfer.hashes)
            hook("verified")
        else:
            transfer = _install_zip(store, entry, stage, version, pin=None if on_manifest else pin, log=log, hook=hook, slot=slot,
                                    platform=platform, commit=commit, toolkit=toolkit)
            if want is None:
                want = _auto(entry, stage / version, log=log)
            if want is not entry.manifest:  # a part of it: the other backends' files go, its own bundle.json in
                _cut_dir(stage / version, entry.manifest, want)
                check_bundle(stage / version, key=key, platform=platform, commit=commit, toolkit=toolkit,
                             hashes={f.path: f.sha256 for f in want.files})  # each checked whole just before
        os.replace(stage / version, slot / version)
        hook("swapping")
        write_atomic(slot / POINTER, json.dumps({"dir": version, "key": key, "installed_at": utc_timestamp(),
                                                 "zip_sha256": transfer.zip_sha256}, sort_keys=True) + "\n")
        swapped = True
        hook("swapped")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if not swapped:
            shutil.rmtree(slot / version, ignore_errors=True)
    if old is not None and old.path.name != version:
        shutil.rmtree(old.path, ignore_errors=True)
    blobcache.prune(blob_cache)
    new = _current(slot)
    assert new is not None and new.key == key
    log.info(f"installed {slot.name} ({key[:12]}) in {new.path}" + (f", its zip pinned by {pin.where}" if pin else ""))
    return InstallOutcome(installed=new, reused=False, replaced=old.key if old is not None else None, pinned=pin,
                          transfer=transfer.done)


def _install_zip(store: Store, entry: Entry, stage: Path, version: str, *, pin: Pin | None, log: Log, hook: Hook,
                 slot: Path, platform: str, commit: str | None, toolkit: str | None) -> _Got:
    """The whole zip downloaded, unpacked safely into stage/version and checked."""
    key = entry.key
    with log.step(f"download {entry.zip_name} ({entry.zip_size / 1e6:.1f} MB) from {store.url}"):
        try:
            zip_path = store.fetch(entry, stage / "download")
        except VerifyError as e:
            raise _invalid(key, e.what, e.why) from None
        zip_sha = entry.zip_sha256  # what the store checked the download against
        if pin is not None:  # the downloaded bytes themselves, before anything is unpacked
            zip_sha = sha256_file(zip_path)
            if zip_sha != pin.sha256:
                raise _pin_refused(entry, pin, zip_sha, where=f"the zip downloaded from {store.url}")
    hook("downloaded")
    with log.step(f"extract and check {slot.name} ({key[:12]})"):
        try:
            extract(zip_path, stage / version)
        except VerifyError as e:
            raise _invalid(key, e.what, e.why) from None
        hook("extracted")
        inside = check_bundle(stage / version, key=key, platform=platform, commit=commit, toolkit=toolkit)
        if inside != entry.manifest:  # the same JSON, as fetch requires (every field is read from it)
            raise _invalid(key, f"the bundle.json inside {entry.zip_name} is not the one {store.url} lists",
                           "the store's manifest and the zip's disagree", fix="publish the bundle again")
    hook("verified")
    n = len(entry.manifest.files)
    return _Got(zip_sha256=zip_sha, done=Transfer(by="zip", downloaded=entry.zip_size, files=n, fetched=n))


BLOB_CACHE = "blobs"


@dataclass(frozen=True)
class _Got:
    zip_sha256: str | None  # the zip's sha256 the pointer records (None: assembled from blobs, no zip read)
    done: Transfer
    hashes: Mapping[str, str] | None = None  # path -> sha256 of the files assembled (read once, as they were linked)


def _cut_dir(root: Path, whole: Manifest, want: Manifest) -> None:
    """The unpacked bundle `whole` made the part `want` says: the files it does not list removed, its bundle.json in."""
    keep = {f.path for f in want.files}
    for f in whole.files:
        if f.path not in keep:
            root.joinpath(*f.path.split("/")).unlink()
    (root / MANIFEST).write_text(want.text(), encoding="utf-8", newline="\n")


def _install_blobs(src: BlobStore, entry: Entry, want: Manifest, cache: Path, dest: Path, *, log: Log,
                   hook: Hook) -> _Got:
    """The bundle assembled in dest from the install root's blob cache (store.blobcache: only what it lacks is
    downloaded, every reused blob hashed again); a blob that is not its file refuses the bundle."""
    try:
        got = blobcache.assemble(src, entry, want, cache, dest, log=log)
    except VerifyError as e:
        raise _invalid(entry.key, e.what, e.why, fix=e.fix) from None
    hook("downloaded")
    hook("extracted")
    return _Got(zip_sha256=None, done=Transfer(by="blobs", downloaded=got.downloaded, files=got.files,
                                                fetched=got.fetched, from_cache=got.from_cache), hashes=got.hashes)


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
