"""The command line (DESIGN §8): exit codes, one message per failure, no tracebacks, real stores and bundles."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llamabundle import bundle, keys
from llamabundle.digest import canonical_json
from tests.clibundles import FILES, LINUX, LINUX_KEY, WINDOWS, make_bundle_dir, make_bundle_zip
from tests.clicontract import all_commands
from tests.clirun import run  # noqa: E402

# --------------------------------------------------------------------------------- recipes / key


def test_recipe_lint_of_the_shipped_recipes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "recipe", "lint", LINUX, WINDOWS)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"ok  {LINUX}  (linux-x86_64-cpu, key {LINUX_KEY[:12]})")
    assert lines[1].startswith(f"ok  {WINDOWS}  (windows-x86_64-cuda12.8, key ")


def test_recipe_lint_of_a_malformed_recipe_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text = LINUX.read_text().replace("backends: [cpu]", "backend: [cpu]")
    bad.write_text(text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith("backend:"))
    p = subprocess.run([sys.executable, "-m", "llamabundle", "recipe", "lint", str(bad)], capture_output=True, text=True,
                       env={**os.environ, "NO_COLOR": "1"}, timeout=60)
    assert p.returncode == 2
    assert f"{bad}:{line}:1: backend: unknown key 'backend'" in p.stderr
    assert "did you mean 'backends'?" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert p.stdout == ""


def test_recipe_lint_reports_every_file_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    code, out, err = run(capsys, "recipe", "lint", LINUX, missing)
    assert code == 2
    assert out.startswith(f"ok  {LINUX}")
    assert f"{missing}: no such recipe file" in err


def test_key_and_explain(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "key", LINUX)
    assert code == 0
    assert re.fullmatch(r"[0-9a-f]{64}\n", out)
    assert out.strip() == LINUX_KEY

    code, out, _ = run(capsys, "key", LINUX, "--explain")
    assert code == 0
    canonical, last = out.splitlines()
    assert canonical == canonical_json(keys.resolve(keys.load(LINUX)).inputs)
    assert hashlib.sha256(canonical.encode()).hexdigest() == LINUX_KEY
    assert last == f"sha256 = {LINUX_KEY}"
    inputs = json.loads(canonical)
    assert inputs["platform"] == "linux-x86_64"
    assert inputs["commit"] == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert inputs["backends"] == ["cpu"]
    assert "name" not in inputs and "publish" not in inputs and "sources" not in inputs  # not key inputs (§4)


def test_show_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "g++").symlink_to(shutil.which("g++") or "/usr/bin/g++")  # the unpinned recipe's key names it
    monkeypatch.setenv("PATH", str(tmp_path))  # no cmake/ninja to query: the plan shows bare names
    code, out, err = run(capsys, "show", LINUX, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["key"] == LINUX_KEY
    assert data["name"] == "linux-x86_64-cpu"
    assert data["platform"] == "linux-x86_64"
    assert data["sources"] == ["github:ggml-org/llama.cpp", "pypi:llama-cpp-python==0.3.36"]
    assert data["tag"] == f"linux-x86_64-cpu-{LINUX_KEY[:12]}"
    plan = data["plan"]
    # found without running anything (the unit-test guard refuses to start cmake): a bare name, or the
    # cmake of the PyPI package when that is installed
    assert plan["configure"][0] == "cmake" or plan["configure"][0].endswith("/cmake")
    assert "-DGGML_BACKEND_DL=ON" in plan["configure"]


def test_show_prints_the_links_and_the_commands_run_before_configuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A CUDA build's fixed-length links and the pin's compile, as the build makes them (the toolkit's link too
    once a toolkit is prepared; show prepares none)."""
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    cuda = Path(__file__).resolve().parents[2] / "recipes" / "linux-x86_64-cuda13.0.yaml"
    code, out, err = run(capsys, "show", cuda)
    assert code == 0, err
    links = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("links ")]
    assert len(links) == 2 and all(line.startswith(str(tmp_path / "cache" / "fixed")) for line in links)
    assert links[0].endswith(f"-> {tmp_path / 'cache' / 'src' / '0c1e57098bba43ac29e6e3b677cdceebdd22334f'}")
    runs = [line for line in out.splitlines() if line.startswith("runs ")]
    assert len(runs) == 1 and "-shared" in runs[0] and runs[0].endswith("cicc_pin.c -ldl")
    code, data, err = run(capsys, "show", cuda, "--json")
    plan = json.loads(data)["plan"]
    assert len(plan["links"]) == 2 and plan["commands"][0][-2:] == [runs[0].split()[-2], "-ldl"]


# --------------------------------------------------------------------------------- store commands


def test_check_publish_check_fetch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    code, out, _ = run(capsys, "check", LINUX, "--store", store)
    assert code == 1
    assert out == f"miss  {LINUX_KEY}  not in {store.resolve()}\n"

    code, out, _ = run(capsys, "check", LINUX, "--store", store, "--json")
    assert code == 1
    assert json.loads(out)["hit"] is False

    zip_path = make_bundle_zip(tmp_path)
    code, out, err = run(capsys, "publish", zip_path, "--store", store)
    assert code == 0, err
    stored = store.resolve() / LINUX_KEY / zip_path.name
    assert out == f"published: {LINUX_KEY} -> {stored}\n"

    code, out, err = run(capsys, "publish", zip_path, "--store", store)
    assert code == 0, err
    assert out == f"already published: {LINUX_KEY} -> {stored}\n"

    code, out, _ = run(capsys, "check", LINUX, "--store", store)
    assert code == 0
    assert out == f"hit   {LINUX_KEY}  {stored}\n"

    code, out, _ = run(capsys, "check", LINUX, "--store", f"file://{store}", "--json")
    assert code == 0
    data = json.loads(out)
    assert data == {"schema": 1, "ok": True, "key": LINUX_KEY, "hit": True, "store": str(store.resolve()),
                    "location": str(stored)}

    dest = tmp_path / "new" / "bundle"
    code, out, err = run(capsys, "fetch", LINUX_KEY, "--store", store, "--out", dest, "--level", "load")
    assert code == 0, err
    assert out == f"fetched and verified: {dest}\n"
    assert "load: passed" in err
    # verified before the rename into --out, and named by --out, not by the directory it was checked in
    assert f"CPU backend loaded from {dest / 'libggml-cpu.so'}" in err and ".partial-" not in err
    assert err.index("load: passed") < err.index(f"bundle unpacked in {dest}")
    assert sorted(p.name for p in dest.iterdir()) == ["LICENSE", "bundle.json", "llama-server"]
    for rel, data_ in FILES.items():
        assert (dest / rel).read_bytes() == data_
    assert os.access(dest / "llama-server", os.X_OK)

    # by recipe path, into an existing empty directory
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = run(capsys, "fetch", LINUX, "--store", store, "--out", empty)
    assert code == 0, err
    assert (empty / "LICENSE").read_bytes() == FILES["LICENSE"]

    # an --out that already holds this very bundle is a success (another fetch of it may have finished first)
    code, out, err = run(capsys, "fetch", LINUX_KEY, "--store", store, "--out", dest)
    assert code == 0 and "already holds this bundle" in err, err
    assert sorted(p.name for p in dest.iterdir()) == ["LICENSE", "bundle.json", "llama-server"]
    # any other non-empty --out is refused and left alone
    (empty / "bundle.json").write_text("{}")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    for taken in (other, empty):
        code, out, err = run(capsys, "fetch", LINUX_KEY, "--store", store, "--out", taken)
        assert code == 2 and f"--out {taken} exists and is not empty" in err, err
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_fetch_of_a_missing_key_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "fetch", "ef" * 32, "--store", tmp_path / "store", "--out", tmp_path / "o")
    assert code == 2
    assert f"no bundle with key {'ef' * 6}" in err
    assert not (tmp_path / "o").exists()


def test_fetch_of_something_neither_key_nor_recipe_is_a_usage_error(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    not_a_key = "z" * 64
    code, _, err = run(capsys, "fetch", not_a_key, "--store", tmp_path / "store", "--out", tmp_path / "o")
    assert code == 2
    assert f"{not_a_key}: no such recipe file" in err
    assert not (tmp_path / "o").exists()


def test_check_reports_a_damaged_store_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    zip_path = make_bundle_zip(tmp_path)
    assert run(capsys, "publish", zip_path, "--store", store)[0] == 0
    stored = store / LINUX_KEY / zip_path.name
    data = bytearray(stored.read_bytes())
    data[-30] ^= 0xFF
    stored.write_bytes(bytes(data))
    code, out, err = run(capsys, "check", LINUX, "--store", store)
    assert code == 5
    assert "does not match its SHA256SUMS" in err
    assert "Traceback" not in err


def test_publish_refuses_a_bundle_that_does_not_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stage, _ = make_bundle_dir(tmp_path)
    (stage / "LICENSE").write_bytes(b"MIT Licensf\n")  # same size, other bytes
    zip_path = bundle.pack(stage, tmp_path / "bad.zip")
    code, out, err = run(capsys, "publish", zip_path, "--store", tmp_path / "store")
    assert code == 5
    assert "LICENSE does not match its sha256 in bundle.json" in err
    assert not (tmp_path / "store" / LINUX_KEY).exists()


# --------------------------------------------------------------------------------- verify / build


def test_verify_a_good_zip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zip_path = make_bundle_zip(tmp_path)
    code, out, err = run(capsys, "verify", zip_path)
    assert code == 0, err
    total = sum(len(v) for v in FILES.values())
    assert out.splitlines()[0] == f"verified {zip_path}: 2 files, {total / 1e6:.1f} MB, key {LINUX_KEY[:12]}"
    assert "  static: passed" in out.splitlines()

    code, out, _ = run(capsys, "verify", zip_path, "--json")
    assert code == 0
    data = json.loads(out)
    assert (data["files"], data["bytes"], data["key"]) == (2, total, LINUX_KEY)
    assert data["levels"] == {"manifest": "passed", "static": "passed"}


def test_verify_a_directory_with_one_changed_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stage, _ = make_bundle_dir(tmp_path)
    assert run(capsys, "verify", stage)[0] == 0
    data = bytearray((stage / "llama-server").read_bytes())
    data[3] ^= 0x20
    (stage / "llama-server").write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", stage)
    assert code == 5
    assert out == ""
    assert f"error: {stage / 'llama-server'} does not match its sha256 in bundle.json" in err  # the user's directory
    assert "Traceback" not in err


@pytest.mark.parametrize("as_given", ["relative", "absolute"])
def test_verify_of_a_tampered_zip_names_the_zip_and_its_member(as_given: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """As the README's verify row says: `bundle.zip:libggml-cpu.so`, the zip as the user named it, then the member
    (issue 32: it said `LICENSE` alone). A changed size is named so too, by the zip reader."""
    stage, _ = make_bundle_dir(tmp_path)
    (stage / "LICENSE").write_bytes(b"MIT Licensf\n")  # same size, other bytes than bundle.json lists
    bundle.pack(stage, tmp_path / "tampered.zip")
    monkeypatch.chdir(tmp_path)
    zip_arg = "tampered.zip" if as_given == "relative" else str(tmp_path / "tampered.zip")
    code, out, err = run(capsys, "verify", zip_arg)
    assert (code, out) == (5, "")
    assert err.splitlines()[0] == f"error: {zip_arg}:LICENSE does not match its sha256 in bundle.json"
    data = json.loads(run(capsys, "verify", zip_arg, "--json")[1])
    assert data["error"]["what"] == f"{zip_arg}:LICENSE does not match its sha256 in bundle.json"
    (stage / "LICENSE").write_bytes(b"MIT License, longer\n")
    bundle.pack(stage, tmp_path / "longer.zip")
    code, _, err = run(capsys, "verify", "longer.zip")
    assert code == 5 and err.startswith("error: longer.zip: member 'LICENSE' is 20 bytes"), err


def test_verify_a_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "verify", tmp_path / "nothing.zip")
    assert code == 2  # a usage error (README: verify exits 0, 2, 5)
    assert f"{tmp_path / 'nothing.zip'} does not exist" in err


def test_build_windows_recipe_on_linux_with_an_empty_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "build", WINDOWS, "--store", tmp_path / "store")
    assert code == 2
    assert "windows-x86_64 bundles cannot be built on linux-x86_64" in err
    assert "run the build on a windows-x86_64 machine" in err
    assert "Traceback" not in err
    assert out == ""


def test_build_with_a_non_empty_out_is_refused_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep").write_text("x")
    code, _, err = run(capsys, "build", LINUX, "--store", tmp_path / "store", "--out", out_dir)
    assert code == 2
    assert f"--out {out_dir} exists and is not empty" in err


def test_unknown_store_scheme_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "check", LINUX, "--store", "s3://bucket")
    assert code == 2
    assert "unknown scheme" in err


# --------------------------------------------------------------------------------- usage


@pytest.mark.parametrize("argv, needle", [
    (["frobnicate"], "No such command 'frobnicate'"),
    (["key", LINUX, "--frob"], "No such option"),
    (["check"], "Missing argument 'RECIPE'"),
    (["verify", "x.zip", "--level", "archs"], "Invalid value for '--level'"),
])
def test_usage_errors_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert needle in err
    assert "Usage: llamabundle" in err
    assert "Traceback" not in err


def test_every_command_is_covered_by_the_help_test() -> None:
    names = {" ".join(c) for c in all_commands()}
    assert {"", "recipe", "recipe lint", "recipe schema", "show", "key", "check", "build", "fetch", "verify",
            "publish"} <= names


@pytest.mark.parametrize("cmd", all_commands(), ids=lambda c: " ".join(c) or "top")
def test_help_of_every_command(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *cmd, "--help")
    assert code == 0
    assert out.startswith(f"Usage: llamabundle {' '.join(cmd)}".rstrip())


def test_github_actions_outputs_and_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out, summary = tmp_path / "out.txt", tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_OUTPUT", str(out))
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    code, _, _ = run(capsys, "check", LINUX, "--store", tmp_path / "store")
    assert code == 1
    # the names of check --json, and zip (empty on a miss)
    assert out.read_text().splitlines() == [f"key={LINUX_KEY}", "hit=false", "location=", "zip="]
    assert summary.read_text().splitlines()[-1] == f"| `{LINUX_KEY[:12]}` | miss |  |  |"
