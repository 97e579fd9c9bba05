"""`llamabundle toolkit plan|install` through llamabundle.cli.main: output, JSON, exit codes, and two
concurrent installs from two processes against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamabundle.backends.cuda.toolkit import layout
from llamabundle.cli import main
from llamabundle.errors import ToolchainError
from tests.clirun import run  # noqa: E402
from tests.redist import RECIPE_13, WINDOWS_12_8_1_TOTAL, WINDOWS_RECIPE, Repo, leftovers

ROOT = Path(__file__).resolve().parents[2]
LINUX_CPU = ROOT / "recipes" / "linux-x86_64-cpu.yaml"


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: object) -> dict:
    code, out, err = run(capsys, "toolkit", "plan", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# ------------------------------------------------------------------------------------------ plan


def test_plan_windows_12_8_1_totals_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    info = _plan_json(capsys, WINDOWS_RECIPE)
    assert info["total_bytes"] == WINDOWS_12_8_1_TOTAL == sum(c["size"] for c in info["components"])
    assert info["download_bytes"] == WINDOWS_12_8_1_TOTAL and info["installed"] is False
    assert len(info["components"]) == 7 and info["toolkit"] == "12.8.1" and info["platform"] == "windows-x86_64"
    nvcc = info["components"][0]
    assert nvcc == {
        "name": "cuda_nvcc", "version": "12.8.93", "archive": "cuda_nvcc-windows-x86_64-12.8.93-archive.zip",
        "url": "https://developer.download.nvidia.com/compute/cuda/redist/cuda_nvcc/windows-x86_64/"
               "cuda_nvcc-windows-x86_64-12.8.93-archive.zip",
        "size": 120912792, "sha256": "9fdc70b4271ed9aad4d64cd7076a7d96ec36512d074b9995fe638de669197391",
        "cached": False, "added_by": None, "note": None}
    code, out, _ = run(capsys, "toolkit", "plan", WINDOWS_RECIPE)
    assert code == 0
    assert "1,255,664,179" in out and "cuda_nvcc-windows-x86_64-12.8.93-archive.zip" in out and "not installed" in out


def test_plan_13x_says_what_it_added(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "toolkit", "plan", "--version", "13.0.2", "--components", "cuda_nvcc,cuda_cudart",
                       "--platform", "windows-x86_64")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "added: needed by cuda_nvcc in 13.x" in lines["cuda_crt"]
    assert "added: needed by cuda_nvcc in 13.x" in lines["libnvvm"]
    assert "added" not in lines["cuda_cudart"]


def test_plan_cached_flags_before_and_after_install(cli_repo: Repo, recipe13: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    m = cli_repo.manifest_path
    before = _plan_json(capsys, recipe13, "--manifest", m)
    assert [c["cached"] for c in before["components"]] == [False] * 4
    assert before["installed"] is False and before["download_bytes"] == before["total_bytes"]
    assert before["components"][0]["url"].startswith(cli_repo.server.url + "/cuda_nvcc/linux-x86_64/")
    code, out, err = run(capsys, "toolkit", "install", recipe13, "--manifest", m)
    assert code == 0, err
    after = _plan_json(capsys, recipe13, "--manifest", m)
    assert [c["cached"] for c in after["components"]] == [True] * 4
    assert after["installed"] is True and after["download_bytes"] == 0 and after["root"] == before["root"]
    code, out, _ = run(capsys, "toolkit", "plan", recipe13, "--manifest", m)
    assert "(installed)" in out and " yes " in out


# --------------------------------------------------------------------------------------- install


def test_install_then_reinstall_downloads_nothing(cli_repo: Repo, recipe13: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    m = cli_repo.manifest_path
    code, out, err = run(capsys, "toolkit", "install", recipe13, "--manifest", m, "--json")
    assert code == 0, err
    first = json.loads(out)
    root = Path(first["root"])
    assert first["reused"] is False and first["downloaded_bytes"] > 0 and len(first["downloaded"]) == 4
    assert root.parent == cli_repo.cache / "toolkits" and first["nvcc"] == str(root / "bin" / "nvcc")
    assert json.loads((root / "version.json").read_text())["cuda_crt"]["version"] == "13.0.88"
    assert (root / "LICENSE.cuda_nvcc").is_file() and os.readlink(root / "lib64") == "lib"
    assert layout.read_installed(root) is not None
    cli_repo.server.reset()
    code, out, err = run(capsys, "toolkit", "install", recipe13, "--manifest", m)
    assert code == 0, err
    assert f"already installed and intact: {root}" in out and "downloaded 0 bytes" in out
    assert cli_repo.server.requests == []


def test_install_by_version_components_platform_and_dest(cli_repo: Repo, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "cuda"
    code, out, err = run(capsys, "toolkit", "install", "--version", "13.0.2", "--components", "cuda_nvcc, cuda_cudart",
                         "--platform", "windows-x86_64", "--manifest", cli_repo.manifest_path, "--dest", dest)
    assert code == 0, err
    assert f"installed CUDA 13.0.2 (windows-x86_64, 4 components): {dest}" in out
    assert (dest / "bin" / "nvcc.exe").is_file() and (dest / "lib" / "x64" / "cudart.lib").is_file()


def test_hash_mismatch_exits_3_and_leaves_nothing(cli_repo: Repo, recipe13: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = json.loads(json.dumps(cli_repo.manifest))
    bad["cuda_cudart"]["linux-x86_64"]["sha256"] = "0" * 64
    mpath = tmp_path / "bad.json"
    mpath.write_text(json.dumps(bad))
    code, out, err = run(capsys, "toolkit", "install", recipe13, "--manifest", mpath)
    assert code == 3
    assert "sha256 mismatch" in err and "Traceback" not in err
    assert not (cli_repo.cache / "toolkits").exists() or not any(
        p.name.startswith("cuda-") for p in (cli_repo.cache / "toolkits").iterdir())
    assert leftovers(cli_repo) == []


def test_500_then_success(cli_repo: Repo, recipe13: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rel = cli_repo.rel("cuda_nvcc")
    cli_repo.server.faults[rel] = ["500"]
    code, out, err = run(capsys, "toolkit", "install", recipe13, "--manifest", cli_repo.manifest_path)
    assert code == 0, err
    assert cli_repo.server.paths().count(rel) == 2


def test_500_forever_is_a_network_error(cli_repo: Repo, recipe13: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli_repo.server.faults[cli_repo.rel("cuda_nvcc")] = ["500"] * 20
    code, out, err = run(capsys, "toolkit", "install", recipe13, "--manifest", cli_repo.manifest_path)
    assert code == 6 and "HTTP 500" in err


def test_unreachable_mirror_exits_6(cli_repo: Repo, recipe13: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    monkeypatch.setenv("LLAMABUNDLE_CUDA_REDIST_URL", f"http://127.0.0.1:{port}")
    code, out, err = run(capsys, "toolkit", "install", recipe13, "--manifest", cli_repo.manifest_path)
    assert code == 6 and "cannot download" in err


def test_truncated_download_resumes(cli_repo: Repo, recipe13: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rel = cli_repo.rel("libnvvm")
    cli_repo.server.faults[rel] = ["truncate"]
    code, out, err = run(capsys, "toolkit", "install", recipe13, "--manifest", cli_repo.manifest_path)
    assert code == 0, err
    ranges = [r for p, r in cli_repo.server.requests if p == rel]
    assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=")


def test_overlapping_components_exit_3(cli_repo: Repo, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "toolkit", "install", "--version", "13.0.2", "--platform", "linux-x86_64",
                         "--components", "cuda_nvcc,cuda_cudart,cuda_conflict", "--manifest", cli_repo.manifest_path)
    assert code == 3 and "both ship include/cuda_runtime.h" in err
    assert leftovers(cli_repo) == []


@pytest.mark.parametrize("argv, match", [
    ((), "pass a RECIPE, or --version and --components"),
    (("--version", "12.8.1"), "pass a RECIPE, or --version and --components"),
    ((WINDOWS_RECIPE, "--version", "12.8.1"), "not both"),
    (("--version", "12.8.1", "--components", "cuda_nvcc,nope"), "'nope' is not a component of CUDA 12.8.1"),
    (("--version", "9.9.9", "--components", "cuda_nvcc"), "CUDA 9.9.9 is not pinned"),
    ((LINUX_CPU,), "has no cuda: section"),
    ((ROOT / "recipes" / "missing.yaml",), "no such recipe file"),
    (("--version", "12.8.1", "--components", "cuda_nvcc", "--source", "nope"), "Invalid value for '--source'"),
])
def test_usage_and_recipe_errors_exit_2(argv: tuple, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("plan", "install"):
        code, out, err = run(capsys, "toolkit", cmd, *argv)
        assert code == 2, (cmd, argv, out, err)
        assert match in err and "Traceback" not in err


def test_toolkit_errors_exit_3(recipe13: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "toolkit", "plan", "--version", "12.8.1", "--components", "cuda_nvcc,cuda_compat",
                         "--platform", "windows-x86_64")
    assert code == 3 and "no windows-x86_64 archive of cuda_compat" in err
    installer = tmp_path / "installer.yaml"
    installer.write_text(RECIPE_13.replace("source: redist", "source: installer"))
    code, out, err = run(capsys, "toolkit", "plan", installer)
    assert code == 3 and "no CUDA 13.0.2 local installer" in err
    code, out, err = run(capsys, "toolkit", "plan", recipe13, "--manifest", tmp_path / "nope.json")
    assert code == 3 and "no such manifest" in err


@pytest.mark.parametrize("source", ["redist", "pypi"])
@pytest.mark.parametrize("cmd", ["plan", "install"])
def test_components_without_nvcc_are_refused_before_any_download(cmd: str, source: str, cli_repo: Repo,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 32: `toolkit install --version 13.0.2 --components cuda_crt,cuda_cccl` (from PyPI) downloaded, then
    exited 3 with "1736 files on disk, 1736 installed". A toolkit is a compiler: a set without cuda_nvcc is a
    usage error (exit 2) naming the cause and the fix, before anything is asked of the redist server or the
    package index (both on loopback here: neither may see one request)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    monkeypatch.setenv("LLAMABUNDLE_PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    code, out, err = run(capsys, "toolkit", cmd, "--source", source, "--version", "13.0.2", "--components",
                         "cuda_crt,cuda_cccl", "--platform", "linux-x86_64")
    assert (code, out) == (2, ""), err
    assert "error: the components cuda_crt, cuda_cccl have no cuda_nvcc: a toolkit without nvcc cannot compile" in err
    assert "fix: add cuda_nvcc: --components cuda_nvcc,cuda_crt,cuda_cccl" in err and "files on disk" not in err
    assert cli_repo.server.requests == []
    assert not (cli_repo.cache / "toolkits").exists() and not (cli_repo.cache / "downloads").exists()


def test_an_installed_toolkit_without_nvcc_says_so(tmp_path: Path) -> None:
    """A root installed complete but without nvcc (an older llamabundle let a PyPI set without cuda_nvcc in) is
    named for what it lacks, not as "incomplete or changed" with equal file counts."""
    root = tmp_path / "cuda"
    (root / "include" / "crt").mkdir(parents=True)
    (root / "include" / "crt" / "host_config.h").write_text("/* crt */\n")
    layout.write_marker(root, version="13.0.2", platform="linux-x86_64", source="pypi",
                        components={"cuda_crt": "13.0.88", "cuda_cccl": "13.0.85"})
    with pytest.raises(ToolchainError) as e:
        layout.read_installed(root)
    assert e.value.what == f"the toolkit in {root} has no nvcc: it holds cuda_cccl, cuda_crt, without cuda_nvcc"
    assert "incomplete" not in e.value.what and "cuda_nvcc" in e.value.fix


@pytest.mark.race
def test_concurrent_installs_from_two_processes_make_one_root(cli_repo: Repo, recipe13: Path) -> None:
    cli_repo.server.delay = 0.15  # each request slow: the two processes overlap
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLAMABUNDLE_CACHE_DIR": str(cli_repo.cache),
           "LLAMABUNDLE_CUDA_REDIST_URL": cli_repo.server.url}
    argv = [sys.executable, "-m", "llamabundle", "--quiet", "toolkit", "install", str(recipe13),
            "--manifest", str(cli_repo.manifest_path), "--json"]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    roots = {r["root"] for r in results}
    assert len(roots) == 1
    assert sorted(r["reused"] for r in results) == [False, True]  # one installed, the other waited and reused it
    root = Path(roots.pop())
    assert layout.read_installed(root) is not None
    # every archive fetched once, by one of them
    assert sorted(cli_repo.server.paths()) == sorted({cli_repo.rel(c) for c in ("cuda_nvcc", "cuda_crt", "libnvvm", "cuda_cudart")})
    assert [p.name for p in (cli_repo.cache / "toolkits").iterdir()] == [root.name]
    assert leftovers(cli_repo) == []


def test_pypi_plan_lists_the_pinned_wheels(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["toolkit", "plan", "--source", "pypi", "--version", "13.0.2", "--components", "cuda_nvcc,cuda_cudart", "--json"])
    assert e.value.code == 0
    plan = json.loads(capsys.readouterr().out)
    files = {w["component"]: w for w in plan["wheels"]}
    assert set(files) == {"cuda_nvcc", "cuda_cudart", "cuda_crt", "libnvvm"}  # crt and nvvm come with nvcc in 13.x
    assert files["cuda_nvcc"]["version"] == "13.0.88" and files["cuda_cudart"]["version"] == "13.0.96"
    assert plan["total_bytes"] == sum(w["size"] for w in plan["wheels"]) > 90_000_000


def test_the_cli_spells_out_the_toolkits_platforms_and_sources_as_the_backend_has_them() -> None:
    """The toolkit command's choices are written out so that `llamabundle --help` imports no backend."""
    from llamabundle.backends.cuda.toolkit import manifest, plan
    from llamabundle.cli import toolkit as toolkit_cli

    assert toolkit_cli.PLATFORMS == manifest.PLATFORMS and toolkit_cli.SOURCES == plan.SOURCES
