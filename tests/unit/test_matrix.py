"""`llamabundle matrix`: the release's GitHub Actions matrix, the legs whose bundles a store does not have. Against
a local store and against the fake GitHub (tests/fakegithub.py) after a bundle of one shipped recipe was
published: only the misses are legs, each with its legs-file settings and its key; the store is asked once per
recipe; on a bare runner (PATH holding only this Python's directory); a release where everything is published
gets an empty matrix. Under GitHub Actions it sets the step outputs the release workflow reads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.clibundles import LINUX_KEY, make_bundle_zip
from tests.clicontract import valid
from tests.clirun import run
from tests.fakegithub import FakeGitHub
from tests.ghstore import REPO, TOKEN

ROOT = Path(__file__).resolve().parents[2]
LEGS = ROOT / ".github" / "release-legs.yml"
RELEASED = [leg["recipe"] for leg in yaml.safe_load(LEGS.read_text(encoding="utf-8"))["legs"]]
SETTINGS = {leg["recipe"]: {k: v for k, v in leg.items() if k != "recipe"}
            for leg in yaml.safe_load(LEGS.read_text(encoding="utf-8"))["legs"]}


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY", "GITHUB_ACTIONS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


def published(tmp_path: Path, capsys: pytest.CaptureFixture[str], store: str) -> None:
    code, _, err = run(capsys, "publish", make_bundle_zip(tmp_path), "--store", store)
    assert code == 0, err


def check_plan(report: dict[str, Any], *, hits: set[str]) -> None:
    valid("matrix", report)
    rows = {r["recipe"]: r for r in report["recipes"]}
    assert list(rows) == RELEASED
    assert {n for n, r in rows.items() if r["hit"]} == hits
    include = report["matrix"]["include"]
    assert [leg["recipe"] for leg in include] == [n for n in RELEASED if n not in hits] and report["count"] == len(include)
    for leg in include:
        assert leg == {**SETTINGS[leg["recipe"]], "recipe": leg["recipe"], "key": rows[leg["recipe"]]["key"]}


def test_only_the_misses_are_legs_with_a_local_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    published(tmp_path, capsys, str(store))
    code, out, err = run(capsys, "matrix", "--legs", LEGS, "--store", store, "--json")
    assert code == 0, err
    report = json.loads(out)
    check_plan(report, hits={"linux-x86_64-cpu"})
    assert report["recipes"][0]["key"] == LINUX_KEY and report["recipes"][0]["location"].startswith(str(store.resolve()))
    code, out, _ = run(capsys, "matrix", "--legs", LEGS, "--store", store)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"hit   linux-x86_64-cpu  {LINUX_KEY}  ") and lines[1].startswith("miss  linux-x86_64-cuda13.0  ")
    assert lines[-1] == f"{len(RELEASED) - 1} of {len(RELEASED)} to build"


def test_a_release_with_everything_published_builds_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    published(tmp_path, capsys, str(store))
    output, summary = tmp_path / "output", tmp_path / "summary"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_OUTPUT", str(output))
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    code, out, err = run(capsys, "matrix", "linux-x86_64-cpu", "--store", store, "--json")
    assert code == 0, err
    report = valid("matrix", json.loads(out))
    assert report["count"] == 0 and report["matrix"] == {"include": []}
    assert output.read_text() == 'matrix={"include":[]}\ncount=0\n'  # the release skips its legs and publish job
    assert f"| linux-x86_64-cpu | `{LINUX_KEY[:12]}` | published |" in summary.read_text()
    # and with misses: the step output is the matrix fromJSON reads, on one line
    output.unlink()
    code, out, err = run(capsys, "matrix", "--legs", LEGS, "--store", store)
    assert code == 0, err
    got = dict(line.split("=", 1) for line in output.read_text().splitlines())
    assert int(got["count"]) == len(RELEASED) - 1
    assert [leg["recipe"] for leg in json.loads(got["matrix"])["include"]] == RELEASED[1:]


def test_against_the_fake_github_on_a_bare_runner(gh: FakeGitHub, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With PATH holding only this Python's directory (no compiler, no glslc, no MSVC): every released recipe is
    keyed, the store is asked once per recipe (its release by tag), and only the misses are legs."""
    monkeypatch.setenv("LLAMABUNDLE_GITHUB_API_URL", gh.api_url)
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    published(tmp_path, capsys, f"github:{REPO}")
    venv_bin = str(Path(sys.executable).parent)
    for tool in ("g++", "gcc", "glslc", "x86_64-w64-mingw32-g++-posix", "cl"):
        assert shutil.which(tool, path=venv_bin) is None, tool
    before = gh.count("GET", "/releases/tags/")
    env = {"PATH": venv_bin, "HOME": str(tmp_path), "LANG": "C.UTF-8", "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "c2"),
           "LLAMABUNDLE_GITHUB_API_URL": gh.api_url, "GITHUB_TOKEN": TOKEN}
    done = subprocess.run([sys.executable, "-m", "llamabundle", "matrix", "--legs", str(LEGS), "--store", f"github:{REPO}",
                           "--json"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    check_plan(report, hits={"linux-x86_64-cpu"})
    assert report["store"] == f"github:{REPO}"
    assert gh.count("GET", "/releases/tags/") - before == len(RELEASED)  # one query per recipe
    assert TOKEN not in done.stdout + done.stderr


@pytest.mark.parametrize(("text", "message"), [
    ("legs: {}\n", "has no `legs:` list"),
    ("legs:\n  - os: ubuntu-24.04\n", "leg 0 is not a mapping with a `recipe:` name"),
    ("legs:\n  - {recipe: linux-x86_64-cpu, os: [a, b]}\n", "leg 0: os is not a scalar"),
    ("legs:\n  - {recipe: linux-x86_64-cpu, OS: x}\n", "'OS' is not a setting name"),
    ("legs:\n  - {recipe: linux-x86_64-cpu}\n  - {recipe: linux-x86_64-cpu}\n", "linux-x86_64-cpu has two legs"),
    ("legs: [" * 5000, "is not a legs file"),
    (b"legs:\n  - {recipe: \xff}\n", "is not a legs file"),
], ids=["empty", "no-recipe", "nested", "bad-name", "twice", "deep", "not-utf8"])
def test_a_bad_legs_file_is_exit_2_and_asks_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    text: str | bytes, message: str) -> None:
    legs = tmp_path / "legs.yml"
    legs.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, out, err = run(capsys, "matrix", "--legs", legs, "--store", tmp_path / "store")
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "store").exists()


def test_a_recipe_without_a_leg_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "matrix", "linux-x86_64-cpu-ubuntu24.04", "--legs", LEGS, "--store", tmp_path / "store")
    assert code == 2 and "no leg for linux-x86_64-cpu-ubuntu24.04 in the legs file" in err, err
