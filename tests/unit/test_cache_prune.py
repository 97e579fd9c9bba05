"""The cache's bound (issue 30): LLAMABUNDLE_CACHE_MAX (default 50G) holds it after every build and fetch, and
`llamabundle cache list|prune` show and trim it. A prune removes the least recently used fetched bundles,
built zips (with their siblings), build trees and downloads; never this run's key, one used in the last two
minutes, nor a build tree whose build lock another process holds. Every fetched zip stayed for good before."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from filelock import FileLock

from llamabundle import cache
from llamabundle.errors import UsageError
from llamabundle.log import Log
from llamabundle.settings import DEFAULT_CACHE_MAX, Settings
from tests import bundles as tb
from tests.clicontract import valid
from tests.clirun import run

OLD = time.time() - 10 * 86400


def _fill(c: Path, rel: str, size: int, age_days: float) -> Path:
    p = c / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if rel.endswith("/"):
        p.mkdir(parents=True, exist_ok=True)
        (p / "data.bin").write_bytes(b"\0" * size)
    else:
        p.write_bytes(b"\0" * size)
    t = time.time() - age_days * 86400
    os.utime(p, (t, t))
    return p


def test_prune_removes_the_least_recently_used_first_and_spares_what_is_in_use(tmp_path: Path) -> None:
    c = tmp_path / "cache"
    source = _fill(c, "src/" + "f" * 40 + "/", 5000, 30)  # sources, toolkits, downloads: while no build uses them
    oldest = _fill(c, "fetched/" + "a" * 64 + "/", 1000, 9)
    zip_ = _fill(c, "out/linux-x86_64-cpu-bbbbbbbbbbbb.zip", 1000, 8)
    ops = _fill(c, "out/linux-x86_64-cpu-bbbbbbbbbbbb.test-backend-ops", 400, 8)  # opscheck.sibling_tool's name
    preload = _fill(c, "out/linux-x86_64-cpu-bbbbbbbbbbbb.test-backend-ops.rpc-preload.so", 100, 8)
    toolkit = _fill(c, "toolkits/cuda-13.0.2-linux-x86_64-pypi-0123456789abcdef/", 2000, 7.5)
    busy = _fill(c, "build/" + "c" * 16 + "-12345678/", 1000, 7)
    kept = _fill(c, "fetched/" + "d" * 64 + "/", 1000, 6)  # this run's key
    download = _fill(c, "downloads/cuda_nvcc.tar.xz", 1000, 5)
    stream = _fill(c, "deflated/" + "9" * 64 + ".z6-1.2.13", 1000, 4)  # a large member's deflate stream (pack)
    fresh = _fill(c, "fetched/" + "e" * 64 + "/", 1000, 0)  # used a moment ago: perhaps by a run going on now
    assert [e.path for e in cache.entries(c)] == [source, oldest, zip_, toolkit, busy, kept, download, stream, fresh]
    (c / "locks").mkdir()
    with FileLock(str(cache.build_lock(c, "c" * 64))), cache.in_use(c):  # another run builds in that tree
        removed = cache.prune(c, limit=0, keep=["d" * 64])
    assert [e.path for e in removed] == [oldest, zip_]
    assert removed[1].size == 1500 and not ops.exists() and not preload.exists()  # the zip's siblings go with it
    assert not oldest.exists() and not zip_.exists()
    assert busy.exists() and kept.exists() and fresh.exists() and source.exists() and toolkit.exists() and download.exists()
    assert stream.exists(), "shared by builds: removed only while no run holds the cache in use"
    assert not any((c / "tmp").iterdir())  # what was moved aside to be removed is gone too
    removed = cache.prune(c, limit=0)  # the locks released: the build tree, the source, toolkit and download go now
    assert [e.path for e in removed] == [source, toolkit, busy, kept, download, stream] and fresh.exists()


HOLDER = """\
import sys, time
from pathlib import Path
from llamabundle import cache
with cache.in_use(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(300)
"""


def test_a_source_used_by_a_running_build_in_another_process_stays(tmp_path: Path) -> None:
    """The in-use lock is an flock: a process that holds it shared (a build: pipeline.making) keeps every source,
    toolkit and download from any prune; once it is gone (killed, even), they go."""
    import subprocess
    import sys

    c = tmp_path / "cache"
    source = _fill(c, "src/" + "f" * 40 + "/", 5000, 30)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(c)], cwd=Path(__file__).resolve().parents[2],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert cache.prune(c, limit=0) == [] and source.exists()
    finally:
        holder.kill()
        holder.wait()
    assert [e.path for e in cache.prune(c, limit=0)] == [source] and not source.exists()


def test_a_build_holds_the_in_use_lock_while_it_makes_its_bundle(tmp_path: Path) -> None:
    from llamabundle.pipeline import making

    c = tmp_path / "cache"
    source = _fill(c, "src/" + "f" * 40 + "/", 5000, 30)
    with making(Settings.from_env({"LLAMABUNDLE_CACHE_DIR": str(c)}), "a" * 64, Log(quiet=True)):
        assert cache.prune(c, limit=0) == [] and source.exists()
    assert [e.path for e in cache.prune(c, limit=0)] == [source]


def test_what_a_build_uses_is_marked_used_and_nothing_outside_the_cache_is_touched(tmp_path: Path) -> None:
    c = tmp_path / "cache"
    root = _fill(c, "toolkits/cuda-13.0.2-x/", 10, 30)
    mine = tmp_path / "my-cuda"
    mine.mkdir()
    os.utime(mine, (OLD, OLD))
    cache.touch_used(c, root / "bin" / "nvcc")
    cache.touch_used(c, mine)
    assert time.time() - root.stat().st_mtime < 60 and mine.stat().st_mtime == pytest.approx(OLD)


def test_prune_stops_at_the_limit_and_a_dry_run_removes_nothing(tmp_path: Path) -> None:
    c = tmp_path / "cache"
    a = _fill(c, "fetched/" + "a" * 64 + "/", 1000, 3)
    b = _fill(c, "fetched/" + "b" * 64 + "/", 1000, 2)
    assert [e.path for e in cache.prune(c, limit=1500, dry_run=True)] == [a] and a.exists()
    assert [e.path for e in cache.prune(c, limit=1500)] == [a] and b.exists()
    assert cache.prune(c, limit=1500) == []


@pytest.mark.parametrize(("raw", "want"), [("", DEFAULT_CACHE_MAX), ("500M", 500 << 20), ("50G", 50 << 30),
                                           ("1.5T", int(1.5 * (1 << 40))), ("123", 123), ("off", None)])
def test_the_bound_is_read_from_the_environment(raw: str, want: int | None) -> None:
    assert Settings.from_env({"LLAMABUNDLE_CACHE_MAX": raw}).cache_max == want


@pytest.mark.parametrize("raw", ["lots", "-1G", "G", "nan"])
def test_a_bad_bound_is_a_usage_error(raw: str) -> None:
    with pytest.raises(UsageError, match="LLAMABUNDLE_CACHE_MAX"):
        Settings.from_env({"LLAMABUNDLE_CACHE_MAX": raw})


def test_the_cache_is_measured_at_most_every_few_minutes(tmp_path: Path) -> None:
    c = tmp_path / "cache"
    assert cache.bound_due(c, now=1000.0) and not cache.bound_due(c, now=1000.0 + cache.BOUND_EVERY - 1)
    assert cache.bound_due(c, now=1000.0 + cache.BOUND_EVERY + 1)


def test_fetch_holds_the_cache_to_its_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from llamabundle.store.local import LocalStore

    c = tmp_path / "cache"
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(c))
    store = LocalStore(tmp_path / "store")
    keys = []
    for tag in ("one", "two"):
        z, m = tb.make_zip(tmp_path / tag, {"LICENSE": os.urandom(100_000)}, {"LICENSE": "license"},
                           inputs=tb.inputs_for(tag), name=f"b-{tag}")
        from llamabundle import bundle
        store.publish(z, bundle.manifest_mod.loads(json.dumps(m)))
        keys.append(m["key"])
    code, out, err = run(capsys, "fetch", keys[0], "--store", store.root, "--out", tmp_path / "o1", "--zip")
    assert code == 0, err
    first = c / "fetched" / keys[0]
    os.utime(first, (OLD, OLD))  # used long ago
    monkeypatch.setenv("LLAMABUNDLE_CACHE_MAX", "150K")  # room for one fetched zip
    code, out, err = run(capsys, "fetch", keys[1], "--store", store.root, "--out", tmp_path / "o0", "--zip")
    assert code == 0 and "cache over" not in err and first.exists()  # measured at most every BOUND_EVERY seconds
    shutil.rmtree(tmp_path / "o0")
    stamp = c / "locks" / "bound.stamp"
    os.utime(stamp, (OLD, OLD))  # the last measure long ago
    code, out, err = run(capsys, "fetch", keys[1], "--store", store.root, "--out", tmp_path / "o2", "--zip")
    assert code == 0, err
    assert "cache over LLAMABUNDLE_CACHE_MAX" in err and f"fetched/{keys[0]}" in err
    assert not first.exists() and (c / "fetched" / keys[1]).is_dir()  # this run's stays


def test_cache_list_and_prune_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    c = tmp_path / "cache"
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(c))
    a = _fill(c, "fetched/" + "a" * 64 + "/", 1000, 3)
    _fill(c, "src/" + "f" * 40 + "/", 700, 3)
    _fill(c, "ui/" + "9" * 64 + "/", 300, 2)  # a built web UI (webui.py)
    code, out, err = run(capsys, "cache", "list", "--json")
    assert code == 0, err
    listed = valid("cache-list", json.loads(out))
    assert listed["areas"]["fetched"] == 1000 and listed["areas"]["src"] == 700 and listed["areas"]["ui"] == 300
    assert [e["path"] for e in listed["entries"]] == [str(a), str(c / "src" / ("f" * 40)), str(c / "ui" / ("9" * 64))]
    code, out, err = run(capsys, "cache", "prune", "--max", "0", "--dry-run", "--json")
    assert code == 0 and valid("cache-prune", json.loads(out))["removed"][0]["path"] == str(a) and a.exists()
    code, out, err = run(capsys, "cache", "prune", "--max", "0")
    assert code == 0 and f"removed fetched/{a.name}" in out and not a.exists()
    assert not (c / "src").exists() or not any((c / "src").iterdir())  # no build uses it: it goes too
    assert not (c / "ui").exists() or not any((c / "ui").iterdir())  # a kept web UI too
    code, out, err = run(capsys, "cache", "prune", "--max", "lots")
    assert code == 2 and "not a size" in err
