"""Reading a real git index (versions 2, 3, 4) without git, and checking a work tree against it."""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from llamabundle.gitindex import IndexEntry, IndexFormatError, blob_sha1, check_tree, read_index

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is needed to make a real index")

FILES = {
    "README.md": b"# test\n",
    "CMakeLists.txt": b"project(x)\n",
    "src/llama.cpp": b"int llama;\n",
    "src/llama.h": b"#pragma once\n",
    "ggml/src/ggml-cuda/ggml-cuda.cu": b"__global__ void k() {}\n",
    "ggml/src/ggml-cuda/common.cuh": b"// common\n",
    "ggml/src/ggml-cpu/ggml-cpu.c": b"int cpu;\n",
    "ggml/include/ggml.h": b"#define GGML 1\n",
    "a/b/c/d/e/deep.txt": b"deep\n",
    "docs/ünïcode name.md": "ü\n".encode(),
    "empty": b"",
    "x" * 40 + "/" + "y" * 120 + ".txt": b"long path\n",
}
EXE = "scripts/build.sh"
LINK = "include/llama.h"  # -> ../src/llama.h


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_SYSTEM": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "core.autocrlf=false",
                           "-c", "core.symlinks=true", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout


def make_repo(root: Path) -> Path:
    root.mkdir()
    git(root, "init", "-q")
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / EXE).parent.mkdir(parents=True)
    (root / EXE).write_text("#!/bin/sh\necho build\n")
    os.chmod(root / EXE, 0o755)
    (root / LINK).parent.mkdir(parents=True)
    os.symlink("../src/llama.h", root / LINK)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "init")
    return root


def ls_files(repo: Path) -> list[IndexEntry]:
    out = []
    for rec in git(repo, "ls-files", "-s", "-z").split("\0"):
        if rec:
            meta, path = rec.split("\t", 1)
            mode, sha, stage = meta.split()
            assert stage == "0"
            out.append(IndexEntry(path=path, mode=int(mode, 8), sha1=sha))
    return out


def index_version(data: bytes) -> int:
    return struct.unpack(">I", data[4:8])[0]


@pytest.fixture(scope="module")
def repo_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repo(tmp_path_factory.mktemp("git") / "repo")


@pytest.fixture()
def repo(repo_template: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "repo"
    shutil.copytree(repo_template, dst, symlinks=True)
    return dst


def index_of(repo: Path) -> bytes:
    return (repo / ".git" / "index").read_bytes()


# ------------------------------------------------------------------------------------ read_index


def test_read_index_v2_matches_git_ls_files(repo: Path) -> None:
    data = index_of(repo)
    assert index_version(data) == 2
    entries = read_index(data)
    assert entries == ls_files(repo)
    assert len(entries) == len(FILES) + 2
    by_path = {e.path: e for e in entries}
    assert by_path[EXE].mode == 0o100755
    assert by_path[LINK].mode == 0o120000
    assert by_path[LINK].sha1 == blob_sha1(b"../src/llama.h")
    assert by_path["README.md"].mode == 0o100644
    assert by_path["README.md"].sha1 == blob_sha1(b"# test\n")
    assert by_path["empty"].sha1 == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert "docs/ünïcode name.md" in by_path


def test_read_index_v4_path_compression(repo: Path) -> None:
    expected = ls_files(repo)
    git(repo, "update-index", "--index-version", "4")
    data = index_of(repo)
    assert index_version(data) == 4
    assert read_index(data) == expected


def test_read_index_v3_extended_flags(repo: Path) -> None:
    # git writes version 3 only when an entry carries extended flags (skip-worktree, intent-to-add).
    git(repo, "update-index", "--index-version", "3")
    git(repo, "update-index", "--skip-worktree", "src/llama.cpp")
    (repo / "new.txt").write_text("new\n")
    git(repo, "add", "-N", "new.txt")
    data = index_of(repo)
    assert index_version(data) == 3
    entries = read_index(data)
    assert entries == ls_files(repo)
    by_path = {e.path: e for e in entries}
    assert by_path["new.txt"].sha1 == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # intent-to-add: empty blob
    assert by_path["src/llama.cpp"].sha1 == blob_sha1(b"int llama;\n")
    # ... and the same entries once rewritten as version 4.
    git(repo, "update-index", "--index-version", "4")
    data4 = index_of(repo)
    assert index_version(data4) == 4
    assert read_index(data4) == entries


def test_read_index_with_extensions_and_a_gitlink(repo: Path) -> None:
    sub_sha = "1234567890abcdef1234567890abcdef12345678"
    git(repo, "update-index", "--add", "--cacheinfo", f"160000,{sub_sha},vendor/sub")
    git(repo, "write-tree")  # adds a TREE extension after the entries
    data = index_of(repo)
    assert b"TREE" in data[-2000:]
    entries = read_index(data)
    assert entries == ls_files(repo)
    assert IndexEntry(path="vendor/sub", mode=0o160000, sha1=sub_sha) in entries


def test_read_index_refuses_a_corrupted_index(repo: Path) -> None:
    data = bytearray(index_of(repo))
    data[len(data) // 2] ^= 0x01
    with pytest.raises(IndexFormatError, match="checksum"):
        read_index(bytes(data))
    data = bytearray(index_of(repo))
    data[-1] ^= 0x80  # the checksum itself
    with pytest.raises(IndexFormatError, match="checksum"):
        read_index(bytes(data))
    with pytest.raises(IndexFormatError):
        read_index(index_of(repo)[:-1])


def test_read_index_refuses_a_non_index(repo: Path) -> None:
    for data in ((repo / "README.md").read_bytes() * 10, (repo / ".git" / "HEAD").read_bytes(), b"", b"DIRC"):
        with pytest.raises(IndexFormatError, match="not a git index"):
            read_index(data)


def test_read_index_refuses_an_unknown_version(repo: Path) -> None:
    body = bytearray(index_of(repo)[:-20])
    struct.pack_into(">I", body, 4, 5)
    data = bytes(body) + hashlib.sha1(body).digest()
    with pytest.raises(IndexFormatError, match="version 5"):
        read_index(data)


def test_read_index_refuses_a_truncated_entry_table() -> None:
    body = bytearray(v2_index([b"a.c"])[:-20])
    struct.pack_into(">I", body, 8, 3)  # claims three entries, holds one
    body += b"\0" * 20
    with pytest.raises(IndexFormatError, match="truncated"):
        read_index(bytes(body) + hashlib.sha1(body).digest())


def v2_index(paths: list[bytes]) -> bytes:
    """A version 2 index listing `paths` (regular files, a fixed blob), with a valid checksum."""
    body = b"DIRC" + struct.pack(">II", 2, len(paths))
    for name in paths:
        entry = b"\0" * 24 + struct.pack(">I", 0o100644) + b"\0" * 12 + bytes.fromhex(blob_sha1(b"x")) \
            + struct.pack(">H", min(len(name), 0xFFF)) + name
        body += entry + b"\0" * (8 - len(entry) % 8)
    return body + hashlib.sha1(body).digest()


@pytest.mark.parametrize("path", [b"/etc/passwd", b"../outside", b"src/../../outside", b"a//b", b"./a", b"a/.",
                                  b".git/config", b"sub/.GIT/hooks/post-checkout", b"trailing/"])
def test_read_index_refuses_a_path_outside_the_tree(tmp_path: Path, path: bytes) -> None:
    assert [e.path for e in read_index(v2_index([b"ok/file.c"]))] == ["ok/file.c"]  # the maker makes real indexes
    with pytest.raises(IndexFormatError, match="unsafe path"):
        read_index(v2_index([b"ok/file.c", path]))
    (tmp_path / "outside").write_bytes(b"x")  # what a check against such an index would have read
    with pytest.raises(IndexFormatError):
        check_tree(tmp_path / "tree", read_index(v2_index([path])))


def test_blob_sha1_is_gits() -> None:
    assert blob_sha1(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert blob_sha1(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


# ------------------------------------------------------------------------------------ check_tree


def test_check_tree_is_clean_for_the_work_tree(repo: Path) -> None:
    entries = read_index(index_of(repo))
    c = check_tree(repo, entries)
    assert c.clean
    assert c.checked == len(FILES) + 2
    assert (c.missing, c.modified, c.extra) == ((), (), ())


def test_check_tree_reports_modified_missing_and_extra(repo: Path) -> None:
    entries = read_index(index_of(repo))
    f = repo / "ggml/src/ggml-cuda/ggml-cuda.cu"
    data = bytearray(f.read_bytes())
    data[3] ^= 0x01  # one byte, same size
    f.write_bytes(bytes(data))
    (repo / "src/llama.h").unlink()
    (repo / "ggml/src/ggml-cpu/injected.c").write_text("evil\n")
    (repo / "top-extra").write_text("x\n")
    c = check_tree(repo, entries)
    assert not c.clean
    assert c.modified == ("ggml/src/ggml-cuda/ggml-cuda.cu",)
    assert c.missing == ("src/llama.h",)
    assert c.extra == ("ggml/src/ggml-cpu/injected.c", "top-extra")
    assert c.checked == len(entries)


def test_check_tree_checks_symlink_targets(repo: Path) -> None:
    entries = read_index(index_of(repo))
    (repo / LINK).unlink()
    os.symlink("../src/llama.cpp", repo / LINK)
    assert check_tree(repo, entries).modified == (LINK,)
    (repo / LINK).unlink()
    (repo / LINK).write_text("#pragma once\n")  # a file where a link belongs
    assert check_tree(repo, entries).modified == (LINK,)
    (repo / LINK).unlink()
    c = check_tree(repo, entries)
    assert c.missing == (LINK,) and c.modified == ()


def test_check_tree_a_link_where_a_file_belongs_is_not_that_file(repo: Path) -> None:
    entries = read_index(index_of(repo))
    (repo / "README.md").unlink()
    os.symlink("CMakeLists.txt", repo / "README.md")
    c = check_tree(repo, entries)
    assert "README.md" in c.missing + c.modified
    assert not c.clean


def test_check_tree_extra_symlinked_dir_and_emptied_file(repo: Path) -> None:
    entries = read_index(index_of(repo))
    os.symlink("/etc", repo / "src" / "etc-link")
    (repo / "README.md").write_bytes(b"")
    c = check_tree(repo, entries)
    assert c.extra == ("src/etc-link",)
    assert c.modified == ("README.md",)


def test_check_tree_ignores_git_dir_and_gitlink_contents(repo: Path) -> None:
    git(repo, "update-index", "--add", "--cacheinfo", "160000,1234567890abcdef1234567890abcdef12345678,vendor/sub")
    (repo / "vendor" / "sub" / "deep").mkdir(parents=True)
    (repo / "vendor" / "sub" / "deep" / "file.c").write_text("submodule content\n")
    (repo / "vendor" / "sub" / ".git").write_text("gitdir: ../../.git/modules/sub\n")
    entries = read_index(index_of(repo))
    c = check_tree(repo, entries)
    assert c.clean, c
    (repo / "vendor" / "stray").write_text("x")
    assert check_tree(repo, entries).extra == ("vendor/stray",)


def test_check_tree_of_a_vendored_copy_with_a_gitdir_file(repo: Path, tmp_path: Path) -> None:
    # The sdist layout: a copied tree whose .git is a file pointing at the module's git dir.
    entries = read_index(index_of(repo))
    copy = tmp_path / "vendored"
    shutil.copytree(repo, copy, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    (copy / ".git").write_text("gitdir: ../../.git/modules/vendor/llama.cpp\n")
    assert check_tree(copy, entries).clean
    nested = copy / "a" / ".git"
    nested.write_text("not ignored below the root\n")
    assert check_tree(copy, entries).extra == ("a/.git",)


def test_loose_commit_time_reads_a_verified_commit_object(tmp_path: Path) -> None:
    from llamabundle.gitindex import loose_commit_time

    repo = make_repo(tmp_path / "r")
    head = git(repo, "rev-parse", "HEAD").strip()
    assert loose_commit_time(repo / ".git", head) == int(git(repo, "log", "-1", "--format=%ct").strip())
    assert loose_commit_time(repo / ".git", "0" * 40) is None  # not there
    obj = repo / ".git" / "objects" / head[:2] / head[2:]
    other = git(repo, "rev-parse", "HEAD^{tree}").strip()  # a real object that is not this commit
    os.chmod(obj, 0o644)
    shutil.copyfile(repo / ".git" / "objects" / other[:2] / other[2:], obj)
    assert loose_commit_time(repo / ".git", head) is None  # its content does not hash to the name
