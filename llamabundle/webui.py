"""llama.cpp's web UI. `ui: build`: built once per UI source tree with npm from the pinned commit's tools/ui
(`npm ci`: its package-lock.json pins every package by integrity hash; then `npm run build`), kept in the
cache by the sha256 of that source tree and reused by every bundle of it. The npm build is not reproducible
(the build time, CSS order): bundles are byte-reproducible by reusing the kept bytes, which one cache does.
`ui: {url, sha256}`: the archive `llamabundle ui pack` makes of a built UI (a deterministic tar: webui.json,
then dist/), pinned by sha256, so that every machine (every release leg) embeds the same bytes; it is
downloaded once, checked (its sha256, its files against the digest it records, its UI source against the
commit's tools/ui) and kept in the cache by that sha256. Either way the assets are laid in the build
directory (tools/ui/dist), where llama.cpp's ui-assets.cmake embeds them into llama-server; the configure and
build that follow run without a network as ever (only this step talks to npm's registry or the archive's host)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tarfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from . import archive, cache, net, proc, scratch, untrusted
from .digest import sha256_file, walk
from .errors import BuildError, LlamaBundleError, ToolchainError, VerifyError
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
    return tree_digest(src / UI_DIR, skip=SKIP)[0]


def tree_digest(root: Path, *, skip: Collection[str] = ()) -> tuple[str, int]:
    """The sha256 of a tree (each file's '/'-path and sha256, sorted) and its number of files; the top-level
    entries named in `skip` are left out."""
    files = sorted(rel for rel in walk(root) if rel.split("/", 1)[0] not in skip)
    h = hashlib.sha256()
    for rel in files:
        h.update(f"{rel}\0{sha256_file(root / rel)}\n".encode())
    return h.hexdigest(), len(files)


def kept(cache_dir: Path, source: str) -> Path:
    return cache_dir / "ui" / source


def built(src: Path, *, cache_dir: Path, log: Log, env: Mapping[str, str], timeout: float | None) -> Assets:
    """The built UI of `src`'s tools/ui: the kept one, else built now with npm and kept (a run that finds
    another run's finished tree uses it)."""
    if not (src / UI_DIR / "package-lock.json").is_file():
        raise BuildError(f"{src} has no {UI_DIR}/package-lock.json", why="the recipe says ui: build, and this "
                         "llama.cpp commit has no web UI to build there", fix="set ui: none in the recipe")
    source = source_id(src)
    home = kept(cache_dir, source)
    _keep_once(home, cache_dir=cache_dir, lock=f"ui-{source[:16]}", log=log,  # one npm build at a time
               waiting=f"another llamabundle process is building the web UI {source[:12]}; waiting for it",
               make=lambda: build(src, home, cache_dir=cache_dir, log=log, env=env, timeout=timeout))
    return _checked(home, source)


def _keep_once(home: Path, *, cache_dir: Path, lock: str, log: Log, waiting: str, make: Callable[[], None]) -> None:
    """Make the kept tree `home` unless it is there, one process at a time (a process that waited for another
    uses what that one kept)."""
    if not (home / "dist" / "index.html").is_file():
        with cache.waiting_lock(cache.lock_dir(cache_dir) / f"{lock}.lock", log, waiting):
            if not (home / "dist" / "index.html").is_file():  # the other one may have kept it meanwhile
                make()


def _work_dir(cache_dir: Path) -> Path:
    """A new directory of this process in the cache's tmp/, where a UI is made before it is renamed into ui/."""
    tmp_root = cache.tmp_dir(cache_dir)
    tmp_root.mkdir(parents=True, exist_ok=True)
    return scratch.make_dir(tmp_root, cache.UI_PREFIX)


def _checked(home: Path, source: str) -> Assets:
    """The kept tree at `home`, its files checked against the digest recorded when it was kept."""
    cache.touch(home)
    digest, files = tree_digest(home / "dist")
    recorded = (home / "dist.sha256").read_text(encoding="utf-8").strip() if (home / "dist.sha256").is_file() else ""
    if recorded != digest:
        shutil.rmtree(home, ignore_errors=True)
        raise BuildError(f"the kept web UI {home} changed after it was kept",
                         why=f"its files' digest is {digest[:12]}, {recorded[:12] or 'none'} was recorded",
                         fix="run the build again: the damaged tree was removed and is made anew")
    return Assets(source=source, digest=digest, dist=home / "dist", files=files)


# ------------------------------------------------------------------- an archive of a built UI (ui pack)

META = "webui.json"  # the archive's first member: {"schema": 1, "source", "digest", "files"}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def archive_name(assets: Assets) -> str:
    return f"webui-{assets.source[:12]}-{assets.digest[:12]}.tar"


def pack(assets: Assets, out_dir: Path) -> Path:
    """A deterministic tar of the built UI in out_dir (the same assets give the same bytes anywhere): webui.json,
    then dist/'s files in path order, each with mode 0644, owner 0 and time 0. Written beside, then renamed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / archive_name(assets)
    meta = json.dumps({"schema": 1, "source": assets.source, "digest": assets.digest, "files": assets.files},
                      sort_keys=True).encode() + b"\n"
    tmp = scratch.make_dir(out_dir, f".{final.name}.partial-")
    try:
        with tarfile.open(tmp / final.name, "w", format=tarfile.PAX_FORMAT) as tf:
            tf.addfile(_member(META, len(meta)), io.BytesIO(meta))
            for rel in sorted(walk(assets.dist)):
                path = assets.dist / rel
                with open(path, "rb") as f:
                    tf.addfile(_member(f"dist/{rel}", path.stat().st_size), f)
        os.replace(tmp / final.name, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0o644, 0, 0, 0, "", ""
    return info


def pinned(url: str, sha256: str, src: Path, *, cache_dir: Path, log: Log, http: Any = None) -> Assets:
    """The UI of a pinned archive: downloaded once (checked by its sha256) and kept by that sha256; its files
    must be those its webui.json records, built from this source tree's tools/ui."""
    if not (src / UI_DIR).is_dir():
        raise BuildError(f"{src} has no {UI_DIR}", why="the recipe pins a web UI archive, and this llama.cpp commit "
                         "has no web UI to embed it into", fix="set ui: none in the recipe")
    source = source_id(src)
    home = cache_dir / "ui" / f"archive-{sha256}"
    _keep_once(home, cache_dir=cache_dir, lock=f"ui-{sha256[:16]}", log=log,
               waiting=f"another llamabundle process is fetching the web UI {sha256[:12]}; waiting for it",
               make=lambda: _fetch_unpack(url, sha256, home, cache_dir=cache_dir, log=log, http=http))
    meta = _read_meta(home / META, url)
    if meta["source"] != source:
        raise BuildError(f"the pinned web UI {url} was built from another web UI source",
                         why=f"it records tools/ui {meta['source'][:12]}, and this commit's tools/ui is {source[:12]}: "
                             "its pages would not match this llama-server",
                         fix="make one for this commit with `llamabundle ui pack RECIPE`, publish it and pin its url "
                             "and sha256 (or use ui: build)")
    return _checked(home, source)


def _fetch_unpack(url: str, sha256: str, home: Path, *, cache_dir: Path, log: Log, http: Any) -> None:
    name = PurePosixPath(url.split("?", 1)[0]).name or "webui.tar"
    dl = cache_dir / "downloads" / sha256 / name
    with log.step(f"web UI: {url} (sha256 {sha256[:12]})"):
        net.download(url, dl, http=http or net.session(), log=log, sha256=sha256, mismatch_error=VerifyError)
    _check_members(dl, url)
    work = _work_dir(cache_dir)
    try:
        archive.extract_tar(dl, work / "tree")
        meta = _read_meta(work / "tree" / META, url)
        if not (work / "tree" / "dist" / "index.html").is_file():
            raise VerifyError(f"the web UI archive {url} has no dist/index.html", why="llama-server embeds none without it",
                              fix="pin an archive made by `llamabundle ui pack`")
        digest, files = tree_digest(work / "tree" / "dist")
        if (digest, files) != (meta["digest"], meta["files"]):
            raise VerifyError(f"the web UI archive {url} holds other files than its {META} records",
                              why=f"its dist/ is {files} files of digest {digest[:12]}, it records {meta['files']} of "
                                  f"{meta['digest'][:12]}", fix="pin an archive made by `llamabundle ui pack`")
        (work / "tree" / "dist.sha256").write_text(digest + "\n", encoding="utf-8")
        home.parent.mkdir(parents=True, exist_ok=True)
        os.replace(work / "tree", home)
        log.info(f"    web UI {digest[:12]}: {files} files from {name}, kept in {home}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_members(path: Path, url: str) -> None:
    """Regular files only, webui.json and dist/…: no links, devices or other names (before anything is extracted)."""
    try:
        with tarfile.open(path) as tf:
            for m in tf:
                if not (m.isfile() or m.isdir()) or not (m.name == META or m.name == "dist" or m.name.startswith("dist/")):
                    raise archive.UnsafeArchive(f"the web UI archive {url}: member '{m.name}' is not one a web UI "
                                                "archive holds", why=f"one holds {META} and dist/'s regular files only",
                                                fix="pin an archive made by `llamabundle ui pack`")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise VerifyError(f"the web UI archive {url} is not a readable tar", why=str(e),
                          fix="pin an archive made by `llamabundle ui pack`") from None


def _read_meta(path: Path, url: str) -> dict[str, Any]:
    fix = "pin an archive made by `llamabundle ui pack`"
    try:
        meta = untrusted.read(path, max_bytes=4096)
    except FileNotFoundError:
        raise VerifyError(f"the web UI archive {url} has no {META}", why="it records the UI's source and files",
                          fix=fix) from None
    except (LlamaBundleError, OSError, ValueError) as e:
        raise VerifyError(f"the web UI archive {url}: {META} is not valid JSON", why=str(e), fix=fix) from None
    ok = (isinstance(meta, dict) and meta.get("schema") == 1 and all(isinstance(meta.get(k), str) and _HEX64.match(meta[k])
                                                                    for k in ("source", "digest"))
          and isinstance(meta.get("files"), int) and not isinstance(meta.get("files"), bool))
    if not ok:
        raise VerifyError(f"the web UI archive {url}: {META} is not what `ui pack` writes",
                          why='it must be {"schema": 1, "source": sha256, "digest": sha256, "files": N}', fix=fix)
    return dict(meta)


def build(src: Path, home: Path, *, cache_dir: Path, log: Log, env: Mapping[str, str], timeout: float | None) -> None:
    npm = shutil.which("npm", path=env.get("PATH") or os.defpath)
    if npm is None:
        raise ToolchainError("the recipe builds llama.cpp's web UI (ui: build) and npm is not on PATH",
                             why="the UI is built once per llama.cpp commit with npm ci and npm run build",
                             fix="install Node.js 20 or newer with npm (Debian/Ubuntu: nodesource's nodejs), or set "
                                 "ui: none in the recipe (a bundle without the web UI)")
    work = _work_dir(cache_dir)
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
