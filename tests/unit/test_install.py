"""install / list / uninstall (DESIGN §5): real bundles from a real local store; tampered and crafted
bundles refused with nothing written; a SIGKILL at each step of an install leaves the old install usable."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from llamabundle import bundle, keys
from llamabundle.bundle.manifest import Manifest
from llamabundle.errors import UsageError, VerifyError
from llamabundle.reasons import Reason
from llamabundle.runtime.install import (
    BUNDLES,
    POINTER,
    BundleInvalid,
    check_bundle,
    data_root,
    install_bundle,
    list_installed,
    uninstall,
)
from llamabundle.settings import Settings
from llamabundle.store.local import LocalStore
from tests.installs import plant, recipe_bundle, slot_entries
from tests.probing import (
    COMMIT,
    NAME,
    QUIET,
    REPO,
    SERVERS,
    cli,
    make_stage,
    make_zip,
    publish,
)
from tests.processes import wait_text

POINTS = ["downloaded", "extracted", "verified", "swapping", "swapped"]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.fixture()
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def install(store: LocalStore, key: str, root: Path, **kw: Any) -> Any:
    return install_bundle(store, key, root=root, log=QUIET, **kw)


# ------------------------------------------------------------------------------------ install / list / uninstall


def test_install_checks_and_lists_the_bundle(tmp_path: Path, store: LocalStore) -> None:
    m = publish(store.root, tmp_path)
    root = tmp_path / "data"
    out = install(store, m.key, root, commit=COMMIT, toolkit="13.0.2")
    assert not out.reused and out.replaced is None
    inst = out.installed
    assert (inst.name, inst.key, inst.backends) == (NAME, m.key, ["cpu", "cuda"])
    assert inst.path.parent == root / BUNDLES / NAME and inst.path.name.startswith(m.key[:12])
    assert bundle.read_manifest(inst.path) == m == inst.manifest
    assert os.access(inst.path / "llama-server", os.X_OK)
    assert slot_entries(root) == sorted([POINTER, inst.path.name])
    assert json.loads((root / BUNDLES / NAME / POINTER).read_text())["key"] == m.key
    assert list_installed(root) == [inst]
    assert inst.cuda == {"toolkit": "13.0.2", "driver_floor": "572.61", "archs": {"sass": ["90"], "ptx": ["75"]}}
    assert inst.to_json() == {"name": NAME, "key": m.key, "path": str(inst.path), "installed_at": inst.installed_at,
                              "platform": "linux-x86_64", "commit": COMMIT, "backends": ["cpu", "cuda"],
                              "toolkit": "13.0.2", "driver_floor": "572.61"}
    again = install(store, m.key, root)
    assert again.reused and again.installed == inst


def test_a_new_key_replaces_the_old_install_only_after_it(tmp_path: Path, store: LocalStore) -> None:
    root = tmp_path / "data"
    old = publish(store.root, tmp_path, salt="old")
    new = publish(store.root, tmp_path, salt="new")
    first = install(store, old.key, root).installed
    out = install(store, new.key, root)
    assert out.replaced == old.key and out.installed.key == new.key
    assert not first.path.exists()
    assert slot_entries(root) == sorted([POINTER, out.installed.path.name])
    assert [i.key for i in list_installed(root)] == [new.key]


def test_an_install_that_was_changed_on_disk_is_installed_again(tmp_path: Path, store: LocalStore) -> None:
    m = publish(store.root, tmp_path)
    root = tmp_path / "data"
    inst = install(store, m.key, root).installed
    (inst.path / "libggml-cuda.so").write_bytes(b"changed")
    out = install(store, m.key, root)
    assert not out.reused and out.replaced == m.key
    check_bundle(out.installed.path, key=m.key, platform="linux-x86_64")
    assert not inst.path.exists()


def test_uninstall_by_key_prefix_or_name(tmp_path: Path, store: LocalStore) -> None:
    root = tmp_path / "data"
    a = publish(store.root, tmp_path)
    b = publish(store.root, tmp_path, name="linux-x86_64-cpu", backends=("cpu",))
    install(store, a.key, root)
    install(store, b.key, root)
    assert [i.name for i in list_installed(root)] == ["linux-x86_64-cpu", NAME]
    with pytest.raises(UsageError) as e:
        uninstall(root, "nothing")
    assert e.value.exit_code == 2 and "no installed bundle matches 'nothing'" in e.value.what
    assert uninstall(root, a.key[:8]).key == a.key
    assert not (root / BUNDLES / NAME).exists()
    assert uninstall(root, "linux-x86_64-cpu").key == b.key
    assert list_installed(root) == []


def test_uninstall_removes_nothing_when_the_install_changed_before_it_got_the_lock(
        tmp_path: Path, store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    import llamabundle.runtime.install as install_mod

    root = tmp_path / "data"
    a = publish(store.root, tmp_path, salt="a")
    b = publish(store.root, tmp_path, salt="b")
    install(store, a.key, root)
    real = install_mod._slot_lock

    def late(*args: Any, **kw: Any) -> Any:  # another install replaces a by b just before uninstall locks
        monkeypatch.setattr(install_mod, "_slot_lock", real)
        install(store, b.key, root)
        return real(*args, **kw)

    monkeypatch.setattr(install_mod, "_slot_lock", late)
    with pytest.raises(UsageError) as e:
        uninstall(root, a.key)
    assert e.value.exit_code == 2
    assert e.value.what == f"'{a.key}' is no longer installed: {NAME} is now {b.key[:12]}; nothing was removed"
    [kept] = list_installed(root)
    assert kept.key == b.key
    check_bundle(kept.path, key=b.key, platform="linux-x86_64")
    assert slot_entries(root) == sorted([POINTER, kept.path.name])


def test_data_root_prefers_dest_then_the_environment(tmp_path: Path) -> None:
    env = Settings.from_env({"LLAMABUNDLE_DATA_DIR": str(tmp_path / "env")})
    assert data_root(env, tmp_path / "dest") == tmp_path / "dest"
    assert data_root(env) == tmp_path / "env"
    assert data_root(Settings.from_env({})).name == "llamabundle"


def test_a_missing_key_is_a_usage_error(tmp_path: Path, store: LocalStore) -> None:
    with pytest.raises(UsageError) as e:
        install(store, "ab" * 32, tmp_path / "data")
    assert "no bundle with key abababababab" in e.value.what
    assert not (tmp_path / "data").exists()


# ------------------------------------------------------------------------------------ refused bundles
# A zip whose members disagree with its manifest cannot be published (the store reads each file into a blob and
# checks it): these entries are written by hand (tests.installs.plant), as a tampering hand, another tool or a
# store of an earlier llamabundle (no blobs) would leave them, so the install downloads and unpacks the zip.


def rezip(src: Path, dst: Path, *, change: dict[str, bytes] | None = None, add: dict[str, bytes] | None = None) -> Path:
    """The same zip with members changed or added (bundle.json untouched)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info, (change or {}).get(info.filename, zin.read(info)))
        for name, data in (add or {}).items():
            zout.writestr(name, data)
    return dst


def assert_refused(store: LocalStore, key: str, root: Path, what: str, **kw: Any) -> BundleInvalid:
    before = tree(root)
    with pytest.raises(BundleInvalid) as e:
        install(store, key, root, **kw)
    assert e.value.exit_code == 5 and e.value.reason is Reason.BUNDLE_INVALID
    assert "(bundle_invalid)" in e.value.what and what in e.value.what, e.value.what
    after = [p for p in tree(root) if ".locks" not in p and p != BUNDLES and p != f"{BUNDLES}/{NAME}"]
    assert after == [p for p in before if ".locks" not in p and p != BUNDLES and p != f"{BUNDLES}/{NAME}"]
    return e.value


def test_a_tampered_bundle_is_refused_and_the_old_install_kept(tmp_path: Path, store: LocalStore) -> None:
    root = tmp_path / "data"
    good = publish(store.root, tmp_path, salt="good")
    kept = install(store, good.key, root).installed
    zip_path, m = make_zip(tmp_path, salt="bad")
    tampered = rezip(zip_path, tmp_path / "tampered.zip", change={"llama-server": SERVERS["ok"].replace(b"H200", b"H201")})
    plant(store.root, m.key, tampered, m.text())  # the store's own digest is of the tampered zip: only the manifest catches it
    assert_refused(store, m.key, root, "llama-server does not match its sha256")
    assert list_installed(root) == [kept]
    check_bundle(kept.path, key=good.key, platform="linux-x86_64")


def test_an_extra_file_is_refused(tmp_path: Path, store: LocalStore) -> None:
    zip_path, m = make_zip(tmp_path)
    plant(store.root, m.key, rezip(zip_path, tmp_path / "extra.zip", add={"libevil.so": b"x"}), m.text())
    assert_refused(store, m.key, tmp_path / "data", "libevil.so is in the bundle but not in bundle.json")


@pytest.mark.parametrize(("kw", "expect", "what"), [
    ({"platform": "windows-x86_64"}, {}, "it is built for windows-x86_64, not linux-x86_64"),
    ({}, {"commit": "1" * 40}, f"holds llama.cpp {COMMIT}, expected 1111"),
    ({}, {"toolkit": "12.8.1"}, "built with CUDA 13.0.2, expected 12.8.1"),
])
def test_expectations_are_checked(tmp_path: Path, store: LocalStore, kw: dict[str, str], expect: dict[str, str],
                                  what: str) -> None:
    m = publish(store.root, tmp_path, **kw)
    assert_refused(store, m.key, tmp_path / "data", what, **expect)


def test_a_key_that_does_not_match_the_bundle_is_refused(tmp_path: Path, store: LocalStore) -> None:
    zip_path, m = make_zip(tmp_path)
    other = "ef" * 32
    plant(store.root, other, zip_path, m.text())  # a store entry under another key
    assert_refused(store, other, tmp_path / "data", f"names key {m.key[:12]}, not efefefefefef")
    stage, m2 = make_stage(tmp_path)  # a manifest whose key is not the sha256 of its inputs
    liar = {**m2.to_json(), "key": other}
    (stage / bundle.MANIFEST).write_text(json.dumps(liar))
    z2 = bundle.pack(stage, tmp_path / "liar.zip", source_date_epoch=0)
    plant(tmp_path / "store2", other, z2, json.dumps(liar))
    assert_refused(LocalStore(tmp_path / "store2"), other, tmp_path / "data", "not the sha256 of the inputs")


def test_a_zip_holding_another_bundle_than_its_store_entry_is_refused(tmp_path: Path, store: LocalStore) -> None:
    zip_b, b = make_zip(tmp_path, salt="b")
    _zip_a, a = make_zip(tmp_path, salt="a")
    plant(store.root, a.key, zip_b, a.text())  # the entry's bundle.json is a's, the zip is b's
    assert_refused(store, a.key, tmp_path / "data", f"names key {b.key[:12]}, not {a.key[:12]}")


def crafted(tmp: Path, member: zipfile.ZipInfo | str, data: bytes) -> tuple[Path, Manifest]:
    """A valid bundle zip plus one hostile member, and the bundle's manifest."""
    zip_path, m = make_zip(tmp)
    out = tmp / f"crafted-{len(list(tmp.glob('crafted-*')))}.zip"
    with zipfile.ZipFile(zip_path) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info))
        zout.writestr(member, data)
    return out, m


def _unix(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = mode << 16
    return info


@pytest.mark.parametrize(("member", "data", "what"), [
    ("../escape.txt", b"evil", "escapes the destination with '..'"),
    ("sub/../../escape.txt", b"evil", "escapes the destination with '..'"),
    ("/tmp/llamabundle-install-evil", b"evil", "has an absolute path"),
    (_unix("libggml-base.so", stat.S_IFLNK | 0o777), b"/etc/passwd", "is a symbolic link"),
    (_unix("dev-null", stat.S_IFCHR | 0o666), b"", "is a device, pipe or socket"),
    (_unix("fifo", stat.S_IFIFO | 0o644), b"", "is a device, pipe or socket"),
    ("bomb.bin", b"\0" * (8 << 20), "times (more than 200)"),
])
def test_crafted_archives_are_refused_with_nothing_written(tmp_path: Path, store: LocalStore, member: Any, data: bytes,
                                                           what: str) -> None:
    root = tmp_path / "work" / "data"
    zip_path, m = crafted(tmp_path, member, data)
    plant(store.root, m.key, zip_path, m.text())
    outside = tree(tmp_path / "work")
    assert_refused(store, m.key, root, what)
    assert [p for p in tree(tmp_path / "work") if ".locks" not in p] == [p for p in outside if ".locks" not in p] + \
        [p for p in ["data", "data/bundles", f"data/bundles/{NAME}"] if p not in outside]
    assert not (tmp_path / "work" / "escape.txt").exists() and not Path("/tmp/llamabundle-install-evil").exists()


def test_a_declared_size_bomb_is_refused(tmp_path: Path, store: LocalStore) -> None:
    zip_path, m = crafted(tmp_path, "big.bin", os.urandom(100_000))  # incompressible: only the declared size is absurd
    data = bytearray(zip_path.read_bytes())
    for sig, off in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):  # declare 4 GiB - 1 in both headers
        at = 0
        while (at := data.find(sig, at)) >= 0:
            name_at = at + (30 if sig == b"PK\x03\x04" else 46)
            if data[name_at:name_at + 7] == b"big.bin":
                data[at + off:at + off + 4] = b"\xff\xff\xff\xfe"
            at += 4
    zip_path.write_bytes(bytes(data))
    plant(store.root, m.key, zip_path, m.text())
    assert_refused(store, m.key, tmp_path / "data", "more than 200")


def test_the_cli_refuses_a_tampered_bundle_with_exit_5(tmp_path: Path, store: LocalStore) -> None:
    zip_path, m = make_zip(tmp_path)
    plant(store.root, m.key, rezip(zip_path, tmp_path / "t.zip", change={"LICENSE": b"MIT Licensf\n"}), m.text())  # same size
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")}
    p = cli("install", "--store", str(store.root), "--key", m.key, "--dest", str(tmp_path / "data"), env=env)
    assert p.returncode == 5, p.stderr
    assert f"error: bundle {m.key[:12]} refused (bundle_invalid): LICENSE does not match its sha256" in p.stderr
    assert "Traceback" not in p.stderr
    assert list_installed(tmp_path / "data") == []


def test_cli_install_by_recipe_list_and_uninstall(tmp_path: Path, store: LocalStore) -> None:
    recipe = keys.load(REPO / "recipes" / "linux-x86_64-cpu.yaml")
    zip_path, m = recipe_bundle(tmp_path, REPO / "recipes" / "linux-x86_64-cpu.yaml")
    assert m.key == keys.resolve(recipe).key
    store.publish(zip_path, m)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache"),
           "LLAMABUNDLE_DATA_DIR": str(tmp_path / "data")}
    p = cli("install", "--store", str(store.root), "--recipe", str(REPO / "recipes" / "linux-x86_64-cpu.yaml"), "--json", env=env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert (out["key"], out["name"], out["reused"], out["commit"]) == (keys.resolve(recipe).key, recipe.name, False, recipe.llama_cpp.commit)
    p = cli("list", "--json", env=env)
    assert [b["key"] for b in json.loads(p.stdout)["bundles"]] == [keys.resolve(recipe).key]
    p = cli("install", "--store", str(store.root), "--key", keys.resolve(recipe).key, env=env)
    assert p.stdout.startswith(f"already installed and intact: {recipe.name} ({keys.resolve(recipe).key[:12]})")
    p = cli("install", "--store", str(store.root), "--key", keys.resolve(recipe).key, "--recipe", "x.yaml", env=env)
    assert p.returncode == 2 and "exactly one of --recipe and --key" in p.stderr
    p = cli("uninstall", keys.resolve(recipe).key, env=env)
    assert p.returncode == 0 and p.stdout == f"removed {recipe.name} ({keys.resolve(recipe).key[:12]})\n"
    assert cli("list", env=env).stdout.startswith("no bundles installed in ")


# ------------------------------------------------------------------------------------ SIGKILL at every step


KILL_SCRIPT = """
import sys, time
from pathlib import Path
from llamabundle.log import Log
from llamabundle.runtime.install import install_bundle
from llamabundle.store.local import LocalStore
store, key, root, point, marker = sys.argv[1:6]
def hook(at):
    if at == point:
        Path(marker).write_text(at)
        time.sleep(600)
install_bundle(LocalStore(Path(store)), key, root=Path(root), log=Log(quiet=True), hook=hook)
"""


@pytest.mark.race
@pytest.mark.parametrize("point", POINTS)
def test_sigkill_at_any_step_leaves_a_usable_install(tmp_path: Path, store: LocalStore, point: str) -> None:
    root = tmp_path / "data"
    old = publish(store.root, tmp_path, salt="old")
    new = publish(store.root, tmp_path, salt="new")
    kept = install(store, old.key, root).installed
    marker = tmp_path / "at"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(store.root), new.key, str(root), point, str(marker)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_text(marker, procs=[proc])
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(60)
    assert proc.returncode == -signal.SIGKILL
    # The install the pointer names is complete and checks: the old one, or (once the pointer moved) the new one.
    [now] = list_installed(root)
    expected = new if point == "swapped" else old
    assert now.key == expected.key
    check_bundle(now.path, key=expected.key, platform="linux-x86_64")
    leftovers = set(slot_entries(root)) - {POINTER, now.path.name}
    assert leftovers, "the killed install left something behind for the next one to clean"
    if point != "swapped":
        assert now == kept
    # A later install takes the lock the dead process held, cleans up and succeeds.
    out = install(store, new.key, root)
    assert out.installed.key == new.key
    assert slot_entries(root) == sorted([POINTER, out.installed.path.name])
    check_bundle(out.installed.path, key=new.key, platform="linux-x86_64")


@pytest.mark.race
def test_an_interrupted_install_cleans_up_after_itself(tmp_path: Path, store: LocalStore) -> None:
    root = tmp_path / "data"
    old = publish(store.root, tmp_path, salt="old")
    new = publish(store.root, tmp_path, salt="new")
    kept = install(store, old.key, root).installed

    def stop(at: str) -> None:
        if at == "swapping":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        install(store, new.key, root, hook=stop)
    assert list_installed(root) == [kept]
    assert slot_entries(root) == sorted([POINTER, kept.path.name])


def test_verify_error_is_the_base_of_bundle_invalid() -> None:
    assert issubclass(BundleInvalid, VerifyError)
