"""`llamabundle deps [--json] FILE...` through llamabundle.cli.main, on real PE files (mingw) and real
ELF files (gcc): each library's class and where it was found, missing ones named with their importer."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.clirun import run
from tests.pefiles import CC, MINGW_OMP, Built, as_i386, make_dir

needs_mingw = pytest.mark.skipif(shutil.which(CC) is None, reason=f"{CC} (mingw-w64) is needed to build real PE files")


@needs_mingw
def test_deps_prints_each_class_and_where(built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_dir(tmp_path, built, "app.exe", "cudart64_12.dll")
    code, out, err = run(capsys, "deps", d / "app.exe")
    assert code == 0, err
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:] if not line.startswith(("system", "missing"))}
    assert rows["cudart64_12.dll"][:3] == ["bundled", str(d / "cudart64_12.dll"), "(cuda_runtime)"]
    assert rows["nvcuda.dll"][:2] == ["driver", "-"] and rows["KERNEL32.dll"][:2] == ["system", "-"]
    assert rows["nvcuda.dll"][-1] == "app.exe"
    assert "system deps: KERNEL32.dll, msvcrt.dll, nvcuda.dll" in out
    assert "missing:" not in out


@needs_mingw
def test_deps_json_names_the_missing_dll_and_its_importer(built: Built, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    d = make_dir(tmp_path, built, "app.exe", "lazy.exe")
    code, out, err = run(capsys, "deps", "--json", d / "app.exe", d / "lazy.exe")
    assert code == 5, err  # a missing library is a failed check (README)
    info = json.loads(out)
    assert info["format"] == "pe" and info["schema"] == 1 and info["ok"] is False
    assert info["error"]["exit_code"] == 5 and "cudart64_12.dll (needed by app.exe)" in info["error"]["what"]
    assert info["missing"] == {"cudart64_12.dll": ["app.exe"], "lazy.dll": ["lazy.exe"]}
    deps = {x["name"]: x for x in info["deps"]}
    assert deps["lazy.dll"]["delay_only"] and deps["cudart64_12.dll"]["kind"] == "cuda_runtime"
    assert deps["KERNEL32.dll"]["imported_by"] == ["app.exe", "lazy.exe"]
    code, out, err = run(capsys, "deps", d / "lazy.exe")
    assert "lazy.dll" in out and "[delay-load]" in out and "missing: lazy.dll (needed by lazy.exe)" in out
    assert code == 5 and "error: 1 of the libraries these binaries need were not found: lazy.dll" in err


@needs_mingw
def test_deps_search_dirs_find_the_mingw_runtime(built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_dir(tmp_path, built, "ggml-cpu-haswell.dll")
    args = [a for m in built.mingw for a in ("--search", m)]
    code, out, err = run(capsys, "deps", "--json", *args, d / "ggml-cpu-haswell.dll")
    assert code == 0, err
    deps = {x["name"].lower(): x for x in json.loads(out)["deps"]}
    for name in MINGW_OMP:
        assert deps[name]["class"] == "mingw_runtime"
        assert Path(deps[name]["path"]).parent in built.mingw


@needs_mingw
def test_deps_refuses_bad_input(built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_dir(tmp_path, built, "app.exe")
    (d / "notes.txt").write_text("hello\n")
    code, _, err = run(capsys, "deps", d / "app.exe", d / "notes.txt")
    assert code == 2 and "notes.txt is neither a PE nor an ELF binary" in err
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(built / "cudart64_12.dll", other / "cudart64_12.dll")
    code, _, err = run(capsys, "deps", d / "app.exe", other / "cudart64_12.dll")
    assert code == 2 and "different directories" in err
    as_i386(built / "cudart64_12.dll", d / "old.dll")
    code, _, err = run(capsys, "deps", d / "old.dll")
    assert code == 5 and "old.dll is a I386 PE file, not x64 (AMD64)" in err
    code, _, err = run(capsys, "deps")
    assert code == 2


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to build real ELF files")
def test_deps_of_elf_binaries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "bundle"
    d.mkdir()
    (tmp_path / "one.c").write_text("int one(void) { return 1; }\n")
    (tmp_path / "ghost.c").write_text("int ghost(void) { return 2; }\n")
    (tmp_path / "main.c").write_text("int one(void);\nint ghost(void);\nint main(void) { return one() + ghost(); }\n")
    gcc = ["gcc", "-O1", "-Wl,--no-as-needed"]
    subprocess.run([*gcc, "-shared", "-fPIC", "-Wl,-soname,libone.so", "-o", d / "libone.so", "one.c"], cwd=tmp_path, check=True)
    subprocess.run([*gcc, "-shared", "-fPIC", "-Wl,-soname,libghost.so", "-o", "libghost.so", "ghost.c"], cwd=tmp_path, check=True)
    subprocess.run([*gcc, "-o", d / "main", "main.c", f"-L{d}", f"-L{tmp_path}", "-lone", "-lghost"], cwd=tmp_path, check=True)
    code, out, err = run(capsys, "deps", "--json", d / "main")
    assert code == 5, err  # libghost.so is missing
    info = json.loads(out)
    assert info["ok"] is False and "libghost.so (needed by main)" in info["error"]["what"]
    assert info["binaries"][0]["path"] == str(d / "main") and "libone.so" in info["binaries"][0]["imports"]
    deps = {x["name"]: x for x in info["deps"]}
    assert info["format"] == "elf"
    assert (deps["libone.so"]["class"], deps["libone.so"]["path"]) == ("bundled", str(d / "libone.so"))
    assert deps["libc.so.6"]["class"] == "system"
    assert info["missing"] == {"libghost.so": ["main"]} and deps["libghost.so"]["class"] == "missing"
    code, out, _ = run(capsys, "deps", "--search", tmp_path, d / "main")
    assert code == 0 and "missing:" not in out and f"{tmp_path / 'libghost.so'}" in out
