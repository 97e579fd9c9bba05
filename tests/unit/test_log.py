"""Log under GitHub Actions: workflow commands are single raw lines, escaped as the runner wants; an error is
one annotation (what, why, fix; file/line/col when known). Elsewhere the plain `error: …` text as before."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from llamabundle.errors import BuildError, LlamaBundleError, RecipeError
from llamabundle.log import Log, actions_report, escape_data, escape_property, workflow_command
from llamabundle.recipe import load_recipe
from llamabundle.settings import Settings
from tests.clirun import run

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
LONG = "the quick brown fox jumps over the lazy dog, again and again: " * 5  # ~300 characters


def capture(*, github_actions: bool = True, width: int = 80) -> tuple[Log, io.StringIO]:
    buf = io.StringIO()  # not a terminal, 80 columns: what a CI runner's pipe looks like to rich
    console = Console(file=buf, width=width, highlight=False)
    assert not console.is_terminal
    return Log(github_actions=github_actions, console=console), buf


# ------------------------------------------------------------------------------------- escaping


def test_escape_data_and_properties() -> None:
    assert escape_data("100% done\r\nnext: a, b") == "100%25 done%0D%0Anext: a, b"
    assert escape_property("100% done\r\nnext: a, b") == "100%25 done%0D%0Anext%3A a%2C b"
    assert escape_data("%0A is not a newline") == "%250A is not a newline"  # % first: no double meaning
    assert workflow_command("warning", "m", {"file": "a,b:c.yaml", "line": 3, "col": None, "title": ""}) \
        == "::warning file=a%2Cb%3Ac.yaml,line=3::m"
    assert workflow_command("endgroup") == "::endgroup::"


# ---------------------------------------------------------------------------- single raw lines


def test_long_warning_group_and_error_are_single_lines_at_80_columns() -> None:
    log, buf = capture()
    log.warn(LONG)
    with log.step("building " + LONG):
        pass
    log.error(BuildError("cmake failed: " + LONG, why="because " + LONG, fix="do " + LONG))
    lines = buf.getvalue().splitlines()
    assert lines[0] == "::warning::" + LONG
    assert lines[1] == "::group::building " + LONG
    assert lines[2] == "::endgroup::"
    assert lines[3].startswith("    building ") and lines[3].endswith(": done in 0.0s")  # one line too
    assert lines[4] == (f"::error title=llamabundle%3A build failed::cmake failed: {LONG}"
                        f"%0Awhy: because {LONG}%0Afix: do {LONG}")
    assert len(lines) == 5


def test_workflow_commands_are_not_rich_markup_or_emoji() -> None:
    log, buf = capture()
    log.warn("[bold]x[/bold] :smile: a\tb")
    log.error("error: [red]y[/red] :warning:")
    assert buf.getvalue().splitlines() == ["::warning::[bold]x[/bold] :smile: a\tb",
                                           "::error title=llamabundle%3A error::[red]y[/red] :warning:"]


def test_message_data_is_escaped() -> None:
    log, buf = capture()
    log.warn("50% of it\r\nthen: the rest, maybe")
    with log.step("a%b\nc"):
        pass
    lines = buf.getvalue().splitlines()
    assert lines[0] == "::warning::50%25 of it%0D%0Athen: the rest, maybe"  # `:` and `,` only in properties
    assert lines[1] == "::group::a%25b%0Ac"


def test_properties_are_escaped() -> None:
    log, buf = capture()
    log.error(RecipeError("bad", file="dir,1/x:y%.yaml", line=3, col=7))
    assert buf.getvalue() == "::error file=dir%2C1/x%3Ay%25.yaml,line=3,col=7,title=llamabundle%3A usage or recipe error::bad\n"


# ---------------------------------------------------------------------------------- one error


def test_an_error_is_one_annotation_with_why_and_fix_then_its_details() -> None:
    log, buf = capture()
    err = BuildError("the build failed", why="ninja exited 1", fix="read the log above",
                     details="  last lines:\n    foo.c:1: error: bar")
    log.error(err)
    lines = buf.getvalue().splitlines()
    assert lines[0] == ("::error title=llamabundle%3A build failed::the build failed"
                        "%0Awhy: ninja exited 1%0Afix: read the log above")
    assert lines[1:] == ["  last lines:", "    foo.c:1: error: bar"]
    assert sum(line.startswith("::") for line in lines) == 1
    assert "error: the build failed" not in buf.getvalue()  # no "::error::error: …"


def test_rendered_text_still_makes_one_annotation() -> None:
    log, buf = capture()
    log.error(LlamaBundleError("what", why="why", fix="fix", details="more").render())
    assert buf.getvalue().splitlines() == ["::error title=llamabundle%3A error::what%0Awhy: why%0Afix: fix", "more"]


def test_a_warning_from_an_error_carries_its_location() -> None:
    log, buf = capture()
    log.warn(RecipeError("r.yaml:2:3: odd", why="w", file="r.yaml", line=2, col=3))
    assert buf.getvalue() == "::warning file=r.yaml,line=2,col=3::r.yaml:2:3: odd%0Awhy: w\n"


def test_outside_actions_the_text_is_as_before() -> None:
    log, buf = capture(github_actions=False)
    err = BuildError("the build failed", why="ninja exited 1", fix="read the log above", details="  tail")
    log.error(err)
    log.error(err.render())
    log.warn("careful: " + LONG)
    with log.step("step"):
        pass
    out = buf.getvalue()
    assert out.splitlines() == ["error: the build failed", "  why: ninja exited 1", "  fix: read the log above",
                                "  tail"] * 2 + ["warning: careful: " + LONG, "==> step", "    step: done in 0.0s"]
    assert "::" not in out


# ------------------------------------------------------------------------- recipe lint, real CLI


def _broken(tmp_path: Path) -> tuple[Path, int, int]:
    """A recipe with a typo in `platform:` in a directory whose name makes every message long."""
    d = tmp_path / ("a-directory-with-a-long-name-so-that-the-message-is-wider-than-eighty-columns" * 2)
    d.mkdir()
    p = d / "bad.yaml"
    text = LINUX.read_text(encoding="utf-8").replace("platform: linux-x86_64", "platform: linux-x86_65")
    p.write_text(text, encoding="utf-8")
    line = text.splitlines().index("platform: linux-x86_65") + 1
    return p, line, len("platform: ") + 1


def test_lint_errors_are_annotations_at_file_line_col(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    bad, line, col = _broken(tmp_path)
    yaml_bad = tmp_path / "y.yaml"
    yaml_bad.write_text("recipe: 1\nname: [x\n", encoding="utf-8")
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.delenv("GITHUB_WORKSPACE", raising=False)
    code, out, err = run(capsys, "recipe", "lint", bad, LINUX, yaml_bad)
    assert code == 2
    assert out.startswith(f"ok  {LINUX}")
    e = pytest.raises(RecipeError, load_recipe, bad).value
    assert (e.file, e.line, e.col) == (str(bad), line, col)
    assert e.what.startswith(f"{bad}:{line}:{col}: platform: ")  # the message text is as it was
    lines = err.splitlines()
    assert lines[0] == (f"::error file={bad},line={line},col={col},title=llamabundle%3A usage or recipe error::"
                        f"{e.what}%0Awhy: {e.why}%0Afix: {e.fix}")
    assert lines[1].startswith(f"::error file={yaml_bad},line=3,col=1,title=")
    assert "malformed YAML" in lines[1]
    assert len(lines) == 2


def test_a_command_error_is_an_annotation_via_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bad, line, col = _broken(tmp_path)
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(tmp_path))
    code, _, err = run(capsys, "key", bad)
    assert code == 2
    (only,) = err.splitlines()
    assert only.startswith(f"::error file={bad.relative_to(tmp_path)},line={line},col={col},title=")
    assert "%0Awhy: the recipe does not match schema 1" in only


def test_lint_outside_actions_prints_the_plain_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad, line, col = _broken(tmp_path)
    code, _, err = run(capsys, "recipe", "lint", bad)
    assert code == 2
    assert err.splitlines()[0].startswith(f"error: {bad}:{line}:{col}: platform: ")
    assert err.splitlines()[1] == "  why: the recipe does not match schema 1 (DESIGN §4)"
    assert "::" not in err


# ------------------------------------------------------------------------------ GITHUB_API_URL


def test_github_api_url_is_honoured(tmp_path: Path) -> None:
    base = {"LLAMABUNDLE_CACHE_DIR": str(tmp_path)}
    assert Settings.from_env(base).github_api_url == "https://api.github.com"
    ghes = {**base, "GITHUB_API_URL": "https://ghe.example.com/api/v3/"}
    assert Settings.from_env(ghes).github_api_url == "https://ghe.example.com/api/v3"
    override = {**ghes, "LLAMABUNDLE_GITHUB_API_URL": "http://127.0.0.1:9/"}
    assert Settings.from_env(override).github_api_url == "http://127.0.0.1:9"
    assert Settings.from_env({**ghes, "LLAMABUNDLE_GITHUB_API_URL": ""}).github_api_url == "https://ghe.example.com/api/v3"


# ------------------------------------------------------------------ step outputs and step summary


def test_actions_report_writes_step_outputs_and_one_summary_row_each(tmp_path: Path) -> None:
    out, summary, zip_path = tmp_path / "out.txt", tmp_path / "summary.md", tmp_path / "b.zip"
    zip_path.write_bytes(b"x" * 1_500_000)
    key = "ab" * 32
    actions_report(output=out, summary=summary, key=key, hit=False, location=None)
    actions_report(output=out, summary=summary, key=key, hit=False, location="/s/b.zip", zip_path=zip_path)
    actions_report(output=None, summary=None, key=key, hit=True, location="x")  # outside Actions: nothing
    assert out.read_bytes() == (f"key={key}\nhit=false\nlocation=\nzip=\n"
                                f"key={key}\nhit=false\nlocation=/s/b.zip\nzip={zip_path.as_posix()}\n").encode()
    sha = hashlib.sha256(zip_path.read_bytes()).hexdigest()
    assert summary.read_text(encoding="utf-8").splitlines() == [
        "| key | result | size | sha256 |", "|---|---|---|---|",
        "| `abababababab` | miss |  |  |", f"| `abababababab` | built | 1.5 MB | `{sha}` |"]


# ------------------------------------------------------------------ every failure path is one annotation


@pytest.mark.parametrize(("env", "argv", "title", "what"), [
    ({}, ("key", LINUX, "--frob"), "usage or recipe error", "No such option"),  # click's own usage errors
    ({}, ("check",), "usage or recipe error", "Missing argument 'RECIPE'."),
    ({}, ("verify", "x.zip", "--level", "most"), "usage or recipe error", "Invalid value for '--level'"),
    ({}, ("no-such-command",), "usage or recipe error", "No such command 'no-such-command'."),
    ({"LLAMABUNDLE_CONNECT_TIMEOUT": "abc"}, ("key", LINUX), "usage or recipe error",  # bad settings
     "LLAMABUNDLE_CONNECT_TIMEOUT='abc' is not a number of seconds"),
    ({"SOURCE_DATE_EPOCH": "yesterday"}, ("recipe", "list"), "usage or recipe error", "SOURCE_DATE_EPOCH='yesterday' is not"),
    ({"LLAMABUNDLE_CACHE_MAX": "lots"}, ("key", LINUX), "usage or recipe error", "LLAMABUNDLE_CACHE_MAX='lots' is not"),
    ({}, ("verify", "missing.zip"), "usage or recipe error", "missing.zip does not exist"),  # the tool's own
], ids=["option", "argument", "choice", "command", "connect-timeout", "source-date-epoch", "cache-max", "tool"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_under_actions_every_failure_is_one_error_annotation(env: dict[str, str], argv: tuple[object, ...], title: str,
                                                             what: str, as_json: bool, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 32: usage errors (click's) and bad LLAMABUNDLE_* values printed no ::error annotation under
    GITHUB_ACTIONS=true, where every other failure did. Now each prints exactly one, with its title."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = run(capsys, *argv, *(["--json"] if as_json else []))
    assert code == 2
    annotations = [line for line in err.splitlines() if line.startswith("::error")]
    assert len(annotations) == 1, err
    assert annotations[0].startswith(f"::error title=llamabundle%3A {title}::{escape_data(what)}"), annotations[0]
    assert "%0Afix: " in annotations[0]
    if as_json:
        assert json.loads(out)["error"]["what"].startswith(what)


def test_under_actions_an_internal_error_is_an_annotation(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from llamabundle import keys

    def broken(*a: object, **kw: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(keys, "load", broken)
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    code, _, err = run(capsys, "key", LINUX)
    assert code == 70
    assert err.splitlines() == ["::error title=llamabundle%3A error::internal error: RuntimeError: a bug"
                                "%0Awhy: this is a bug in llamabundle%0Afix: rerun with --debug and report the traceback"]
    monkeypatch.delenv("GITHUB_ACTIONS")
    code, _, err = run(capsys, "key", LINUX)
    assert code == 70 and err.splitlines() == [
        "internal error: RuntimeError: a bug",
        "  this is a bug in llamabundle; rerun with --debug and report the traceback"]
    assert "::" not in err


def test_outside_actions_a_usage_error_is_clicks_text_alone(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "key", LINUX, "--frob")
    assert code == 2 and "Error: No such option" in err and "::error" not in err


def test_the_zip_step_output_names_the_zip(tmp_path: Path) -> None:
    """`zip` (issue 32: the release workflow parsed build's --json for it): the zip on this machine with forward
    slashes (build), the stored zip's name (check's hit), empty on a miss."""
    out, zip_path = tmp_path / "out.txt", tmp_path / "sub dir" / "b.zip"
    actions_report(output=out, summary=None, key="k", hit=False, location="/s/b.zip", zip_path=zip_path)
    actions_report(output=out, summary=None, key="k", hit=True, location="https://x/b.zip", zip_name="b.zip")
    actions_report(output=out, summary=None, key="k", hit=False, location=None)
    zips = [line.removeprefix("zip=") for line in out.read_text(encoding="utf-8").splitlines() if line.startswith("zip=")]
    assert zips == [zip_path.as_posix(), "b.zip", ""]
