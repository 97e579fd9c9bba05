"""Kills and races across real `llamabundle` processes (issue 12): SIGKILL at chosen points leaves leftovers that
the next run removes (never a live run's); several CLIs at once on one store and cache all end with exit 0
and one result; a full or read-only --out names the path that failed and leaves nothing behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llamabundle import bundle, digest, keys
from llamabundle.store.local import LocalStore
from tests import bundles as tb
from tests.processes import wait_for, wait_text

pytestmark = pytest.mark.race

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
# llama-server answers the load check like the real one; HANG makes it write its pid and sleep
SERVER = b"""#!/bin/sh
if [ -n "$(ls "$(dirname "$0")"/HANG 2>/dev/null)" ]; then echo $$ > "$(cat "$(dirname "$0")"/HANG)"; exec sleep 600; fi
echo "load_backend: loaded CPU backend from $(dirname "$0")/libggml-cpu.so" >&2
echo "Available devices:"
exit 0
"""


def env_for(tmp: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LLAMABUNDLE_CACHE_DIR": str(tmp / "cache"),
            "LLAMABUNDLE_DATA_DIR": str(tmp / "data"), "HOME": str(tmp), "LANG": "C.UTF-8"}


def cli(tmp: Path, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "llamabundle", *map(str, args)], env=env_for(tmp), cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(p: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    out, err = p.communicate(timeout=timeout)
    assert "Traceback" not in out + err and "internal error" not in out + err, out + err
    return p.returncode, out + err


def kill_group(p: subprocess.Popen[str]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.communicate()


def linux_bundle(tmp: Path, *, payload: int = 0, hang: str | None = None) -> tuple[Path, str]:
    """A bundle zip of the shipped Linux recipe (its key), `payload` random bytes in it."""
    files = {"llama-server": SERVER, "LICENSE": b"MIT License\n"}
    roles = {"llama-server": "exe", "LICENSE": "license"}
    if payload:
        files["payload.bin"] = random.Random(7).randbytes(payload)
        roles["payload.bin"] = "runtime"
    if hang is not None:
        files["HANG"] = hang.encode()
        roles["HANG"] = "runtime"
    zip_path, m = tb.make_zip(tmp, files, roles, zip_name="linux-x86_64-cpu.zip", name="linux-x86_64-cpu",
                              inputs=tb.inputs_of(keys.load(LINUX)), executables=("llama-server",))
    return zip_path, m["key"]


def stored(tmp: Path, **kw: object) -> tuple[Path, str]:
    zip_path, key = linux_bundle(tmp, **kw)  # type: ignore[arg-type]
    store = tmp / "store"
    LocalStore(store).publish(zip_path, bundle.read_manifest(_unpacked(tmp, zip_path)))
    return store, key


def _unpacked(tmp: Path, zip_path: Path) -> Path:
    d = tmp / "unpacked"
    if not d.exists():
        bundle.unpack(zip_path, d)
    return d


# ------------------------------------------------------------------------------------------- kills


def test_a_verify_killed_while_llama_server_runs_leaves_its_copy_under_the_cache_and_the_next_run_removes_it(
        tmp_path: Path) -> None:
    pidfile = tmp_path / "server.pid"
    zip_path, _ = linux_bundle(tmp_path, hang=str(pidfile))
    p = cli(tmp_path, "verify", zip_path, "--level", "load")
    server_pid = int(wait_text(pidfile, procs=[p]))  # llama-server has started
    scratch_dir = tmp_path / "cache" / "tmp"
    left = [d for d in scratch_dir.iterdir() if d.name.startswith("verify-")]
    assert len(left) == 1 and left[0].name.startswith(f"verify-{p.pid}-")  # under the cache, named by its owner
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"llamabundle-verify-*{p.pid}*"))
    kill_group(p)  # SIGKILL: nothing can clean up
    if Path(f"/proc/{server_pid}").exists():
        os.kill(server_pid, signal.SIGKILL)
    assert left[0].is_dir()
    good, _ = linux_bundle(tmp_path / "good")
    code, out = finish(cli(tmp_path, "verify", good))
    assert code == 0, out
    assert list(scratch_dir.iterdir()) == []  # the dead run's copy and this run's are gone


def test_a_live_verify_keeps_its_copy_while_another_verify_sweeps(tmp_path: Path) -> None:
    pidfile = tmp_path / "server.pid"
    zip_path, _ = linux_bundle(tmp_path, hang=str(pidfile))
    p = cli(tmp_path, "verify", zip_path, "--level", "load")
    try:
        wait_text(pidfile, procs=[p])  # llama-server has started
        good, _ = linux_bundle(tmp_path / "good")
        code, out = finish(cli(tmp_path, "verify", good))
        assert code == 0, out
        assert [d.name.split("-")[1] for d in (tmp_path / "cache" / "tmp").iterdir()] == [str(p.pid)]
    finally:
        kill_group(p)
        if pidfile.is_file() and pidfile.read_text().strip():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_fetch_killed_mid_unpack_leaves_a_partial_beside_out_that_the_next_fetch_removes(tmp_path: Path) -> None:
    store, key = stored(tmp_path, payload=48 << 20)
    out = tmp_path / "out"
    p = cli(tmp_path, "fetch", key, "--store", store, "--out", out)
    partial = wait_for(lambda: [d for d in tmp_path.glob(".out.partial-*")], name="the unpack to start")
    kill_group(p)
    assert partial[0].exists() and not out.exists()  # type: ignore[index]
    code, text = finish(cli(tmp_path, "fetch", key, "--store", store, "--out", out))
    assert code == 0, text
    assert list(tmp_path.glob(".out.partial-*")) == []
    assert (out / "payload.bin").stat().st_size == 48 << 20


# ------------------------------------------------------------------------------------------- races


def test_three_fetches_of_one_key_into_one_cache_all_succeed(tmp_path: Path) -> None:
    store, key = stored(tmp_path, payload=8 << 20)
    procs = [cli(tmp_path, "fetch", key, "--store", store, "--out", tmp_path / f"out{i}", "--zip") for i in range(3)]
    results = [finish(p) for p in procs]
    assert [c for c, _ in results] == [0, 0, 0], results
    fetched = tmp_path / "cache" / "fetched" / key
    assert sorted(p.name for p in fetched.iterdir()) == ["linux-x86_64-cpu.zip"]  # one zip, no .part
    for i in range(3):
        assert digest.sha256_file(tmp_path / f"out{i}" / "payload.bin") == digest.sha256_file(
            tmp_path / "unpacked" / "payload.bin")


def test_three_fetches_of_one_key_into_one_out_all_succeed_with_one_result(tmp_path: Path) -> None:
    store, key = stored(tmp_path, payload=8 << 20)
    out = tmp_path / "out"
    procs = [cli(tmp_path, "fetch", key, "--store", store, "--out", out) for _ in range(3)]
    results = [finish(p) for p in procs]
    assert [c for c, _ in results] == [0, 0, 0], results  # was 0 6 6: the later two found --out filled
    assert digest.sha256_file(out / "payload.bin") == digest.sha256_file(tmp_path / "unpacked" / "payload.bin")
    assert sorted(p.name for p in out.iterdir()) == ["HANG", "LICENSE", "bundle.json", "llama-server", "payload.bin"] or \
        sorted(p.name for p in out.iterdir()) == ["LICENSE", "bundle.json", "llama-server", "payload.bin"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []
    code, text = finish(cli(tmp_path, "fetch", key, "--store", store, "--out", out))  # again, later: the same
    assert code == 0 and "already holds this bundle" in text, text


def test_what_a_killed_fetch_left_under_another_key_is_removed_by_the_next_fetch(tmp_path: Path) -> None:
    store, key = stored(tmp_path)
    other = tmp_path / "cache" / "fetched" / ("e" * 64)
    other.mkdir(parents=True)
    dead = other / ".linux-x86_64-cpu.zip.4194303-1-abcdef.part"  # an owner that no longer runs (pid past pid_max)
    dead.write_bytes(b"x" * 1000)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        from llamabundle.scratch import start_time

        live = other / f".linux-x86_64-cpu.zip.{sleeper.pid}-{start_time(sleeper.pid)}-abcdef.part"
        live.write_bytes(b"y")
        half_packed = tmp_path / "cache" / "out" / ".linux-x86_64-cpu-0123.zip.part-4194303-1-fedcba"
        half_packed.parent.mkdir(parents=True)
        half_packed.write_bytes(b"z")
        code, text = finish(cli(tmp_path, "fetch", key, "--store", store, "--out", tmp_path / "out"))
        assert code == 0, text
        assert not dead.exists() and not half_packed.exists()  # was kept for good: only its own key's dir was swept
        assert live.exists()  # never a live run's
    finally:
        sleeper.kill()
        sleeper.wait()


def test_two_builds_that_hit_the_store_at_once_both_succeed(tmp_path: Path) -> None:
    store, key = stored(tmp_path, payload=8 << 20)
    procs = [cli(tmp_path, "build", LINUX, "--store", store, "--out", tmp_path / f"out{i}") for i in range(2)]
    results = [finish(p) for p in procs]
    assert [c for c, _ in results] == [0, 0], results
    assert all("cache hit" in text for _, text in results)
    assert not list((tmp_path / "cache").glob("tmp/*"))


# ---------------------------------------------------------------------------------- full and read-only disks


@pytest.fixture()
def tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """mount(8) a small tmpfs (root only): `mount("ro")`, `mount("size=1m")`."""
    mounted: list[Path] = []

    def mount(opts: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        d = tmp_path / f"mnt{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in reversed(mounted):
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_fetch_into_a_full_out_filesystem_names_out_and_leaves_nothing(tmp_path: Path, tmpfs) -> None:  # type: ignore[no-untyped-def]
    store, key = stored(tmp_path, payload=4 << 20)
    full = tmpfs("size=1m")
    code, text = finish(cli(tmp_path, "fetch", key, "--store", store, "--out", full / "out"))
    assert code == 6, text
    assert f"{full}/" in text and "No space left on device" in text and "(in --out)" in text
    assert str(tmp_path / "cache") not in text.split("fix:")[0]  # the full disk is --out's, not the cache's
    assert list(full.iterdir()) == []


def test_fetch_into_a_read_only_out_is_refused_before_any_work(tmp_path: Path, tmpfs) -> None:  # type: ignore[no-untyped-def]
    store, key = stored(tmp_path)
    ro = tmpfs("ro,size=1m")
    code, text = finish(cli(tmp_path, "fetch", key, "--store", store, "--out", ro / "out"))
    assert code == 2, text
    assert f"--out {ro}/out cannot be written" in text and "read-only" in text
    assert not (tmp_path / "cache" / "fetched").exists()


def test_a_cache_on_a_full_disk_names_the_cache(tmp_path: Path, tmpfs) -> None:  # type: ignore[no-untyped-def]
    store, key = stored(tmp_path, payload=4 << 20)
    full = tmpfs("size=1m")
    env = {**env_for(tmp_path), "LLAMABUNDLE_CACHE_DIR": str(full / "cache")}
    r = subprocess.run([sys.executable, "-m", "llamabundle", "fetch", key, "--store", str(store), "--out",
                        str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 6, r.stderr
    assert f"{full}/cache" in r.stderr and "Traceback" not in r.stderr
    assert "(in the cache, LLAMABUNDLE_CACHE_DIR)" in r.stderr
    assert not (tmp_path / "out").exists()
    assert not [p for p in (full / "cache" / "fetched" / key).iterdir()] if (full / "cache" / "fetched" / key).exists() else True


def test_install_onto_a_full_disk_is_the_disk_not_the_bundle(tmp_path: Path, tmpfs) -> None:  # type: ignore[no-untyped-def]
    store, key = stored(tmp_path, payload=4 << 20)
    full = tmpfs("size=1m")
    code, text = finish(cli(tmp_path, "install", "--key", key, "--store", store, "--dest", full / "apps"))
    assert code == 6, text  # was 5, "bundle invalid": the bundle is fine
    assert f"{full}/apps/" in text and "No space left on device" in text and "(in the install root, --dest)" in text
    assert "bundle_invalid" not in text
    left = [p.relative_to(full).as_posix() for p in full.rglob("*")]
    # what it downloaded before the disk filled stays in the blob cache, each file whole and checked (the next
    # try reuses it); no partial file
    kept = [p for p in left if p.startswith("apps/blobs/")]
    assert all(digest.sha256_file(full / p) == Path(p).name.removesuffix(".x") for p in kept), kept
    assert [p for p in left if not p.startswith(("apps/bundles/.locks", "apps/blobs/")) and
            p not in ("apps", "apps/blobs", "apps/bundles", "apps/bundles/linux-x86_64-cpu")] == []


def test_verify_of_a_zip_needs_no_cache_so_a_read_only_one_does_not_stop_it(tmp_path: Path, tmpfs) -> None:  # type: ignore[no-untyped-def]
    zip_path, key = linux_bundle(tmp_path)
    ro = tmpfs("ro,size=1m")
    env = {**env_for(tmp_path), "LLAMABUNDLE_CACHE_DIR": str(ro / "cache")}
    for level in ("static", "load"):
        r = subprocess.run([sys.executable, "-m", "llamabundle", "verify", str(zip_path), "--level", level], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr  # was 2: "cannot make a scratch directory in <cache>/tmp"
        assert f"key {key[:12]}" in r.stdout


# ---------------------------------------------------------------------------------- GitHub, through the CLI


def _github_with_the_linux_bundle(tmp: Path):  # type: ignore[no-untyped-def]
    from llamabundle.store.github import GitHubStore
    from tests.fakegithub import FakeGitHub
    from tests.ghstore import REPO, TOKEN

    zip_path, key = linux_bundle(tmp)
    recipe = keys.load(LINUX)
    gh = FakeGitHub(REPO, token=TOKEN)
    gh.__enter__()
    GitHubStore(REPO, api_url=gh.api_url, token=TOKEN, tags={key: keys.resolve(recipe).tag}, sleep=lambda _s: None).publish(
        zip_path, bundle.read_manifest(_unpacked(tmp, zip_path)))
    env = {**env_for(tmp), "GITHUB_API_URL": gh.api_url, "GITHUB_TOKEN": TOKEN}
    return gh, env, f"github:{REPO}", key


def test_check_over_github_retries_a_dropped_manifest_and_condemns_only_what_arrived_wrong(tmp_path: Path) -> None:
    gh, env, store, key = _github_with_the_linux_bundle(tmp_path)
    try:
        def check() -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "llamabundle", "check", str(LINUX), "--store", store],
                                  env=env, capture_output=True, text=True, timeout=120)

        gh.drop_asset("bundle.json", after=100, times=1)  # the connection drops inside bundle.json's body, once
        r = check()
        assert r.returncode == 0 and r.stdout.startswith(f"hit   {key}"), r.stdout + r.stderr
        assert [d.headers.get("range") for d in gh.downloads("bundle.json")][-2:] == [None, "bytes=100-"]

        gh.drop_asset("bundle.json", after=100, times=None)  # it drops every time: a network error, not a verdict
        r = check()
        assert r.returncode == 6, r.stderr
        assert "connection dropped" in r.stderr and "delete" not in r.stderr and "Traceback" not in r.stderr
    finally:
        gh.__exit__(None, None, None)
