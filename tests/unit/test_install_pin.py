"""install pinned from outside the release (--expect-sha256, --digests): a release whose zip and bundle.json
were both replaced agrees with itself and passes every check of DESIGN §5, but not the pin. Real zips
(tests/bundles.py) in a real local store and a fake GitHub; a refused install leaves nothing behind and the
previous install usable."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llamabundle import bundle, digest
from llamabundle.errors import UsageError
from llamabundle.log import Log
from llamabundle.reasons import Reason
from llamabundle.runtime.install import (
    BUNDLES,
    POINTER,
    BundleInvalid,
    Installed,
    check_bundle,
    install_bundle,
    list_installed,
    load_digests,
    parse_sha256,
)
from llamabundle.store.base import Entry
from llamabundle.store.github import GitHubStore
from llamabundle.store.local import SUMS, LocalStore
from tests import bundles as tb
from tests.clirun import run
from tests.fakegithub import FakeGitHub

QUIET = Log(quiet=True)
NAME = "pin-bundle"
PLATFORM = "linux-x86_64"
REPO = "acme/bundles"
ROLES = {"llama-server": "exe", "libggml-cpu.so": "backend", "LICENSE": "license"}


@dataclass
class Made:
    zip_path: Path
    manifest_bytes: bytes  # bundle.json as it is in the zip
    key: str

    @property
    def sha256(self) -> str:
        return digest.sha256_file(self.zip_path)

    @property
    def sums_line(self) -> str:
        return f"{self.sha256}  {self.zip_path.name}\n"


def make(tmp: Path, tag: str = "a", *, server: bytes = b"#!/bin/sh\necho genuine\n", where: str = "") -> Made:
    """A real bundle zip (tests.bundles) named as a release names it, `<name>-<key12>.zip`; `where` keeps two
    zips of one key (a genuine one and its replacement) apart."""
    inputs = tb.inputs_for(tag)
    key = tb.key_of(inputs)
    out = tmp / f"made-{tag}-{where or 'genuine'}"
    files = {"llama-server": server, "libggml-cpu.so": b"cpu backend " + tag.encode() + b"\n", "LICENSE": b"MIT\n"}
    zip_path, _m = tb.make_zip(out, files, ROLES, zip_name=f"{NAME}-{key[:12]}.zip", name=NAME, inputs=inputs,
                               executables=("llama-server",), backends=["cpu"])
    stage = next(out.glob("stage-*"))
    return Made(zip_path=zip_path, manifest_bytes=(stage / bundle.MANIFEST).read_bytes(), key=key)


def evil_twin(tmp: Path, tag: str = "a") -> Made:
    """The same key, other files, a bundle.json consistent with them: what replacing both assets of a release
    gives. It passes manifest.trust: only a pin from outside the release refuses it."""
    return make(tmp, tag, server=b"#!/bin/sh\necho pwned\n", where="evil")


def plant(store_root: Path, made: Made) -> None:
    """The store entry of `made`, written by a hand that replaced the genuine one (zip, SHA256SUMS, bundle.json)."""
    d = store_root / made.key
    d.mkdir(parents=True, exist_ok=True)
    for old in d.iterdir():
        old.unlink()
    (d / made.zip_path.name).write_bytes(made.zip_path.read_bytes())
    (d / SUMS).write_text(made.sums_line, encoding="utf-8")
    (d / bundle.MANIFEST).write_bytes(made.manifest_bytes)


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".locks" not in p.parts) if root.exists() else []


def install(store: Any, key: str, root: Path, **kw: Any) -> Any:
    return install_bundle(store, key, root=root, log=QUIET, platform=PLATFORM, **kw)


def assert_refused(store: Any, key: str, root: Path, what: str, **kw: Any) -> BundleInvalid:
    before = [p for p in tree(root) if p not in (BUNDLES, f"{BUNDLES}/{NAME}")]
    with pytest.raises(BundleInvalid) as e:
        install(store, key, root, **kw)
    assert e.value.exit_code == 5 and e.value.reason is Reason.BUNDLE_INVALID
    assert what in e.value.what, e.value.what
    assert e.value.why and e.value.fix
    assert [p for p in tree(root) if p not in (BUNDLES, f"{BUNDLES}/{NAME}")] == before  # nothing written, no stage left
    return e.value


def still_usable(root: Path, inst: Installed) -> None:
    assert list_installed(root) == [inst]
    check_bundle(inst.path, key=inst.key, platform=PLATFORM)
    assert (inst.path / "llama-server").read_bytes() == b"#!/bin/sh\necho genuine\n"


def pointer(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / BUNDLES / NAME / POINTER).read_text(encoding="utf-8"))
    return data


def digest_file(tmp: Path, text: str, name: str = "digests.txt") -> Path:
    p = tmp / name
    p.write_text(text, encoding="utf-8", newline="")
    return p


@dataclass
class Spy:
    """A store that counts fetches and can lie: `claim` replaces the sha256 its lookup reports, `serve` the zip
    its fetch hands back (unchecked), as a compromised mirror would."""

    inner: LocalStore
    claim: str | None = None
    serve: Path | None = None
    fetches: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.inner.url

    def lookup(self, key: str) -> Entry | None:
        e = self.inner.lookup(key)
        if e is None or self.claim is None:
            return e
        return Entry(key=e.key, zip_name=e.zip_name, zip_sha256=self.claim, zip_size=e.zip_size, manifest=e.manifest,
                     location=e.location)

    def fetch(self, entry: Entry, dest: Path, **kw: Any) -> Path:
        self.fetches.append(entry.key)
        if self.serve is None:
            return self.inner.fetch(self.inner.lookup(entry.key) or entry, dest, **kw)
        dest.mkdir(parents=True, exist_ok=True)
        out = dest / entry.zip_name
        out.write_bytes(self.serve.read_bytes())
        return out

    def publish(self, zip_path: Path, manifest: Any) -> Any:
        return self.inner.publish(zip_path, manifest)


@pytest.fixture()
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


# ------------------------------------------------------------------------------------------ the Python API


def test_the_pinned_zip_installs_and_the_pin_is_recorded(tmp_path: Path, store: LocalStore) -> None:
    g = make(tmp_path)
    plant(store.root, g)
    root = tmp_path / "data"
    out = install(store, g.key, root, expect_sha256=g.sha256.upper())  # either case, as people paste it
    assert not out.reused and out.installed.key == g.key and out.installed.zip_sha256 == g.sha256
    assert out.to_json()["pinned"] == {"sha256": g.sha256, "source": "--expect-sha256"}
    assert pointer(root)["zip_sha256"] == g.sha256
    again = install(store, g.key, root, expect_sha256=g.sha256)  # the install came from the pinned zip: reused
    assert again.reused and again.installed == out.installed and again.pinned == out.pinned
    assert install(store, g.key, root).to_json()["pinned"] is None


def test_a_wrong_pin_is_refused_before_the_download_and_the_previous_install_stays(tmp_path: Path,
                                                                                   store: LocalStore) -> None:
    old, new = make(tmp_path, "old"), make(tmp_path, "new")
    plant(store.root, old)
    plant(store.root, new)
    root = tmp_path / "data"
    kept = install(store, old.key, root).installed
    spy = Spy(store)
    e = assert_refused(spy, new.key, root, f"has sha256 {new.sha256}, not the {old.sha256} pinned by --expect-sha256",
                       expect_sha256=old.sha256)
    assert "(bundle_invalid)" in e.what and "nothing was downloaded" in e.why
    assert "gh attestation verify" in e.fix and "rebuilt on purpose" in e.fix
    assert spy.fetches == []  # the store's own digest already differs from the pin: no download at all
    still_usable(root, kept)


def test_the_downloaded_bytes_are_checked_before_anything_is_unpacked(tmp_path: Path, store: LocalStore) -> None:
    """A store that claims the pinned digest but hands back another zip: the bytes on disk decide."""
    g, other = make(tmp_path, "g"), make(tmp_path, "other")
    plant(store.root, g)
    plant(store.root, other)
    root = tmp_path / "data"
    kept = install(store, other.key, root).installed  # an install of the same name to keep
    spy = Spy(store, claim=g.sha256, serve=evil_twin(tmp_path, "g").zip_path)
    points: list[str] = []
    e = assert_refused(spy, g.key, root, f"not the {g.sha256} pinned by --expect-sha256", expect_sha256=g.sha256,
                       hook=points.append)
    assert spy.fetches == [g.key] and "the zip downloaded from" in e.why
    assert points == []  # refused before "downloaded": never extracted, never checked, never swapped
    assert list_installed(root) == [kept]


def test_a_consistently_replaced_release_passes_today_but_not_the_pin_nor_the_digest_list(tmp_path: Path,
                                                                                         store: LocalStore) -> None:
    g = make(tmp_path)
    plant(store.root, g)
    pinned_root = tmp_path / "pinned"
    genuine = install(store, g.key, pinned_root, expect_sha256=g.sha256).installed
    digests = digest_file(tmp_path, g.sums_line)  # the list the app ships: the release's own SHA256SUMS line

    evil = evil_twin(tmp_path)
    assert evil.key == g.key and evil.zip_path.name == g.zip_path.name and evil.sha256 != g.sha256
    plant(store.root, evil)  # zip, SHA256SUMS and bundle.json all replaced, all agreeing

    # without a pin it passes every check there is: the gap the pin closes
    naive = install(store, g.key, tmp_path / "naive").installed
    assert (naive.path / "llama-server").read_bytes() == b"#!/bin/sh\necho pwned\n"

    for kw, by in (({"expect_sha256": g.sha256}, "--expect-sha256"), ({"digests": load_digests(digests)}, f"{digests}:1")):
        assert_refused(store, g.key, tmp_path / "fresh", f"pinned by {by}", **kw)
        assert not list_installed(tmp_path / "fresh")
        # the tampered install of today is not reused under the pin, and is left as it is
        assert_refused(store, g.key, tmp_path / "naive", f"pinned by {by}", **kw)
        assert list_installed(tmp_path / "naive") == [naive]
        # an install that came from the pinned zip is still that zip: reused, nothing downloaded
        again = install(Spy(store), g.key, pinned_root, **kw)
        assert again.reused and again.installed == genuine
    still_usable(pinned_root, genuine)


def test_an_install_without_a_recorded_zip_digest_is_checked_again_under_a_pin(tmp_path: Path,
                                                                              store: LocalStore) -> None:
    g = make(tmp_path)
    plant(store.root, g)
    root = tmp_path / "data"
    first = install(store, g.key, root).installed
    ptr = pointer(root)
    del ptr["zip_sha256"]  # as an install made before pointers recorded it
    (root / BUNDLES / NAME / POINTER).write_text(json.dumps(ptr), encoding="utf-8")
    spy = Spy(store)
    out = install(spy, g.key, root, expect_sha256=g.sha256)
    assert spy.fetches == [g.key] and not out.reused and out.replaced == g.key
    assert out.installed.zip_sha256 == g.sha256 and not first.path.exists()


def test_the_digest_list_pins_by_zip_name_or_by_key(tmp_path: Path, store: LocalStore) -> None:
    a, b = make(tmp_path, "a"), make(tmp_path, "b")
    plant(store.root, a)
    plant(store.root, b)
    text = ("# the bundles this app installs\n\n"
            f"{a.sha256} *{a.zip_path.name}\r\n"  # sha256sum's binary mode, CRLF line ends
            f"{b.sha256}  {b.key}\n")             # by cache key
    digests = load_digests(digest_file(tmp_path, text))
    out_a = install(store, a.key, tmp_path / "ra", digests=digests)
    out_b = install(store, b.key, tmp_path / "rb", digests=digests)
    assert out_a.to_json()["pinned"] == {"sha256": a.sha256, "source": f"digests:{digests.path}"}
    assert out_a.pinned is not None and out_a.pinned.line == 3
    assert out_b.pinned is not None and out_b.pinned.sha256 == b.sha256 and out_b.pinned.line == 4


def test_a_bundle_the_digest_list_lacks_is_refused_with_how_to_add_it(tmp_path: Path, store: LocalStore) -> None:
    a, b = make(tmp_path, "a"), make(tmp_path, "b")
    plant(store.root, a)
    plant(store.root, b)
    path = digest_file(tmp_path, a.sums_line)
    root = tmp_path / "data"
    kept = install(store, a.key, root, digests=load_digests(path)).installed
    spy = Spy(store)
    e = assert_refused(spy, b.key, root, f"{b.zip_path.name} is not in the digest list {path}",
                       digests=load_digests(path))
    assert spy.fetches == []
    assert f"`<sha256>  {b.zip_path.name}`" in e.fix and str(path) in e.fix and "ship the updated list" in e.fix
    still_usable(root, kept)


def test_a_wrong_line_in_the_digest_list_says_which_line_to_update(tmp_path: Path, store: LocalStore) -> None:
    g = make(tmp_path)
    plant(store.root, g)
    path = digest_file(tmp_path, f"{'ab' * 32}  other.zip\n{'0' * 64}  {g.zip_path.name}\n")
    e = assert_refused(store, g.key, tmp_path / "data", f"pinned by {path}:2", digests=load_digests(path))
    assert f"line 2 of {path}" in e.fix


def test_pin_arguments_are_checked_before_the_store_is_asked(tmp_path: Path) -> None:
    spy = Spy(LocalStore(tmp_path / "store"))
    for bad in ("", "abc", "0" * 63, "0" * 65, "g" * 64, " " + "0" * 64):
        with pytest.raises(UsageError) as e:
            install(spy, "0" * 64, tmp_path / "data", expect_sha256=bad)
        assert e.value.exit_code == 2 and "is not a sha256" in e.value.what
    path = digest_file(tmp_path, f"{'0' * 64}  x.zip\n")
    with pytest.raises(UsageError, match="at most one"):
        install(spy, "0" * 64, tmp_path / "data", expect_sha256="0" * 64, digests=load_digests(path))
    assert spy.fetches == [] and not (tmp_path / "data").exists()
    assert parse_sha256("AB" * 32) == "ab" * 32


MALFORMED = {
    "short digest": (f"{'0' * 63}  a.zip\n", 1),
    "upper case": (f"{'A' * 64}  a.zip\n", 1),
    "one space": (f"{'0' * 64} a.zip\n", 1),
    "no name": (f"{'0' * 64}  \n", 1),
    "a path": (f"# ok\n{'0' * 64}  a.zip\n{'1' * 64}  dist/b.zip\n", 3),
    "a second digest": (f"{'0' * 64}  a.zip\n\n{'1' * 64}  a.zip\n", 3),
    "prose": ("the digests are on the release page\n", 1),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_digest_list_names_file_and_line(tmp_path: Path, case: str) -> None:
    text, line = MALFORMED[case]
    path = digest_file(tmp_path, text)
    with pytest.raises(UsageError) as e:
        load_digests(path)
    assert e.value.exit_code == 2 and e.value.what.startswith(f"{path}:{line}: "), e.value.what
    assert (e.value.file, e.value.line) == (str(path), line) and e.value.fix


def test_a_digest_list_that_is_not_text_or_lists_nothing_is_a_usage_error(tmp_path: Path) -> None:
    binary = tmp_path / "bin.txt"
    binary.write_bytes(f"{'0' * 64}  a.zip\n".encode() + b"\xff\xfe  b.zip\n")
    with pytest.raises(UsageError, match=f"^{binary}:2: the digest list is not UTF-8 text"):
        load_digests(binary)
    with pytest.raises(UsageError, match="lists no bundle"):
        load_digests(digest_file(tmp_path, "# nothing yet\n\n", "empty.txt"))
    with pytest.raises(UsageError, match="cannot read the digest list"):
        load_digests(tmp_path / "missing.txt")
    with pytest.raises(UsageError, match="not a regular file"):
        load_digests(tmp_path)


def test_a_digest_list_giving_two_digests_by_name_and_by_key_is_a_usage_error(tmp_path: Path, store: LocalStore) -> None:
    g = make(tmp_path)
    plant(store.root, g)
    path = digest_file(tmp_path, f"{g.sha256}  {g.zip_path.name}\n{'0' * 64}  {g.key}\n")
    with pytest.raises(UsageError) as e:
        install(store, g.key, tmp_path / "data", digests=load_digests(path))
    assert e.value.exit_code == 2 and "lines 1 and 2 give two sha256" in e.value.what and e.value.line == 2


# ------------------------------------------------------------------------------------------------- the CLI


def install_json(capsys: pytest.CaptureFixture[str], *argv: object, code: int = 0) -> dict[str, Any]:
    got, out, err = run(capsys, "install", *argv, "--json")
    assert got == code, (out, err)
    obj: dict[str, Any] = json.loads(out)
    name = "install" if code == 0 else "error"
    schema = json.loads((resources.files("llamabundle.data") / "schemas" / f"cli-{name}.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(schema).validate(obj)
    return obj


def test_cli_pins_record_their_source_in_the_json(tmp_path: Path, store: LocalStore,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    g = make(tmp_path)
    plant(store.root, g)
    base = ("--store", store.root, "--key", g.key)
    data = install_json(capsys, *base, "--dest", tmp_path / "d1", "--expect-sha256", g.sha256)
    assert data["pinned"] == {"sha256": g.sha256, "source": "--expect-sha256"} and data["reused"] is False
    path = digest_file(tmp_path, g.sums_line)
    data = install_json(capsys, *base, "--dest", tmp_path / "d2", "--digests", path)
    assert data["pinned"] == {"sha256": g.sha256, "source": f"digests:{path}"}
    assert install_json(capsys, *base, "--dest", tmp_path / "d3")["pinned"] is None
    code, _out, err = run(capsys, "install", *base, "--dest", tmp_path / "d1", "--expect-sha256", g.sha256)
    assert code == 0 and "already installed and intact" in err + _out


def test_cli_refuses_a_replaced_github_release_by_pin_and_by_digest_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    g = make(tmp_path)
    evil = evil_twin(tmp_path)
    digests = digest_file(tmp_path, g.sums_line)
    with FakeGitHub(REPO) as gh:
        monkeypatch.setenv("LLAMABUNDLE_GITHUB_API_URL", gh.api_url)
        for var in ("GITHUB_TOKEN", "GH_TOKEN"):
            monkeypatch.delenv(var, raising=False)
        # the release as the attacker left it: zip, bundle.json and SHA256SUMS all replaced, all agreeing
        gh.add_release(f"{NAME}-{g.key[:12]}", draft=False, assets={
            evil.zip_path.name: evil.zip_path.read_bytes(), bundle.MANIFEST: evil.manifest_bytes,
            SUMS: evil.sums_line.encode()})
        base = ("--store", f"github:{REPO}", "--key", g.key)
        store = GitHubStore(REPO, api_url=gh.api_url, log=QUIET)
        assert install(store, g.key, tmp_path / "naive").installed.key == g.key  # today: it passes
        fetched = len(gh.downloads(evil.zip_path.name))

        for pin in (("--expect-sha256", g.sha256), ("--digests", digests)):
            err = install_json(capsys, *base, "--dest", tmp_path / "data", *pin, code=5)["error"]
            assert f"has sha256 {evil.sha256}, not the {g.sha256} pinned by" in err["what"], err
            assert "nothing was downloaded" in err["why"] and err["fix"].startswith("do not install it")
            assert not list_installed(tmp_path / "data")
            assert len(gh.downloads(evil.zip_path.name)) == fetched  # refused on the release's digest: not fetched
        # a pin of what the release holds installs it (downloaded, the bytes hashed, then unpacked)
        data = install_json(capsys, *base, "--dest", tmp_path / "data", "--expect-sha256", evil.sha256)
        assert data["pinned"]["sha256"] == evil.sha256 and len(gh.downloads(evil.zip_path.name)) == fetched + 1


def test_cli_refuses_a_key_the_digest_list_lacks_with_exit_5(tmp_path: Path, store: LocalStore,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make(tmp_path, "a"), make(tmp_path, "b")
    plant(store.root, a)
    plant(store.root, b)
    path = digest_file(tmp_path, a.sums_line)
    err = install_json(capsys, "--store", store.root, "--key", b.key, "--dest", tmp_path / "data", "--digests", path,
                       code=5)["error"]
    assert f"is not in the digest list {path}" in err["what"] and "add the line" in err["fix"]
    assert not (tmp_path / "data" / BUNDLES / NAME / POINTER).exists()
    code, _out, text = run(capsys, "install", "--store", store.root, "--key", b.key, "--dest", tmp_path / "data",
                           "--digests", path)
    assert code == 5 and "error:" in text and "fix:" in text and "Traceback" not in text


@pytest.mark.parametrize("argv", [
    ("--expect-sha256", "abc"),
    ("--expect-sha256", "z" * 64),
    ("--expect-sha256", "0" * 64, "--digests", "DIGESTS"),
    ("--expect-sha256", "abc", "--if-needed"),
    ("--digests", "MISSING"),
    ("--digests", "MALFORMED"),
])
def test_cli_malformed_pins_are_usage_errors(tmp_path: Path, store: LocalStore, capsys: pytest.CaptureFixture[str],
                                             argv: tuple[str, ...]) -> None:
    g = make(tmp_path)
    plant(store.root, g)
    files = {"DIGESTS": digest_file(tmp_path, g.sums_line), "MISSING": tmp_path / "missing.txt",
             "MALFORMED": digest_file(tmp_path, f"{g.sums_line}{g.sha256[:-1]}  b.zip\n", "bad.txt")}
    args = [str(files.get(a, a)) for a in argv]
    err = install_json(capsys, "--store", store.root, "--key", g.key, "--dest", tmp_path / "data", *args, code=2)["error"]
    assert err["exit_code"] == 2 and err["fix"], err
    if "MALFORMED" in argv:
        assert err["what"].startswith(f"{files['MALFORMED']}:2: ") and (err["file"], err["line"]) == (str(files["MALFORMED"]), 2)
    assert not (tmp_path / "data").exists()


def test_the_pin_is_the_sha256_of_the_zip_file_itself(tmp_path: Path) -> None:
    """What an app pins is what `sha256sum` prints for the released zip (and what SHA256SUMS lists)."""
    g = make(tmp_path)
    assert g.sha256 == hashlib.sha256(g.zip_path.read_bytes()).hexdigest()
    assert load_digests(digest_file(tmp_path, g.sums_line)).entries == {g.zip_path.name: (g.sha256, 1)}
