"""Errors name the real cause (issue 30): a SOURCE_DATE_EPOCH no zip can date is a usage error before any work
(it crashed the pack after the whole build, exit 70), `--store file://` without a path is a usage error (it
meant the current directory), a disk error names whose directory failed, a pack of a commit dated past 2107
still packs, and `index` writes its files as UTF-8 under LC_ALL=C (it crashed on a store path that is not ASCII)
and prints such a path as its own bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from llamabundle import bundle, errors
from llamabundle.errors import UsageError
from llamabundle.settings import Settings
from llamabundle.store import open_store
from tests import bundles as tb
from tests.clirun import run

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "recipes" / "linux-x86_64-cpu.yaml"


@pytest.mark.parametrize("value", ["4354819200", "253402300800", "1e20", "100000000000000000000", "-1", "315532799"])
def test_a_source_date_epoch_no_zip_can_date_is_a_usage_error(value: str) -> None:
    with pytest.raises(UsageError, match="1980-01-01.*2107-12-31"):
        Settings.from_env({"SOURCE_DATE_EPOCH": value})


@pytest.mark.parametrize("value", ["315532800", "1700000000", "4354819199"])
def test_the_dates_a_zip_can_hold_are_taken(value: str) -> None:
    assert Settings.from_env({"SOURCE_DATE_EPOCH": value}).source_date_epoch == int(value)


def test_build_refuses_it_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "4354819200")
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run(capsys, "build", LINUX, "--store", tmp_path / "store")
    assert code == 2 and "SOURCE_DATE_EPOCH='4354819200'" in err, err
    assert not (tmp_path / "cache").exists()


def test_a_commit_dated_past_what_a_zip_can_hold_still_packs(tmp_path: Path) -> None:
    stage = tmp_path / "s"
    tb.write_bundle(stage, {"LICENSE": b"MIT\n"}, {"LICENSE": "license"})
    z = bundle.pack(stage, tmp_path / "b.zip", source_date_epoch=4354819200 + 10**9)
    assert zipfile.ZipFile(z).infolist()[0].date_time[0] == 2107
    assert bundle.built_at(10**20).startswith("2107-12-31")


@pytest.mark.parametrize("url", ["file://", "file://  "])
def test_a_file_store_without_a_path_is_a_usage_error(url: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="names no directory"):
        open_store(url)
    assert open_store(f"file://{tmp_path}").url == str(tmp_path)


def test_a_disk_error_names_whose_directory_failed(tmp_path: Path) -> None:
    errors.forget_owners()
    try:
        errors.own(tmp_path / "cache", "the cache, LLAMABUNDLE_CACHE_DIR")
        errors.own(tmp_path / "cache" / "store", "the store")
        errors.own(tmp_path / "out", "--out")
        full = OSError(28, "No space left on device")
        for path, whose in ((tmp_path / "cache" / "fetched" / "k" / "b.zip", "(in the cache, LLAMABUNDLE_CACHE_DIR)"),
                            (tmp_path / "cache" / "store" / "k" / "b.zip", "(in the store)"),
                            (tmp_path / ".out.partial-1-2-abcdef" / "lib.so", "(in --out)"),
                            (tmp_path / "out" / "lib.so", "(in --out)")):
            full.filename = str(path)
            e = errors.from_os_error(full, doing="write")
            assert e.exit_code == 6 and e.what == f"cannot write {path} {whose}", e.what
        full.filename = str(tmp_path / "elsewhere")
        assert errors.from_os_error(full, doing="write").what == f"cannot write {tmp_path / 'elsewhere'}"
    finally:
        errors.forget_owners()


def test_index_writes_utf8_under_the_c_locale_for_a_store_path_that_is_not_ascii(tmp_path: Path) -> None:
    store = tmp_path / "störe"
    zip_path, _m = tb.make_zip(tmp_path, {"LICENSE": b"MIT\n"}, {"LICENSE": "license"})
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache"),
           "HOME": str(tmp_path), "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    env.pop("LANG", None)
    for argv in (["publish", str(zip_path), "--store", str(store)], ["index", "--store", str(store), "--out", str(tmp_path / "site-ü")]):
        r = subprocess.run([sys.executable, "-m", "llamabundle", *argv], env=env, capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr.decode(errors="replace")  # index was exit 70 (UnicodeEncodeError)
    site = tmp_path / "site-ü"
    assert json.loads((site / "index.json").read_text(encoding="utf-8"))["store"] == str(store)
    assert str(store) in (site / "index.html").read_text(encoding="utf-8")
    # what it printed names the path as its own bytes, on stdout (click) and stderr (the log), not \udcc3 or ??
    assert os.fsencode(store) in r.stdout and os.fsencode(store) in r.stderr, (r.stdout, r.stderr)
    assert b"\\udc" not in r.stdout + r.stderr and b"st??re" not in r.stdout + r.stderr


def test_every_text_file_the_tool_opens_names_its_encoding() -> None:
    """read_text, write_text, open() in text mode and Popen(text=True) without encoding= follow the locale
    (ASCII under LC_ALL=C and PYTHONUTF8=0): every one in the package says UTF-8 (or is binary)."""
    import ast

    loose = []
    for path in sorted((ROOT / "llamabundle").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            kw = {k.arg for k in node.keywords}
            if "encoding" in kw:
                continue
            if name in ("read_text", "write_text"):
                loose.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
            elif name == "open" and isinstance(f, ast.Name):
                mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
                modes = [mode.body, mode.orelse] if isinstance(mode, ast.IfExp) else [mode]
                if not all(isinstance(m, ast.Constant) and "b" in str(m.value) for m in modes) and not (
                        node.args and isinstance(node.args[0], ast.JoinedStr) and "/proc/" in ast.unparse(node.args[0])):
                    loose.append(f"{path.relative_to(ROOT)}:{node.lineno} open")
            elif name == "Popen" and "text" in kw:
                loose.append(f"{path.relative_to(ROOT)}:{node.lineno} Popen(text=True)")
    assert loose == []
