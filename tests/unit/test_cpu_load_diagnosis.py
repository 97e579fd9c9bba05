"""When llama-server loads no CPU backend (ggml's scan of the variants is silent in a release build), the load
check says why, per variant: what dlopen answered, the score it gave here, a crash on load. Real shared
libraries compiled with gcc; llama-server a stand-in that loads nothing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from llamabundle.errors import VerifyError
from llamabundle.platforms import base

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to compile the variants")

SERVER = '#!/bin/sh\necho "Available devices:"\necho "  (none)"\n'


def _lib(root: Path, name: str, body: str) -> None:
    src = root.parent / f"{name}.c"
    src.write_text(body)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(root / name), str(src)], check=True)


def _bundle(tmp_path: Path) -> Path:
    root = tmp_path / "bundle"
    root.mkdir()
    server = root / "llama-server"
    server.write_text(SERVER)
    server.chmod(0o755)
    return root


def test_each_variant_says_what_dlopen_answered_and_what_it_scored(tmp_path: Path) -> None:
    root = _bundle(tmp_path)
    _lib(root, "libggml-cpu-good.so", "int ggml_backend_score(void) { return 3; }\n")
    _lib(root, "libggml-cpu-unsupported.so", "int ggml_backend_score(void) { return 0; }\n")
    _lib(root, "libggml-cpu-needs.so", "extern int not_defined_anywhere(void);\n"
                                       "int ggml_backend_score(void) { return not_defined_anywhere(); }\n")
    _lib(root, "libggml-cpu-crashes.so", "#include <stdlib.h>\n__attribute__((constructor)) static void f(void) { abort(); }\n")
    (root / "libggml-cpu-garbage.so").write_bytes(b"not an ELF file at all")
    with pytest.raises(VerifyError) as e:
        base.run_list_devices(root, exe_name="llama-server")
    assert e.value.what == "llama-server did not load a CPU backend"
    why = e.value.why
    assert why.startswith("no 'loaded CPU backend from' line; loaded one by one here: ")
    assert "libggml-cpu-good.so: score 3" in why
    assert "libggml-cpu-unsupported.so: score 0" in why
    assert "libggml-cpu-needs.so: not loaded:" in why and "not_defined_anywhere" in why
    assert "libggml-cpu-garbage.so: not loaded:" in why
    assert "libggml-cpu-crashes.so: exit -6" in why  # SIGABRT in its constructor, in a process of its own


def test_a_bundle_without_cpu_variants_gets_the_plain_reason(tmp_path: Path) -> None:
    root = _bundle(tmp_path)
    with pytest.raises(VerifyError) as e:
        base.run_list_devices(root, exe_name="llama-server")
    assert e.value.why == "no 'loaded CPU backend from' line"


def test_the_variants_load_in_the_bundles_clean_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant whose dependency only the caller's LD_LIBRARY_PATH provides is not loaded: the diagnosis runs
    where llama-server ran."""
    root = _bundle(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "dep.c").write_text("int dep_score(void) { return 7; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(elsewhere / "libdep.so"), str(elsewhere / "dep.c")], check=True)
    src = tmp_path / "v.c"
    src.write_text("extern int dep_score(void);\nint ggml_backend_score(void) { return dep_score(); }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(root / "libggml-cpu-x64.so"), str(src),
                    f"-L{elsewhere}", "-ldep"], check=True)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(elsewhere))
    with pytest.raises(VerifyError) as e:
        base.run_list_devices(root, exe_name="llama-server")
    assert "libggml-cpu-x64.so: not loaded:" in e.value.why and "libdep.so" in e.value.why
