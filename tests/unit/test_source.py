"""Fetching llama.cpp at the pinned commit (DESIGN §4 sources): real git repos, real `git archive`
tarballs served over HTTP on 127.0.0.1, real sdists with a real git index."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import socket
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamabundle.errors import SourceError, VerifyError
from llamabundle.recipe import Recipe
from llamabundle.settings import Settings
from llamabundle.source import MARKER, SourceMismatch, cached_source, fetch_source
from llamabundle.source.github import archive_commit
from tests.fakeindex import FakeIndex
from tests.gitsources import (
    FILES,
    GIT_ENV,
    commit_all,
    git,
    git_archive,
    make_repo,
    quiet_log,
    settings_for,
    tree_files,
    write_files,
    write_recipe,
)
from tests.loopback import Loopback, Reply, Request, static

COMMIT_TIME = 1704067200  # the GIT_COMMITTER_DATE of tests/gitsources.py, as unix time


# ------------------------------------------------------------------------------------ helpers


class Server:
    """A tests/loopback.py server of `routes` (path -> bytes, as application/x-gzip) that records every path
    asked for; a path in `truncated` promises 1000 bytes more than it holds, sends half of it and hangs up."""

    def __init__(self) -> None:
        self.routes: dict[str, bytes] = {}
        self.truncated: set[str] = set()
        self.loop = Loopback(self._answer).start()
        self.url = self.loop.url

    @property
    def requests(self) -> list[str]:
        return self.loop.paths()

    def _answer(self, req: Request) -> Reply:
        if req.path in self.truncated:
            body = self.routes[req.path]
            return Reply(200, {"Content-Length": str(len(body) + 1000)}, body[: len(body) // 2])
        return static(self.routes, headers={"Content-Type": "application/x-gzip"})(req)

    def close(self) -> None:
        self.loop.close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_nothing_cached(settings: Settings, commit: str) -> None:
    assert not (settings.cache_dir / "src" / commit).exists()
    assert cached_source_dir_leftovers(settings) == []


def assert_marker(marker: dict[str, object], *, commit: str, origin: str, files: dict[str, bytes]) -> None:
    """A marker of format 2: what was proven, and the tree as it was then (every file, its size)."""
    assert (marker["format"], marker["commit"], marker["origin"]) == (2, commit, origin)
    assert marker["tree"] == {"files": len(files), "bytes": sum(len(b) for b in files.values()),
                              "digest": marker["tree"]["digest"]}  # type: ignore[index]
    listing = marker["listing"]
    assert isinstance(listing, dict) and sorted(listing) == sorted(files)
    assert {p: v[1] for p, v in listing.items()} == {p: len(b) for p, b in files.items()}


def cached_source_dir_leftovers(settings: Settings) -> list[str]:
    tmp = settings.cache_dir / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []


# ------------------------------------------------------------------------------------- github


def test_github_archive_is_proven_by_its_pax_header_and_cached(tmp_path: Path, server: Server) -> None:
    repo = tmp_path / "upstream"
    sha = make_repo(repo)
    archive = git_archive(repo, sha)
    (tmp_path / "a.tar.gz").write_bytes(archive)
    assert archive_commit(tmp_path / "a.tar.gz") == sha  # git wrote the commit into the pax global header
    server.routes[f"/ggml-org/llama.cpp/tar.gz/{sha}"] = archive

    settings = settings_for(tmp_path, server.url)
    recipe = write_recipe(tmp_path / "r.yaml", sha, ["github: ggml-org/llama.cpp"])
    log, out = quiet_log()
    tree = fetch_source(recipe, settings, log)

    assert tree.commit == sha
    assert tree.origin == "github:ggml-org/llama.cpp"
    assert tree.path == settings.cache_dir / "src" / sha
    marker = json.loads((tree.path / MARKER).read_text())
    assert_marker(marker, commit=sha, origin="github:ggml-org/llama.cpp", files=FILES)
    assert marker["commit_time"] == COMMIT_TIME  # the archive's mtimes
    assert marker["proof"] == {"method": "the commit in the archive's pax header (git archive)",
                               "archive_sha256": hashlib.sha256(archive).hexdigest()}
    assert tree.commit_time == COMMIT_TIME
    got = tree_files(tree.path)
    got.pop(MARKER)
    assert got == FILES
    assert server.requests == [f"/ggml-org/llama.cpp/tar.gz/{sha}"]
    assert f"{sha[:12]} proven from github:ggml-org/llama.cpp" in out.getvalue()
    assert cached_source_dir_leftovers(settings) == []

    again = fetch_source(recipe, settings, log)
    assert again == tree
    assert server.requests == [f"/ggml-org/llama.cpp/tar.gz/{sha}"]  # a cache hit asks nobody
    assert "from the cache (github:ggml-org/llama.cpp)" in out.getvalue()
    assert cached_source(recipe, settings) == tree


def test_github_archive_of_another_commit_is_a_mismatch_and_stops(tmp_path: Path, server: Server) -> None:
    repo = tmp_path / "upstream"
    pinned = make_repo(repo)
    write_files(repo, {"src/llama.cpp": b"int llama(void) { return 2; }\n"})
    other = commit_all(repo, "second")
    server.routes[f"/o/r/tar.gz/{pinned}"] = git_archive(repo, other)  # the server lies
    # a path: source that WOULD prove the pinned commit: it must not be tried after a mismatch
    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(repo), str(checkout)], env=GIT_ENV, check=True)
    git("checkout", "-q", pinned, cwd=checkout)

    settings = settings_for(tmp_path, server.url)
    recipe = write_recipe(tmp_path / "r.yaml", pinned, ["github: o/r", f"path: {checkout}"])
    log, out = quiet_log()
    with pytest.raises(SourceMismatch) as e:
        fetch_source(recipe, settings, log)
    assert isinstance(e.value, VerifyError) and e.value.exit_code == 5
    assert e.value.what == f"github:o/r delivered commit {other}, not {pinned}"
    assert server.requests == [f"/o/r/tar.gz/{pinned}"]
    assert "path:" not in out.getvalue()
    assert_nothing_cached(settings, pinned)


@pytest.mark.parametrize("how", ["closed-port", "http-404", "truncated"])
def test_unreachable_github_falls_back_to_the_next_source(tmp_path: Path, server: Server, how: str) -> None:
    checkout = tmp_path / "checkout"
    sha = make_repo(checkout)
    url = f"http://127.0.0.1:{closed_port()}" if how == "closed-port" else server.url  # no routes: 404
    if how == "truncated":
        server.routes[f"/o/r/tar.gz/{sha}"] = git_archive(checkout, sha)
        server.truncated.add(f"/o/r/tar.gz/{sha}")
    settings = settings_for(tmp_path, url)
    recipe = write_recipe(tmp_path / "r.yaml", sha, ["github: o/r", f"path: {checkout}"])
    log, out = quiet_log()
    tree = fetch_source(recipe, settings, log)

    assert tree.origin == f"path:{checkout}"
    assert tree.path == settings.cache_dir / "src" / sha
    text = out.getvalue()
    assert "warning: source github:o/r unavailable" in text
    assert "trying the next source" in text
    assert {"closed-port": "connection refused", "http-404": "HTTP 404",
            "truncated": f"cannot download {server.url}/o/r/tar.gz/{sha}"}[how] in text
    assert not list((settings.cache_dir / "tmp").iterdir())  # no partial download left
    assert server.requests == ([] if how == "closed-port" else [f"/o/r/tar.gz/{sha}"])
    got = tree_files(tree.path)
    got.pop(MARKER)
    assert got == FILES


# --------------------------------------------------------------------------------------- path


def test_path_source_at_the_pinned_commit_copies_tracked_files_only(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    sha = make_repo(checkout)
    (checkout / "untracked.txt").write_text("not in git\n")
    (checkout / "build").mkdir()
    (checkout / "build" / "x.o").write_bytes(b"\x7fELF")
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    recipe = write_recipe(tmp_path / "r.yaml", sha, [f"path: {checkout}"])
    tree = fetch_source(recipe, settings, quiet_log()[0])
    got = tree_files(tree.path)
    marker = json.loads(got.pop(MARKER))
    assert_marker(marker, commit=sha, origin=f"path:{checkout}", files=FILES)
    assert marker["commit_time"] == COMMIT_TIME
    assert marker["proof"]["files"] == len(FILES) and marker["proof"]["path"] == str(checkout)
    assert got == FILES  # no .git, no untracked files, no build output
    assert tree.origin == f"path:{checkout}"


def test_path_source_at_another_commit_is_a_mismatch(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    pinned = make_repo(checkout)
    write_files(checkout, {"LICENSE": b"changed\n"})
    head = commit_all(checkout, "second")
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    recipe = write_recipe(tmp_path / "r.yaml", pinned, [f"path: {checkout}"])
    with pytest.raises(SourceMismatch) as e:
        fetch_source(recipe, settings, quiet_log()[0])
    assert e.value.exit_code == 5
    assert e.value.what == f"path:{checkout} is at commit {head}, not {pinned}"
    assert f"checkout {pinned}" in e.value.fix
    assert_nothing_cached(settings, pinned)


def test_path_source_with_local_changes_is_a_mismatch(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    sha = make_repo(checkout)
    (checkout / "src" / "llama.cpp").write_bytes(b"int llama(void) { return 42; }\n")
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    recipe = write_recipe(tmp_path / "r.yaml", sha, [f"path: {checkout}"])
    with pytest.raises(SourceMismatch) as e:
        fetch_source(recipe, settings, quiet_log()[0])
    assert e.value.exit_code == 5
    assert e.value.what == f"path:{checkout} has local changes"
    assert e.value.why == "M src/llama.cpp"
    assert_nothing_cached(settings, sha)


def test_path_source_that_is_not_a_git_checkout_is_a_mismatch(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    write_files(plain, FILES)
    sha = "a1" * 20
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    recipe = write_recipe(tmp_path / "r.yaml", sha, [f"path: {plain}"])
    with pytest.raises(SourceMismatch) as e:
        fetch_source(recipe, settings, quiet_log()[0])
    assert e.value.what == f"path:{plain} is not a git checkout"


def test_relative_path_is_resolved_against_the_recipe_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = tmp_path / "work" / "llama.cpp"
    sha = make_repo(checkout)
    recipe = write_recipe(tmp_path / "work" / "recipes" / "r.yaml", sha, ["path: ../llama.cpp"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "llama.cpp").mkdir()  # a decoy relative to the working directory
    monkeypatch.chdir(elsewhere)
    tree = fetch_source(recipe, settings_for(tmp_path, "http://127.0.0.1:9"), quiet_log()[0])
    assert tree.origin == "path:../llama.cpp"
    assert (tree.path / "src" / "llama.cpp").read_bytes() == FILES["src/llama.cpp"]


# ---------------------------------------------------------------------------------------- git


def test_git_source_fetches_the_exact_commit(tmp_path: Path) -> None:
    upstream = tmp_path / "upstream"
    pinned = make_repo(upstream)
    git("config", "uploadpack.allowAnySHA1InWant", "true", cwd=upstream)
    write_files(upstream, {"LICENSE": b"a later license\n", "new.txt": b"later\n"})
    tip = commit_all(upstream, "second")
    assert tip != pinned
    url = upstream.as_uri()
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    recipe = write_recipe(tmp_path / "r.yaml", pinned, [f"git: {url}"])
    tree = fetch_source(recipe, settings, quiet_log()[0])
    assert tree.origin == f"git:{url}"
    got = tree_files(tree.path)
    got.pop(MARKER)
    assert got == FILES  # the pinned commit, not the tip; no .git
    assert not (tree.path / ".git").exists()


def test_git_source_without_the_commit_is_unavailable(tmp_path: Path) -> None:
    upstream = tmp_path / "upstream"
    make_repo(upstream)
    missing = "b2" * 20
    url = upstream.as_uri()
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    recipe = write_recipe(tmp_path / "r.yaml", missing, [f"git: {url}"])
    log, out = quiet_log()
    with pytest.raises(SourceError) as e:
        fetch_source(recipe, settings, log)
    assert type(e.value) is SourceError and e.value.exit_code == 6
    assert f"git:{url}: git fetch {url} {missing[:12]}" in e.value.why
    assert f"source git:{url} unavailable" in out.getvalue()
    assert_nothing_cached(settings, missing)


# --------------------------------------------------------------------------------------- pypi


def make_sdist(tmp: Path, *, head: str | None = None, tamper: dict[str, bytes] | None = None) -> tuple[bytes, str]:
    """A synthetic llama-cpp-python-like sdist: pkg-1.0/vendor/llama.cpp/... plus the submodule's
    git HEAD and index, taken from a real repository whose work tree has the same files."""
    repo = tmp / "vendored-repo"
    sha = make_repo(repo) if not repo.exists() else git("rev-parse", "HEAD", cwd=repo)
    top = tmp / "sdist-build" / "pkg-1.0"
    shutil.rmtree(top.parent, ignore_errors=True)
    vendored = top / "vendor" / "llama.cpp"
    write_files(vendored, FILES)
    write_files(vendored, tamper or {})
    (vendored / ".git").write_text("gitdir: ../../.git/modules/vendor/llama.cpp\n")
    gitdir = top / ".git" / "modules" / "vendor" / "llama.cpp"
    gitdir.mkdir(parents=True)
    shutil.copyfile(repo / ".git" / "index", gitdir / "index")
    (gitdir / "HEAD").write_text((head or sha) + "\n")
    (top / "pyproject.toml").write_text("[project]\nname = 'pkg'\nversion = '1.0'\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(top, arcname="pkg-1.0")
    return buf.getvalue(), sha


def seed_download(settings: Settings, sha256: str, data: bytes) -> Path:
    d = settings.cache_dir / "downloads" / sha256
    d.mkdir(parents=True, exist_ok=True)
    (d / "pkg-1.0.tar.gz").write_bytes(data)
    return d / "pkg-1.0.tar.gz"


def pypi_recipe(tmp: Path, commit: str, sha256: str) -> Recipe:
    return write_recipe(tmp / "r.yaml", commit, [f"pypi: {{package: pkg, version: '1.0', sha256: {sha256}}}"])


def test_pypi_sdist_with_a_matching_git_index_is_proven(tmp_path: Path) -> None:
    data, sha = make_sdist(tmp_path)
    digest = hashlib.sha256(data).hexdigest()
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    seed_download(settings, digest, data)
    log, out = quiet_log()
    tree = fetch_source(pypi_recipe(tmp_path, sha, digest), settings, log)
    assert tree.origin == "pypi:pkg==1.0"
    assert tree.path == settings.cache_dir / "src" / sha
    got = tree_files(tree.path)
    got.pop(MARKER)
    assert got == FILES  # the dangling .git pointer file is gone
    assert f"pypi:pkg==1.0: {len(FILES)} files match the git index of {sha[:12]}" in out.getvalue()


def test_pypi_sdist_with_a_modified_vendored_file_is_a_mismatch(tmp_path: Path) -> None:
    data, sha = make_sdist(tmp_path, tamper={"src/llama.cpp": b"int llama(void) { return 666; }\n"})
    digest = hashlib.sha256(data).hexdigest()
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    seed_download(settings, digest, data)
    with pytest.raises(SourceMismatch) as e:
        fetch_source(pypi_recipe(tmp_path, sha, digest), settings, quiet_log()[0])
    assert e.value.exit_code == 5
    assert e.value.what == f"pypi:pkg==1.0: vendored tree differs from commit {sha[:12]}"
    assert e.value.why == "0 missing, 1 modified, 0 extra: modified src/llama.cpp"
    assert_nothing_cached(settings, sha)


def test_pypi_sdist_with_an_extra_vendored_file_is_a_mismatch(tmp_path: Path) -> None:
    data, sha = make_sdist(tmp_path, tamper={"src/evil.c": b"/* not in the commit */\n"})
    digest = hashlib.sha256(data).hexdigest()
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    seed_download(settings, digest, data)
    with pytest.raises(SourceMismatch) as e:
        fetch_source(pypi_recipe(tmp_path, sha, digest), settings, quiet_log()[0])
    assert e.value.why == "0 missing, 0 modified, 1 extra: extra src/evil.c"


def test_pypi_sdist_vendoring_another_commit_is_a_mismatch(tmp_path: Path) -> None:
    other = "c3" * 20
    data, sha = make_sdist(tmp_path, head=other)
    digest = hashlib.sha256(data).hexdigest()
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    seed_download(settings, digest, data)
    with pytest.raises(SourceMismatch) as e:
        fetch_source(pypi_recipe(tmp_path, sha, digest), settings, quiet_log()[0])
    assert e.value.what == f"pypi:pkg==1.0 vendors llama.cpp {other}, not {sha}"
    assert_nothing_cached(settings, sha)


def test_pypi_sdist_comes_from_the_index_by_url(tmp_path: Path) -> None:
    data, sha = make_sdist(tmp_path)
    digest = hashlib.sha256(data).hexdigest()
    index = FakeIndex()
    try:
        index.add("pkg", "pkg-1.0.tar.gz", data)
        index.add("pkg", "pkg-0.9.tar.gz", b"an older release")
        settings = dataclasses.replace(settings_for(tmp_path, "http://127.0.0.1:9"), pip_index_url=index.url)
        tree = fetch_source(pypi_recipe(tmp_path, sha, digest), settings, quiet_log()[0])
        assert tree.origin == "pypi:pkg==1.0" and (tree.path / "src" / "llama.cpp").is_file()
        assert index.requests == ["/simple/pkg/", "/files/pkg/pkg-1.0.tar.gz"]
        assert (settings.cache_dir / "downloads" / digest / "pkg-1.0.tar.gz").read_bytes() == data
    finally:
        index.close()


@pytest.mark.parametrize("how", ["bytes", "listing"])
def test_pypi_index_serving_another_sdist_is_refused(tmp_path: Path, how: str) -> None:
    data, sha = make_sdist(tmp_path)
    pinned = hashlib.sha256(data).hexdigest()
    index = FakeIndex()
    try:
        index.add("pkg", "pkg-1.0.tar.gz", data)
        if how == "bytes":
            index.served["pkg-1.0.tar.gz"] = data[:-4] + b"evil"
        else:
            index.listed_sha256["pkg-1.0.tar.gz"] = "e" * 64
        settings = dataclasses.replace(settings_for(tmp_path, "http://127.0.0.1:9"), pip_index_url=index.url)
        with pytest.raises(SourceMismatch) as e:
            fetch_source(pypi_recipe(tmp_path, sha, pinned), settings, quiet_log()[0])
        assert e.value.exit_code == 5 and "sha256" in e.value.what
        assert ("/files/pkg/pkg-1.0.tar.gz" in index.requests) == (how == "bytes")
        assert list((settings.cache_dir / "downloads").rglob("*.tar.gz*")) == []
        assert_nothing_cached(settings, sha)
    finally:
        index.close()


def test_pypi_cached_sdist_with_a_wrong_sha256_is_not_used(tmp_path: Path) -> None:
    data, sha = make_sdist(tmp_path)
    pinned = hashlib.sha256(data + b"-the pinned file differs").hexdigest()
    settings = dataclasses.replace(settings_for(tmp_path, "http://127.0.0.1:9"), pip_index_url="http://127.0.0.1:9/simple")
    seed_download(settings, pinned, data)  # filed under the pinned digest, but its bytes hash differently
    log, out = quiet_log()
    with pytest.raises(SourceError) as e:
        fetch_source(pypi_recipe(tmp_path, sha, pinned), settings, log)
    assert "does not have the pinned sha256" in out.getvalue()
    assert "127.0.0.1:9/simple/pkg/" in e.value.why  # the refused file sent it to the index
    assert not (settings.cache_dir / "downloads" / pinned / "pkg-1.0.tar.gz").exists()
    assert_nothing_cached(settings, sha)


# ----------------------------------------------------------------------------------- all fail


def test_every_source_failing_is_a_source_error_listing_each(tmp_path: Path, server: Server) -> None:
    sha = "d4" * 20
    missing_repo = (tmp_path / "no-such-repo").as_uri()
    settings = settings_for(tmp_path, server.url)  # no routes: 404
    recipe = write_recipe(tmp_path / "r.yaml", sha, ["github: o/r", f"git: {missing_repo}", "path: ./nowhere"])
    log, out = quiet_log()
    with pytest.raises(SourceError) as e:
        fetch_source(recipe, settings, log)
    err = e.value
    assert type(err) is SourceError and err.exit_code == 6
    assert err.what == f"no source delivered llama.cpp {sha[:12]}"
    lines = err.why.splitlines()
    assert lines[0] == "every source in llama_cpp.sources failed:"
    assert [ln.strip().split(": ", 1)[0] for ln in lines[1:]] == ["github:o/r", f"git:{missing_repo}", "path:./nowhere"]
    assert f"GET {server.url}/o/r/tar.gz/{sha} answered HTTP 404" in lines[1]
    assert f"git fetch {missing_repo} {sha[:12]}" in lines[2]
    assert f"{(tmp_path / 'nowhere').resolve()} is not a directory" in lines[3]
    assert out.getvalue().count("trying the next source") == 3
    assert "error:" in err.render() and "fix:" in err.render()
    assert_nothing_cached(settings, sha)
