"""llama.cpp's web UI (`ui: build`): built once per UI source tree with npm from the pinned commit's tools/ui
(`npm ci`: its package-lock.json pins every package by integrity hash; then `npm run build`), kept in the
cache by the sha256 of that source tree and reused by every bundle of it. The npm build is not reproducible
(the build time, CSS order): bundles are byte-reproducible by reusing the kept bytes. The assets are laid in
the build directory (tools/ui/dist), where llama.cpp's ui-assets.cmake embeds them into llama-server; the
configure and build that follow run without a network as ever (only this step talks to the npm registry)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import cache, proc, scratch
from .digest import sha256_file, walk
from .errors import BuildError, ToolchainError
from .log import Log

UI_DIR = "tools/ui"
SKIP = ("dist", "node_modules", ".svelte-kit", "build")  # outputs, never inputs
NEEDED = ("index.html",)  # what ui-assets.cmake embeds only when it is there


@dataclass(frozen=True, kw_only=True)
class Assets:
    source: str  # sha256 of the UI source tree
    digest: str  # sha256 of the built tree (every file's path and sha256)
    dist: Path  # the kept tree
    files: int


def source_id(src: Path) -> str:
    """The sha256 of tools/ui's files (paths and contents; its build outputs and node_modules left out)."""
    root = src / UI_DIR
    h = hashlib.sha256()
    for rel in sorted(walk(root)):
        if rel.split("/", 1)[0] in SKIP:
            continue
        h.update(f"{rel}\0{sha256_file(root / rel)}\n".encode())
    return h.hexdigest()


def tree_digest(root: Path) -> tuple[str, int]:
    """The sha256 of a tree (each file's '/'-path and sha256, sorted) and its number of files."""
    files = sorted(walk(root))
    h = hashlib.sha256()
    for rel in files:
        h.update(f"{rel}\0{sha256_file(root / rel)}\n".encode())
    return h.hexdigest(), len(files)


def kept(cache_dir: Path, source: str) -> Path:
    return cache_dir / "ui" / source


def provide(src: Path, *, cache_dir: Path, log: Log, env: Mapping[str, str], timeout: float | None) -> Assets:
    """The built UI of `src`'s tools/ui: the kept one, else built now with npm and kept (a run that finds
    another run's finished tree uses it)."""
    if not (src / UI_DIR / "package-lock.json").is_file():
        raise BuildError(f"{src} has no {UI_DIR}/package-lock.json", why="the recipe says ui: build, and this "
                         "llama.cpp commit has no web UI to build there", fix="set ui: none in the recipe")
    source = source_id(src)
    home = kept(cache_dir, source)
    if not (home / "dist" / "index.html").is_file():
        with cache.waiting_lock(cache.lock_dir(cache_dir) / f"ui-{source[:16]}.lock", log,  # one npm build at a time
                                f"another llamabundle process is building the web UI {source[:12]}; waiting for it"):
            if not (home / "dist" / "index.html").is_file():  # the other one may have kept it meanwhile
                build(src, home, cache_dir=cache_dir, log=log, env=env, timeout=timeout)
    cache.touch(home)
    digest, files = tree_digest(home / "dist")
    recorded = (home / "dist.sha256").read_text(encoding="utf-8").strip() if (home / "dist.sha256").is_file() else ""
    if recorded != digest:
        shutil.rmtree(home, ignore_errors=True)
        raise BuildError(f"the kept web UI {home} changed after it was built",
                         why=f"its files' digest is {digest[:12]}, {recorded[:12] or 'none'} was recorded",
                         fix="run the build again: the damaged tree was removed and is built anew")
    return Assets(source=source, digest=digest, dist=home / "dist", files=files)


def build(src: Path, home: Path, *, cache_dir: Path, log: Log, env: Mapping[str, str], timeout: float | None) -> None:
    npm = shutil.which("npm", path=env.get("PATH") or os.defpath)
    if npm is None:
        raise ToolchainError("the recipe builds llama.cpp's web UI (ui: build) and npm is not on PATH",
                             why="the UI is built once per llama.cpp commit with npm ci and npm run build",
                             fix="install Node.js 20 or newer with npm (Debian/Ubuntu: nodesource's nodejs), or set "
                                 "ui: none in the recipe (a bundle without the web UI)")
    tmp_root = cache.tmp_dir(cache_dir)
    tmp_root.mkdir(parents=True, exist_ok=True)
    work = scratch.make_dir(tmp_root, cache.UI_PREFIX)
    try:
        tree = work / "src"
        shutil.copytree(src / UI_DIR, tree, ignore=shutil.ignore_patterns(*SKIP))
        run_env = {**env, "npm_config_cache": str(cache_dir / "downloads" / "npm"), "npm_config_audit": "false",
                   "npm_config_fund": "false", "npm_config_update_notifier": "false", "LLAMA_UI_OUT_DIR": str(work / "dist"),
                   "CI": "1"}
        fix = "check the npm registry can be reached (npm config get registry), or set ui: none in the recipe"
        with log.step(f"web UI: npm ci in {UI_DIR} (every package pinned by package-lock.json)"):
            proc.run([npm, "ci", "--no-audit", "--no-fund"], log=log, error=BuildError, what="npm ci of the web UI failed",
                     fix=fix, cwd=tree, env=run_env, timeout=timeout, label="npm ci")
        with log.step("web UI: npm run build"):
            proc.run([npm, "run", "build"], log=log, error=BuildError, what="the web UI's build failed", fix=fix,
                     cwd=tree, env=run_env, timeout=timeout, label="npm run build")
        dist = work / "dist"
        missing = [n for n in NEEDED if not (dist / n).is_file()]
        if missing:
            raise BuildError("the web UI's build made no " + ", ".join(missing), why=f"looked in {dist}",
                             fix="report this: llama.cpp's tools/ui did not build as expected")
        digest, files = tree_digest(dist)
        (work / "dist.sha256").write_text(digest + "\n", encoding="utf-8")
        home.parent.mkdir(parents=True, exist_ok=True)
        try:  # the npm tree (node_modules) stays with it: removing its files costs more than the build
            work.rename(home)
        except OSError:
            if not (home / "dist" / "index.html").is_file():  # not another run's finished tree: a real failure
                raise
            shutil.rmtree(work, ignore_errors=True)
        log.info(f"    web UI {digest[:12]}: {files} files, kept in {home}")
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def place(assets: Assets, build_dir: Path, log: Log) -> Path:
    """The assets laid where ui-assets.cmake embeds them from: <build>/tools/ui/dist (replacing what is there).
    Told neither to build nor to download, that script calls them 'stale' in its warning: they are these."""
    dest = build_dir / UI_DIR / "dist"
    if dest.exists():
        if tree_digest(dest)[0] == assets.digest:
            return dest
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(assets.dist, tmp)
    tmp.rename(dest)
    log.info(f"    web UI {assets.digest[:12]} ({assets.files} files) in {dest}")
    return dest
