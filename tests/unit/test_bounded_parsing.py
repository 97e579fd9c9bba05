"""Bounded parsing of every file a user, a store or a network controls (issue 30): a bundle.json, a source
marker, an install pointer, an index's index.json, an API answer or a recipe nested 100,000 levels deep gives
that file's own error (exit 5 for a bundle, 2 for a recipe or a usage, 6 for a network answer, 3 for a
toolkit manifest), naming it, never a RecursionError or `internal error` (exit 70); a big file within the
limits (untrusted.MAX_BYTES, MAX_DEPTH levels) still parses. An API answer that is not JSON says what came
back: the URL, the status, the content type and its first bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from llamabundle import build, bundle, keys, net, pyindex, untrusted
from llamabundle.backends.cuda.toolkit.manifest import load_manifest
from llamabundle.bundle import manifest
from llamabundle.bundle.manifest import ManifestError
from llamabundle.errors import RecipeError, ToolchainError
from llamabundle.platforms.windows import msvc
from llamabundle.recipe import parse_recipe
from llamabundle.runtime import results
from llamabundle.runtime.install import BUNDLES, POINTER, list_installed
from llamabundle.source import MARKER, cached_source, fetch_source
from tests import bundles as tb
from tests.clirun import run
from tests.fakegithub import Exchange, FakeGitHub, Request
from tests.ghstore import KEY, REPO, TOKEN, store_for
from tests.gitsources import make_repo, quiet_log, settings_for, write_recipe
from tests.installs import plant
from tests.loopback import Loopback, Reply

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
FILES = {"llama-server": b"#!/bin/sh\nexit 0\n", "LICENSE": b"MIT License\n"}
ROLES = {"llama-server": "exe", "LICENSE": "license"}
N = 100_000
DEEP = b"[" * N + b"]" * N  # 100,000 nested arrays: json.loads alone raises RecursionError
DEEP_OBJECTS = b'{"a":' * N + b"1" + b"}" * N
NESTED = f"nested deeper than {untrusted.MAX_DEPTH} levels"
HTML = b"<!DOCTYPE html>\n<html lang=\"en\"><head><title>Sign in</title></head><body>" + b"x" * 500 + b"</body></html>"


def nested(levels: int, leaf: Any) -> Any:
    """`leaf` inside `levels` alternating lists and objects."""
    for i in range(levels):
        leaf = [leaf] if i % 2 else {"k": leaf}
    return leaf


def clean(code: int, out: str, err: str, want: int, *texts: str) -> str:
    """The command ended with exit `want`, one error message holding `texts`, no traceback or internal error."""
    both = out + err
    assert "Traceback" not in both and "internal error" not in both and "RecursionError" not in both, both
    assert code == want, (code, both)
    for text in texts:
        assert text in both, (text, both)
    return both


# ------------------------------------------------------------------------------------------- the helper


@pytest.mark.parametrize("raw", [DEEP, DEEP_OBJECTS, DEEP.decode(), b"[" * N], ids=["arrays", "objects", "text", "unclosed"])
def test_deep_json_is_refused_before_it_is_parsed(raw: bytes | str) -> None:
    with pytest.raises(untrusted.Untrusted, match=f"^{NESTED}$") as e:
        untrusted.loads(raw)
    assert isinstance(e.value, ValueError)  # the readers that catch ValueError treat it as any damaged file


def test_the_limits_are_exact_and_brackets_in_strings_do_not_count() -> None:
    at = untrusted.MAX_DEPTH
    assert untrusted.loads(b"[" * at + b"]" * at) is not None
    assert untrusted.loads(json.dumps(nested(at, 1))) == nested(at, 1)
    with pytest.raises(untrusted.Untrusted, match=NESTED):
        untrusted.loads(json.dumps(nested(at + 1, 1)))
    tricky = {"s": "[" * N + '\\"{' * 1000, "t": ['"]]]"', "{{{\\\\"]}  # brackets, quotes and escapes in strings
    assert untrusted.loads(json.dumps(tricky)) == tricky
    with pytest.raises(untrusted.Untrusted, match=r"^larger than 1 MiB \(1048577 bytes\)$"):
        untrusted.loads(b" " * (1 << 20) + b"1", max_bytes=1 << 20)
    with pytest.raises(ValueError, match="Expecting value"):  # not JSON: json's own error, for the caller to word
        untrusted.loads(b"<html>")


def test_a_big_file_within_the_limits_parses() -> None:
    big = {"blob": [nested(40, list(range(1000))) for _ in range(1500)]}  # some 7 MB, 42 levels deep
    raw = json.dumps(big).encode()
    assert len(raw) > 5 << 20
    assert untrusted.loads(raw) == big


def test_read_reads_no_more_than_the_limit_and_never_waits_on_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        untrusted.read(fifo)
    (tmp_path / "big.json").write_bytes(b"[" + b"1," * 100_000 + b"1]")
    with pytest.raises(untrusted.Untrusted, match="^larger than 1000 bytes"):
        untrusted.read(tmp_path / "big.json", max_bytes=1000)


def test_preview_is_printable() -> None:
    assert untrusted.preview(b"<a>\n\x00\x1b[31m\xff caf\xc3\xa9") == "'<a>\\n\\x00\\x1b[31m\\xff café'"
    assert untrusted.preview(b"x" * 100).endswith("x'…") and len(untrusted.preview(b"x" * 100)) == 83


# ------------------------------------------------------------------------------------ bundle.json: exit 5


@pytest.mark.parametrize("raw", [DEEP, DEEP_OBJECTS], ids=["arrays", "objects"])
def test_a_deep_manifest_is_a_manifest_error(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / bundle.MANIFEST).write_bytes(raw)
    with pytest.raises(ManifestError) as e:
        bundle.read_manifest(tmp_path)  # what verify, fetch, install, publish, probe and a cache hit read with
    assert e.value.exit_code == 5 and e.value.what == f"bundle.json is {NESTED}"
    with pytest.raises(ManifestError, match=f"^STORE/k/bundle.json is {NESTED}$"):
        manifest.loads(raw, where="STORE/k/bundle.json")


def test_a_big_manifest_within_the_limits_is_read(tmp_path: Path) -> None:
    """Unknown fields of format 1 are kept: a manifest 42 levels deep and of some MB is a manifest."""
    data = tb.write_bundle(tmp_path, FILES, ROLES, extra={"blob": [nested(40, list(range(50))) for _ in range(200)]})
    assert (tmp_path / bundle.MANIFEST).stat().st_size > 1 << 20
    assert bundle.read_manifest(tmp_path).to_json() == data


class World:
    """A good bundle of the Linux recipe (its real key), and doctored copies of it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.key = keys.resolve(keys.load(LINUX)).key
        self.inputs = tb.inputs_of(keys.load(LINUX))
        self.good_zip, _m = tb.make_zip(tmp, FILES, ROLES, zip_name="good.zip", name="linux-x86_64-cpu",
                                        inputs=self.inputs, executables=("llama-server",))

    def stage(self, name: str, manifest_bytes: bytes) -> Path:
        stage = self.tmp / name
        tb.write_bundle(stage, FILES, ROLES, name="linux-x86_64-cpu", inputs=self.inputs, executables=("llama-server",))
        (stage / bundle.MANIFEST).write_bytes(manifest_bytes)
        return stage

    def zip(self, name: str, manifest_bytes: bytes) -> Path:
        return bundle.pack(self.stage(f"stage-{name}", manifest_bytes), self.tmp / name, source_date_epoch=0)


def test_every_command_that_reads_a_bundle_refuses_a_deep_manifest_with_exit_5(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = World(tmp_path)
    directory, zip_path = w.stage("deep-dir", DEEP), w.zip("deep.zip", DEEP)
    store = tmp_path / "store"
    for argv in (["verify", directory], ["verify", zip_path], ["verify", zip_path, "--level", "load"],
                 ["publish", zip_path, "--store", store], ["probe", "--bundle", directory, "--dest", tmp_path / "dest"],
                 ["doctor", "--bundle", directory, "--dest", tmp_path / "dest"]):
        clean(*run(capsys, *argv), 5, f"bundle.json is {NESTED}")
    assert not store.exists() or not any(p for p in store.iterdir() if not p.name.startswith("."))


def test_every_command_that_reads_a_store_entry_refuses_a_deep_manifest_with_exit_5(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = World(tmp_path)
    store = tmp_path / "store"
    entry = plant(store, w.key, w.good_zip, DEEP)
    named = f"{entry / bundle.MANIFEST} is {NESTED}"
    out, dest = tmp_path / "out", tmp_path / "dest"
    for argv in (["check", LINUX, "--store", store], ["fetch", LINUX, "--store", store, "--out", out],
                 ["fetch", w.key, "--store", store, "--out", out],
                 ["install", "--recipe", LINUX, "--store", store, "--dest", dest],
                 ["install", "--key", w.key, "--store", store, "--dest", dest],
                 ["build", LINUX, "--store", store],  # a build's cache hit
                 ["index", "--store", store, "--out", tmp_path / "site"]):
        clean(*run(capsys, *argv), 5, named)
    assert not out.exists() or not any(out.iterdir())
    assert not (tmp_path / "site").exists()


def test_a_store_entry_with_a_big_manifest_within_the_limits_is_used(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    w = World(tmp_path)
    stage = tmp_path / "big"
    data = tb.write_bundle(stage, FILES, ROLES, name="linux-x86_64-cpu", inputs=w.inputs, executables=("llama-server",),
                           extra={"blob": [nested(40, list(range(50))) for _ in range(200)]})
    zip_path = bundle.pack(stage, tmp_path / "big.zip", source_date_epoch=0)
    store = tmp_path / "store"
    plant(store, w.key, zip_path, json.dumps(data))
    clean(*run(capsys, "check", LINUX, "--store", store), 0)
    clean(*run(capsys, "fetch", w.key, "--store", store, "--out", tmp_path / "out"), 0)
    assert (tmp_path / "out" / bundle.MANIFEST).stat().st_size > 1 << 20


# -------------------------------------------------------------- the other files of a store, cache, install


def test_a_deep_source_marker_is_a_damaged_marker_and_the_source_is_fetched_again(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    sha = make_repo(checkout)
    settings = settings_for(tmp_path, "http://127.0.0.1:9")
    recipe = write_recipe(tmp_path / "r.yaml", sha, [f"path: {checkout}"])
    tree = fetch_source(recipe, settings, quiet_log()[0])
    (tree.path / MARKER).write_bytes(DEEP)
    log, text = quiet_log()
    assert cached_source(recipe, settings, log) is None  # a miss, never an exception
    assert f"its marker {MARKER} is damaged: it is {NESTED}; fetching the source again" in text.getvalue()
    assert fetch_source(recipe, settings, quiet_log()[0]) == tree
    assert cached_source(recipe, settings) is not None


def test_a_deep_install_pointer_is_a_damaged_pointer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slot = tmp_path / "dest" / BUNDLES / "linux-x86_64-cpu"
    slot.mkdir(parents=True)
    (slot / POINTER).write_bytes(DEEP)
    assert list_installed(tmp_path / "dest") == []  # as any pointer that does not parse: nothing installed there
    clean(*run(capsys, "list", "--dest", tmp_path / "dest"), 0, "no bundles installed")
    clean(*run(capsys, "uninstall", "linux-x86_64-cpu", "--dest", tmp_path / "dest"), 2, "no installed bundle matches")


def test_a_deep_index_json_in_out_is_not_a_previous_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "store").mkdir()
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.json").write_bytes(DEEP)
    clean(*run(capsys, "index", "--store", tmp_path / "store", "--out", site), 2,
          f"--out {site} is a directory that is not a previous index", f"its index.json is {NESTED}")
    assert (site / "index.json").read_bytes() == DEEP


def test_deep_cached_results_build_stamps_and_vswhere_output(tmp_path: Path) -> None:
    (tmp_path / "result.json").write_bytes(DEEP)
    assert results.read(tmp_path / "result.json", dict) is None  # a cache miss
    (tmp_path / "stamp").write_bytes(DEEP)
    assert build._read_stamp(tmp_path / "stamp") is None  # the build configures again
    with pytest.raises(ToolchainError, match="vswhere's output is not the JSON list it should be"):
        msvc.parse_vswhere(DEEP.decode())


def test_a_deep_toolkit_manifest_is_a_toolchain_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "redistrib_12.8.1.json"
    path.write_bytes(DEEP)
    with pytest.raises(ToolchainError) as e:
        load_manifest(path)
    assert e.value.what == f"{path}: not a readable JSON manifest" and e.value.why == NESTED
    clean(*run(capsys, "toolkit", "plan", "--manifest", path, "--version", "12.8.1", "--components", "cudart"), 3,
          str(path), NESTED)


# ------------------------------------------------------------------------------------ API answers: exit 6


def answer_with(gh: FakeGitHub, body: bytes, ctype: str, path_part: str = "/releases") -> None:
    """Every API request whose path holds `path_part` is answered 200 with `body`, as a proxy or a wrong URL would."""
    def fault(req: Request, h: Exchange) -> bool:
        if req.host != "api" or path_part not in req.path:
            return False
        h.reply(Reply(200, {"Content-Type": ctype}, body))
        return True

    gh.add_fault(fault, once=False)


@pytest.mark.parametrize("tags", [{KEY: "test-bundle-x"}, {}], ids=["by-tag", "bare-key"])
def test_an_api_answer_that_is_not_json_says_what_came_back(gh: FakeGitHub, tags: dict[str, str]) -> None:
    answer_with(gh, HTML, "text/html; charset=utf-8")
    with pytest.raises(net.NetworkError) as e:
        store_for(gh, tags=tags).lookup(KEY)
    err = e.value
    assert err.exit_code == 6 and err.what.startswith("GitHub's answer for ") and err.what.endswith(" is not JSON")
    assert f"{gh.api_url}/repos/{REPO}/releases" in err.why and "answered HTTP 200 (text/html; charset=utf-8, " in err.why
    assert "'<!DOCTYPE html>\\n<html lang=\"en\"><head><title>Sign in</title>" in err.why and "…" in err.why
    assert "Expecting value" in err.why and "GITHUB_API_URL" in err.fix
    assert TOKEN not in err.render()


def test_a_deep_api_answer_is_a_network_error(gh: FakeGitHub) -> None:
    answer_with(gh, DEEP, "application/json; charset=utf-8")
    with pytest.raises(net.NetworkError) as e:
        store_for(gh).list_entries()
    assert e.value.exit_code == 6 and e.value.what == f"GitHub's answer for the release list is {NESTED}"
    assert "answered HTTP 200 (application/json; charset=utf-8, 200000 bytes): '[[[[" in e.value.why


def test_an_api_answer_that_is_not_json_through_the_cli(gh: FakeGitHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LLAMABUNDLE_GITHUB_API_URL", gh.api_url)
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    answer_with(gh, HTML, "text/html")
    both = clean(*run(capsys, "index", "--store", f"github:{REPO}", "--out", tmp_path / "site"), 6,
                 "GitHub's answer for the release list is not JSON", "answered HTTP 200 (text/html, ", "<!DOCTYPE html>")
    assert TOKEN not in both and not (tmp_path / "site").exists()
    key = keys.resolve(keys.load(LINUX)).key
    clean(*run(capsys, "fetch", key, "--store", f"github:{REPO}", "--out", tmp_path / "out"), 6, "is not JSON",
          "answered HTTP 200 (text/html, ")


@pytest.mark.parametrize("body,what", [(HTML, "is not JSON"), (DEEP, f"is {NESTED}")], ids=["html", "deep"])
def test_a_package_index_answer_that_is_not_json_says_what_came_back(body: bytes, what: str) -> None:
    ctype = "application/vnd.pypi.simple.v1+json"
    with Loopback(lambda req: Reply(200, {"Content-Type": ctype}, body)) as server:
        with pytest.raises(pyindex.IndexUnavailable) as e:
            pyindex.project_files("demo", index_url=f"{server.url}/simple", http=net.session())
    assert e.value.exit_code == 6 and e.value.what == f"the package index page {server.url}/simple/demo/ {what}"
    assert f"{server.url}/simple/demo/ answered HTTP 200 ({ctype}, {len(body)} bytes): '{body[:15].decode()}" in e.value.why


# ------------------------------------------------------------------------------------- recipes: exit 2


def deep_flow_recipe(levels: int) -> str:
    return LINUX.read_text() + "extra: " + "[" * levels + "]" * levels + "\n"


def deep_block_recipe(levels: int) -> str:
    return LINUX.read_text() + "".join(f"{' ' * i}k{i}:\n" for i in range(levels)) + f"{' ' * levels}v\n"


@pytest.mark.parametrize("make", [deep_flow_recipe, deep_block_recipe], ids=["flow", "block"])
def test_a_deep_recipe_is_a_recipe_error_naming_file_line_and_column(tmp_path: Path, make: Any,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "deep.yaml"
    p.write_text(make(N if make is deep_flow_recipe else 200))
    lines = LINUX.read_text().count("\n")
    at = f"{p}:{lines + 1}:{8 + 63}" if make is deep_flow_recipe else f"{p}:{lines + 65}:{64 + 1}"
    for argv in (["recipe", "lint", p], ["key", p], ["show", p]):
        clean(*run(capsys, *argv), 2, f"{at}: the recipe nests mappings and lists deeper than 64 levels")
    with pytest.raises(RecipeError) as e:
        keys.load(p)
    assert (e.value.file, e.value.line) == (str(p), int(at.split(":")[-2]))


def test_the_recipe_depth_limit_is_checked_before_the_schema() -> None:
    """64 levels are read (and refused by the schema: no such key); 65 are refused before they are composed."""
    with pytest.raises(RecipeError, match="extra") as e:
        parse_recipe(deep_flow_recipe(63), file="r.yaml")  # the recipe's mapping and 63 lists
    assert "deeper than" not in e.value.what
    with pytest.raises(RecipeError, match=r"^r.yaml:\d+:71: the recipe nests mappings and lists deeper than 64 levels$"):
        parse_recipe(deep_flow_recipe(64), file="r.yaml")


def test_an_alias_bomb_is_refused_at_its_first_alias(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bomb = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
    p = tmp_path / "laughs.yaml"
    p.write_text(LINUX.read_text() + bomb)
    line = LINUX.read_text().count("\n") + 2
    for argv in (["recipe", "lint", p], ["key", p]):
        clean(*run(capsys, *argv), 2, f"{p}:{line}:8: YAML aliases (*a) are not allowed in recipes")


def test_a_shipped_recipe_still_lints(capsys: pytest.CaptureFixture[str]) -> None:
    clean(*run(capsys, "recipe", "lint", LINUX), 0)
