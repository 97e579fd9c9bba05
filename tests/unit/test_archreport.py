"""`llamabundle archs`: which GPU generations a recipe's bundle runs from SASS, from PTX through the JIT, or not at
all — against the shipped recipes, small recipes written here, the JSON schema, and the CLI through cli.main."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import jsonschema
import pytest
from rich.console import Console

from llamabundle import data, keys
from llamabundle.backends.cuda.report import (
    ArchReport,
    Device,
    Generation,
    Row,
    Status,
    arch_report,
    gpu_generations,
)
from llamabundle.cli.archs import plain_lines, print_table
from tests.clirun import run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
CUDA13 = ROOT / "recipes" / "linux-x86_64-cuda13.0.yaml"
WIN128 = ROOT / "recipes" / "windows-x86_64-cuda12.8.yaml"
GENERATIONS = ["Maxwell", "Pascal", "Volta", "Turing", "Ampere", "Ada Lovelace", "Hopper", "Blackwell"]

ROW = {
    "type": "object", "additionalProperties": False,
    "required": ["generation", "cc", "examples", "status", "via", "notes", "driver_floor"],
    "properties": {
        "generation": {"enum": GENERATIONS},
        "cc": {"type": "string", "pattern": r"^[0-9]+\.[0-9]$"},
        "examples": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "status": {"enum": ["sass", "ptx-jit", "unsupported"]},
        "via": {"type": ["string", "null"], "pattern": r"^(sm|compute)_[0-9]{2,3}[af]?$"},
        "notes": {"type": "string"},
        "driver_floor": {"type": ["string", "null"], "pattern": r"^[0-9]+(\.[0-9]+)*$"},
    },
}
SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["schema", "recipe", "key", "platform", "toolkit", "archs", "sass", "ptx", "driver_floor", "rows",
                 "generations", "summary"],
    "properties": {
        "schema": {"const": 1},
        "recipe": {"type": "string"},
        "key": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        "platform": {"enum": ["linux-x86_64", "windows-x86_64"]},
        "toolkit": {"type": ["string", "null"]},
        "archs": {"type": "array", "items": {"type": "string"}},
        "sass": {"type": "array", "items": {"type": "string"}},
        "ptx": {"type": "array", "items": {"type": "string"}},
        "driver_floor": {"type": ["string", "null"]},
        "rows": {"type": "array", "minItems": 1, "items": ROW},
        "generations": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "status"],
            "properties": {"name": {"enum": GENERATIONS}, "status": {"enum": ["sass", "ptx-jit", "unsupported", "mixed"]}}}},
        "summary": {"type": "string"},
    },
}


KEY = "0" * 64  # the key is the caller's (keys.py); the report only carries it


def recipe_with(tmp_path: Path, base: Path, archs: list[str], *, name: str = "r", extra: str = "") -> Path:
    """A copy of a shipped recipe with another arch list (and optionally a driver floor)."""
    text = re.sub(r"(?m)^  archs: \[.*\]$", f"  archs: [{', '.join(archs)}]", base.read_text())
    text = re.sub(r"(?m)^  driver_floor: .*$\n", "", text)
    text = re.sub(r"(?m)^(  archs: .*)$", lambda m: m[1] + extra, text)
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


def rows(report: ArchReport) -> dict[str, Row]:
    return {r.cc: r for r in report.rows}


def report_for(tmp_path: Path, base: Path, archs: list[str], **kw: str) -> dict[str, Row]:
    return rows(arch_report(keys.load(recipe_with(tmp_path, base, archs, **kw)), key=KEY))




# ------------------------------------------------------------------------------------- data


def test_generation_data_covers_every_cc_the_toolkits_know() -> None:
    gens = gpu_generations()
    assert [g.name for g in gens] == GENERATIONS
    listed = {d.cc for g in gens for d in g.devices}
    for version, info in data.cuda_toolkits().items():
        for arch in info["archs"]:
            if arch.isdigit() and arch != "88":  # sm_88 is no public product
                cc = f"{int(arch) // 10}.{int(arch) % 10}"
                assert cc in listed, f"CUDA {version} knows sm_{arch} but no GPU of CC {cc} is listed"
    blackwell = {d.cc for d in gens[-1].devices}
    assert {"10.0", "10.3", "11.0", "12.0", "12.1"} <= blackwell
    assert {g.name for g in gens if g.last_driver_branch == "580"} == {"Maxwell", "Pascal", "Volta"}


# --------------------------------------------------------------------------- shipped recipes


def test_windows_cuda12_8_recipe() -> None:
    report = arch_report(keys.load(WIN128), key=KEY)
    r = rows(report)
    assert report.toolkit == "12.8.1" and report.driver_floor == "572.61" and report.platform == "windows-x86_64"
    hopper = r["9.0"]
    assert (hopper.status, hopper.via) == (Status.PTX_JIT, "compute_80")
    assert "JIT" in hopper.notes and "tens of seconds" in hopper.notes and "add 90-real" in hopper.notes
    assert ">= 572.61" in hopper.notes and hopper.driver_floor == "572.61"
    # Ampere differs inside the generation: 8.0 from PTX, 8.6 and 8.7 (binary compatible) from sm_86.
    assert [(r[cc].status, r[cc].via) for cc in ("8.0", "8.6", "8.7", "8.9")] == [
        (Status.PTX_JIT, "compute_80"), (Status.SASS, "sm_86"), (Status.SASS, "sm_86"), (Status.SASS, "sm_89")]
    assert r["8.6"].notes == "" and "binary compatibility" in r["8.7"].notes and "add 87-real" in r["8.7"].notes
    # 120a is arch-specific: 12.0 only; 12.1 falls back to the PTX of 80.
    assert (r["12.0"].status, r["12.0"].via) == (Status.SASS, "sm_120a")
    assert (r["12.1"].status, r["12.1"].via) == (Status.PTX_JIT, "compute_80")
    assert "sm_120a runs only on 12.0" in r["12.1"].notes and "add 120-real" in r["12.1"].notes
    # Highest PTX at or below the device: 6.0 gets compute_50, 6.1/6.2 compute_61; Maxwell needs an R580-or-older driver.
    assert [r[cc].via for cc in ("5.0", "5.2", "6.0", "6.1", "6.2", "7.0", "7.5")] == [
        "compute_50", "compute_50", "compute_50", "compute_61", "compute_61", "compute_70", "compute_75"]
    assert "R580" in r["5.2"].notes and "R580" not in r["7.5"].notes
    # Thor is 10.1 under CUDA 12.8 numbering; 11.0 is not listed for this toolkit.
    assert "10.1" in r and "11.0" not in r
    assert report.generations()["Hopper"] == "ptx-jit" and report.generations()["Ampere"] == "mixed"
    assert "Hopper" in report.summary().split(";")[0] and "Ampere (8.0)" in report.summary()


def test_linux_cuda13_recipe() -> None:
    report = arch_report(keys.load(CUDA13), key=KEY)
    r = rows(report)
    assert report.driver_floor == "580.95.05" and report.archs == ("75-virtual", "90-real")
    for cc in ("5.0", "5.2", "5.3", "6.0", "6.1", "6.2", "7.0", "7.2"):
        assert r[cc].status == Status.UNSUPPORTED and r[cc].via is None and r[cc].driver_floor is None
        assert "CUDA 13.0.2 cannot target" in r[cc].notes and "below sm_75" in r[cc].notes
    assert (r["9.0"].status, r["9.0"].via, r["9.0"].notes) == (Status.SASS, "sm_90", "")
    assert all(r[cc].via == "compute_75" and r[cc].status == Status.PTX_JIT for cc in ("7.5", "8.6", "8.9", "10.0", "12.1"))
    assert "11.0" in r and "10.1" not in r
    gens = report.generations()
    assert gens == {"Maxwell": "unsupported", "Pascal": "unsupported", "Volta": "unsupported", "Turing": "ptx-jit",
                    "Ampere": "ptx-jit", "Ada Lovelace": "ptx-jit", "Hopper": "sass", "Blackwell": "ptx-jit"}
    assert "not at all: Maxwell, Pascal, Volta" in report.summary()


def test_cpu_recipe_runs_on_no_gpu() -> None:
    report = arch_report(keys.load(CPU), key=KEY)
    assert report.toolkit is None and report.driver_floor is None and report.archs == ()
    assert {r.status for r in report.rows} == {Status.UNSUPPORTED}
    assert all("no CUDA backend" in r.notes for r in report.rows)
    assert report.summary() == "no CUDA backend: the bundle runs on the CPU only"
    assert [r.cc for r in report.rows if r.generation == "Blackwell"] == ["10.0", "10.3", "11.0", "12.0", "12.1"]
    jsonschema.validate(report.to_json(), SCHEMA)


# ------------------------------------------------------------------------------ small recipes


def test_adding_90_real_moves_hopper_from_jit_to_sass(tmp_path: Path) -> None:
    without = report_for(tmp_path, CUDA13, ["80-virtual"], name="a")
    with_90 = report_for(tmp_path, CUDA13, ["80-virtual", "90-real"], name="b")
    assert (without["9.0"].status, without["9.0"].via) == (Status.PTX_JIT, "compute_80")
    assert (with_90["9.0"].status, with_90["9.0"].via) == (Status.SASS, "sm_90")
    assert "add 90-real" in without["9.0"].notes
    # Nothing else changes: 90-real is SASS for 9.x only.
    assert {cc: r for cc, r in without.items() if cc != "9.0"} == {cc: r for cc, r in with_90.items() if cc != "9.0"}
    assert without["7.5"].status == Status.UNSUPPORTED and "lowest PTX: compute_80" in without["7.5"].notes


def test_arch_specific_a_targets_run_on_their_cc_only(tmp_path: Path) -> None:
    r = report_for(tmp_path, CUDA13, ["80-virtual", "90a-real"])
    assert (r["9.0"].status, r["9.0"].via) == (Status.SASS, "sm_90a")
    # 'a' PTX is not forward compatible: compute_90a JITs on 9.0 and nowhere else; plain compute_90 does.
    a = report_for(tmp_path, CUDA13, ["90a-virtual"], name="a")
    plain = report_for(tmp_path, CUDA13, ["90-virtual"], name="p")
    assert (a["9.0"].status, a["9.0"].via) == (Status.PTX_JIT, "compute_90a")
    assert a["10.0"].status == Status.UNSUPPORTED and "compute_90a runs only on 9.0" not in a["10.0"].notes
    assert (plain["10.0"].status, plain["10.0"].via) == (Status.PTX_JIT, "compute_90")
    # A later 9.x part (none exists yet) would run plain sm_90 but never sm_90a.
    gens = [Generation(name="Hopper", devices=(Device(cc="9.0", examples=("H100",)), Device(cc="9.5", examples=("next",))))]
    rec = keys.load(recipe_with(tmp_path, CUDA13, ["90a-real", "80-virtual"], name="n"))
    later = rows(arch_report(rec, key=KEY, generations=gens))
    assert (later["9.5"].status, later["9.5"].via) == (Status.PTX_JIT, "compute_80")
    assert "sm_90a runs only on 9.0" in later["9.5"].notes
    rec = keys.load(recipe_with(tmp_path, CUDA13, ["90-real"], name="m"))
    assert rows(arch_report(rec, key=KEY, generations=gens))["9.5"].via == "sm_90"


def test_family_f_targets_run_within_their_family(tmp_path: Path) -> None:
    r = report_for(tmp_path, CUDA13, ["120f-real"])
    assert (r["12.0"].via, r["12.1"].via) == ("sm_120f", "sm_120f")
    assert "by its family" in r["12.1"].notes and r["12.0"].notes == ""
    assert r["10.0"].status == Status.UNSUPPORTED and r["11.0"].status == Status.UNSUPPORTED
    a = report_for(tmp_path, CUDA13, ["120a-real", "75-virtual"], name="a")
    assert (a["12.0"].via, a["12.1"].via) == ("sm_120a", "compute_75")
    dc = report_for(tmp_path, CUDA13, ["100f-real", "103f-real"], name="dc")
    assert (dc["10.0"].via, dc["10.3"].via) == ("sm_100f", "sm_103f") and dc["11.0"].status == Status.UNSUPPORTED
    only103 = report_for(tmp_path, CUDA13, ["103f-real"], name="o")
    assert only103["10.0"].status == Status.UNSUPPORTED and "sm_103f needs 10.3 or later" in only103["10.0"].notes
    # Family PTX JITs inside the family only; plain PTX on every later major.
    gens = [Generation(name="Blackwell", devices=tuple(Device(cc=c, examples=("x",)) for c in ("12.0", "12.1", "13.0")))]
    fam = rows(arch_report(keys.load(recipe_with(tmp_path, CUDA13, ["120f-virtual"], name="fv")), key=KEY, generations=gens))
    assert [(fam[c].status, fam[c].via) for c in ("12.0", "12.1", "13.0")] == [
        (Status.PTX_JIT, "compute_120f"), (Status.PTX_JIT, "compute_120f"), (Status.UNSUPPORTED, None)]
    assert rows(arch_report(keys.load(recipe_with(tmp_path, CUDA13, ["120-virtual"], name="pv")), key=KEY, generations=gens))["13.0"].via == "compute_120"


def test_best_sass_is_the_highest_at_or_below_the_device(tmp_path: Path) -> None:
    r = report_for(tmp_path, CUDA13, ["80-real", "86-real", "75-virtual"])
    assert [r[cc].via for cc in ("7.5", "8.0", "8.6", "8.7", "8.9", "9.0")] == [
        "compute_75", "sm_80", "sm_86", "sm_86", "sm_86", "compute_75"]
    assert "add 89-real" in r["8.9"].notes


def test_maxwell_on_cuda12_8_without_low_ptx_says_what_to_add(tmp_path: Path) -> None:
    r = report_for(tmp_path, WIN128, ["61-virtual", "86-real"])
    assert r["5.2"].status == Status.UNSUPPORTED and r["5.2"].via is None
    assert "lowest PTX: compute_61" in r["5.2"].notes and "add 52-real" in r["5.2"].notes
    assert r["6.1"].via == "compute_61" and r["6.0"].status == Status.UNSUPPORTED
    sass_only = report_for(tmp_path, WIN128, ["86-real"], name="s")
    assert sass_only["9.0"].status == Status.UNSUPPORTED and "no -virtual arch" in sass_only["9.0"].notes


def test_driver_floor_past_r580_leaves_maxwell_out(tmp_path: Path) -> None:
    floor = '\n  driver_floor: {windows: "590.10", linux: "590.44.01"}'
    report = arch_report(keys.load(recipe_with(tmp_path, WIN128, ["50-virtual", "90-real"], extra=floor)), key=KEY)
    r = rows(report)
    assert report.driver_floor == "590.10"
    assert r["5.0"].status == Status.UNSUPPORTED and "past R580" in r["5.0"].notes
    assert (r["7.5"].status, r["7.5"].driver_floor) == (Status.PTX_JIT, "590.10") and "590.10" in r["7.5"].notes


# ------------------------------------------------------------------------------------- JSON


@pytest.mark.parametrize("recipe", [CPU, CUDA13, WIN128], ids=lambda p: p.stem)
def test_json_matches_schema(recipe: Path) -> None:
    info = arch_report(keys.load(recipe), key=KEY).to_json()
    jsonschema.validate(info, SCHEMA)
    assert [g["name"] for g in info["generations"]] == GENERATIONS
    for row in info["rows"]:
        assert (row["via"] is None) == (row["status"] == "unsupported")
        assert (row["driver_floor"] is None) == (row["status"] == "unsupported")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**info, "rows": [{**info["rows"][0], "status": "maybe"}]}, SCHEMA)


# -------------------------------------------------------------------------------------- CLI


def test_cli_json_equals_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "archs", WIN128, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info.pop("ok") is True  # every --json report says whether the command succeeded (cli.output)
    keyed = keys.resolve(keys.load(WIN128))
    assert info == json.loads(json.dumps(arch_report(keyed.recipe, key=keyed.key).to_json()))
    assert info["key"] == keys.resolve(keys.load(WIN128)).key and info["toolkit"] == "12.8.1"
    assert info["sass"] == ["86", "89", "120a"] and info["ptx"] == ["50", "61", "70", "75", "80"]
    hopper = next(r for r in info["rows"] if r["cc"] == "9.0")
    assert hopper["status"] == "ptx-jit" and hopper["via"] == "compute_80" and hopper["generation"] == "Hopper"


def test_cli_plain_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "archs", recipe_with(tmp_path, CUDA13, ["80-virtual"]))
    assert code == 0
    lines = out.splitlines()
    keyed = keys.resolve(keys.load(tmp_path / "r.yaml"))
    report = arch_report(keyed.recipe, key=keyed.key)
    assert lines == plain_lines(report)
    assert len([ln for ln in lines if re.match(r"^(Maxwell|Pascal|Volta|Turing|Ampere|Ada Lovelace|Hopper|Blackwell) ", ln)]) == len(report.rows)
    hopper = next(ln for ln in lines if ln.startswith("Hopper "))
    assert hopper.split()[1:4] == ["9.0", "ptx-jit", "compute_80"]
    assert lines[-1].startswith("summary  only through the PTX JIT") and "Hopper" in lines[-1]
    code, out, _ = run(capsys, "archs", recipe_with(tmp_path, CUDA13, ["80-virtual", "90-real"], name="b"))
    assert next(ln for ln in out.splitlines() if ln.startswith("Hopper ")).split()[1:4] == ["9.0", "sass", "sm_90"]
    assert "Hopper" not in out.splitlines()[-1].split(";")[0]


def test_cli_rich_table_on_a_terminal() -> None:
    buf = io.StringIO()
    print_table(arch_report(keys.load(WIN128), key=KEY), Console(file=buf, force_terminal=True, width=240, color_system="standard"))
    text = buf.getvalue()
    assert "\x1b[" in text and "Hopper" in text and "compute_80" in text and "sm_120a" in text
    assert "summary  only through the PTX JIT" in text


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "archs", tmp_path / "missing.yaml")
    assert code == 2 and "no such recipe file" in err
    code, out, _ = run(capsys, "--help")
    assert code == 0 and re.search(r"(?m)^\s+archs\s", out)
