"""Faults across the local store, fetch and install (issue 12), with real processes: CLIs racing on one install
root, three fetches into one directory, a publisher SIGKILLed during its copy, malformed store entries, a
read-only and a full filesystem (tmpfs mounts), a --store that is a regular file, non-ASCII names under the
C locale. Each test asserts the exit codes (DESIGN §8) and what is left on disk afterwards."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamabundle import bundle
from llamabundle.bundle.manifest import Manifest
from llamabundle.errors import StoreError
from llamabundle.runtime.install import (
    BUNDLES,
    POINTER,
    check_bundle,
    install_bundle,
    list_installed,
)
from llamabundle.store import blobcache
from llamabundle.store.local import PUBLISH_PREFIX, LocalStore
from tests.installs import plant, rebundle, recipe_bundle, slot_entries
from tests.probing import NAME, QUIET, REPO, cli, make_stage, make_zip, publish
from tests.processes import wait_for, wait_text

pytestmark = pytest.mark.race

LINUX = REPO / "recipes" / "linux-x86_64-cpu.yaml"


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")}


def start(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """`llamabundle ARGS` started in its own process, as tests.probing.cli runs it (without waiting)."""
    return subprocess.Popen([sys.executable, "-m", "llamabundle", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env={**env, "PYTHONPATH": str(REPO), "NO_COLOR": "1"})


def child(script: str, *args: object, **kw: object) -> subprocess.Popen[str]:
    """A small python program of this test in its own process."""
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, **kw)  # type: ignore[call-overload]


def finish(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[tuple[int, str, str]]:
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out or "", err or "") for p, (out, err) in zip(procs, outs, strict=True)]


def clean(text: str) -> None:
    assert "Traceback" not in text and "internal error" not in text, text


def big_zip(tmp: Path, size: int = 2 << 20, **kw: Any) -> tuple[Path, Manifest]:
    """tests.probing's bundle with an incompressible member of `size` bytes, so that the zip is that large too."""
    stage, m = make_stage(tmp, **kw)
    m = rebundle(stage, m, extra={"libbig.so": os.urandom(size)})
    return bundle.pack(stage, tmp / f"{m.name}-{m.key[:12]}-big.zip", source_date_epoch=0), m


def installed_ok(root: Path, m: Manifest) -> None:
    """Exactly `m` is installed under root, it checks, and nothing else is left in its slot."""
    [now] = list_installed(root)
    assert now.key == m.key
    check_bundle(now.path, key=m.key, platform="linux-x86_64")
    assert slot_entries(root, now.name) == sorted([POINTER, now.path.name])


# ------------------------------------------------------------------------------- uninstall racing install


INSTALL_PAUSED = """
import sys, time
from pathlib import Path
from llamabundle.log import Log
from llamabundle.runtime.install import install_bundle
from llamabundle.store.local import LocalStore
store, key, root, marker, go = sys.argv[1:6]
def hook(at):
    if at == "verified":  # holding the slot's lock, the new install checked but not yet in place
        Path(marker).touch()
        while not Path(go).exists():
            time.sleep(0.01)
install_bundle(LocalStore(Path(store)), key, root=Path(root), log=Log(quiet=True), hook=hook)
"""

# `llamabundle uninstall` that says when it has chosen what to remove and is about to take the lock
UNINSTALL_MARKED = """
import sys
from pathlib import Path
import llamabundle.runtime.install as install_mod
from llamabundle.cli import main
marker, argv = sys.argv[1], sys.argv[2:]
real = install_mod._slot_lock
def marked(*a, **kw):
    Path(marker).touch()
    return real(*a, **kw)
install_mod._slot_lock = marked
main(argv)
"""


def test_uninstall_waiting_for_a_running_install_removes_nothing_of_it(tmp_path: Path) -> None:
    store, root = tmp_path / "store", tmp_path / "data"
    ka = publish(store, tmp_path, salt="a")
    kb = publish(store, tmp_path, salt="b")
    install_bundle(LocalStore(store), ka.key, root=root, log=QUIET)
    marker_i, marker_u, go = tmp_path / "installing", tmp_path / "uninstalling", tmp_path / "go"
    inst = child(INSTALL_PAUSED, store, kb.key, root, marker_i, go)
    wait_for(marker_i)  # KB's install holds the lock; KA is still what the pointer names
    un = child(UNINSTALL_MARKED, marker_u, "uninstall", ka.key, "--dest", root, stdout=subprocess.PIPE,
               stderr=subprocess.PIPE)
    wait_for(marker_u)  # the uninstall saw KA installed and now waits for the lock
    go.touch()
    [(rc_i, _, err_i), (rc_u, out_u, err_u)] = finish([inst, un])
    assert rc_i == 0, err_i
    assert rc_u == 2, out_u + err_u
    assert f"error: '{ka.key}' is no longer installed: {NAME} is now {kb.key[:12]}; nothing was removed" in err_u
    clean(err_u)
    installed_ok(root, kb)


def test_concurrent_install_and_uninstall_clis_never_lose_the_new_install(tmp_path: Path, env: dict[str, str]) -> None:
    store, root = tmp_path / "store", tmp_path / "data"
    keys = [publish(store, tmp_path, salt=s) for s in ("a", "b")]
    assert cli("install", "--store", str(store), "--key", keys[0].key, "--dest", str(root), env=env).returncode == 0
    for n in range(6):  # each round: KB (installed twice at once) races `uninstall KA`; then the roles swap
        ka, kb = keys[n % 2], keys[(n + 1) % 2]
        argvs = [("install", "--store", str(store), "--key", kb.key, "--dest", str(root)),
                 ("uninstall", ka.key, "--dest", str(root)),
                 ("install", "--store", str(store), "--key", kb.key, "--dest", str(root))]
        procs = [start(*a, env=env) for a in (argvs if n % 3 else argvs[::-1])]
        results = dict(zip((a[0] + str(i) for i, a in enumerate(argvs if n % 3 else argvs[::-1])), finish(procs), strict=True))
        for name, (rc, out, err) in results.items():
            clean(out + err)
            if name.startswith("install"):
                assert rc == 0, (n, err)
                assert out.startswith((f"installed {NAME} ({kb.key[:12]})", f"already installed and intact: {NAME} ({kb.key[:12]})"))
            else:
                assert rc in (0, 2), (n, err)
                assert rc == 0 and out == f"removed {NAME} ({ka.key[:12]})\n" or \
                    rc == 2 and ("is no longer installed" in err or f"no installed bundle matches '{ka.key}'" in err), (n, err)
        installed_ok(root, kb)  # every round: KB survives, whoever got the lock first
    p = cli("list", "--dest", str(root), "--json", env=env)
    assert [b["key"] for b in json.loads(p.stdout)["bundles"]] == [keys[0].key]


# ------------------------------------------------------------------------------- fetches into one directory


FETCH = """
import os, sys, time
from pathlib import Path
from llamabundle.errors import LlamaBundleError
from llamabundle.store.local import LocalStore
root, key, dest, ready, go = sys.argv[1:6]
store = LocalStore(Path(root))
entry = store.lookup(key)
Path(ready).touch()
while not os.path.exists(go):
    time.sleep(0.001)
try:
    print(store.fetch(entry, Path(dest)))
except LlamaBundleError as e:
    print(e.render(), file=sys.stderr)
    sys.exit(e.exit_code)
"""


def test_three_concurrent_fetches_into_one_directory_all_succeed(tmp_path: Path) -> None:
    store = tmp_path / "store"
    zip_path, m = big_zip(tmp_path, 16 << 20)
    LocalStore(store).publish(zip_path, m)
    dest, go = tmp_path / "cache" / "fetched" / m.key, tmp_path / "go"
    readies = [tmp_path / f"ready-{i}" for i in range(3)]
    procs = [child(FETCH, store, m.key, dest, r, go, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in readies]
    for r in readies:
        wait_for(r)
    go.touch()  # all three copy the same zip into the same directory at once
    results = finish(procs)
    assert [rc for rc, _, _ in results] == [0, 0, 0], results
    assert {out.strip() for _, out, _ in results} == {str(dest / zip_path.name)}
    assert sorted(p.name for p in dest.iterdir()) == [zip_path.name]  # one zip, no .part of anyone
    assert (dest / zip_path.name).read_bytes() == zip_path.read_bytes()


def test_three_concurrent_cli_fetches_share_one_cache(tmp_path: Path, env: dict[str, str]) -> None:
    """By content (the store keeps its files as blobs): the three share the cache's blob of each file."""
    store = tmp_path / "store"
    zip_path, m = big_zip(tmp_path, 8 << 20, backends=("cpu",))  # verify static: no GPU code to read
    LocalStore(store).publish(zip_path, m)
    procs = [start("fetch", m.key, "--store", str(store), "--out", str(tmp_path / f"out{i}"), env=env) for i in range(3)]
    results = finish(procs)
    assert [rc for rc, _, _ in results] == [0, 0, 0], results
    for _rc, out, err in results:
        clean(out + err)
    blobs = tmp_path / "cache" / "blobs"  # each file once, no partial blob left
    assert sorted(p.name for p in blobs.iterdir() if p.name != blobcache.STAMPS) == sorted(
        {blobcache.blob_name(f) for f in m.files})
    assert not (tmp_path / "cache" / "fetched" / m.key).exists()  # no zip was read
    with zipfile.ZipFile(zip_path) as zf:
        for i in range(3):
            out_dir = tmp_path / f"out{i}"
            assert sorted(p.name for p in out_dir.iterdir()) == sorted([*(f.path for f in m.files), "bundle.json"])
            assert (out_dir / "libbig.so").read_bytes() == zf.read("libbig.so")


# ------------------------------------------------------------------------------- a publisher killed mid-copy


PUBLISH_KILLED = """
import sys, time
from pathlib import Path
import llamabundle.store.local as local
from llamabundle.bundle.manifest import loads
root, zip_path, manifest_path, marker = sys.argv[1:5]
def stuck(src, src_path, tmp, final, **kw):  # half the zip copied into the stage, then wait to be killed
    tmp.write_bytes(src.read(Path(zip_path).stat().st_size // 2))
    Path(marker).write_text(str(tmp))
    time.sleep(600)
local._copy = stuck
local.LocalStore(Path(root)).publish(Path(zip_path), loads(Path(manifest_path).read_bytes()))
"""

HOLD_STAGE = """
import sys, time
from pathlib import Path
from llamabundle import scratch
d = scratch.make_dir(Path(sys.argv[1]), ".publish-")
(d / "partial.zip").write_bytes(b"x" * 1000)
Path(sys.argv[2]).write_text(str(d))
time.sleep(600)
"""

LOOKUP = """
import sys
from pathlib import Path
from llamabundle.store.local import LocalStore
print(LocalStore(Path(sys.argv[1])).lookup(sys.argv[2]).zip_sha256)
"""


def test_a_publisher_killed_during_its_copy_is_cleaned_up_by_the_next_run(tmp_path: Path) -> None:
    store = tmp_path / "store"
    zip_path, m = big_zip(tmp_path)
    (tmp_path / "m.json").write_text(m.text())
    killed = child(PUBLISH_KILLED, store, zip_path, tmp_path / "m.json", tmp_path / "copying")
    try:
        wait_text(tmp_path / "copying", procs=[killed])
        os.kill(killed.pid, signal.SIGKILL)
    finally:
        killed.wait(60)
    [left] = [p for p in store.iterdir() if p.name.startswith(PUBLISH_PREFIX)]
    assert left.name.startswith(f"{PUBLISH_PREFIX}{killed.pid}-")
    assert (left / m.key / zip_path.name).stat().st_size == zip_path.stat().st_size // 2
    assert not (store / m.key).exists()  # nothing half-published where readers look

    holder = child(HOLD_STAGE, store, tmp_path / "held")
    try:
        live = Path(wait_text(tmp_path / "held", procs=[holder]))
        # the next publish (another process) removes the dead publisher's stage, never the live one's
        p = child(PUBLISH_KILLED.replace("local._copy = stuck", ""), store, zip_path, tmp_path / "m.json",
                  tmp_path / "unused", stderr=subprocess.PIPE)
        [(rc, _, err)] = finish([p])
        assert rc == 0, err
        assert not left.exists()
        assert live.is_dir() and (live / "partial.zip").read_bytes() == b"x" * 1000
        assert sorted(p.name for p in (store / m.key).iterdir()) == ["SHA256SUMS", "bundle.json", zip_path.name]
    finally:
        holder.kill()
        holder.wait(60)
    # its owner is gone: the next lookup (another process) removes it
    p = child(LOOKUP, store, m.key, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    [(rc, out, err)] = finish([p])
    assert rc == 0 and out.strip() == LocalStore(store).lookup(m.key).zip_sha256, err
    assert not live.exists()
    assert [p.name for p in store.iterdir() if p.name.startswith(".publish")] == []


# ------------------------------------------------------------------------------- malformed store entries


def _recipe_bundle(tmp: Path) -> tuple[Path, Manifest]:
    """A bundle of the shipped Linux recipe: its key is the one `check recipes/linux-x86_64-cpu.yaml` asks for."""
    return recipe_bundle(tmp, LINUX)


MALFORMED = {  # name -> (bundle.json of the store entry, from the good manifest; what the message says)
    "list": (lambda m: [1, 2], "bundle.json is a list, not an object"),
    "files-string": (lambda m: {**m, "files": "x"}, "'files' is the string 'x', not a list"),
    "files-number": (lambda m: {**m, "files": [1]}, "'files[0]' is a number, not an object"),
    "platform-number": (lambda m: {**m, "platform": 5}, "'platform' is a number, not a string"),
    "key-number": (lambda m: {**m, "key": 12345}, "'key' is a number, not a string"),
    "llama_cpp-string": (lambda m: {**m, "llama_cpp": "x"}, "'llama_cpp' is the string 'x', not an object"),
    "inputs-edited": (lambda m: {**m, "inputs": {**m["inputs"], "commit": "1" * 40}},
                      "is not the sha256 of the inputs its bundle.json records"),
}


@pytest.mark.parametrize("kind", [*MALFORMED, "windows-under-linux-key"])
def test_a_malformed_store_entry_is_refused_by_check_and_install_with_exit_5(tmp_path: Path, env: dict[str, str],
                                                                            kind: str) -> None:
    store, root = tmp_path / "store", tmp_path / "data"
    zip_path, good = _recipe_bundle(tmp_path)
    if kind == "windows-under-linux-key":
        win_zip, win = make_zip(tmp_path, platform="windows-x86_64")
        entry = plant(store, good.key, win_zip, win.text())
        what = f"names key {win.key[:12]}, not {good.key[:12]}"
    else:
        make, what = MALFORMED[kind]
        entry = plant(store, good.key, zip_path, json.dumps(make(good.to_json())))
    before = {p.name: p.read_bytes() for p in entry.iterdir()}
    p = cli("check", str(LINUX), "--store", str(store), env=env)
    assert p.returncode == 5, p.stdout + p.stderr
    assert what in p.stderr and str(entry.resolve()) in p.stderr, p.stderr
    clean(p.stdout + p.stderr)
    p = cli("install", "--store", str(store), "--key", good.key, "--dest", str(root), env=env)
    assert p.returncode == 5, p.stdout + p.stderr
    assert f"error: bundle {good.key[:12]} refused (bundle_invalid): " in p.stderr and what in p.stderr, p.stderr
    clean(p.stdout + p.stderr)
    assert list_installed(root) == [] and not (root / BUNDLES / good.name).exists()
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == before  # refused, and left for a person to look at


def test_a_rekeyed_entry_is_refused_by_install(tmp_path: Path, env: dict[str, str]) -> None:
    store, root = tmp_path / "store", tmp_path / "data"
    zip_path, m = make_zip(tmp_path)
    fake = "f" * 64
    plant(store, fake, zip_path, json.dumps({**m.to_json(), "key": fake}))
    p = cli("install", "--store", str(store), "--key", fake, "--dest", str(root), env=env)
    assert p.returncode == 5 and "is not the sha256 of the inputs" in p.stderr, p.stderr
    clean(p.stderr)
    assert list_installed(root) == []


# ------------------------------------------------------------------------------- read-only and full filesystems


@contextlib.contextmanager
def mounted(where: Path, *args: str) -> Iterator[Path]:
    """`mount ARGS where`, unmounted afterwards; the test is skipped where mounting is not permitted."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", *args, str(where)], check=False, capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"mount is not permitted here: {p.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], check=False, capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def read_only_bind(src: Path, where: Path) -> contextlib.AbstractContextManager[Path]:
    @contextlib.contextmanager
    def cm() -> Iterator[Path]:
        with mounted(where, "--bind", str(src)):
            p = subprocess.run(["mount", "-o", "remount,ro,bind", str(where)], check=False, capture_output=True, text=True)
            if p.returncode != 0:
                pytest.skip(f"a read-only bind mount is not permitted here: {p.stderr.strip()}")
            yield where
    return cm()


PUBLISH = """
import sys
from pathlib import Path
from llamabundle.errors import LlamaBundleError
from llamabundle.bundle.manifest import loads
from llamabundle.store.local import LocalStore
root, zip_path, manifest_path = sys.argv[1:4]
try:
    done = LocalStore(Path(root)).publish(Path(zip_path), loads(Path(manifest_path).read_bytes()))
except LlamaBundleError as e:
    print(e.render(), file=sys.stderr)
    sys.exit(e.exit_code)
print("created" if done.created else "kept", done.entry.location)
"""


def publish_in_child(tmp: Path, store: Path, zip_path: Path, m: Manifest) -> tuple[int, str, str]:
    mpath = tmp / f"manifest-{m.key[:12]}.json"
    mpath.write_text(m.text())
    return finish([child(PUBLISH, store, zip_path, mpath, stdout=subprocess.PIPE, stderr=subprocess.PIPE)])[0]


def test_a_read_only_store_is_a_store_error_naming_the_path(tmp_path: Path) -> None:
    zip_path, m = make_zip(tmp_path)
    with mounted(tmp_path / "ro", "-t", "tmpfs", "-o", "ro,size=4m", "tmpfs") as ro:
        for store, named in ((ro / "store", ro / "store"), (ro, ro / ".locks")):
            rc, out, err = publish_in_child(tmp_path, store, zip_path, m)
            assert rc == 6, out + err
            assert f"error: cannot publish {m.key[:12]} to the store {store}" in err and str(named) in err, err
            assert "Read-only file system" in err
            clean(err)
        assert list(ro.iterdir()) == []
        rw = LocalStore(tmp_path / "store-rw")
        entry = rw.publish(zip_path, m).entry
        with pytest.raises(StoreError) as e:  # a fetch into it names the destination
            rw.fetch(entry, ro)
        assert e.value.what == f"cannot write {ro / zip_path.name}" and "Read-only file system" in e.value.why
        assert list(ro.iterdir()) == []


def test_a_read_only_store_still_serves_what_it_holds(tmp_path: Path, env: dict[str, str]) -> None:
    src = tmp_path / "src"
    zip_path, m = _recipe_bundle(tmp_path)
    LocalStore(src).publish(zip_path, m)
    dead = src / ".publish-999999999-5-abcdef"  # a killed publisher's leftover: it cannot be removed here
    dead.mkdir()
    with read_only_bind(src, tmp_path / "ro") as ro:
        p = cli("check", str(LINUX), "--store", str(ro), env=env)
        assert p.returncode == 0 and p.stdout.startswith(f"hit   {m.key}"), p.stderr
        rc, out, err = publish_in_child(tmp_path, ro, zip_path, m)  # already there: no lock, no write needed
        assert rc == 0 and out.startswith("kept "), err
        p = cli("install", "--store", str(ro), "--key", m.key, "--dest", str(tmp_path / "data"), env=env)
        assert p.returncode == 0, p.stderr
        with mounted(tmp_path / "rodata", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs") as rodata:
            p = cli("install", "--store", str(ro), "--key", m.key, "--dest", str(rodata), env=env)
            assert p.returncode == 6, p.stderr
            assert f"error: cannot use the install root {rodata}" in p.stderr and "Read-only file system" in p.stderr
            clean(p.stderr)
        assert dead.exists()
    installed_ok(tmp_path / "data", m)


def test_a_full_filesystem_leaves_nothing_half_written(tmp_path: Path, env: dict[str, str]) -> None:
    small_zip, small = make_zip(tmp_path, salt="small")
    large_zip, large = big_zip(tmp_path, salt="big")
    with mounted(tmp_path / "full", "-t", "tmpfs", "-o", "size=1m", "tmpfs") as full:
        # publish: the copy fails, the stage is removed, the store is as before
        store = full / "store"
        rc, out, err = publish_in_child(tmp_path, store, large_zip, large)
        assert rc == 6, out + err
        assert f"error: cannot write {store / large.key / large_zip.name}" in err and "No space left on device" in err
        clean(err)
        assert sorted(p.name for p in store.iterdir()) == [".locks"]
        assert publish_in_child(tmp_path, store, small_zip, small)[0] == 0  # the space was given back

        # fetch: the destination is named, nothing is left in it
        rw = LocalStore(tmp_path / "store-rw")
        rw.publish(large_zip, large)
        dest = full / "dl"
        with pytest.raises(StoreError) as e:
            rw.fetch(rw.lookup(large.key), dest)
        assert e.value.exit_code == 6 and e.value.what == f"cannot write {dest / large_zip.name}"
        assert "No space left on device" in e.value.why
        assert list(dest.iterdir()) == []

        # install: the old install stays, nothing of the new one is left
        rw.publish(small_zip, small)
        data = full / "data"
        assert cli("install", "--store", str(rw.root), "--key", small.key, "--dest", str(data), env=env).returncode == 0
        p = cli("install", "--store", str(rw.root), "--key", large.key, "--dest", str(data), env=env)
        assert p.returncode == 6, p.stderr
        assert "No space left on device" in p.stderr and str(data) in p.stderr, p.stderr
        clean(p.stderr)
        installed_ok(data, small)


# ------------------------------------------------------------------------------- a --store that is a file


def test_a_store_that_is_a_regular_file_is_a_usage_error(tmp_path: Path, env: dict[str, str]) -> None:
    a_file = tmp_path / "store.txt"
    a_file.write_text("not a store\n")
    zip_path, m = _recipe_bundle(tmp_path)
    for args in (("check", str(LINUX)), ("install", "--key", m.key, "--dest", str(tmp_path / "data")),
                 ("publish", str(zip_path))):
        p = cli(*args, "--store", str(a_file), env=env)
        assert p.returncode == 2, (args, p.stderr)
        assert f"error: store {a_file} is not a directory" in p.stderr, p.stderr
        clean(p.stderr)
    assert a_file.read_text() == "not a store\n"
    assert not (tmp_path / "data").exists()


# ------------------------------------------------------------------------------- non-ASCII under the C locale


def test_non_ascii_names_under_the_c_locale(tmp_path: Path, env: dict[str, str]) -> None:
    store = tmp_path / "störe ü"
    zip_path, m = make_zip(tmp_path)
    named = zip_path.rename(tmp_path / "bündel ☃.zip")
    LocalStore(store).publish(named, m)
    c_env = {**env, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    p = cli("install", "--store", str(store), "--key", m.key, "--dest", str(tmp_path / "dätä"), env=c_env)
    assert p.returncode == 0, p.stderr
    clean(p.stderr)
    installed_ok(tmp_path / "dätä", m)
    p = subprocess.run([sys.executable, "-c", LOOKUP, str(store), m.key], check=False, capture_output=True, text=True, cwd=REPO,
                       env={**c_env, "PYTHONPATH": str(REPO)}, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == hashlib.sha256(named.read_bytes()).hexdigest(), p.stderr
