"""The load check's reading of llama-server --list-devices where its lines are missing. When no CPU backend
loaded (ggml's scan of the variants is silent in a release build) it says why, per variant: what dlopen
answered, the score it gave here, a crash on load (real shared libraries compiled with gcc; llama-server a
stand-in that loads nothing). When the lines were lost (llama.cpp's log thread is not waited for at exit)
the run is repeated."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from llamabundle.errors import VerifyError
from llamabundle.platforms import load as base

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


def _flaky_server(root: Path, body: str) -> Path:
    """A llama-server that counts its runs in `runs` beside the bundle and prints `body` (shell) with $n the run."""
    runs = root.parent / "runs"
    runs.write_text("")
    server = root / "llama-server"
    server.write_text(f'#!/bin/sh\necho x >> "{runs}"\nn=$(wc -l < "{runs}")\nd=$(dirname "$0")\n{body}')
    server.chmod(0o755)
    return runs


def test_a_run_whose_backend_lines_were_lost_is_repeated(tmp_path: Path) -> None:
    """llama.cpp's log thread is not waited for at exit: the 'loaded' lines of a run can be missing while the
    device list (printed directly) is there. Such a run is repeated and the lines of all runs read together."""
    root = _bundle(tmp_path)
    runs = _flaky_server(root, 'if [ "$n" -ge 2 ]; then echo "load_backend: loaded CPU backend from $d/libggml-cpu-x64.so" >&2; fi\n'
                               'if [ "$n" -ge 3 ]; then echo "load_backend: loaded CUDA backend from $d/libggml-cuda.so" >&2; fi\n'
                               'echo "Available devices:"\necho "  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"\n')
    loaded = base.run_list_devices(root, exe_name="llama-server")
    assert len(runs.read_text().splitlines()) == 3  # the CPU line came in the second run, CUDA's in the third
    assert set(loaded.backends) == {"CPU", "CUDA"} and loaded.devices == ["CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"]


def test_a_complete_run_is_not_repeated_and_a_bundle_that_never_says_fails_after_the_attempts(tmp_path: Path) -> None:
    root = _bundle(tmp_path)
    runs = _flaky_server(root, 'echo "load_backend: loaded CPU backend from $d/libggml-cpu-x64.so" >&2\necho "Available devices:"\n')
    assert set(base.run_list_devices(root, exe_name="llama-server").backends) == {"CPU"}
    assert len(runs.read_text().splitlines()) == 1
    runs = _flaky_server(root, 'echo "Available devices:"\n')
    with pytest.raises(VerifyError, match="did not load a CPU backend"):
        base.run_list_devices(root, exe_name="llama-server")
    assert len(runs.read_text().splitlines()) == base.LIST_ATTEMPTS
