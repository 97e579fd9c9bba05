"""The bundle's own llamabundle-probe, run as an app would run it (a clean environment, from the bundle's
directory), its one JSON object validated against the schema llamabundle ships; and a backend module that
does not load (a tiny library that imports one that is nowhere), for the loader's own words about it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema

from llamabundle import data

ABSENT = "llamabundle-absent"  # the library the stand-in module imports, on no machine


def schema() -> dict[str, Any]:
    got: dict[str, Any] = data.schema("llamabundle-probe")
    return got


def run_probe(argv: list[str], *, env: dict[str, str], cwd: Path | None = None, timeout: float = 300) -> dict[str, Any]:
    res = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, (argv, res.returncode, res.stderr[-3000:])
    got: dict[str, Any] = json.loads(res.stdout)  # one object, nothing after it
    jsonschema.validate(got, schema())
    return got


def module(got: dict[str, Any], file: str) -> dict[str, Any]:
    (m,) = [m for m in got["modules"] if m["file"] == file]
    return m


def add_unloadable_module(bundle: Path, *, cc: str, name: str, dep: str) -> None:
    """Compile into `bundle` a backend module `name` (ggml's rpc, which no recipe builds) that imports `dep`,
    a library built only to be linked against and then removed: the loader must refuse the module."""
    work = bundle.parent / f"{bundle.name}-unloadable"
    work.mkdir(exist_ok=True)
    (work / "dep.c").write_text("int llamabundle_absent(void) { return 1; }\n")
    (work / "mod.c").write_text("int llamabundle_absent(void);\nint ggml_backend_score(void) { return llamabundle_absent(); }\n")
    windows = dep.endswith(".dll")
    if windows:
        subprocess.run([cc, "-shared", "-o", str(work / dep), str(work / "dep.c"), f"-Wl,--out-implib,{work / 'dep.a'}"],
                       check=True)
        subprocess.run([cc, "-shared", "-o", str(bundle / name), str(work / "mod.c"), str(work / "dep.a")], check=True)
    else:
        subprocess.run([cc, "-shared", "-fPIC", f"-Wl,-soname,{dep}", "-o", str(work / dep), str(work / "dep.c")], check=True)
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(bundle / name), str(work / "mod.c"), str(work / dep)], check=True)
    (work / dep).unlink()
