"""Every command, given malformed input, ends with a documented exit code (DESIGN §8) and one message: never a
traceback, never `internal error` (exit 70) for anything a user, a disk or a network can cause (issue 12).

The table below walks each command of the CLI with the inputs an outsider tries: missing, a directory, a
FIFO, bytes that are not UTF-8, YAML of the wrong shape, a zip that is not one, a zip with a symbolic link,
a zip crafted past zipfile's reach (an encrypted member, another method, a data descriptor: tests/craftedzips.py),
bundle.json of the wrong shape or of another key, a store entry whose manifest is malformed, a --store or
--out that is a regular file. A test also checks that no command of the CLI is left out of the table."""

from __future__ import annotations

import json
import os
import stat
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llamabundle import bundle, digest, keys
from tests import bundles as tb
from tests import craftedzips as cz
from tests.clicontract import all_commands
from tests.clirun import run

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
FILES = {"llama-server": b"#!/bin/sh\nexit 0\n", "LICENSE": b"MIT License\n"}
ROLES = {"llama-server": "exe", "LICENSE": "license"}


class World:
    """The malformed inputs, made once per test in tmp."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.recipe_key = keys.resolve(keys.load(LINUX)).key
        self.good_zip, self.good = tb.make_zip(tmp, FILES, ROLES, zip_name="good.zip", name="linux-x86_64-cpu",
                                               inputs=tb.inputs_of(keys.load(LINUX)), executables=("llama-server",))

    def path(self, kind: str) -> Path:
        p = self.tmp / f"in-{kind}"
        if p.exists() or p.is_symlink():
            return p
        if kind == "missing":
            pass
        elif kind == "dir":
            p.mkdir()
        elif kind == "fifo":
            os.mkfifo(p)
        elif kind == "binary":
            p.write_bytes(b"\xff\xfe\x00garbage\x80\x81")
        elif kind == "yaml-list":
            p.write_text("- 1\n- 2\n")
        elif kind == "yaml-bad":
            p.write_text("schema: 1\nname: [unclosed\n")
        elif kind == "recipe-unknown-field":
            p.write_text(LINUX.read_text() + "\nfrobnicate: true\n")
        elif kind == "empty":
            p.write_bytes(b"")
        elif kind == "notzip":
            p.write_bytes(b"PK\x03\x04 this is not really a zip" * 10)
        elif kind == "truncated-zip":
            p.write_bytes(self.good_zip.read_bytes()[: self.good_zip.stat().st_size // 2])
        elif kind == "symlink-zip":
            p.write_bytes(self.good_zip.read_bytes())
            with zipfile.ZipFile(p, "a") as zf:
                info = zipfile.ZipInfo("libevil.so")
                info.external_attr = (stat.S_IFLNK | 0o777) << 16
                zf.writestr(info, "/etc/passwd")
        elif kind in COLLIDING:
            p.write_bytes(self.good_zip.read_bytes())
            with zipfile.ZipFile(p, "a") as zf:
                for name, data in COLLIDING[kind]:
                    info = zipfile.ZipInfo(name)
                    if data is None:
                        info.external_attr = (stat.S_IFLNK | 0o777) << 16
                    zf.writestr(info, data or b"/etc")
        elif kind.startswith("manifest:"):
            self._zip_with_manifest(p, MANIFESTS[kind.removeprefix("manifest:")](self.good))
        elif kind.startswith("crafted:"):
            p.write_bytes(cz.crafted(self.good_zip, kind.removeprefix("crafted:"), "llama-server"))
        elif kind == "regular-file":
            p.write_text("not a directory\n")
        else:
            raise AssertionError(kind)
        return p

    def _zip_with_manifest(self, p: Path, data: Any) -> None:
        stage = self.tmp / f"stage-{p.name}"
        tb.write_bundle(stage, FILES, ROLES, name="linux-x86_64-cpu", inputs=tb.inputs_of(keys.load(LINUX)))
        (stage / bundle.MANIFEST).write_text(json.dumps(data))
        bundle.pack(stage, p, source_date_epoch=0)

    def store(self, manifest: str) -> Path:
        """A local store whose entry for the Linux recipe's key holds the good zip and a malformed bundle.json."""
        root = self.tmp / f"store-{manifest}"
        if root.exists():
            return root
        entry = root / self.recipe_key
        entry.mkdir(parents=True)
        (entry / "linux-x86_64-cpu.zip").write_bytes(self.good_zip.read_bytes())
        (entry / "SHA256SUMS").write_text(f"{digest.sha256_file(self.good_zip)}  linux-x86_64-cpu.zip\n")
        (entry / bundle.MANIFEST).write_text(json.dumps(MANIFESTS[manifest](self.good)))
        return root


# members whose names differ but collide on disk (they made verify and fetch fail with an OSError, exit 70)
COLLIDING: dict[str, list[tuple[str, bytes | None]]] = {
    "file-then-child": [("a", b"x"), ("a/b", b"y")],
    "dir-then-file": [("d/", b""), ("d", b"x")],
    "link-then-child": [("l", None), ("l/x", b"y")],
    "under-the-manifest": [("bundle.json/x", b"y")],
}


def _set(data: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {**data, **kw}


MANIFESTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "list": lambda m: [1, 2],
    "files-str": lambda m: _set(m, files="x"),
    "files-int": lambda m: _set(m, files=[1]),
    "platform-int": lambda m: _set(m, platform=5),
    "key-int": lambda m: _set(m, key=12345),
    "llama-str": lambda m: _set(m, llama_cpp="x"),
    "rekeyed": lambda m: _set(m, key="f" * 64),
    "windows": lambda m: _set(m, platform="windows-x86_64"),
}
FIELD = {"list": "is a list, not an object", "files-str": "'files'", "files-int": "'files[0]'",
         "platform-int": "'platform'", "key-int": "'key'", "llama-str": "'llama_cpp'",
         "rekeyed": "is not the sha256 of the inputs", "windows": "it says platform windows-x86_64"}

# (command line with {placeholders}, exit code, text the message holds)
RECIPE_INPUTS = [("missing", "no such recipe file"), ("dir", ""), ("fifo", ""), ("binary", ""), ("yaml-list", ""),
                 ("yaml-bad", ""), ("recipe-unknown-field", "frobnicate"), ("empty", "")]
RECIPE_COMMANDS = [["show", "{p}"], ["key", "{p}"], ["check", "{p}", "--store", "{store}"], ["archs", "{p}"],
                   ["build", "{p}", "--store", "{store}"], ["fetch", "{p}", "--store", "{store}", "--out", "{out}"],
                   ["install", "--recipe", "{p}", "--store", "{store}", "--dest", "{dest}"], ["recipe", "lint", "{p}"],
                   ["toolkit", "plan", "{p}"], ["toolkit", "install", "{p}"], ["bundle", "{p}", "{dir}", "--out", "{out}"],
                   ["matrix", "{p}", "--store", "{store}"], ["ui", "pack", "{p}", "--out", "{out}"]]
BUNDLE_INPUTS = [("missing", 2, "does not exist"), ("empty", 5, ""), ("notzip", 5, ""), ("truncated-zip", 5, ""),
                 ("symlink-zip", 5, "symbolic link"), ("binary", 5, ""), ("fifo", 2, "")]
BUNDLE_INPUTS += [(f"manifest:{k}", 5, FIELD[k]) for k in MANIFESTS]
BUNDLE_INPUTS += [(k, 5, "which is a file" if k != "dir-then-file" else "collides") for k in COLLIDING]
BUNDLE_INPUTS += [(f"crafted:{k}", 5, cz.REFUSED[k]) for k in ("encrypted", "shrink", "aes", "descriptors", "local-name")]
BUNDLE_COMMANDS = [["verify", "{p}"], ["publish", "{p}", "--store", "{store}"], ["deps", "{p}"],
                   ["verify", "{p}", "--level", "load"]]
STORE_COMMANDS = [["check", str(LINUX), "--store", "{s}"], ["fetch", str(LINUX), "--store", "{s}", "--out", "{out}"],
                  ["fetch", "{key}", "--store", "{s}", "--out", "{out}"],
                  ["install", "--recipe", str(LINUX), "--store", "{s}", "--dest", "{dest}"],
                  ["install", "--key", "{key}", "--store", "{s}", "--dest", "{dest}"],
                  ["build", str(LINUX), "--store", "{s}"], ["matrix", str(LINUX), "--store", "{s}"]]
OTHER: list[tuple[list[str], int, str]] = [
    (["check", str(LINUX), "--store", "{file}"], 2, "not a directory"),
    (["fetch", str(LINUX), "--store", "{file}", "--out", "{out}"], 2, "not a directory"),
    (["publish", "{good}", "--store", "{file}"], 2, "not a directory"),
    (["install", "--recipe", str(LINUX), "--store", "{file}", "--dest", "{dest}"], 2, "not a directory"),
    (["check", str(LINUX), "--store", "ftp://x"], 2, "unknown scheme"),
    (["fetch", "{key}", "--store", "{empty_store}", "--out", "{file}"], 2, "is a file"),
    (["fetch", "{key}", "--store", "{empty_store}", "--out", "{fifo}"], 2, ""),
    (["fetch", "abc", "--store", "{empty_store}", "--out", "{out}"], 2, ""),
    (["install", "--key", "abc", "--store", "{empty_store}", "--dest", "{dest}"], 2, ""),
    (["install", "--key", "{key}", "--store", "{empty_store}", "--dest", "{file}"], 2, ""),
    (["uninstall", "nothing-like-it", "--dest", "{dest}"], 2, "no installed bundle matches"),
    (["list", "--dest", "{file}"], 2, ""),
    (["probe", "--bundle", "{dir}", "--dest", "{dest}"], 5, "has no bundle.json"),
    (["doctor", "--bundle", "{dir}", "--dest", "{dest}"], 5, "has no bundle.json"),
    (["doctor", "--dest", "{file}"], 2, ""),
    (["plan", "{binary}", "--free-vram", "8GiB"], 2, ""),
    (["plan", "{missing}", "--free-vram", "8GiB"], 2, ""),
    (["plan", "{fifo}", "--free-vram", "8GiB"], 2, "not a regular file"),
    (["deps", "{fifo}"], 2, "not a regular file"),
    (["index", "--store", "{file}", "--out", "{out}"], 2, "not a directory"),
    (["index", "--store", "{empty_store}", "--out", "{file}"], 2, ""),
    (["telemetry", "--pid", "abc"], 2, ""),
    (["telemetry", "--max-age", "-1"], 2, ""),
    (["toolkit", "plan", "--manifest", "{fifo}", "--version", "12.8.1", "--components", "cudart"], 2, "not a regular file"),
    (["toolkit", "install", "--version", "12.8.1", "--components", "cudart", "--source", "installer",
      "--installer", "{fifo}", "--dest", "{dest}"], 2, "not a regular file"),
    (["deps", "{missing}"], 2, ""),
    (["deps", "{dir}"], 2, ""),
    (["toolkit", "plan", "--version", "99.0.0", "--components", "cudart", "--platform", "linux-x86_64"], 2, ""),
    (["toolkit", "plan", "--manifest", "{binary}", "--version", "12.8.1", "--components", "cudart"], 3, ""),
    (["recipe", "schema", "extra-arg"], 2, ""),
    (["recipe", "list", "--frob"], 2, ""),
    (["cache", "list", "--frob"], 2, ""),
    (["cache", "prune", "--max", "lots"], 2, "not a size"),
    (["cache", "prune", "--max", "off"], 2, "give a size"),
    (["matrix", "--legs", "{binary}", "--store", "{empty_store}"], 2, "is not a legs file"),
    (["matrix", "--legs", "{fifo}", "--store", "{empty_store}"], 2, ""),
    (["matrix", "--legs", "{missing}", "--store", "{empty_store}"], 2, ""),
    (["matrix", str(LINUX), "--store", "{file}"], 2, "not a directory"),
    (["bundle", str(LINUX), "{dir}", "--out", "{out}"], 2, "is not a CMake build directory"),
    (["bundle", str(LINUX), "{missing}", "--out", "{out}"], 2, "does not exist"),
    (["bundle", str(LINUX), "{file}", "--out", "{out}"], 2, "is a file"),
]


def _fill(argv: list[str], w: World, p: Path | None = None, s: Path | None = None) -> list[str]:
    subs = {"{p}": str(p), "{s}": str(s), "{store}": str(w.tmp / "store"), "{out}": str(w.tmp / "out"),
            "{dest}": str(w.tmp / "dest"), "{key}": w.recipe_key, "{good}": str(w.good_zip),
            "{file}": str(w.path("regular-file")), "{fifo}": str(w.path("fifo")), "{dir}": str(w.path("dir")),
            "{binary}": str(w.path("binary")), "{missing}": str(w.path("missing")),
            "{empty_store}": str(w.tmp / "empty-store")}
    return [subs.get(a, a) for a in argv]


def _check(capsys: pytest.CaptureFixture[str], argv: list[str], code: int, text: str) -> None:
    got, out, err = run(capsys, *argv)
    both = out + err
    assert "Traceback" not in both and "internal error" not in both, (argv, both)
    assert got == code, (argv, got, both)
    if text:
        assert text in both, (argv, both)
    if code not in (0, 1):
        assert err.startswith("error: ") or err.startswith("Usage: ") or "Error: " in err, (argv, err)


@pytest.mark.parametrize("kind,text", RECIPE_INPUTS, ids=[k for k, _ in RECIPE_INPUTS])
def test_every_recipe_command_refuses_a_malformed_recipe_with_exit_2(tmp_path: Path, kind: str, text: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    w = World(tmp_path)
    p = w.path(kind)
    for argv in RECIPE_COMMANDS:
        _check(capsys, _fill(argv, w, p), 2, text)
    assert not (tmp_path / "out").exists() and not (tmp_path / "store").exists()


@pytest.mark.parametrize("kind,code,text", BUNDLE_INPUTS, ids=[k for k, _, _ in BUNDLE_INPUTS])
def test_every_bundle_command_refuses_a_malformed_bundle(tmp_path: Path, kind: str, code: int, text: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    w = World(tmp_path)
    p = w.path(kind)
    for argv in BUNDLE_COMMANDS:
        want = code
        if argv[0] == "deps":  # deps reads binaries, not bundles: anything that is not PE/ELF is a usage error
            want = 2
        _check(capsys, _fill(argv, w, p), want, text if argv[0] != "deps" else "")
    store = tmp_path / "store"
    assert not store.exists() or not any(p for p in store.iterdir() if not p.name.startswith("."))
    leftovers = list((tmp_path / "cache-tmp").glob("*")) if (tmp_path / "cache-tmp").exists() else []
    assert leftovers == []


@pytest.mark.parametrize("manifest", list(MANIFESTS))
def test_every_store_command_refuses_a_store_entry_with_a_malformed_manifest(
        tmp_path: Path, manifest: str, capsys: pytest.CaptureFixture[str]) -> None:
    w = World(tmp_path)
    s = w.store(manifest)
    for argv in STORE_COMMANDS:
        _check(capsys, _fill(argv, w, s=s), 5, FIELD[manifest])
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
        assert not (tmp_path / "dest" / "bundles").exists() or not [
            p for p in (tmp_path / "dest" / "bundles").iterdir() if not p.name.startswith(".")]


@pytest.mark.parametrize("argv,code,text", OTHER, ids=[" ".join(a[:2]) + f"-{i}" for i, (a, _, _) in enumerate(OTHER)])
def test_other_malformed_inputs(tmp_path: Path, argv: list[str], code: int, text: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    w = World(tmp_path)
    (tmp_path / "empty-store").mkdir()
    _check(capsys, _fill(argv, w), code, text)


def test_the_walk_covers_every_command() -> None:
    walked = {" ".join(a[:2]) if a[0] in ("recipe", "toolkit", "cache", "ui") else a[0]
              for a in [*RECIPE_COMMANDS, *BUNDLE_COMMANDS, *STORE_COMMANDS, *(o[0] for o in OTHER)]}
    commands = {" ".join(c) for c in all_commands() if c and not (len(c) == 1 and c[0] in ("recipe", "toolkit", "cache", "ui"))}
    assert commands - walked == set(), "add malformed inputs for these commands"
