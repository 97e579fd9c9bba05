"""The source cache re-proven before use (issue 12, item 4): a cached tree is compared with what its marker
recorded when it was proven (a stat walk, nothing read); an emptied, added-to or altered tree, or a damaged
or old marker, is a cache miss that fetches the source again, never a crash nor a tree handed to a build.
Fetch directories in <cache>/tmp name their owner; those of dead owners (real processes, killed) are removed
by the next fetch, those of live ones are kept."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llamabundle import scratch
from llamabundle.errors import SourceError
from llamabundle.recipe import Recipe
from llamabundle.settings import Settings
from llamabundle.source import (
    MARKER,
    TMP_PREFIX,
    MarkerDamaged,
    SourceMismatch,
    cached_source,
    fetch_source,
    parse_marker,
    record_tree,
    tree_difference,
)
from tests.gitsources import FILES, make_repo, quiet_log, settings_for, tree_files, write_recipe

REPO = Path(__file__).resolve().parents[2]


def cached(tmp: Path) -> tuple[Recipe, Settings, Path]:
    """A path: source fetched once into a fresh cache: (recipe, settings, the cached tree)."""
    checkout = tmp / "checkout"
    sha = make_repo(checkout)
    settings = settings_for(tmp, "http://127.0.0.1:9")
    recipe = write_recipe(tmp / "r.yaml", sha, [f"path: {checkout}"])
    tree = fetch_source(recipe, settings, quiet_log()[0])
    assert tree.path == settings.cache_dir / "src" / sha
    return recipe, settings, tree.path


def leftovers(settings: Settings) -> list[str]:
    tmp = settings.cache_dir / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []


def assert_fetched_again(recipe: Recipe, settings: Settings, path: Path, why: str) -> str:
    """The next fetch does not use the cached tree: it says why, proves the source again and leaves a
    complete tree with a fresh marker, and nothing in <cache>/tmp."""
    assert cached_source(recipe, settings) is None  # a miss, never an exception
    log, out = quiet_log()
    tree = fetch_source(recipe, settings, log)
    text = out.getvalue()
    assert f"warning: source cache {path} is not used: " in text
    assert why in text, text
    assert "fetching the source again" in text
    assert "proven from path:" in text and "from the cache" not in text
    got = tree_files(tree.path)
    marker = json.loads(got.pop(MARKER))
    assert got == FILES and marker["format"] == 2 and marker["tree"]["files"] == len(FILES)
    assert leftovers(settings) == []
    again_log, again = quiet_log()
    assert fetch_source(recipe, settings, again_log) == tree and "from the cache" in again.getvalue()
    assert "warning" not in again.getvalue()
    return text


# ------------------------------------------------------------------------------------ the tree changed


def _empty(root: Path) -> None:
    for p in root.iterdir():
        if p.name != MARKER:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _rewrite_same_size(root: Path) -> None:
    f = root / "src" / "llama.cpp"
    st = f.stat()
    f.write_bytes(f.read_bytes().replace(b"1", b"7"))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a second later, as an editor would


def _to_symlink(root: Path) -> None:
    (root / "LICENSE").unlink()
    (root / "LICENSE").symlink_to("CMakeLists.txt")


CHANGES = {
    "emptied": (_empty, (f"{len(FILES)} files ({sum(map(len, FILES.values()))} bytes) were proven, 0 (0 bytes) are "
                         f"there: {len(FILES)} missing, 0 added, 0 changed (missing CMakeLists.txt; missing LICENSE; "
                         "missing ggml/include/ggml.h)")),
    "a file added": (lambda r: (r / "src" / "evil.c").write_bytes(b"/* not in the commit */\n"),
                     "0 missing, 1 added, 0 changed (added src/evil.c)"),
    "a file removed": (lambda r: (r / "ggml" / "include" / "ggml.h").unlink(),
                       "1 missing, 0 added, 0 changed (missing ggml/include/ggml.h)"),
    "a file grown": (lambda r: (r / "LICENSE").write_bytes(b"MIT License\nand more\n"),
                     "changed LICENSE (size 12 -> 21)"),
    "a file rewritten in place, same size": (_rewrite_same_size, "changed src/llama.cpp (modified: mtime "),
    "a file made executable": (lambda r: (r / "LICENSE").chmod(0o755), "changed LICENSE (mode 644 -> 755)"),
    "a file replaced by a symlink": (_to_symlink, "changed LICENSE (was a file of 12 bytes, is a symlink of 14 bytes)"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_tree_under_a_valid_marker_is_fetched_again(tmp_path: Path, change: str) -> None:
    recipe, settings, path = cached(tmp_path)
    (path / "LICENSE").chmod(0o644)
    marker_before = (path / MARKER).read_text()
    edit, why = CHANGES[change]
    assert cached_source(recipe, settings) is not None
    edit(path)
    assert (path / MARKER).read_text() == marker_before  # the marker alone still looks valid
    text = assert_fetched_again(recipe, settings, path, why)
    assert "is not used: the tree changed since it was proven: " in text


def test_an_unchanged_tree_is_used_without_reading_any_source(tmp_path: Path) -> None:
    recipe, settings, path = cached(tmp_path)
    shutil.rmtree(tmp_path / "checkout")  # the source is gone: only the cache can answer
    log, out = quiet_log()
    tree = fetch_source(recipe, settings, log)
    assert tree.path == path and "from the cache (path:" in out.getvalue() and "warning" not in out.getvalue()


# ------------------------------------------------------------------------------------ the marker damaged


def _marker(path: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((path / MARKER).read_text())
    return data


def _with(path: Path, **changes: object) -> bytes:
    return json.dumps({**_marker(path), **changes}).encode()


def _without(path: Path, key: str) -> bytes:
    data = _marker(path)
    del data[key]
    return json.dumps(data).encode()


def _listing_edited(path: Path) -> bytes:
    data = _marker(path)
    listing = data["listing"]
    assert isinstance(listing, dict)
    listing["LICENSE"][1] += 1
    return json.dumps(data).encode()


DAMAGE = {
    "not JSON": (lambda p: b'{"format": 2, "commit": ', "its marker .llamabundle-source.json is damaged: it is not JSON"),
    "not UTF-8": (lambda p: b"\xff\xfe\x00{", "its marker cannot be read"),
    "a list": (lambda p: b"[1, 2]", "is damaged: it is not a JSON object"),
    "the format before tree records": (
        lambda p: json.dumps({"commit": p.name, "origin": "path:x", "commit_time": 1}).encode(),
        "it was written by an older llamabundle, which did not record the tree"),
    "an unknown format": (lambda p: _with(p, format=3), "it has format 3, not 2"),
    "a boolean format": (lambda p: _with(p, format=True), "it has format True, not 2"),
    "no listing": (lambda p: _without(p, "listing"), "it lacks 'listing'"),
    "no tree": (lambda p: _without(p, "tree"), "it lacks 'tree'"),
    "a string count": (lambda p: _with(p, tree={**_marker(p)["tree"], "files": "4"}),  # type: ignore[dict-item]
                       "'tree.files' is '4', not a non-negative integer"),
    "a listing that is a list": (lambda p: _with(p, listing=[]), "'proof', 'tree' and 'listing' must be objects"),
    "a negative size": (lambda p: _with(p, listing={"LICENSE": [33188, -1, 0]}), "not a non-negative integer"),
    "a listing edited": (_listing_edited, "its listing does not add up to its own file count, size and digest"),
    "a null commit": (lambda p: _with(p, commit=None), "'commit' and 'origin' must be strings"),
    "another commit": (lambda p: _with(p, commit="0" * 40), f"its marker names commit '{'0' * 40}'"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_or_old_marker_is_a_cache_miss(tmp_path: Path, damage: str) -> None:
    recipe, settings, path = cached(tmp_path)
    make, why = DAMAGE[damage]
    (path / MARKER).write_bytes(make(path))
    assert_fetched_again(recipe, settings, path, why)


@pytest.mark.parametrize("what", ["the marker is a directory", "the marker is missing", "the entry is a file"])
def test_an_entry_that_is_not_a_marked_tree_is_replaced(tmp_path: Path, what: str) -> None:
    recipe, settings, path = cached(tmp_path)
    if what == "the entry is a file":
        shutil.rmtree(path)
        path.write_bytes(b"not a tree")
        shutil.rmtree(settings.cache_dir / "tmp")  # a cache without its scratch directory yet
        assert cached_source(recipe, settings) is None
        log, out = quiet_log()
        assert tree_files(fetch_source(recipe, settings, log).path).keys() - {MARKER} == FILES.keys()
        assert "no marker (an interrupted fetch)" in out.getvalue() and leftovers(settings) == []
        return
    (path / MARKER).unlink()
    if what == "the marker is a directory":
        (path / MARKER).mkdir()
    assert_fetched_again(recipe, settings, path, "it has no marker (an interrupted fetch)")


def test_parse_marker_names_what_is_wrong_and_record_tree_skips_only_the_marker(tmp_path: Path) -> None:
    root = tmp_path / "t"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"123")
    (root / MARKER).write_text("{}")
    (root / "a" / MARKER).write_text("a file of that name below the top is part of the tree")
    rec = record_tree(root)
    assert sorted(rec.listing) == ["a/.llamabundle-source.json", "a/b/f"]
    assert rec.files == 2 and rec.bytes == 3 + len("a file of that name below the top is part of the tree")
    assert tree_difference(rec, record_tree(root)) is None
    with pytest.raises(MarkerDamaged, match="it lacks 'commit'"):
        parse_marker('{"format": 2}')
    with pytest.raises(MarkerDamaged, match="listing entry 'x' is not"):
        parse_marker(json.dumps({"format": 2, "commit": "c", "origin": "o", "proof": {}, "listing": {"x": [1, 2]},
                                 "tree": {"files": 1, "bytes": 2, "digest": "0" * 64}}))


# ------------------------------------------------------------------------------------ leftovers of killed runs


def _python(code: str, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True,  # type: ignore[call-overload]
                            env={**os.environ, "PYTHONPATH": str(REPO)}, **kw)


MAKE_DIR = ("import os, sys; from pathlib import Path; from llamabundle import scratch; "
            "d = scratch.make_dir(Path(sys.argv[1]) if len(sys.argv) > 1 else Path({work!r}), {prefix!r}); "
            "(d / 'tree').mkdir(); (d / 'tree' / 'big').write_bytes(b'x' * 100000); print(d, flush=True); ")


def test_fetch_removes_the_fetch_directories_of_dead_owners_only(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    sha = make_repo(checkout)
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    work = settings.cache_dir / "tmp"
    # a fetch killed with SIGKILL after it made its directory
    dead = _python(MAKE_DIR.format(work=str(work), prefix=TMP_PREFIX) + "os.kill(os.getpid(), 9)", stdout=subprocess.PIPE)
    dead_dir = Path(dead.communicate(timeout=60)[0].strip())
    assert dead.returncode == -signal.SIGKILL and (dead_dir / "tree" / "big").is_file()
    # a fetch that still runs
    live = _python(MAKE_DIR.format(work=str(work), prefix=TMP_PREFIX) + "sys.stdin.read()",
                   stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        assert live.stdout is not None
        live_dir = Path(live.stdout.readline().strip())
        # what an older version left (a random name, no owner): removed once it is a day old
        legacy = work / f"{TMP_PREFIX}k2j4_x9q"
        (legacy / "x").mkdir(parents=True)
        old = time.time() - 2 * 86400
        os.utime(legacy, (old, old))
        other = work / "stage-not-ours"  # another command's scratch: not this sweep's business
        other.mkdir()

        recipe = write_recipe(tmp_path / "r.yaml", sha, [f"path: {checkout}"])
        fetch_source(recipe, settings, quiet_log()[0])

        assert not dead_dir.exists() and not legacy.exists()
        assert (live_dir / "tree" / "big").is_file() and other.is_dir()
        assert leftovers(settings) == sorted([live_dir.name, other.name])  # the fetch's own directory is gone too
        assert live_dir.name.startswith(f"{TMP_PREFIX}{live.pid}-")
    finally:
        live.communicate("", timeout=60)
    fetch_source(recipe, settings, quiet_log()[0])  # once its owner has ended, its leftover goes too
    assert leftovers(settings) == [other.name]


@pytest.mark.race
def test_a_fetch_killed_midway_leaves_nothing_the_next_fetch_keeps(tmp_path: Path) -> None:
    """SIGKILL while the tree is half made (a git that hangs after the files were copied): the next fetch
    removes the killed one's directory, ignores its unmarked tree and proves the source again."""
    checkout = tmp_path / "checkout"
    sha = make_repo(checkout)
    real_git = shutil.which("git")
    assert real_git
    bindir, hung = tmp_path / "bin", tmp_path / "git.pid"
    bindir.mkdir()
    (bindir / "git").write_text("#!/bin/sh\n"
                                f'if [ "$3" = log ]; then echo $$ > {shlex.quote(str(hung))}; exec sleep 300; fi\n'
                                f'exec {shlex.quote(real_git)} "$@"\n')
    (bindir / "git").chmod(0o755)
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    recipe = write_recipe(tmp_path / "r.yaml", sha, [f"path: {checkout}"])
    code = ("from pathlib import Path; from llamabundle.log import Log; from llamabundle import keys; from llamabundle.settings import Settings; "
            "from llamabundle.source import fetch_source; "
            f"fetch_source(keys.load({str(tmp_path / 'r.yaml')!r}), Settings(cache_dir=Path({str(settings.cache_dir)!r})), "
            "Log(quiet=True))")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bindir}:{os.environ['PATH']}"})
    try:
        for _ in range(6000):
            if hung.exists() and hung.read_text().strip():
                break
            assert p.poll() is None, "the fetch ended before git hung"
            time.sleep(0.01)
        (half,) = leftovers(settings)
        assert half.startswith(f"{TMP_PREFIX}{p.pid}-")
        assert (settings.cache_dir / "tmp" / half / "tree" / "src" / "llama.cpp").is_file()  # copied, not marked
        p.send_signal(signal.SIGKILL)
        assert p.wait(60) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if hung.exists() and hung.read_text().strip():  # the hung git is in its own session: end it here
            try:
                os.kill(int(hung.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not (settings.cache_dir / "src" / sha).exists()
    log, out = quiet_log()
    tree = fetch_source(recipe, settings, log)
    assert f"proven from path:{checkout}" in out.getvalue()
    got = tree_files(tree.path)
    assert json.loads(got.pop(MARKER))["tree"]["files"] == len(FILES) and got == FILES
    assert leftovers(settings) == []
    assert scratch.start_time(p.pid) is None


def test_a_cache_that_cannot_be_written_is_a_store_error_naming_the_path(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    sha = make_repo(checkout)
    (tmp_path / "a-file").write_text("the cache directory's parent is a regular file")
    settings = Settings(cache_dir=tmp_path / "a-file" / "cache", connect_timeout=2)
    recipe = write_recipe(tmp_path / "r.yaml", sha, [f"path: {checkout}"])
    with pytest.raises(SourceError) as e:
        fetch_source(recipe, settings, quiet_log()[0])
    assert e.value.exit_code == 6
    assert e.value.what == f"cannot fetch the source into the cache: {settings.cache_dir / 'locks'}"
    assert e.value.why == "Not a directory" and "LLAMABUNDLE_CACHE_DIR" in e.value.fix


def test_a_git_that_lists_a_path_outside_the_checkout_is_not_believed(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = tmp_path / "checkout"
    sha = make_repo(checkout)
    (tmp_path / "secret").write_text("outside the checkout")
    real_git = shutil.which("git")
    assert real_git
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "git").write_text('#!/bin/sh\nif [ "$3" = ls-files ]; then printf "LICENSE\\0../secret\\0"; exit 0; fi\n'
                                f'exec {shlex.quote(real_git)} "$@"\n')
    (bindir / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    with pytest.raises(SourceMismatch) as e:
        fetch_source(write_recipe(tmp_path / "r.yaml", sha, [f"path: {checkout}"]), settings, quiet_log()[0])
    assert e.value.exit_code == 5 and e.value.what == f"path:{checkout}: git lists a file outside the checkout: '../secret'"
    assert leftovers(settings) == [] and not (settings.cache_dir / "src" / sha).exists()
