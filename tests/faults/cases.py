"""The matrix's cases. Each makes its inputs in a fresh directory (with this checkout's test helpers: the inputs
are data), runs `python -m llamabundle` from the tree under test, and reports an Outcome: the exit code, whether
a traceback or `internal error` was printed, the bytes a run left behind (any name carrying an owner token, a
`.part` or a `.partial-`: every run has ended, so every owner is dead) and the processes left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from llamabundle import bundle, digest, keys
from tests import bundles as tb
from tests import craftedzips as cz
from tests.loopback import Loopback, Reply
from tests.processes import wait_for, wait_text

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
NESTED = b"[" * 100_000 + b"]" * 100_000
# a llama-server that answers the load check, or (HANG names a file) starts a helper that leaves with setsid
# (its pid in HANG.helper), then writes its own pid to HANG and sleeps
SERVER = rb"""#!/bin/sh
if [ -n "$(ls "$(dirname "$0")"/HANG 2>/dev/null)" ]; then
  m="$(cat "$(dirname "$0")"/HANG)"
  setsid sh -c "echo \$\$ > '$m.helper.tmp' && mv '$m.helper.tmp' '$m.helper' && exec sleep 600" &
  while [ ! -s "$m.helper" ]; do sleep 0.01; done
  echo $$ > "$m"; exec sleep 600
fi
echo "load_backend: loaded CPU backend from $(dirname "$0")/libggml-cpu.so" >&2
echo "Available devices:"
exit 0
"""
_LEFT = re.compile(r"\d+-\d+-[0-9a-f]{6}|\.part$|\.partial-")


@dataclass
class Outcome:
    code: int | None  # None: the case could not run here (`skipped` says why)
    text: str = ""
    traceback: bool = False
    left: list[str] = field(default_factory=list)  # what runs left behind: "path (bytes)"
    left_bytes: int = 0
    procs: list[int] = field(default_factory=list)  # pids still running
    skipped: str = ""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class World:
    """A case's directory and the tree whose llamabundle it runs."""

    tmp: Path
    tree: Path
    pids: list[int] = field(default_factory=list)  # helper processes that must be gone at the end

    def env(self, **more: str) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.tmp), "LANG": "C.UTF-8",
                "PYTHONPATH": str(self.tree), "LLAMABUNDLE_CACHE_DIR": str(self.tmp / "cache"),
                "LLAMABUNDLE_DATA_DIR": str(self.tmp / "data"), **more}

    def start(self, *args: object, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """llamabundle, with SIGINT's default action whatever ours is (a shell's background job ignores SIGINT,
        and an ignored SIGINT stays ignored across exec: the interrupt cases would see it finish instead)."""
        return subprocess.Popen([sys.executable, "-m", "llamabundle", *map(str, args)], env=env or self.env(),
                                cwd=self.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                encoding="utf-8", errors="replace", start_new_session=True, preexec_fn=_default_sigint)

    def cli(self, *args: object, env: dict[str, str] | None = None, timeout: float = 180) -> Outcome:
        p = self.start(*args, env=env)
        out, _ = p.communicate(timeout=timeout)
        return Outcome(code=p.returncode, text=out)

    # ------------------------------------------------------------------------------------------ inputs

    def good_zip(self, *, payload: int = 0, hang: Path | None = None, **fields: object) -> tuple[Path, dict[str, object]]:
        """A bundle zip of the shipped Linux CPU recipe's inputs (its key is that recipe's)."""
        files = {"llama-server": SERVER, "LICENSE": b"MIT License\n" * 200}
        roles = {"llama-server": "exe", "LICENSE": "license"}
        if payload:
            files["payload.bin"] = os.urandom(payload)
            roles["payload.bin"] = "runtime"
        if hang is not None:
            files["HANG"] = str(hang).encode()
            roles["HANG"] = "runtime"
        n = len(list(self.tmp.glob("good-*.zip")))
        return tb.make_zip(self.tmp, files, roles, zip_name=f"good-{n}.zip", name="linux-x86_64-cpu",
                           inputs=tb.inputs_of(keys.load(LINUX)), executables=("llama-server",), **fields)

    def zip_with_manifest(self, raw: bytes) -> Path:
        """A zip whose bundle.json is `raw` (the files of a good bundle beside it)."""
        stage = self.tmp / "stage-raw"
        tb.write_bundle(stage, {"LICENSE": b"MIT\n"}, {"LICENSE": "license"}, name="linux-x86_64-cpu",
                        inputs=tb.inputs_of(keys.load(LINUX)))
        (stage / bundle.MANIFEST).write_bytes(raw)
        return bundle.pack(stage, self.tmp / "raw.zip", source_date_epoch=0)

    def store_with(self, z: Path, manifest: dict[str, object] | bytes) -> tuple[Path, str]:
        """A local store whose entry holds `z` (its SHA256SUMS right) and `manifest` as its bundle.json."""
        key = tb.key_of(tb.inputs_of(keys.load(LINUX)))
        entry = self.tmp / "store" / key
        entry.mkdir(parents=True, exist_ok=True)
        (entry / "linux-x86_64-cpu.zip").write_bytes(z.read_bytes())
        (entry / "SHA256SUMS").write_text(f"{digest.sha256_file(z)}  linux-x86_64-cpu.zip\n")
        (entry / bundle.MANIFEST).write_bytes(manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode())
        return self.tmp / "store", key

    # ------------------------------------------------------------------------------------------ after

    def leftovers(self) -> tuple[list[str], int]:
        found, total = [], 0
        for p in self.tmp.rglob("*"):
            if _LEFT.search(p.name) and not p.is_symlink():
                size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
                found.append(f"{p.relative_to(self.tmp)} ({size} bytes)")
                total += size
        return found, total

    def running(self) -> list[int]:
        time.sleep(0.5)  # signals land
        alive = []
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                    if f.read().rsplit(")", 1)[-1].split()[0] != "Z":
                        alive.append(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass
        return alive


@contextmanager
def tmpfs(world: World, opts: str) -> Iterator[Path | None]:
    """A small tmpfs (root only), or None where it cannot be mounted."""
    d = world.tmp / f"mnt{len(list(world.tmp.glob('mnt*')))}"
    d.mkdir()
    ok = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)],
                                              capture_output=True).returncode == 0
    try:
        yield d if ok else None
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(d)], check=False)


Run = Callable[[World], Outcome]


@dataclass(frozen=True)
class Case:
    id: str
    group: str
    expect: int
    run: Run


CASES: list[Case] = []


def case(group: str, id: str, expect: int) -> Callable[[Run], Run]:
    def add(run: Run) -> Run:
        CASES.append(Case(id=id, group=group, expect=expect, run=run))
        return run
    return add


# ------------------------------------------------------------------------------------------ crafted zips

def _crafted_case(kind: str, command: str) -> Run:
    def run(w: World) -> Outcome:
        good, manifest = w.good_zip()
        z = w.tmp / f"{kind}.zip"
        z.write_bytes(cz.crafted(good, kind, "LICENSE" if kind != "bzip2" else "bundle.json"))
        if command == "verify":
            return w.cli("verify", z)
        if command == "publish":
            return w.cli("publish", z, "--store", w.tmp / "pub")
        store, key = w.store_with(z, manifest)
        if command == "fetch":
            return w.cli("fetch", key, "--store", store, "--out", w.tmp / "out")
        return w.cli("install", "--key", key, "--store", store, "--dest", w.tmp / "apps")
    return run


for _kind in ("encrypted", "shrink", "aes", "bzip2", "descriptors", "encrypted-descriptors", "local-name",
              "overlapping", "larger-than-listed"):
    for _command in ("verify", "publish", "fetch", "install"):
        case("crafted zip", f"{_kind} / {_command}", 5)(_crafted_case(_kind, _command))


# ------------------------------------------------------------------------------------------ deep nesting

def _deep_case(command: str) -> Run:
    def run(w: World) -> Outcome:
        z = w.zip_with_manifest(NESTED)
        if command == "verify":
            return w.cli("verify", z)
        if command == "publish":
            return w.cli("publish", z, "--store", w.tmp / "pub")
        good, _ = w.good_zip()
        store, key = w.store_with(good, NESTED)  # the store's record of it
        if command == "fetch":
            return w.cli("fetch", key, "--store", store, "--out", w.tmp / "out")
        if command == "check":
            return w.cli("check", LINUX, "--store", store)
        return w.cli("install", "--key", key, "--store", store, "--dest", w.tmp / "apps")
    return run


for _command in ("verify", "publish", "fetch", "install", "check"):
    case("deep nesting", f"bundle.json of 100,000 arrays / {_command}", 5)(_deep_case(_command))


@case("deep nesting", "recipe nested 100,000 levels / key", 2)
def _deep_recipe(w: World) -> Outcome:
    r = w.tmp / "deep.yaml"
    r.write_text("schema: 1\nname: x\nx: " + "[" * 100_000 + "]" * 100_000 + "\n")
    return w.cli("key", r)


@case("deep nesting", "install pointer of 100,000 arrays / list", 0)
def _deep_pointer(w: World) -> Outcome:
    slot = w.tmp / "data" / "bundles" / "linux-x86_64-cpu"
    slot.mkdir(parents=True)
    (slot / "current").write_bytes(NESTED)
    return w.cli("list")


# ------------------------------------------------------------------------------------------ claims

def _claim_case(command: str, **fields: object) -> Run:
    def run(w: World) -> Outcome:
        z, manifest = w.good_zip(backends=["cpu"])
        stage = w.tmp / "claimed"
        bundle.unpack(z, stage)
        (stage / bundle.MANIFEST).write_text(json.dumps({**json.loads((stage / bundle.MANIFEST).read_text()), **fields}))
        edited = bundle.pack(stage, w.tmp / "claimed.zip", source_date_epoch=0)
        if command == "verify":
            return w.cli("verify", edited)
        if command == "publish":
            return w.cli("publish", edited, "--store", w.tmp / "pub")
        store, key = w.store_with(edited, {**manifest, **fields})
        if command == "fetch":
            return w.cli("fetch", key, "--store", store, "--out", w.tmp / "out")
        return w.cli("install", "--key", key, "--store", store, "--dest", w.tmp / "apps")
    return run


for _command in ("verify", "publish", "fetch", "install"):
    case("claims", f"CPU bundle claiming cpu+cuda / {_command}", 5)(_claim_case(_command, backends=["cpu", "cuda"]))


@case("claims", "zip's bundle.json not the store's record / install", 5)
def _install_mismatch(w: World) -> Outcome:
    z, manifest = w.good_zip()
    store, key = w.store_with(z, {**manifest, "built_at": "2030-01-01T00:00:00Z"})
    return w.cli("install", "--key", key, "--store", store, "--dest", w.tmp / "apps")


# ------------------------------------------------------------------------------------------ disks

def _disk_case(what: str) -> Run:
    def run(w: World) -> Outcome:
        z, manifest = w.good_zip(payload=3 << 20)
        store, key = w.store_with(z, manifest)
        with tmpfs(w, "ro,size=1m" if what == "verify" else "size=1m") as mnt:
            if mnt is None:
                return Outcome(code=None, skipped="mounting a tmpfs needs root and mount(8)")
            if what == "install":
                return w.cli("install", "--key", key, "--store", store, "--dest", mnt / "apps")
            if what == "out":
                return w.cli("fetch", key, "--store", store, "--out", mnt / "out")
            if what == "cache":
                return w.cli("fetch", key, "--store", store, "--out", w.tmp / "out",
                             env=w.env(LLAMABUNDLE_CACHE_DIR=str(mnt / "cache")))
            return w.cli("verify", z, "--level", "load", env=w.env(LLAMABUNDLE_CACHE_DIR=str(mnt / "cache")))
    return run


case("disks", "install onto a full --dest", 6)(_disk_case("install"))
case("disks", "fetch into a full --out", 6)(_disk_case("out"))
case("disks", "fetch with a full cache", 6)(_disk_case("cache"))
case("disks", "verify ZIP with a read-only cache", 0)(_disk_case("verify"))


# ------------------------------------------------------------------------------------------ inputs

@case("inputs", "--store file:// (no path) / check", 2)
def _empty_file_store(w: World) -> Outcome:
    return w.cli("check", LINUX, "--store", "file://")


@case("inputs", "SOURCE_DATE_EPOCH=4354819200 (2108) / build", 2)
def _sde(w: World) -> Outcome:
    return w.cli("build", LINUX, "--store", w.tmp / "store", env=w.env(SOURCE_DATE_EPOCH="4354819200"))


@case("inputs", "GitHub API answering 200 with an HTML page / check", 6)
def _html_api(w: World) -> Outcome:
    page = Reply(headers={"Content-Type": "text/html; charset=utf-8"}, body=b"<!DOCTYPE html><html>sign in</html>")
    with Loopback(lambda _req: page) as server:
        return w.cli("check", LINUX, "--store", "github:acme/bundles",
                     env=w.env(GITHUB_API_URL=server.url, GITHUB_TOKEN="t0ken"))


@case("locale", "index of a store at a non-ASCII path under LC_ALL=C", 0)
def _locale(w: World) -> Outcome:
    z, _ = w.good_zip()
    env = {k: v for k, v in w.env(LC_ALL="C", PYTHONUTF8="0").items() if k != "LANG"}
    published = w.cli("publish", z, "--store", w.tmp / "störe", env=env)
    if published.code != 0:
        return published
    return w.cli("index", "--store", w.tmp / "störe", "--out", w.tmp / "site", env=env)


# ------------------------------------------------------------------------------------------ concurrency and kills

@case("concurrency", "three fetches of one key into one --out at once (worst exit)", 0)
def _three_fetches(w: World) -> Outcome:
    z, manifest = w.good_zip(payload=8 << 20)
    store, key = w.store_with(z, manifest)
    procs = [w.start("fetch", key, "--store", store, "--out", w.tmp / "out") for _ in range(3)]
    texts = [p.communicate(timeout=180)[0] for p in procs]
    codes = [p.returncode for p in procs]
    return Outcome(code=max(codes), text=f"exits {codes}\n" + "\n".join(texts))


@case("kills", "SIGINT while fetch unpacks beside --out", 130)
def _interrupted_fetch(w: World) -> Outcome:
    z, manifest = w.good_zip(payload=96 << 20)  # an unpack long enough to be interrupted on a fast machine
    store, key = w.store_with(z, manifest)
    p = w.start("fetch", key, "--store", store, "--out", w.tmp / "out")
    wait_for(lambda: list(w.tmp.glob(".out.partial-*")), procs=[p], name="the unpack beside --out")
    os.kill(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    return Outcome(code=p.returncode, text=out)


@case("kills", "llamabundle SIGKILLed during the load check (its llama-server and the server's setsid helper; "
      "then one more verify)", -9)
def _killed_parent(w: World) -> Outcome:
    marker = w.tmp / "server.pid"
    z, _ = w.good_zip(hang=marker)
    p = w.start("verify", z, "--level", "load")
    pid = int(wait_text(marker, procs=[p]))
    w.pids += [pid, int(wait_text(marker.with_name(marker.name + ".helper"), procs=[p]))]
    os.kill(p.pid, signal.SIGKILL)  # llamabundle alone, as an OOM killer or `kill -9` would
    out, _ = p.communicate(timeout=60)
    after = w.cli("verify", z)  # the next run that uses the cache removes what the killed one left there
    return Outcome(code=p.returncode, text=out + after.text)


@case("hanging tools", "nvidia-smi that hangs and leaves with setsid / probe", 0)
def _hanging_smi(w: World) -> Outcome:
    pidfile = w.tmp / "smi-child.pid"
    smi = w.tmp / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nsetsid sh -c 'echo $$ > {pidfile}; exec sleep 600' &\nexec sleep 600\n")
    smi.chmod(0o755)
    p = w.start("probe", "--nvidia-smi", smi, "--json")  # stopped after gpus.SMI_TIMEOUT (15 s)
    w.pids.append(int(wait_text(pidfile, procs=[p], timeout=60)))
    out, _ = p.communicate(timeout=180)
    return Outcome(code=p.returncode, text=out)


def run_case(c: Case, tmp: Path, tree: Path) -> Outcome:
    """Run one case in `tmp` (new) against the llamabundle in `tree`, then look for what it left."""
    tmp.mkdir(parents=True)
    w = World(tmp=tmp, tree=tree)
    try:
        o = c.run(w)
    finally:
        pass
    if o.code is None:
        return o
    o.traceback = "Traceback" in o.text or "internal error" in o.text
    o.left, o.left_bytes = w.leftovers()
    o.procs = w.running()
    for pid in o.procs:  # leave none behind for the next case
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return o
