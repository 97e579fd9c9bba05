"""Choosing and checking the CUDA toolkit before a long build starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llamabundle import keys
from llamabundle.backends.cuda.toolkit.resolve import (
    check_host_compiler,
    resolve_toolkit,
)
from llamabundle.backends.cuda.toolkit.system import (
    find_system_toolkit,
    installed_version,
)
from llamabundle.errors import ToolchainError
from llamabundle.log import Log
from llamabundle.settings import Settings

REPO = Path(__file__).resolve().parents[2]
CUDA13 = keys.load(REPO / "recipes" / "linux-x86_64-cuda13.0.yaml")


def _fake_toolkit(root: Path, version: str) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (root / "version.json").write_text(json.dumps({"cuda": {"name": "CUDA SDK", "version": version}}))
    return root


def test_installed_version_from_version_json(tmp_path: Path) -> None:
    assert installed_version(_fake_toolkit(tmp_path / "a", "13.0.2")) == "13.0.2"
    assert installed_version(tmp_path) is None


def test_system_toolkit_is_used_only_at_the_pinned_version(tmp_path: Path) -> None:
    old = _fake_toolkit(tmp_path / "old", "12.8.1")
    good = _fake_toolkit(tmp_path / "good", "13.0.2")
    tk, notes = find_system_toolkit("13.0.2", "linux-x86_64", {"CUDA_PATH": str(old), "CUDA_HOME": str(good), "PATH": "/nonexistent"},
                                    defaults=())
    assert tk is not None and tk.root == good and tk.source == "system" and tk.version == "13.0.2"
    assert notes == [f"{old}: CUDA 12.8.1"]
    tk, notes = find_system_toolkit("13.0.2", "linux-x86_64", {"CUDA_PATH": str(old), "PATH": "/nonexistent"}, defaults=())
    assert tk is None and notes == [f"{old}: CUDA 12.8.1"]


def test_a_mismatching_system_toolkit_falls_back_to_redist_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _fake_toolkit(tmp_path / "old", "12.8.1")
    settings = Settings(cache_dir=tmp_path / "cache", cuda_redist_url="http://127.0.0.1:9", connect_timeout=1)
    env = {"CUDA_PATH": str(old), "PATH": "/nonexistent"}
    with pytest.raises(Exception) as e:  # the redist mirror is a closed port: a network error, after the warning
        resolve_toolkit(CUDA13, settings=settings, log=Log(), env=env, source="system", system_roots=())
    err = capsys.readouterr().err
    assert "no installed CUDA 13.0.2" in err and "12.8.1" in err and "bootstrapping from redist" in err
    assert getattr(e.value, "exit_code", None) == 6


def _fake_program(tmp_path: Path, name: str, script: str) -> dict[str, str]:
    """An environment whose PATH finds a stand-in `name` running `script` first."""
    bindir = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
    bindir.mkdir()
    (bindir / name).write_text(f"#!/bin/sh\n{script}\n")
    (bindir / name).chmod(0o755)
    return {"PATH": f"{bindir}{os.pathsep}/usr/bin:/bin"}


def _fake_gcc(tmp_path: Path, major: str) -> dict[str, str]:
    return _fake_program(tmp_path, "gcc", f"echo {major}")


def test_host_compiler_in_range(tmp_path: Path) -> None:
    assert check_host_compiler(CUDA13, env=_fake_gcc(tmp_path, "13")) == "gcc 13"


def test_host_compiler_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ToolchainError) as e:
        check_host_compiler(CUDA13, env=_fake_gcc(tmp_path, "16"))
    assert e.value.exit_code == 3
    assert "gcc 16" in e.value.what and "8 to 15" in e.value.why


WINDOWS = keys.load(REPO / "recipes" / "windows-x86_64-cuda12.8.yaml")


def _fake_cl(tmp_path: Path, version: str) -> dict[str, str]:
    return _fake_program(tmp_path, "cl", f"echo 'Microsoft (R) C/C++ Optimizing Compiler Version {version} for x64' >&2\nexit 2")


def test_msvc_version_in_range(tmp_path: Path) -> None:
    assert check_host_compiler(WINDOWS, env=_fake_cl(tmp_path, "19.44.35207")) == "msvc 1944"


def test_msvc_version_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ToolchainError) as e:
        check_host_compiler(WINDOWS, env=_fake_cl(tmp_path, "19.50.10101"))
    # one table (msvc.json, read from host_config.h): the same limits as the check before vcvars runs
    assert e.value.exit_code == 3 and "_MSC_VER 1950" in e.value.what and "rejects _MSC_VER >= 1950" in e.value.why
