"""llama.cpp sources for the source tests: real git repositories made in a temp dir (FILES, committed with a
fixed author and date), their trees read back, and the recipe, settings and log a fetch is given."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

from rich.console import Console

from llamabundle import keys
from llamabundle.log import Log
from llamabundle.recipe import Recipe
from llamabundle.settings import Settings

GIT_ENV = {
    **os.environ,
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
}
FILES = {
    "CMakeLists.txt": b"cmake_minimum_required(VERSION 3.14)\nproject(llama.cpp)\n",
    "LICENSE": b"MIT License\n",
    "src/llama.cpp": b"int llama(void) { return 1; }\n",
    "ggml/include/ggml.h": b"#pragma once\n",
}


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True).stdout.strip()


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def commit_all(repo: Path, message: str) -> str:
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", message, cwd=repo)
    return git("rev-parse", "HEAD", cwd=repo)


def make_repo(path: Path, files: dict[str, bytes] = FILES) -> str:
    path.mkdir(parents=True)
    git("init", "-q", cwd=path)
    write_files(path, files)
    return commit_all(path, "first")


def git_archive(repo: Path, sha: str) -> bytes:
    return subprocess.run(["git", "archive", "--format=tar.gz", f"--prefix=llama.cpp-{sha}/", sha], cwd=repo,
                          env=GIT_ENV, check=True, capture_output=True).stdout


def tree_files(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def settings_for(tmp: Path, archive_url: str) -> Settings:
    return Settings(cache_dir=tmp / "cache", github_archive_url=archive_url, connect_timeout=2)


def quiet_log() -> tuple[Log, io.StringIO]:
    buf = io.StringIO()
    return Log(console=Console(file=buf, width=400, highlight=False, color_system=None)), buf


def write_recipe(path: Path, commit: str, sources: list[str]) -> Recipe:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["recipe: 1", "name: test-cpu", "platform: linux-x86_64", "llama_cpp:", f"  commit: {commit}", "  sources:"]
    lines += [f"    - {s}" for s in sources]
    lines += ["backends: [cpu]", "toolchain: {compiler: gcc}", "targets: [llama-server]", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return keys.load(str(path))
